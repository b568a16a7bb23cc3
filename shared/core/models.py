"""The user-facing result record (`spec/001`, `spec/002`): one `VerificationResult` per job.

Field names, types and defaults are the contract with the reference implementation; extra
fields found in reference exports (format 2.2) are accepted and kept so files round-trip.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.core.ids import compute_result_id

# the reference's failure category -> group (for reference files whose failure lacks `group`)
FAILURE_GROUP_OF = {
    "content": "content", "recursion_limit": "autofail", "trace_validation": "autofail",
    "deep_judgment": "autofail", "deep_judgment_rubric": "autofail", "timeout": "retry", "connection": "retry",
    "rate_limit": "retry", "server_error": "retry", "abstention": "abstained", "sufficiency": "abstained",
    "template_validation": "system", "parsing": "system", "unexpected_error": "system",
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class ModelIdentity(_Section):
    """Interface + model name (+ sorted MCP tool names): what identifies a model in results."""

    interface: str = "litellm"
    model_name: str
    tools: list[str] = Field(default_factory=list)
    config_id: str | None = None

    @property
    def display_string(self) -> str:
        base = f"{self.interface}:{self.model_name}"
        return f"{base}+[{','.join(sorted(self.tools))}]" if self.tools else base

    @property
    def canonical_key(self) -> str:
        return f"{self.interface}:{self.model_name}:{','.join(sorted(self.tools))}"


class VerificationResultMetadata(_Section):
    question_id: str
    template_id: str = "no_template"
    failure: dict[str, Any] | None = None
    caveats: list[Any] = Field(default_factory=list)
    warnings: list[Any] = Field(default_factory=list)
    partial_content: Any = None
    retry_counts: dict[str, Any] | None = None
    question_text: str = ""
    raw_answer: str | None = None
    keywords: list[str] | None = None
    answering: ModelIdentity
    parsing: ModelIdentity
    answering_system_prompt: str | None = None
    parsing_system_prompt: str | None = None
    execution_time: float = 0.0
    timestamp: str = ""
    result_id: str = ""
    run_name: str | None = None
    replicate: int | None = None
    completed_without_errors: bool = True
    error: str | None = None
    few_shot_enabled: bool = False
    few_shot_example_count: int = 0
    evaluation_mode: str | None = None
    # the reference's multi-turn scenario fields (format 2.2); veribus runs single questions: null
    scenario_id: str | None = None
    scenario_node: str | None = None
    scenario_turn: int | None = None
    scenario_path: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _status_from_failure(cls, data: Any) -> Any:
        """Reference exports (format 2.2) record a non-pass as `failure` with no
        `completed_without_errors`: derive both status fields from it. A verdict (content,
        auto-fail, abstention/sufficiency) still completed without errors; retry and system
        failures did not."""
        if isinstance(data, dict) and "completed_without_errors" not in data and data.get("failure"):
            failure = data["failure"]
            if isinstance(failure, dict):
                group = failure.get("group") or FAILURE_GROUP_OF.get(str(failure.get("category")), "system")
                if group in ("content", "autofail", "abstained"):
                    return {**data, "completed_without_errors": True}
                data = {**data, "completed_without_errors": False}
                data.setdefault("error", f"{failure.get('stage', 'pipeline')}: {failure.get('reason')}")
            else:
                data = {**data, "completed_without_errors": False}
                data.setdefault("error", str(failure))
        return data

    @property
    def answering_model(self) -> str:
        return self.answering.display_string

    @property
    def parsing_model(self) -> str:
        return self.parsing.display_string

    @staticmethod
    def compute_result_id(
        question_id: str,
        answering: ModelIdentity,
        parsing: ModelIdentity,
        timestamp: str,
        replicate: int | None = None,
    ) -> str:
        return compute_result_id(
            question_id, answering.canonical_key, parsing.canonical_key, timestamp, replicate
        )


class VerificationResultTemplate(_Section):
    raw_llm_response: str = ""
    trace_messages: list[dict[str, Any]] = Field(default_factory=list)
    conversation_context: list[Any] = Field(default_factory=list)  # reference 2.2 (scenarios): empty here
    parsed_gt_response: dict[str, Any] | None = None
    parsed_llm_response: dict[str, Any] | None = None
    template_validation_error: str | None = None
    template_verification_performed: bool = False
    verify_result: bool | None = None
    verify_granular_result: Any = None
    field_verification_error: str | None = None
    field_results: dict[str, bool] | None = None
    field_scores: dict[str, Any] | None = None  # reference 2.2; not computed by veribus
    composition_strategy: str | None = None
    embedding_check_performed: bool = False
    embedding_similarity_score: float | None = None
    embedding_override_applied: bool = False
    embedding_model_used: str | None = None
    regex_validations_performed: bool = False
    regex_validation_results: dict[str, bool] | None = None
    regex_validation_details: dict[str, dict[str, Any]] | None = None
    regex_overall_success: bool | None = None
    regex_extraction_results: dict[str, Any] | None = None
    recursion_limit_reached: bool = False
    # reference 2.2 fields for features veribus does not have (partial timeouts, agentic and dynamic
    # parsing): present with the reference's "did not happen" values so files match key for key
    response_timeout_partial: bool = False
    usage_unavailable: bool = False
    investigation_trace: Any = None
    agentic_parsing_performed: bool = False
    agentic_extraction_recovery: Any = None
    agentic_extraction_error: str | None = None
    dynamic_parsing_performed: bool = False
    dynamic_parse_decision: Any = None
    dynamic_decision_reasoning: str | None = None
    abstention_check_performed: bool = False
    abstention_detected: bool | None = None
    abstention_override_applied: bool = False
    abstention_reasoning: str | None = None
    sufficiency_check_performed: bool = False
    sufficiency_detected: bool | None = None
    sufficiency_override_applied: bool = False
    sufficiency_reasoning: str | None = None
    answering_mcp_servers: list[str] | None = None
    usage_metadata: dict[str, Any] | None = None
    agent_metrics: dict[str, Any] | None = None


class VerificationResultRubric(_Section):
    rubric_evaluation_performed: bool = False
    rubric_evaluation_strategy: str | None = None
    llm_trait_scores: dict[str, int | bool] | None = None
    llm_trait_labels: dict[str, str] | None = None
    regex_trait_scores: dict[str, bool] | None = None
    callable_trait_scores: dict[str, bool | int] | None = None
    metric_trait_scores: dict[str, dict[str, float]] | None = None
    metric_trait_confusion_lists: dict[str, dict[str, list[str]]] | None = None
    trait_errors: dict[str, str] | None = None
    trait_provenance: dict[str, str] | None = None  # trait -> global | question_specific | dynamic
    dynamic_rubric_promoted_traits: list[str] | None = None
    dynamic_rubric_skipped_traits: dict[str, str] | None = None

    def _by_type(self) -> list[tuple[str, dict[str, Any] | None]]:
        return [
            ("llm", self.llm_trait_scores),
            ("regex", self.regex_trait_scores),
            ("callable", self.callable_trait_scores),
            ("metric", self.metric_trait_scores),
        ]

    def get_all_trait_scores(self) -> dict[str, Any]:
        """Every trait's score in one flat dict, keyed by trait name."""
        out: dict[str, Any] = {}
        for _, scores in self._by_type():
            out.update(scores or {})
        return out

    def get_trait_by_name(self, name: str) -> tuple[Any, str] | None:
        """`(value, trait_type)` for a trait, or None when no trait has that name."""
        for kind, scores in self._by_type():
            if scores and name in scores:
                return scores[name], kind
        return None

    def get_llm_trait_labels(self) -> dict[str, str]:
        return dict(self.llm_trait_labels or {})


