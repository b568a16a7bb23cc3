"""Our `BaseAnswer`: the base class of answer templates, compatible with the reference's.

Reference checkpoints write templates as `class Answer(BaseAnswer)` with `from
karenina.schemas.entities import BaseAnswer`; inside the sandbox workers those imports resolve to
this module (`install_karenina_aliases`). Two template styles are supported:

* classic: plain fields + `model_post_init` (or `ground_truth()`) setting `self.correct` (and
  optionally `self.regex`) + a hand-written `verify()` (and optional `verify_granular()`);
* declarative: `VerifiedField(description, ground_truth, verify_with=<primitive>, weight)` fields,
  whose `verify()` / `verify_granular()` are derived from the field metadata, optionally
  combined by a nested `class VerificationStrategy: verify_strategy = AnyOf(...)`.

Nothing here runs in a service process on user code: the services only import the module for
its names; templates are executed in `shared.templates.sandbox` workers.
"""

from __future__ import annotations

import re
import string
import sys
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import CoreSchema

from shared.templates.judge_schema import JudgeJsonSchema

# Attributes of a template instance that are ours, not answers the judge fills in.
INTERNAL_FIELDS = frozenset({"id", "correct"})
_VERIFICATION_KEY = "__verification__"


# --------------------------------------------------------------------------- primitives

_PUNCT_TABLE = str.maketrans("", "", string.punctuation)
_NORMALIZERS: dict[str, Any] = {
    "lowercase": str.lower,
    "uppercase": str.upper,
    "strip": str.strip,
    "remove_punctuation": lambda s: s.translate(_PUNCT_TABLE),
    "collapse_whitespace": lambda s: " ".join(s.split()),
}


def normalize_text(steps: list[str], text: str) -> str:
    """Apply named normalisation steps in order (unknown names are an authoring error)."""
    for step in steps:
        fn = _NORMALIZERS.get(step)
        if fn is None:
            raise ValueError(f"unknown normalizer {step!r} (known: {', '.join(sorted(_NORMALIZERS))})")
        text = fn(text)
    return text


_PRIMITIVES: dict[str, type[Primitive]] = {}


class Primitive(BaseModel):
    """A comparison of one judge-extracted value with its ground truth (declarative templates)."""

    model_config = ConfigDict(extra="forbid")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _PRIMITIVES[cls.__name__] = cls

    def check(self, extracted: Any, expected: Any) -> bool:
        raise NotImplementedError


class BooleanMatch(Primitive):
    def check(self, extracted: Any, expected: Any) -> bool:
        return bool(extracted) == bool(expected)


class ExactMatch(Primitive):
    normalize: list[str] = ["lowercase", "strip"]

    def check(self, extracted: Any, expected: Any) -> bool:
        return normalize_text(self.normalize, str(extracted)) == normalize_text(self.normalize, str(expected))


class ContainsAny(Primitive):
    substrings: list[str]
    normalize: list[str] = []

    def check(self, extracted: Any, expected: Any) -> bool:
        text = normalize_text(self.normalize, str(extracted))
        return any(normalize_text(self.normalize, s) in text for s in self.substrings)


class ContainsAll(Primitive):
    substrings: list[str]
    normalize: list[str] = []

    def check(self, extracted: Any, expected: Any) -> bool:
        text = normalize_text(self.normalize, str(extracted))
        return all(normalize_text(self.normalize, s) in text for s in self.substrings)


class RegexMatch(Primitive):
    pattern: str
    flags: list[str] = []

    def check(self, extracted: Any, expected: Any) -> bool:
        flags = 0
        for name in self.flags:
            flags |= getattr(re, name, 0)
        return re.search(self.pattern, str(extracted), flags) is not None


class NumericExact(Primitive):
    def check(self, extracted: Any, expected: Any) -> bool:
        return float(extracted) == float(expected)


class NumericTolerance(Primitive):
    tolerance: float
    mode: Literal["relative", "absolute"] = "relative"

    def check(self, extracted: Any, expected: Any) -> bool:
        got, want = float(extracted), float(expected)
        diff = abs(got - want)
        if self.mode == "absolute":
            return diff <= self.tolerance
        return diff == 0 if want == 0 else diff / abs(want) <= self.tolerance


class NumericRange(Primitive):
    min: float | None = None
    max: float | None = None

    def check(self, extracted: Any, expected: Any) -> bool:
        val = float(extracted)
        return (self.min is None or val >= self.min) and (self.max is None or val <= self.max)


