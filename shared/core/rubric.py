"""Rubric traits and rubrics, with the reference's field names (`karenina.schemas.entities`).

A trait describes *how* a response is scored; evaluating it is the rubric service's job. The
models here only validate what can be checked without running user code: regex patterns
compile, score ranges are ordered, literal traits have classes, names are unique, callable code
decodes (base64 source, plain source, or a base64 cloudpickle). Nothing is executed or unpickled.

A trait read from a reference checkpoint may lack what it needs to run (a callable without
`callable_code`, a regex without `pattern`: the reference's own test checkpoints have both). The
reference loads such files, so we do too; the trait carries `load_error` and the rubric stage
records that as the trait's error instead of a score.
"""

from __future__ import annotations

import ast
import base64
import binascii
import functools
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

TraitKind = Literal["boolean", "score", "literal"]
MetricName = Literal["precision", "recall", "specificity", "accuracy", "f1"]

METRICS_TP_ONLY = frozenset({"precision", "recall", "f1"})
MAX_LITERAL_CLASSES = 20

_B64_RE = re.compile(r"[A-Za-z0-9+/]+={0,2}")


class RubricError(ValueError):
    """A rubric that cannot be used as written (name clash, bad trait)."""


class _Trait(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1)
    description: str | None = None
    load_error: str | None = Field(
        default=None,
        description="Why this trait cannot be evaluated (set when loaded from an incomplete checkpoint)",
    )

    @field_validator("name")
    @classmethod
    def _strip_name(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("trait name must not be empty")
        return v


class LLMRubricTrait(_Trait):
    """A trait the judge model scores: boolean, score in [min_score, max_score], or a literal class."""

    kind: TraitKind
    min_score: int | None = 1
    max_score: int | None = 5
    classes: dict[str, str] | None = Field(
        default=None, description="Literal kind: class name -> description, in order (index = score)"
    )
    higher_is_better: bool = True
    deep_judgment_enabled: bool = False
    deep_judgment_excerpt_enabled: bool = True
    deep_judgment_max_excerpts: int | None = Field(default=None, ge=1)
    deep_judgment_fuzzy_match_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    deep_judgment_excerpt_retry_attempts: int | None = Field(default=None, ge=0)
    deep_judgment_search_enabled: bool = False

    @field_validator("classes", mode="before")
    @classmethod
    def _classes_from_list(cls, v: Any) -> Any:
        """A plain list of class names is accepted; each name doubles as its description."""
        if isinstance(v, list | tuple):
            out: dict[str, str] = {}
            for item in v:
                if not isinstance(item, str):
                    raise ValueError(f"class names must be strings, got {type(item).__name__}")
                out[item] = item
            if len(out) != len(v):
                raise ValueError("duplicate class name in classes list")
            return out
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> LLMRubricTrait:
        if self.kind == "literal":
            if not self.classes:
                raise ValueError("classes: a literal trait needs at least 2 classes")
            if len(self.classes) < 2:
                raise ValueError(f"classes: a literal trait needs at least 2 classes, got {len(self.classes)}")
            if len(self.classes) > MAX_LITERAL_CLASSES:
                raise ValueError(f"classes: at most {MAX_LITERAL_CLASSES} classes, got {len(self.classes)}")
            seen: set[str] = set()
            for cname in self.classes:
                if not cname.strip():
                    raise ValueError("classes: class names must not be empty")
                if cname.lower() in seen:
                    raise ValueError(f"classes: duplicate class name (case-insensitive) {cname!r}")
                seen.add(cname.lower())
            self.min_score = 0
            self.max_score = len(self.classes) - 1
        elif self.kind == "boolean":
            self.min_score = None
            self.max_score = None
            self.classes = None
        else:  # score; explicit `is None` so that a min_score of 0 is kept
            if self.classes:
                raise ValueError("classes: only literal traits have classes")
            if self.min_score is None:
                self.min_score = 1
            if self.max_score is None:
                self.max_score = 5
            if self.min_score > self.max_score:
                raise ValueError(f"min_score ({self.min_score}) must be <= max_score ({self.max_score})")
        return self

    def class_names(self) -> list[str]:
        """Literal class names in index order (empty for other kinds)."""
        return list(self.classes) if self.kind == "literal" and self.classes else []

    def class_index(self, class_name: str) -> int:
        """Index of a literal class (case-insensitive), -1 when unknown (the reference's error value)."""
        lowered = class_name.strip().lower()
        for i, name in enumerate(self.class_names()):
            if name.lower() == lowered:
                return i
        return -1


class RegexTrait(_Trait):
    """A deterministic trait: does `pattern` occur in the response (optionally inverted)."""

    pattern: str = ""
    case_sensitive: bool = True
    invert_result: bool = False
    higher_is_better: bool = True

    @model_validator(mode="after")
    def _pattern_compiles(self) -> RegexTrait:
        if self.load_error is not None:
            return self
        if not self.pattern:
            raise ValueError("pattern: must not be empty")
        try:
            re.compile(self.pattern, 0 if self.case_sensitive else re.IGNORECASE)
        except re.error as e:
            raise ValueError(f"pattern: invalid regex {self.pattern!r}: {e}") from e
        return self


CallableFormat = Literal["source", "base64_source", "cloudpickle"]


@functools.lru_cache(maxsize=512)  # the rubric stage decodes the same traits for every job
def classify_callable_code(code: str, label: str = "<callable>") -> tuple[CallableFormat, str | bytes]:
    """Decide what `callable_code` holds without running it; raise ValueError if it is none of them.

    Returns ("source", text), ("base64_source", text) or ("cloudpickle", pickled bytes).
    Source is only compiled (syntax check), never executed; pickles are never loaded here.
    """
    b64_problem = ""
    compact = "".join(code.split())
    if compact and len(compact) % 4 == 0 and _B64_RE.fullmatch(compact):
        try:
            raw = base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError) as e:
            raw = None
            b64_problem = f"base64: {e}"
        if raw is not None:
            if raw[:1] == b"\x80":  # pickle protocol >= 2 (cloudpickle uses 5)
                return "cloudpickle", raw
            try:
                text = raw.decode("utf-8")
                compile(text, label, "exec")
                return "base64_source", text
            except UnicodeDecodeError:
                b64_problem = "base64 decodes to neither UTF-8 Python source nor a pickle"
            except SyntaxError as e:
                b64_problem = f"base64-decoded source has a SyntaxError at line {e.lineno}: {e.msg}"
    try:
        compile(code, label, "exec")
    except SyntaxError as e:
        detail = f"SyntaxError at line {e.lineno}: {e.msg}"
        if b64_problem:
            raise ValueError(f"callable_code is not decodable ({b64_problem}; as plain source: {detail})") from e
        raise ValueError(f"callable_code is neither base64 nor valid Python source ({detail})") from e
    return "source", code