class VerificationResultDeepJudgment(_Section):
    deep_judgment_enabled: bool = False
    deep_judgment_performed: bool = False
    extracted_excerpts: dict[str, list[dict[str, Any]]] | None = None
    attribute_reasoning: dict[str, str] | None = None
    deep_judgment_stages_completed: list[str] | None = None
    deep_judgment_model_calls: int = 0
    deep_judgment_excerpt_retry_count: int = 0
    attributes_without_excerpts: list[str] | None = None
    deep_judgment_search_enabled: bool = False
    hallucination_risk_assessment: dict[str, str] | None = None


class VerificationResultDeepJudgmentRubric(_Section):
    deep_judgment_rubric_performed: bool = False
    extracted_rubric_excerpts: dict[str, list[dict[str, Any]]] | None = None
    rubric_trait_reasoning: dict[str, str] | None = None
    deep_judgment_rubric_scores: dict[str, int | bool] | None = None
    standard_rubric_scores: dict[str, int | bool] | None = None
    trait_metadata: dict[str, dict[str, Any]] | None = None
    traits_without_valid_excerpts: list[str] | None = None
    rubric_hallucination_risk_assessment: dict[str, dict[str, Any]] | None = None
    total_deep_judgment_model_calls: int = 0
    total_traits_evaluated: int = 0
    total_excerpt_retries: int = 0


class VerificationResult(_Section):
    """The complete evidence record of one job; nested access only (no flat accessors)."""

    metadata: VerificationResultMetadata
    template: VerificationResultTemplate | None = None
    rubric: VerificationResultRubric | None = None
    deep_judgment: VerificationResultDeepJudgment | None = None
    deep_judgment_rubric: VerificationResultDeepJudgmentRubric | None = None
    evaluation_input: str | None = None
    used_full_trace: bool = True
    trace_extraction_error: str | None = None