class SetContainment(Primitive):
    mode: Literal["exact", "subset", "superset", "overlap"] = "exact"
    min_overlap: int | None = None
    normalize: list[str] = []

    def check(self, extracted: Any, expected: Any) -> bool:
        def norm(items: Any) -> set[Any]:
            return {normalize_text(self.normalize, str(i)) if self.normalize else i for i in items}

        got, want = norm(extracted), norm(expected)
        if self.mode == "exact":
            return got == want
        if self.mode == "subset":
            return got <= want
        if self.mode == "superset":
            return got >= want
        return len(got & want) >= (self.min_overlap or 1)


class OrderedMatch(Primitive):
    normalize: list[str] = ["lowercase", "strip"]

    def check(self, extracted: Any, expected: Any) -> bool:
        got, want = list(extracted), list(expected)
        return len(got) == len(want) and all(
            normalize_text(self.normalize, str(a)) == normalize_text(self.normalize, str(b))
            for a, b in zip(got, want, strict=True)
        )


class LiteralMatch(Primitive):
    def check(self, extracted: Any, expected: Any) -> bool:
        return bool(extracted == expected)


def primitive_from_dict(data: dict[str, Any]) -> Primitive:
    """Rebuild a primitive from its stored form (`{"type": name, **params}`)."""
    params = dict(data)
    name = params.pop("type", None)
    cls = _PRIMITIVES.get(str(name))
    if cls is None:
        raise ValueError(f"unknown verification primitive {name!r}")
    return cls(**params)


# --------------------------------------------------------------------------- composition


class FieldCheck(BaseModel):
    """Leaf of a composition tree: one field's pass/fail."""

    type: Literal["field_check"] = "field_check"
    field: str


class AllOf(BaseModel):
    type: Literal["all_of"] = "all_of"
    conditions: list[Any] = []


class AnyOf(BaseModel):
    type: Literal["any_of"] = "any_of"
    conditions: list[Any] = []


class AtLeastN(BaseModel):
    type: Literal["at_least_n"] = "at_least_n"
    n: int
    conditions: list[Any] = []


def evaluate_strategy(node: Any, field_results: dict[str, bool | None]) -> bool:
    """Walk a composition tree; a field counts as passing only when its result is exactly True."""
    if isinstance(node, FieldCheck):
        if node.field not in field_results:
            raise KeyError(f"VerificationStrategy refers to unknown field {node.field!r}")
        return field_results[node.field] is True
    if isinstance(node, AllOf):
        return all(evaluate_strategy(c, field_results) for c in node.conditions)
    if isinstance(node, AnyOf):
        return any(evaluate_strategy(c, field_results) for c in node.conditions)
    if isinstance(node, AtLeastN):
        return sum(1 for c in node.conditions if evaluate_strategy(c, field_results)) >= node.n
    raise TypeError(f"not a composition node: {type(node).__name__}")


def strategy_label(node: Any) -> str:
    """The result's `composition_strategy` string: all_of, any_of or at_least_n(N)."""
    if isinstance(node, AtLeastN):
        return f"at_least_n({node.n})"
    return "any_of" if isinstance(node, AnyOf) else "all_of"


# --------------------------------------------------------------------------- VerifiedField


class VerificationMeta(BaseModel):
    """What a VerifiedField carries besides its description; never shown to the judge."""

    ground_truth: Any
    verify_with: dict[str, Any]
    weight: float = 1.0
    extraction_hint: str | None = None


def VerifiedField(  # noqa: N802 - the reference's public name
    description: str,
    ground_truth: Any,
    verify_with: Primitive,
    weight: float = 1.0,
    extraction_hint: str | None = None,
    **kwargs: Any,
) -> Any:
    """A pydantic Field whose ground truth and check live in hidden json_schema_extra metadata."""
    if not description or not description.strip():
        raise ValueError("VerifiedField: description is required (the judge reads it)")
    if not isinstance(verify_with, Primitive):
        raise ValueError("VerifiedField: verify_with must be a verification primitive, e.g. ExactMatch()")
    meta = VerificationMeta(
        ground_truth=ground_truth,
        verify_with={"type": type(verify_with).__name__, **verify_with.model_dump(mode="json")},
        weight=weight,
        extraction_hint=extraction_hint,
    )
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    extra[_VERIFICATION_KEY] = meta.model_dump(mode="json")
    return Field(description=description, json_schema_extra=extra, **kwargs)