class CallableTrait(_Trait):
    """A trait computed by user Python over the response text (run in the sandbox, never here)."""

    kind: Literal["boolean", "score"] = "boolean"
    callable_code: str | None = Field(
        default=None, description="Plain Python source, base64 of source, or base64 of a cloudpickle"
    )
    min_score: int | None = None
    max_score: int | None = None
    invert_result: bool = False
    higher_is_better: bool = True

    _format: CallableFormat | None = PrivateAttr(default=None)
    _decoded: str | bytes | None = PrivateAttr(default=None)

    @field_validator("callable_code", mode="before")
    @classmethod
    def _bytes_to_text(cls, v: Any) -> Any:
        """Raw pickled bytes (as the reference stores them in memory) are kept as base64 text."""
        if isinstance(v, bytes | bytearray):
            return base64.b64encode(bytes(v)).decode("ascii")
        return v

    @model_validator(mode="after")
    def _check(self) -> CallableTrait:
        if self.kind == "score":
            if self.min_score is not None and self.max_score is not None and self.min_score > self.max_score:
                raise ValueError(f"min_score ({self.min_score}) must be <= max_score ({self.max_score})")
        if self.load_error is not None:
            return self
        if not self.callable_code or not self.callable_code.strip():
            raise ValueError("callable_code: required (Python source, base64 source or base64 cloudpickle)")
        fmt, decoded = classify_callable_code(self.callable_code, f"<callable trait {self.name}>")
        if fmt == "base64_source":
            # kept as readable source (events, YAML, sandbox); the JSON-LD writer re-encodes it
            self.callable_code = decoded if isinstance(decoded, str) else self.callable_code
            fmt = "source"
        self._format = fmt
        self._decoded = decoded
        return self

    @property
    def code_format(self) -> Literal["source", "cloudpickle"] | None:
        """`source` (plain or base64 input) or `cloudpickle`; None when the trait has no usable code."""
        return self._format  # type: ignore[return-value]

    def source_code(self) -> str | None:
        """The Python source (decoded from base64 if needed); None for pickles and missing code."""
        return self._decoded if isinstance(self._decoded, str) else None

    def pickled_bytes(self) -> bytes | None:
        """The cloudpickle payload, for the sandbox to load; None for source callables."""
        return self._decoded if isinstance(self._decoded, bytes) else None

    def function_names(self) -> list[str]:
        """Top-level function names in source callables (what the sandbox can call)."""
        src = self.source_code()
        if src is None:
            return []
        return [n.name for n in ast.parse(src).body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


class MetricRubricTrait(_Trait):
    """Instruction-level confusion matrix (the judge marks which instructions the answer meets)."""

    evaluation_mode: Literal["tp_only", "full_matrix"] = "tp_only"
    metrics: list[MetricName] = Field(..., min_length=1)
    tp_instructions: list[str] = Field(default_factory=list)
    tn_instructions: list[str] = Field(default_factory=list)
    repeated_extraction: bool = True

    @model_validator(mode="after")
    def _computable(self) -> MetricRubricTrait:
        if len(set(self.metrics)) != len(self.metrics):
            raise ValueError("metrics: duplicate metric name")
        if not self.tp_instructions:
            raise ValueError("tp_instructions: at least one instruction is required")
        if self.evaluation_mode == "tp_only":
            bad = sorted(set(self.metrics) - METRICS_TP_ONLY)
            if bad:
                raise ValueError(
                    f"metrics: {bad} need true negatives; use evaluation_mode full_matrix with tn_instructions"
                )
        elif not self.tn_instructions:
            raise ValueError("tn_instructions: required when evaluation_mode is full_matrix")
        return self


AnyTrait = LLMRubricTrait | RegexTrait | CallableTrait | MetricRubricTrait

_WIRE_TYPES: dict[str, type[BaseModel]] = {
    "llm": LLMRubricTrait,
    "regex": RegexTrait,
    "callable": CallableTrait,
    "metric": MetricRubricTrait,
}


def trait_type_of(trait: AnyTrait) -> str:
    """Short type tag: llm | regex | callable | metric."""
    for tag, cls in _WIRE_TYPES.items():
        if isinstance(trait, cls):
            return tag
    raise TypeError(f"not a rubric trait: {type(trait).__name__}")


class Rubric(BaseModel):
    """A set of traits by type; a question's effective rubric is global.merge(question-specific)."""

    model_config = ConfigDict(extra="forbid")

    llm_traits: list[LLMRubricTrait] = Field(default_factory=list)
    regex_traits: list[RegexTrait] = Field(default_factory=list)
    callable_traits: list[CallableTrait] = Field(default_factory=list)
    metric_traits: list[MetricRubricTrait] = Field(default_factory=list)
    dynamic_traits: list[dict[str, Any]] = Field(
        default_factory=list,
        description="traits evaluated only when the judge finds their concept in the response (spec/003 "
        "stage 11): wire-form dicts {type, name, ...}, validated like the static ones",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> Rubric:
        seen: set[str] = set()
        for t in self.all_traits():
            if t.name in seen:
                raise ValueError(f"duplicate trait name {t.name!r}: trait names must be unique in a rubric")
            seen.add(t.name)
        return self

    def all_traits(self) -> list[AnyTrait]:
        return [*self.llm_traits, *self.regex_traits, *self.callable_traits, *self.metric_traits]

    def trait_names(self) -> list[str]:
        return [t.name for t in self.all_traits()]

    def get(self, name: str) -> AnyTrait | None:
        for t in self.all_traits():
            if t.name == name:
                return t
        return None

    def is_empty(self) -> bool:
        return not (self.llm_traits or self.regex_traits or self.callable_traits or self.metric_traits
                    or self.dynamic_traits)

    def merge(self, other: Rubric | None) -> Rubric:
        """Global + question-specific traits in one rubric; a shared trait name is an error."""
        if other is None or other.is_empty():
            return self.model_copy()
        clash = sorted(set(self.trait_names()) & set(other.trait_names()))
        if clash:
            raise RubricError(
                f"trait name clash between the global and the question rubric: {', '.join(map(repr, clash))}"
            )
        return Rubric(
            llm_traits=[*self.llm_traits, *other.llm_traits],
            regex_traits=[*self.regex_traits, *other.regex_traits],
            callable_traits=[*self.callable_traits, *other.callable_traits],
            metric_traits=[*self.metric_traits, *other.metric_traits],
            dynamic_traits=[*self.dynamic_traits, *other.dynamic_traits],
        )

    @classmethod
    def from_traits(cls, traits: list[AnyTrait]) -> Rubric:
        groups: dict[str, list[Any]] = {"llm": [], "regex": [], "callable": [], "metric": []}
        for t in traits:
            groups[trait_type_of(t)].append(t)
        return cls(
            llm_traits=groups["llm"],
            regex_traits=groups["regex"],
            callable_traits=groups["callable"],
            metric_traits=groups["metric"],
        )

    def to_wire(self) -> dict[str, Any]:
        """Event payload form: {"traits": [{"type": "llm"|"regex"|"callable"|"metric", ...fields}]}."""
        wire: dict[str, Any] = {
            "traits": [
                {"type": trait_type_of(t), **t.model_dump(mode="json", exclude_none=True)}
                for t in self.all_traits()
            ]
        }
        if self.dynamic_traits:
            wire["dynamic_traits"] = [dict(t) for t in self.dynamic_traits]
        return wire

    @classmethod
    def from_wire(cls, data: dict[str, Any] | None) -> Rubric:
        """Inverse of `to_wire` (an empty rubric for None)."""
        if not data:
            return cls()
        traits: list[AnyTrait] = []
        for i, raw in enumerate(data.get("traits") or []):
            if not isinstance(raw, dict):
                raise RubricError(f"traits[{i}]: expected an object, got {type(raw).__name__}")
            fields = dict(raw)
            tag = fields.pop("type", None)
            model = _WIRE_TYPES.get(str(tag))
            if model is None:
                raise RubricError(f"traits[{i}] ({fields.get('name', '?')}): unknown trait type {tag!r}")
            traits.append(model.model_validate(fields))  # type: ignore[arg-type]
        rubric = cls.from_traits(traits)
        rubric.dynamic_traits = [dict(t) for t in data.get("dynamic_traits") or [] if isinstance(t, dict)]
        return rubric
