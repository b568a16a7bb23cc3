"""The JSON schema generator for the judge's view of a template (`BaseAnswer.judge_json_schema`):
pydantic's own, with less fixed cost per schema. Every question's template is a new class whose
schema is built once, in the sandbox, so the generator's per-schema set-up counts."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import GenerateJsonSchema


class _LazyMethods(dict):  # type: ignore[type-arg]
    """Core schema type -> bound generator method, bound on first use (see `JudgeJsonSchema`)."""

    def __init__(self, owner: GenerateJsonSchema) -> None:
        super().__init__()
        self.owner = owner

    def __missing__(self, key: str) -> Any:
        method = getattr(self.owner, key.replace("-", "_") + "_schema")
        self[key] = method
        return method


class JudgeJsonSchema(GenerateJsonSchema):
    """pydantic's JSON schema generator, same output, less fixed cost per schema: a template's
    schema is built once per question (every one new), and pydantic's generator binds all ~60
    of its per-type methods up front and builds a TypeAdapter to encode even a `None` default,
    together about as much as the rest of the schema."""

    def build_schema_type_to_method(self) -> Any:
        return _LazyMethods(self)

    @property
    def mode(self) -> Any:
        """pydantic's `mode` (read ~40 times per schema), without its KeyError per read when the
        config does not set `json_schema_mode_override` (the usual case)."""
        try:
            override = self._config_wrapper_stack.tail.effective_config.get("json_schema_mode_override")
        except AttributeError:  # a pydantic without these internals: its own way
            return super().mode
        return self._mode if override is None else override

    def encode_default(self, dft: Any) -> Any:
        if type(dft) in _JSON_NATIVE:  # what TypeAdapter(type(dft)).dump_python(dft, mode="json") returns
            return dft
        return super().encode_default(dft)


# exact types; not float: a template's ser_json_inf_nan config may rewrite inf/nan
_JSON_NATIVE = frozenset({type(None), bool, int, str})


__all__ = ["JudgeJsonSchema"]
