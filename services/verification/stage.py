"""VerifyTemplate, EmbeddingCheck and DeepJudgmentAutoFail (spec/003 stages 8-10).

verify_result = field verification AND regex verification; the guards' auto-fails force it
to False; the embedding check may only turn a failed *field* verification into a pass (never a
regex failure); DeepJudgmentAutoFail then forces False when deep judgment left attributes
without a corroborating excerpt. Each of the three stages records its status (performed /
skipped / failed, with the reason) in `state.stages`.

EmbeddingCheck (stage 9) runs only when enabled (`embedding_check_enabled`, or env EMBEDDING_CHECK;
see services/verification/embedding.py for the precedence) and field verification failed: cosine
similarity of the parsed ground truth and parsed response values; at or above the threshold the
judge (the parsing model) is asked whether they are semantically equivalent, and a yes sets
`embedding_override_applied` and verify_result = True AND the regex result. The check is
non-fatal: an unavailable model or a failed judge call is recorded on the stage, never on the
result's error. With the check off, nothing is imported or computed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from services.verification.embedding import (
    Embedder,
    EmbeddingUnavailable,
    embedding_settings,
    get_embedder,
    values_text,
)
from shared.core import prompts
from shared.core.events import Job, State
from shared.core.stage import SANDBOX_SCOPE, record, stage_error
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError, usage_entry
from shared.templates.calls import run_verify

log = logging.getLogger("veribus.verification")

STAGE = "verify_template"
EMBEDDING_STAGE = "embedding_check"
DJ_AUTOFAIL_STAGE = "deep_judgment_autofail"

_OUTCOME_FIELDS = (
    "template_verification_performed", "verify_result", "verify_granular_result", "field_verification_error",
    "parsed_llm_response", "parsed_gt_response", "field_results", "composition_strategy",
    "regex_validations_performed", "regex_validation_results", "regex_validation_details",
    "regex_overall_success", "regex_extraction_results",
)

_default_llm: LLMClient | None = None


def _judge(llm: LLMClient | None) -> LLMClient:
    """The client for the equivalence judge: the caller's, else one per process (no cache)."""
    global _default_llm
    if llm is not None:
        return llm
    if _default_llm is None:
        _default_llm = LLMClient()
    return _default_llm


def _apply_guard_overrides(state: State) -> str | None:
    """The guards' verdicts (spec/003 override table); returns why verification is skipped."""
    sig = state.signals
    tmpl = state.template
    for flag, why in (
        (sig.recursion_limit, "recursion limit reached"),
        (sig.abstention, "abstention detected"),
        (sig.trace_validation_failed, "trace validation failed"),
        (sig.insufficient, "response insufficient"),
    ):
        if flag:
            tmpl["verify_result"] = False
            sig.field_verification_result = False
            return why
    return None


def _skip_all(state: State, t: float, why: str) -> State:
    for stage in (STAGE, EMBEDDING_STAGE, DJ_AUTOFAIL_STAGE):
        record(state, stage, "skipped", t, why)
    return state


async def verify_template(job: Job, state: State, llm: LLMClient | None = None,
                          embedder: Embedder | None = None) -> State:
    """Stages 8-10: VerifyTemplate, EmbeddingCheck, DeepJudgmentAutoFail.

    Requires: signal `parsed`, `job.template_code` (run in the sandbox), the guards' signals
    (any fired: verify_result is False and verification is skipped), `job.options`.
    Produces: `template.verify_result`, `verify_granular_result`, `field_results`, regex
    results, `template.embedding_*`; signal `field_verification_result`; three stage records;
    `error` when the template cannot run.
    Calls: the template sandbox (`run_verify`); for the embedding check the embedding model
    (`embedder`, default the configured one) and `llm` as the equivalence judge (a process
    default when None).
    """
    t = time.time()
    if state.error:
        return _skip_all(state, t, "upstream error")
    why = _apply_guard_overrides(state)
    if why:
        return _skip_all(state, t, why)
    parsed: dict[str, Any] | None = state.signals.parsed
    if parsed is None or not job.template_code:
        return _skip_all(state, t, "nothing parsed")
    outcome = await run_verify(
        job.template_code, parsed, job.question_id, state.template.get("raw_llm_response", ""),
        template_id=job.template_id, timeout_s=job.options.get("template_timeout_s"), scope=SANDBOX_SCOPE.get(),
    )
    if getattr(outcome, "error", None):
        state.error = stage_error(STAGE, ValueError(outcome.error))
        record(state, STAGE, "failed", t, str(outcome.error)[:300])
        record(state, EMBEDDING_STAGE, "skipped", time.time(), "upstream error")
        record(state, DJ_AUTOFAIL_STAGE, "skipped", time.time(), "upstream error")
        return state
    for name in _OUTCOME_FIELDS:
        state.template[name] = getattr(outcome, name, None)
    if not state.template.get("regex_validations_performed"):
        # the reference's empty regex outcome when the template has no regex checks
        for name in ("regex_validation_results", "regex_validation_details", "regex_extraction_results"):
            state.template[name] = state.template.get(name) or {}
        state.template["regex_overall_success"] = True
    field_ok = getattr(outcome, "field_verification_result", None)
    state.signals.field_verification_result = bool(outcome.verify_result if field_ok is None else field_ok)
    record(state, STAGE, "performed", t)
    await embedding_check(job, state, llm, embedder)
    deep_judgment_autofail(job, state)
    return state