def _strip_key(obj: Any, key: str) -> None:
    if isinstance(obj, dict):
        obj.pop(key, None)
        for v in obj.values():
            _strip_key(v, key)
    elif isinstance(obj, list):
        for v in obj:
            _strip_key(v, key)


# --------------------------------------------------------------------------- BaseAnswer


class _CoreSchemaOf:
    """Annotation: the core schema pydantic generates for the annotated type, built directly.
    pydantic regenerates an inherited field's schema for every subclass, and every question's
    template is a new subclass of BaseAnswer: its two fields cost about as much as a template's
    own. A fresh schema per call (pydantic adds metadata to the schema it is given)."""

    def __init__(self, make: Callable[[], CoreSchema]) -> None:
        self.make = make

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> CoreSchema:
        return self.make()


def _optional_str() -> CoreSchema:
    """`core_schema.nullable_schema(core_schema.str_schema())`, as a literal (the helpers cost more)."""
    return {"type": "nullable", "schema": {"type": "str"}}


def _optional_dict() -> CoreSchema:
    """`nullable_schema(dict_schema(str_schema(), any_schema()))`, as a literal."""
    return {"type": "nullable", "schema": {"type": "dict", "keys_schema": {"type": "str"}, "values_schema": {"type": "any"}}}


class BaseAnswer(BaseModel):
    """Base class of answer templates.

    `id` is the question id (set by the pipeline via `set_question_id`); `correct` is the ground
    truth dict a template sets in `model_post_init` / `ground_truth()`. Extra attributes are
    allowed so templates can stash helpers (`self.regex`, `self.tolerance`) on the instance.
    """

    model_config = ConfigDict(extra="allow")

    # = `id: str | None` and `correct: SkipJsonSchema[dict[str, Any] | None]`, cheaper to subclass
    id: Annotated[str | None, _CoreSchemaOf(_optional_str)] = None
    correct: Annotated[dict[str, Any] | None, _CoreSchemaOf(_optional_dict), SkipJsonSchema()] = Field(
        default=None, exclude=True)

    # Optional named regex checks against the raw response, as a ClassVar on the subclass or set
    # on the instance in model_post_init / ground_truth():
    #   {"name": {"pattern": r"...", "expected": ..., "match_type": "exact|contains|count|all"}}
    # (not declared here: pydantic forbids assigning a ClassVar on instances)

    def model_post_init(self, context: Any, /) -> None:
        """Set `correct`: via a subclass's `ground_truth()`, else from VerifiedField metadata."""
        if type(self).ground_truth is not BaseAnswer.ground_truth:
            returned = self.ground_truth()
            if self.correct is None and isinstance(returned, dict):
                self.correct = returned
        if self.correct is None:
            verified = type(self).verified_fields()
            if verified:
                self.correct = {name: meta.ground_truth for name, meta in verified.items()}

    def ground_truth(self) -> dict[str, Any] | None:
        """The ground truth dict. Subclasses may override it to *set* `self.correct` instead of
        writing `model_post_init` (the reference's lifecycle hook); either way `correct` ends set."""
        return self.correct

    def set_question_id(self, question_id: str) -> None:
        self.id = question_id

    def verify(self) -> bool:
        """Field verification. Declarative templates get it from their VerifiedFields; regex-only
        templates pass trivially (their regex checks decide); classic templates must override."""
        verified = type(self).verified_fields()
        if verified:
            results = self.field_results()
            strategy = type(self).verification_strategy()
            return evaluate_strategy(strategy, results) if strategy is not None else all(
                r is True for r in results.values()
            )
        if self.regex_specs():
            return True
        raise NotImplementedError(f"{type(self).__name__} defines no verify() method")

    def verify_granular(self) -> float:
        """Partial credit in [0, 1] from VerifiedField weights, honouring the composition:
        AnyOf scores the best passing field, AtLeastN the best N, otherwise the weighted mean."""
        verified = type(self).verified_fields()
        if not verified:
            raise NotImplementedError(f"{type(self).__name__} defines no verify_granular() method")
        results = self.field_results()
        total = sum(m.weight for m in verified.values())
        if total == 0:
            return 0.0
        passing = sorted((verified[n].weight for n, ok in results.items() if ok is True), reverse=True)
        strategy = type(self).verification_strategy()
        if isinstance(strategy, AnyOf):
            return (passing[0] if passing else 0.0) / total
        if isinstance(strategy, AtLeastN):
            return sum(passing[: strategy.n]) / total
        return sum(passing) / total

    # -- declarative support --------------------------------------------------------------

    @classmethod
    def verified_fields(cls) -> dict[str, VerificationMeta]:
        """Fields declared with VerifiedField, with their (hidden) metadata; cached per class."""
        cached = cls.__dict__.get("_veribus_verified")
        if cached is not None:
            return cached
        out: dict[str, VerificationMeta] = {}
        for name, info in cls.model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and _VERIFICATION_KEY in extra:
                out[name] = VerificationMeta.model_validate(extra[_VERIFICATION_KEY])
        type.__setattr__(cls, "_veribus_verified", out)
        return out

    @classmethod
    def verification_strategy(cls) -> Any:
        holder = getattr(cls, "VerificationStrategy", None)
        return getattr(holder, "verify_strategy", None) if holder is not None else None

    @classmethod
    def composition_strategy(cls) -> str | None:
        """`composition_strategy` of the result: None for classic templates."""
        strategy = cls.verification_strategy()
        if strategy is not None:
            return strategy_label(strategy)
        return "all_of" if cls.verified_fields() else None

    @classmethod
    def has_verify(cls) -> bool:
        return cls.verify is not BaseAnswer.verify or bool(cls.verified_fields())

    @classmethod
    def has_verify_granular(cls) -> bool:
        return cls.verify_granular is not BaseAnswer.verify_granular or bool(cls.verified_fields())

    def field_results(self) -> dict[str, bool]:
        """Per-field pass/fail of the VerifiedFields (empty for classic templates)."""
        out: dict[str, bool] = {}
        for name, meta in type(self).verified_fields().items():
            out[name] = bool(primitive_from_dict(meta.verify_with).check(getattr(self, name), meta.ground_truth))
        return out

    @classmethod
    def answer_field_names(cls) -> list[str]:
        """The fields the judge fills in (everything but our internal ones)."""
        return [n for n in cls.model_fields if n not in INTERNAL_FIELDS]

    @classmethod
    def judge_json_schema(cls) -> dict[str, Any]:
        """JSON schema of the judge-filled fields: no id/correct, no hidden verification data."""
        if getattr(cls.model_json_schema, "__func__", None) is _MODEL_JSON_SCHEMA:
            schema = cls.model_json_schema(schema_generator=JudgeJsonSchema)
        else:  # the template overrides model_json_schema: call it as it expects
            schema = cls.model_json_schema()
        props = schema.get("properties", {})
        for name in INTERNAL_FIELDS:
            props.pop(name, None)
        if "required" in schema:
            schema["required"] = [r for r in schema["required"] if r not in INTERNAL_FIELDS]
            if not schema["required"]:
                del schema["required"]
        schema.pop("additionalProperties", None)
        _strip_key(schema, _VERIFICATION_KEY)
        return schema

    # -- regex checks ---------------------------------------------------------------------

    def regex_specs(self) -> dict[str, dict[str, Any]]:
        specs = getattr(self, "regex", None)
        return specs if isinstance(specs, dict) else {}

    def verify_regex(self, raw_text: str) -> dict[str, Any]:
        """Run the named regex checks on the raw response.

        Returns {"success": bool, "results": {name: bool}, "details": {name: {pattern, expected,
        match_type, matches_found, match_count, success_reason | failure_reason | error}}}.
        """
        results: dict[str, bool] = {}
        details: dict[str, dict[str, Any]] = {}
        for name, spec in self.regex_specs().items():
            pattern = spec.get("pattern", "")
            expected = spec.get("expected")
            match_type = spec.get("match_type", "exact")
            detail: dict[str, Any] = {"pattern": pattern, "expected": expected, "match_type": match_type}
            try:
                ok = _regex_check(raw_text, pattern, expected, match_type, detail)
            except Exception as exc:  # a broken pattern fails its own check only
                ok = False
                detail["error"] = f"{type(exc).__name__}: {exc}"
            results[name] = ok
            details[name] = detail
        return {"success": all(results.values()), "results": results, "details": details}


