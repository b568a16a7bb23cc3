"""A VerificationResult dump without its default values, and back, exactly.

`result.finalized` carries the whole result so a rebuild needs no other event, but most of a
result's ~80 fields hold their defaults (null, false, [], 0). On the wire the finalizer sends
`compact(dump)`: every field of a result section (the models in `shared.core.models`) whose JSON
value equals the field's default is left out. `expand` puts them back in the model's field
order, so `expand(compact(d))` is `d` key for key and byte for byte once encoded (the projector's
`result_json` and a rebuild's fingerprints depend on that). The defaults are read from the
models themselves, once, so a field added there is handled without touching this module.

Only the sections' own fields are compacted; nested maps and lists (usage, traces, scores)
travel as they are. Values are compared by type as well (`0` is not `false`).
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from shared.core.models import VerificationResult

_MISSING = object()
_Schema = tuple[tuple[str, Any, "_Schema | None"], ...]
_SCHEMA: _Schema | None = None


def _default_json(field: Any) -> Any:
    """The JSON value of a field's default, or _MISSING when it has none or it is not a constant."""
    if field.default_factory is not None:
        if field.default_factory is list:
            return []
        if field.default_factory is dict:
            return {}
        return _MISSING
    if field.default is PydanticUndefined:
        return _MISSING
    d = field.default
    if d is None or isinstance(d, bool | int | float | str):
        return d
    if isinstance(d, list | dict) and not d:
        return type(d)()
    return _MISSING


def _section_of(annotation: Any) -> Any:
    """The section model a field holds (`Model` or `Model | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:
            return models[0]
    return None


def _schema_of(model: Any) -> _Schema:
    out = []
    for name, field in model.model_fields.items():
        sub = _section_of(field.annotation)
        out.append((name, _default_json(field), _schema_of(sub) if sub is not None else None))
    return tuple(out)


def _schema() -> _Schema:
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = _schema_of(VerificationResult)
    return _SCHEMA


def _is_default(value: Any, default: Any) -> bool:
    return default is not _MISSING and type(value) is type(default) and value == default


def _compact(data: dict[str, Any], schema: _Schema) -> dict[str, Any]:
    out: dict[str, Any] = {}
    known = set()
    for name, default, sub in schema:
        known.add(name)
        if name not in data:
            continue
        value = data[name]
        if _is_default(value, default):
            continue
        out[name] = _compact(value, sub) if sub is not None and isinstance(value, dict) else value
    for name, value in data.items():  # extra fields (reference files' unknown keys) stay as they are
        if name not in known:
            out[name] = value
    return out


class _Filler:
    """One section's expansion, prepared once: a dict of every field in order (defaults, or
    _MISSING for a required one) that the sent fields are merged over at C speed."""

    def __init__(self, schema: _Schema) -> None:
        self.base = {name: default for name, default, _ in schema}
        self.required = tuple(name for name, default, _ in schema if default is _MISSING)
        self.fresh = tuple((name, type(default)) for name, default, _ in schema if isinstance(default, list | dict))
        self.subs = tuple((name, _Filler(sub)) for name, _, sub in schema if sub is not None)

    def expand(self, data: dict[str, Any]) -> dict[str, Any]:
        # the merge keeps the fields' order; extra fields follow them, as in a dump
        out = {**self.base, **data}
        base = self.base
        for name in self.required:
            if out[name] is _MISSING:
                del out[name]  # a required field the sender did not have: left out, as it was
        for name, kind in self.fresh:
            if out[name] is base[name]:
                out[name] = kind()  # a fresh [] / {}, never the shared default
        for name, sub in self.subs:
            value = out.get(name)
            if isinstance(value, dict):
                out[name] = sub.expand(value)
        return out


_FILLER: _Filler | None = None


_EMPTY_DEFAULTS: frozenset[str] | None = None


def is_empty_template_default(name: str, value: Any) -> bool:
    """Whether a template-section value is its field's empty default (null, or [] where the
    default is []): a stage state may leave it out (stages read the section with `.get(...) or`,
    and the fold builds it with the model, which puts the default back)."""
    global _EMPTY_DEFAULTS
    if _EMPTY_DEFAULTS is None:
        sub = next(s for n, _, s in _schema() if n == "template")
        _EMPTY_DEFAULTS = frozenset(f"{n}:{'[]' if d == [] else 'null'}" for n, d, _ in sub or ()
                                    if d is None or (type(d) is list and not d))
    if value is None:
        return f"{name}:null" in _EMPTY_DEFAULTS
    return type(value) is list and not value and f"{name}:[]" in _EMPTY_DEFAULTS


def compact(dump: dict[str, Any]) -> dict[str, Any]:
    """A `VerificationResult.model_dump(mode="json")` without the fields at their defaults."""
    return _compact(dump, _schema())


def expand(data: dict[str, Any]) -> dict[str, Any]:
    """The full dump back from `compact`, in the model's field order."""
    global _FILLER
    if _FILLER is None:
        _FILLER = _Filler(_schema())
    return _FILLER.expand(data)
