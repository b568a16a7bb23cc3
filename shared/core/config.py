"""User-facing run configuration (`VerificationConfig`) and process settings (env vars).

`VerificationConfig` mirrors the reference's field names and defaults; `Settings` holds where
the bus, the store and the simulator are, read once from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.core.events import ModelSpec

EvaluationMode = Literal["template_only", "template_and_rubric", "rubric_only"]


def config_uses_simulator(config: Mapping[str, Any] | None) -> bool:
    """True when a run config (as stored: a dict) names the `simulator` interface for a model:
    its results come from the offline simulator and are labelled SIMULATED."""
    return bool(config) and any(isinstance(m, Mapping) and m.get("interface") == "simulator"
                                for key in ("answering_models", "parsing_models")
                                for m in (config or {}).get(key) or [])


# `litellm` (the default), the offline `simulator` and recorded `manual` traces are veribus's own;
# the rest are the reference's adapter names, accepted so its configs run unchanged (called
# through litellm like the default: the model name and api_base choose the provider)
INTERFACES = ("litellm", "simulator", "manual", "langchain", "openrouter", "openai_endpoint", "claude_agent_sdk",
              "claude_tool")
# integer fields a YAML `true` would otherwise fill with 1 (pydantic reads a bool as an int)
_MODEL_INTS = ("max_tokens", "max_concurrency", "requests_per_minute", "tokens_per_minute", "max_retries", "max_turns")


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {str(value).lower()}")
    return value


class ModelConfig(BaseModel):
    """One answering or parsing model. `model_name` is any litellm model string."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_name: str
    id: str = ""
    model_provider: str | None = None
    interface: str = "litellm"
    api_base: str | None = None
    api_key_env: str | None = Field(
        default=None, description="Name of the env var holding the API key (the key itself is never stored)"
    )
    temperature: float = Field(default=0.0, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    system_prompt: str | None = None
    max_concurrency: int = Field(default=32, ge=1, description="calls in flight, for the whole deployment")
    requests_per_minute: int | None = Field(default=None, ge=1, description="for the whole deployment")
    tokens_per_minute: int | None = Field(default=None, ge=1, description="for the whole deployment")
    input_cost_per_million_tokens: float | None = Field(
        default=None, ge=0, description="USD per million input tokens (overrides litellm's cost map)")
    output_cost_per_million_tokens: float | None = Field(
        default=None, ge=0, description="USD per million output tokens (overrides litellm's cost map)")
    limit_scope: Literal["model", "endpoint"] = Field(
        default="model", description="share the limits per model, or per endpoint (api_base) across its models")
    timeout: float = Field(default=120.0, gt=0)
    hedge_after_s: Annotated[float, Field(gt=0)] | Literal["auto"] | None = Field(
        default=None, description="opt-in: a call still unanswered after this many seconds gets a second "
        "copy when the model's limit has a free slot; the first reply wins, and the other copy runs to its end "
        "holding its slot and is counted as costing what the winner did. 'auto': after the 95th percentile of "
        "the model's last 200 call latencies in this process, once it has 20")
    max_retries: int = Field(default=4, ge=0)
    params: dict[str, Any] = Field(default_factory=dict)
    mcp_urls_dict: dict[str, str] | None = None
    max_turns: int = Field(default=10, ge=1)
    manual_traces: dict[str, Any] | None = None

    @field_validator("interface")
    @classmethod
    def _known_interface(cls, v: str) -> str:
        if v not in INTERFACES:
            raise ValueError(f"{v!r} is not an interface: one of {', '.join(INTERFACES)}")
        return v

    @field_validator(*_MODEL_INTS, "temperature", mode="before")
    @classmethod
    def _numbers_not_bools(cls, v: Any) -> Any:
        return _not_a_bool(v)

    @field_validator("model_name")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("model_name must not be empty")
        return v.strip()

    @field_validator("params")
    @classmethod
    def _no_secrets_in_params(cls, v: dict[str, Any]) -> dict[str, Any]:
        """params travel in every event: a key there would be stored everywhere."""
        secretish = [k for k in v if any(w in k.lower() for w in ("key", "token", "secret", "password", "authorization"))]
        if secretish:
            raise ValueError(
                f"params.{secretish[0]} looks like a secret: params are recorded in every event; put the secret "
                "in an environment variable and name that variable in api_key_env")
        return v

    @model_validator(mode="after")
    def _provider_prefix(self) -> ModelConfig:
        if self.model_provider and "/" not in self.model_name:
            self.model_name = f"{self.model_provider}/{self.model_name}"
        if not self.id:
            self.id = self.model_name
        return self

    def to_spec(self) -> ModelSpec:
        return ModelSpec(
            model_name=self.model_name,
            id=self.id,
            interface="manual" if self.interface == "manual" else self.interface,
            api_base=self.api_base,
            api_key_env=self.api_key_env,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            system_prompt=self.system_prompt,
            max_concurrency=self.max_concurrency,
            timeout=self.timeout,
            hedge_after_s=self.hedge_after_s,
            max_retries=self.max_retries,
            params=dict(self.params),
            mcp_servers=dict(self.mcp_urls_dict or {}),
            max_turns=self.max_turns,
            manual_traces=dict(self.manual_traces or {}),
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            limit_scope=self.limit_scope,
            input_cost_per_million_tokens=self.input_cost_per_million_tokens,
            output_cost_per_million_tokens=self.output_cost_per_million_tokens,
        )


class StageOptions(BaseModel):
    """The per-stage switches of `VerificationConfig`, carried on every job."""

    model_config = ConfigDict(extra="forbid")

    abstention_enabled: bool = False
    sufficiency_enabled: bool = False
    embedding_check_enabled: bool = False
    embedding_check_model: str = "all-MiniLM-L6-v2"
    embedding_check_threshold: float = Field(default=0.85, ge=0.0, le=1.0)
    deep_judgment_enabled: bool = False
    deep_judgment_max_excerpts_per_attribute: int = Field(default=3, ge=1)
    deep_judgment_fuzzy_match_threshold: float = Field(default=0.80, ge=0.0, le=1.0)
    deep_judgment_excerpt_retry_attempts: int = Field(default=2, ge=0)
    deep_judgment_search_enabled: bool = False
    deep_judgment_search_tool: str = "local"
    deep_judgment_rubric_mode: Literal["disabled", "enable_all", "use_checkpoint", "custom"] = "disabled"
    deep_judgment_rubric_config: dict[str, Any] | None = None
    rubric_evaluation_strategy: Literal["batch", "sequential"] = "batch"
    use_full_trace_for_template: bool = False
    use_full_trace_for_rubric: bool = True
    prompt_config: dict[str, str] | None = None
    template_timeout_s: float = Field(default=10.0, gt=0)
    response_cache: bool = Field(default=False, description="reuse model replies across runs (veribus run --cache)")
    response_cache_ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0,
                                        description="a cached reply older than this is asked again")