def _regex_check(text: str, pattern: str, expected: Any, match_type: str, detail: dict[str, Any]) -> bool:
    """One regex check; fills `detail` with what was found and why it passed or failed."""
    found = re.findall(pattern, text)
    detail["matches_found"] = found
    detail["match_count"] = len(found)
    if match_type == "exact":
        ok = len(found) == 1 and found[0] == expected
        why = "single exact match" if ok else f"expected exactly one match equal to {expected!r}, got {found!r}"
    elif match_type == "contains":
        ok = expected in found
        why = f"{expected!r} among the matches" if ok else f"{expected!r} not among the matches {found!r}"
    elif match_type == "count":
        ok = isinstance(expected, int) and len(found) == expected
        why = f"{len(found)} matches" + ("" if ok else f", expected {expected!r}")
    elif match_type == "all":
        if not isinstance(expected, list):
            ok, why = False, f"match_type 'all' needs a list as expected, got {type(expected).__name__}"
        else:
            missing = [e for e in expected if e not in found]
            ok = not missing
            why = "all expected items matched" if ok else f"missing expected items {missing!r}"
    else:
        ok, why = False, f"unknown match_type {match_type!r}"
    detail["success_reason" if ok else "failure_reason"] = why
    return ok


_MODEL_JSON_SCHEMA = BaseModel.model_json_schema.__func__  # type: ignore[attr-defined]