def _regex_ok(tmpl: dict[str, Any]) -> bool:
    if not tmpl.get("regex_validations_performed"):
        return True
    return tmpl.get("regex_overall_success") is not False


async def embedding_check(job: Job, state: State, llm: LLMClient | None = None,
                          embedder: Embedder | None = None) -> None:
    """Stage 9 (see module docstring): may raise a failed field verification to a pass."""
    t = time.time()
    cfg = embedding_settings(job.options)
    tmpl = state.template
    if not cfg.enabled:
        record(state, EMBEDDING_STAGE, "skipped", t, "embedding check disabled")
        return
    if state.signals.field_verification_result:
        record(state, EMBEDDING_STAGE, "skipped", t, "field verification passed")
        return
    expected, got = tmpl.get("parsed_gt_response"), tmpl.get("parsed_llm_response")
    if not expected or not got:
        record(state, EMBEDDING_STAGE, "skipped", t, "no parsed ground truth or response to compare")
        return
    keys = list(expected) + [k for k in got if k not in expected]
    expected_text, got_text = values_text(expected, keys), values_text(got, keys)
    emb = embedder or get_embedder(cfg.model)
    tmpl["embedding_check_performed"] = True
    try:
        score = await emb.similarity(expected_text, got_text)
    except EmbeddingUnavailable as exc:
        log.warning("result %s: embedding check not possible (non-fatal): %s", job.result_id, exc)
        tmpl["embedding_similarity_score"] = None
        tmpl["embedding_model_used"] = None
        record(state, EMBEDDING_STAGE, "failed", t, str(exc)[:300])
        return
    tmpl["embedding_similarity_score"] = round(score, 4)
    tmpl["embedding_model_used"] = emb.name
    if score < cfg.threshold:
        record(state, EMBEDDING_STAGE, "performed", t, f"similarity {score:.3f} below threshold {cfg.threshold:.2f}")
        return
    try:
        reply = await _judge(llm).complete(
            job.parsing, prompts.equivalence_messages(job.question_text, expected_text, got_text, job.options),
            stage=EMBEDDING_STAGE, response_schema=prompts.EQUIVALENCE_SCHEMA, schema_name="semantic_equivalence",
            validate=_equivalence,
        )
    except LLMError as exc:
        log.warning("result %s: embedding check judge failed (non-fatal): %s", job.result_id, exc)
        record(state, EMBEDDING_STAGE, "performed", t, f"similar ({score:.3f}) but the equivalence judge failed: {exc}"[:300])
        return
    state.usage[EMBEDDING_STAGE] = usage_entry(reply)
    if not reply.parsed["semantically_equivalent"]:
        record(state, EMBEDDING_STAGE, "performed", t, f"similar ({score:.3f}) but judged not equivalent")
        return
    regex_ok = _regex_ok(tmpl)
    tmpl["embedding_override_applied"] = True
    state.signals.field_verification_result = True
    tmpl["verify_result"] = regex_ok
    log.warning("result %s: embedding check override: field verification failed but the answer is semantically "
                "equivalent (similarity %.3f) -> field pass, verify_result=%s", job.result_id, score, regex_ok)
    record(state, EMBEDDING_STAGE, "performed", t,
           f"override: equivalent (similarity {score:.3f})" + ("" if regex_ok else "; regex still fails"))


def _equivalence(obj: Any) -> Any:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    value = obj.get("semantically_equivalent", obj.get("equivalent"))
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no"):
        value = value.strip().lower() in ("true", "yes")
    if not isinstance(value, bool):
        raise ValueError('missing boolean field "semantically_equivalent"')
    return {"semantically_equivalent": value, "reasoning": str(obj.get("reasoning") or "")}


def deep_judgment_autofail(job: Job, state: State) -> None:
    """Stage 10: attributes deep judgment could not ground in the response fail the result."""
    t = time.time()
    dj = state.deep_judgment
    if not job.options.get("deep_judgment_enabled"):
        record(state, DJ_AUTOFAIL_STAGE, "skipped", t, "deep judgment disabled")
    elif not dj or not dj.get("deep_judgment_performed"):
        record(state, DJ_AUTOFAIL_STAGE, "skipped", t, "deep judgment not performed")
    elif state.signals.abstention:
        record(state, DJ_AUTOFAIL_STAGE, "skipped", t, "abstention detected")
    elif not dj.get("attributes_without_excerpts"):
        record(state, DJ_AUTOFAIL_STAGE, "skipped", t, "no attributes missing excerpts")
    else:
        missing = list(dj["attributes_without_excerpts"])
        state.signals.dj_autofail = True
        state.template["verify_result"] = False
        state.signals.field_verification_result = False
        log.warning("result %s: deep judgment auto-fail: no excerpts for %s after %d retr%s -> verify_result=False",
                    job.result_id, ", ".join(missing), dj.get("deep_judgment_excerpt_retry_count", 0),
                    "y" if dj.get("deep_judgment_excerpt_retry_count", 0) == 1 else "ies")
        record(state, DJ_AUTOFAIL_STAGE, "performed", t, f"no excerpts for {', '.join(missing)}"[:300])