def _each_model_once(models: list[ModelConfig]) -> list[ModelConfig]:
    """A model's identity (interface, model name, tools: the spec's ModelIdentity) is part of
    every result id: two entries with one identity make the same result ids, and half of the jobs
    would be lost to the other half (the run then never completes). Refused, named."""
    seen: dict[str, int] = {}
    for i, m in enumerate(models):
        key = m.to_spec().canonical_key
        if key in seen:
            raise ValueError(f"entries {seen[key] + 1} and {i + 1} are the same model ({key.rstrip(':')}): a model's "
                             "interface, name and tools make its results' ids, so the two would overwrite each "
                             "other's results; list it once (another temperature or params is another run)")
        seen[key] = i
    return models


class VerificationConfig(StageOptions):
    """What to run: models × replicates × mode, plus the stage switches."""

    # validated when left out too: an empty list is refused under the field's own name (its `loc`),
    # so the CLI can name the option that sets it (shared.cli.common.validation_text)
    answering_models: list[ModelConfig] = Field(default_factory=list, validate_default=True)
    parsing_models: list[ModelConfig] = Field(default_factory=list, validate_default=True)
    replicate_count: int = Field(default=1, ge=1, le=1000)
    evaluation_mode: EvaluationMode = "template_only"
    run_name: str | None = None
    few_shot_config: dict[str, Any] | None = None

    @field_validator("replicate_count", mode="before")
    @classmethod
    def _count_not_a_bool(cls, v: Any) -> Any:
        return _not_a_bool(v)

    @field_validator("answering_models")
    @classmethod
    def _needs_answering(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        if not models:
            raise ValueError("at least one answering model is required")
        return _each_model_once(models)

    @field_validator("parsing_models")
    @classmethod
    def _needs_judge(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        if not models:
            raise ValueError("at least one parsing (judge) model is required")
        return _each_model_once(models)

    def stage_options(self) -> StageOptions:
        return StageOptions(**{k: getattr(self, k) for k in StageOptions.model_fields})

    def sampling_notes(self) -> list[str]:
        """What the run should be told before it starts about how its answers are sampled: a
        hedged model (`hedge_after_s`) keeps the first of two replies, and at a temperature above
        0 the two differ and the faster is more often the shorter, so the replies kept lean toward
        short ones. Not refused: it is the user's trade of tail latency for that lean."""
        notes = []
        for role, models in (("answering", self.answering_models), ("judge", self.parsing_models)):
            for m in models:
                temperature = m.params.get("temperature", m.temperature)
                if m.hedge_after_s is not None and isinstance(temperature, int | float) and temperature > 0:
                    notes.append(
                        f"{role} model {m.id!r} is hedged (hedge_after_s: {m.hedge_after_s}) at temperature "
                        f"{temperature:g}: of two copies of a slow call the first reply is kept, and a faster reply "
                        "is more often a shorter one, so the replies kept lean toward short ones; leave "
                        "hedge_after_s unset when these replies are what the run measures")
        return notes


NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def parse_server_list(value: str) -> list[str]:
    """Split a comma-separated list of NATS URLs; a bad entry is named in the error. A bare
    `host:port` is read as `nats://host:port` (nats-py does the same)."""
    out: list[str] = []
    for raw in value.split(","):
        url = raw.strip()
        if not url:
            continue
        if "://" not in url:
            url = f"nats://{url}"
        parsed = urlparse(url)
        try:
            port = parsed.port
        except ValueError:
            port = -1
        if parsed.scheme not in NATS_SCHEMES or not parsed.hostname or port == -1:
            raise ValueError(f"VERIBUS_NATS_URL: {raw.strip()!r} is not a NATS server URL "
                             f"(expected e.g. nats://host:4222; several are separated by commas)")
        out.append(url)
    if not out:
        raise ValueError("VERIBUS_NATS_URL: no server URL given")
    return out


class Settings(BaseModel):
    """Where things are. Every field has a `VERIBUS_*` env var; see the README."""

    nats_url: str = "nats://127.0.0.1:4222"  # one URL or a comma-separated list (a cluster)
    nats_url_from_flag: str | None = None  # set by the CLI when --nats-url gave the URL (not configuration)
    stack: str | None = None  # set by `veribus up` on every process it starts: the stack home (not configuration)
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_tls_ca: str | None = None
    nats_role: str = "cli"  # which role's credentials to use (shared.runtime.bus_auth)
    nats_credentials: str | None = None  # the role credentials file (default <home>/auth/credentials.json)
    home: Path = Path(".veribus")
    clickhouse_url: str | None = None  # e.g. http://user:pass@host:8123/db ; unset -> embedded chdb
    clickhouse_database: str = "veribus"
    simulator_url: str | None = None
    consumer_max_ack_pending: int = 512
    # a message unacked this long is redelivered (a killed service's jobs come back after it); a
    # handler still working marks its message in progress every third of it (shared.runtime.pump),
    # for up to consumer_max_hold_s, so a model call may take longer than the ack wait
    consumer_ack_wait_s: float = Field(default=30.0, ge=1)
    consumer_max_hold_s: float = Field(default=3600.0, gt=0)
    # a stopping stage service lets its handlers in flight finish this long, then hands the rest
    # back to the stream (nak: redelivered at once, not after the ack wait); under `down`'s 10 s
    shutdown_grace_s: float = Field(default=5.0, ge=0, le=8)
    consumer_max_deliver: int = Field(default=5, ge=1)  # deliveries whose handler fails, then the give-up
    # further deliveries for a message whose handling was cut off each time (its service stopped
    # or killed); the one after them records the give-up without running the handler, so a job
    # that kills its process, or is handed back by many `down`s, still ends with a result
    consumer_max_interrupted: int = Field(default=20, ge=0)
    llm_cache: bool = True
    llm_transport: Literal["auto", "litellm", "direct"] = "auto"
    litellm_lean: bool = True  # skip litellm's per-call logging hooks (see shared.runtime.llm.transport)
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = "text"
    # OTLP/HTTP collector for OpenTelemetry spans (shared.runtime.tracing); unset: no tracing, nothing imported
    otel_endpoint: str | None = None
    progress_interval_s: float = Field(default=10.0, ge=0)  # the CLI's progress line while following a run (0: every result)
    debug: bool = False  # the CLI shows the traceback of an unexpected error instead of one line
    # /healthz /readyz /metrics of a service process (VERIBUS_<SERVICE>_METRICS_PORT wins)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    generation_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    guards_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    parsing_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    verification_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    rubric_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    finalization_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    projector_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    # concurrent handlers per service process (VERIBUS_<SERVICE>_WORKERS)
    generation_workers: int = Field(default=64, ge=1)
    guards_workers: int = Field(default=64, ge=1)
    parsing_workers: int = Field(default=64, ge=1)
    verification_workers: int = Field(default=64, ge=1)
    rubric_workers: int = Field(default=64, ge=1)
    finalization_workers: int = Field(default=64, ge=1)
    sandbox_workers: int = Field(default=2, ge=1)
    sandbox_timeout_s: float = Field(default=10.0, gt=0)
    sandbox_memory_mb: int = Field(default=512, ge=64)
    # the jail (shared.templates.boundary validates these itself and fails closed on a bad value)
    sandbox: Literal["auto", "jail", "unsafe"] = "auto"  # auto / jail: the bubblewrap jail; unsafe: no OS boundary
    sandbox_uid: str = "65534"  # uid/gid the sandbox drops to when the service runs as root
    sandbox_bwrap: str | None = None  # the bubblewrap binary (default: bwrap on PATH)
    sandbox_tag: str | None = None  # set by the pool for its own processes, not configuration
    mcp_connect_timeout_s: float = Field(default=30.0, gt=0)
    mcp_tool_timeout_s: float = Field(default=60.0, gt=0)
    mcp_max_result_chars: int = Field(default=100_000, ge=1)  # of a tool result, what the model reads
    mcp_max_trace_chars: int = Field(default=16_000, ge=1)  # of a tool result, what the trace keeps
    embedding_threads: int = Field(default=1, ge=1)
    projector_batch: int = Field(default=1000, ge=1)
    projector_batch_timeout: float = Field(default=0.5, gt=0)
    search_corpus: Path | None = None  # the built-in "local" search tool's corpus
    # the query endpoint's per-query limits (shared.store reads them where the handles are made)
    query_timeout_s: float = Field(default=10.0, gt=0)
    query_memory_mb: int = Field(default=512, ge=1)
    query_concurrency: int = Field(default=4, ge=1)
    query_threads: int = Field(default=1, ge=1)
    query_result_mb: int = Field(default=64, ge=1)  # a result's JSON size where a query stops (the projector's reply: 1 MB)
    rebuild_workers: int | None = Field(default=None, ge=0)  # `projections rebuild` worker processes (None: one per core)
    # the operator's allow-list of URL=KEY_VARIABLE pairs (shared.runtime.endpoints parses them)
    endpoints: str | None = None
    endpoints_file: str | None = None
    model_limits: bool = True  # max_concurrency / rpm / tpm shared by the deployment (shared.runtime.limits)
    limits_lease_s: float = 10.0  # a dead replica's slots are free again after this long
    response_cache_max_age_s: float = 30 * 24 * 3600.0  # the cross-run cache bucket's max age
    lean_events: bool = True  # jobs carry content hashes, not their question/template/rubric (shared.runtime.content)
    stream_max_age_s: float = 0.0  # the event stream's retention by age (0: keep forever)
    cost_map: str | None = None  # a price map file instead of the one litellm ships (shared.runtime.llm.pricing)
    stream_max_bytes: int = -1  # the event stream's retention by size (-1: unlimited; oldest dropped first)
    stream_replicas: int | None = Field(default=None, ge=1, le=5)  # None: min(3, cluster size)

    @field_validator("nats_url")
    @classmethod
    def _check_nats_url(cls, value: str) -> str:
        parse_server_list(value)
        return value

    @field_validator("sandbox", mode="before")
    @classmethod
    def _sandbox_mode(cls, value: Any) -> Any:
        """`VERIBUS_SANDBOX` in any case, blank for the default: `up` refuses another value
        before it starts anything (a typo once failed every template of every run, after the
        model calls were paid)."""
        return (value.strip().lower() or "auto") if isinstance(value, str) else value

    @property
    def nats_servers(self) -> list[str]:
        """The NATS server URLs (VERIBUS_NATS_URL may list several, comma-separated)."""
        return parse_server_list(self.nats_url)

    @property
    def chdb_path(self) -> Path:
        return self.home / "chdb"

    @classmethod
    def given(cls, name: str) -> bool:
        """Whether the environment sets this field (`VERIBUS_<NAME>`, non-empty): a configured
        value rather than the default, e.g. a NATS URL that wins over the local stack's."""
        return name in cls.from_env(name).model_fields_set

    @classmethod
    def from_env(cls, *only: str, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from the `VERIBUS_<FIELD>` variables (of `environ`, default this process's); a
        bad value is refused naming the variable. `only`: read just these fields (the others keep
        their defaults), for a module that needs a few and must not fail on an unrelated one."""
        env = os.environ if environ is None else environ
        unknown = [name for name in only if name not in cls.model_fields]
        if unknown:
            raise ValueError(f"no such setting: {', '.join(unknown)}")
        data: dict[str, Any] = {}
        for name in only or cls.model_fields:
            val = env.get(f"VERIBUS_{name.upper()}")
            if val is not None and val != "":
                data[name] = val
        try:
            return cls(**data)
        except ValidationError as exc:
            wrong = "; ".join(f"VERIBUS_{str(e['loc'][0]).upper()}={data.get(str(e['loc'][0]))!r}: {e['msg']}"
                              for e in exc.errors())
            raise ValueError(wrong) from None