# --------------------------------------------------------------------------- karenina aliases

_TYPING_NAMES = ("Any", "Literal", "Optional", "Union")
PRIMITIVE_NAMES = tuple(sorted(_PRIMITIVES))
COMPOSITION_NAMES = ("AllOf", "AnyOf", "AtLeastN", "FieldCheck")


def template_namespace() -> dict[str, Any]:
    """Globals a template is executed with: the names the reference pre-binds for templates
    (our own primitives, even after a template defined a Primitive of the same name)."""
    return dict(_TEMPLATE_NAMESPACE)


_TEMPLATE_NAMESPACE: dict[str, Any] = {
    "BaseAnswer": BaseAnswer, "Field": Field, "VerifiedField": VerifiedField, "List": list, "Dict": dict,
    **{n: getattr(typing, n) for n in _TYPING_NAMES},
    **{n: _PRIMITIVES[n] for n in PRIMITIVE_NAMES},
    **{n: globals()[n] for n in COMPOSITION_NAMES},
}


def install_karenina_aliases() -> None:
    """Make `karenina.schemas.entities.BaseAnswer` & co importable (sandbox workers only)."""
    me = sys.modules[__name__]
    everything = {n: getattr(me, n) for n in ("BaseAnswer", "VerifiedField", "VerificationMeta",
                                              "evaluate_strategy", *PRIMITIVE_NAMES, *COMPOSITION_NAMES)}
    layout: dict[str, dict[str, Any]] = {
        "karenina": {},
        "karenina.schemas": everything,
        "karenina.schemas.entities": everything,
        "karenina.schemas.entities.answer": {"BaseAnswer": BaseAnswer},
        "karenina.schemas.entities.verified_field": {"VerifiedField": VerifiedField,
                                                     "VerificationMeta": VerificationMeta},
        "karenina.schemas.entities.primitives": {n: _PRIMITIVES[n] for n in PRIMITIVE_NAMES},
        "karenina.schemas.entities.composition": {n: everything[n] for n in (*COMPOSITION_NAMES,
                                                                                "evaluate_strategy")},
        "karenina.schemas.primitives": {n: everything[n] for n in (*PRIMITIVE_NAMES, *COMPOSITION_NAMES)},
        "karenina.schemas.domain": {"BaseAnswer": BaseAnswer},
        "karenina.schemas.answer_class": {"BaseAnswer": BaseAnswer},
    }
    for mod_name, attrs in layout.items():
        mod = types.ModuleType(mod_name, "veribus alias of the reference's module (shared.templates.answer)")
        mod.__path__ = []  # a package, so submodule imports resolve through sys.modules
        mod.__dict__.update(attrs)
        sys.modules[mod_name] = mod
    for mod_name in layout:  # parent.child attributes, as a real import would set them
        parent, _, child = mod_name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[mod_name])


__all__ = [
    "BaseAnswer", "VerifiedField", "VerificationMeta", "Primitive", "FieldCheck", "AllOf", "AnyOf",
    "AtLeastN", "evaluate_strategy", "strategy_label", "primitive_from_dict", "normalize_text",
    "template_namespace", "install_karenina_aliases", "INTERNAL_FIELDS",
    *PRIMITIVE_NAMES,
]
