"""Template and callable-trait functions the stage services call (spec/003 stages 1, 8, 11).

Each async function sends its user-code part to the sandbox (`shared.templates.sandbox`) and gets plain
data back; the `worker_*` functions are what runs inside the sandbox workers (they import user
code, so never call them in a service process); what checks template code without running
it is `shared.templates.static_checks`. `regex_trait_score` runs no user code but a benchmark's pattern,
which can backtrack for hours on a short answer: services call it in the sandbox
(`run_regex_trait`), under its wall time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import sys
import types
import typing
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, get_args, get_origin

import cloudpickle
import msgspec
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from shared.templates.answer import INTERNAL_FIELDS, BaseAnswer, template_namespace
from shared.templates.sandbox import Sandbox, get_sandbox
from shared.templates.static_checks import syntax_message

# =========================================================================== results


class TemplateInfo(msgspec.Struct):
    """What ValidateTemplate learns about a template (JSON-serialisable)."""

    ok: bool
    error: str | None = None
    class_name: str | None = None
    json_schema: dict[str, Any] | None = None  # what the judge fills: no id/correct, no hidden metadata
    field_names: list[str] = []
    ground_truth: dict[str, Any] | None = None  # `correct` of a placeholder instance, when obtainable
    has_verify_granular: bool = False
    regex_patterns: dict[str, str] = {}  # name -> pattern of the template's regex checks
    composition_strategy: str | None = None


class VerifyOutcome(msgspec.Struct):
    """What VerifyTemplate computes (field names as in the result's `template` section).

    `error` is fatal (the parsed dict does not fit the template, the template is invalid, or
    the sandbox stopped it); `field_verification_error` is not (verify() raised)."""

    template_verification_performed: bool = False
    verify_result: bool | None = None
    field_verification_result: bool | None = None
    verify_granular_result: Any = None
    field_verification_error: str | None = None
    parsed_llm_response: dict[str, Any] | None = None
    parsed_gt_response: dict[str, Any] | None = None
    field_results: dict[str, bool] | None = None
    composition_strategy: str | None = None
    regex_validations_performed: bool = False
    regex_validation_results: dict[str, bool] | None = None
    regex_validation_details: dict[str, dict[str, Any]] | None = None
    regex_overall_success: bool | None = None
    regex_extraction_results: dict[str, Any] | None = None
    error: str | None = None


class CallableTraitError(RuntimeError):
    """A callable trait could not be loaded or run, or returned the wrong kind of value."""


# =========================================================================== service side


async def validate_template(
    code: str,
    question_id: str | None = None,
    *,
    template_id: str | None = None,
    sandbox: Sandbox | None = None,
    timeout_s: float | None = None,
    scope: str | None = None,
) -> TemplateInfo:
    """Stage 1: compile the template in the sandbox and describe it (never raises for bad code).
    `scope` (the run id): calls of one run may share a sandbox process; None: a fresh one."""
    if not code or not code.strip():
        return TemplateInfo(ok=False, error="template code is empty")
    reply = await (sandbox or get_sandbox()).call(
        "validate_template", code=code, question_id=question_id, template_id=template_id, timeout_s=timeout_s,
        scope=scope,
    )
    if not reply["ok"]:
        return TemplateInfo(ok=False, error=reply["error"])
    try:  # user code can write its own reply: never trust its shape
        return msgspec.convert(reply["value"], TemplateInfo)
    except msgspec.ValidationError as exc:
        return TemplateInfo(ok=False, error=f"template validation returned a malformed result: {exc}")


async def run_verify(
    code: str,
    parsed: dict[str, Any],
    question_id: str,
    raw_response: str | None = None,
    *,
    template_id: str | None = None,
    sandbox: Sandbox | None = None,
    timeout_s: float | None = None,
    scope: str | None = None,
) -> VerifyOutcome:
    """Stage 8: verify() + regex checks (+ verify_granular) on the judge's parsed dict.
    `scope` (the run id): calls of one run may share a sandbox process; None: a fresh one."""
    reply = await (sandbox or get_sandbox()).call(
        "verify_template", code=code, parsed=parsed, question_id=question_id, raw_response=raw_response,
        template_id=template_id, timeout_s=timeout_s, scope=scope,
    )
    if not reply["ok"]:
        return VerifyOutcome(error=reply["error"])
    try:  # user code can write its own reply: never trust its shape
        return msgspec.convert(reply["value"], VerifyOutcome)
    except msgspec.ValidationError as exc:
        return VerifyOutcome(error=f"template verification returned a malformed result: {exc}")


async def run_callable_trait(
    code: str | bytes,
    text: str,
    kind: str,
    *,
    min_score: int | None = None,
    max_score: int | None = None,
    sandbox: Sandbox | None = None,
    timeout_s: float | None = None,
    scope: str | None = None,
) -> bool | int:
    """Run a callable trait (plain source, base64 source or base64/raw cloudpickle) on `text`.

    kind "boolean" must return a bool; kind "score" an int (floats are truncated, as the
    reference does) within [min_score, max_score] when given. Raises CallableTraitError."""
    if kind not in ("boolean", "score"):
        raise CallableTraitError(f"unknown callable trait kind {kind!r} (expected 'boolean' or 'score')")
    reply = await (sandbox or get_sandbox()).call(
        "callable_trait", code=code, text=text, kind=kind, min_score=min_score, max_score=max_score,
        timeout_s=timeout_s, scope=scope,
    )
    if not reply["ok"]:
        err = str(reply["error"])
        if reply.get("kind") == "exception":
            prefix = f"{CallableTraitError.__name__}: "
            err = err[len(prefix):] if err.startswith(prefix) else f"callable trait raised {err}"
        raise CallableTraitError(err)
    value = reply["value"]
    if (kind == "boolean" and not isinstance(value, bool)) or (
            kind == "score" and (isinstance(value, bool) or not isinstance(value, int))):
        raise CallableTraitError(f"callable trait returned a malformed result ({type(value).__name__})")
    return value


class RegexTraitError(RuntimeError):
    """A regex trait's pattern did not compile, or its search did not end in time."""


async def run_regex_trait(pattern: str, text: str, case_sensitive: bool, invert: bool, *,
                          sandbox: Sandbox | None = None, timeout_s: float | None = None,
                          scope: str | None = None) -> bool:
    """`regex_trait_score` in the sandbox (`scope` as for `run_verify`): a pattern that
    backtracks catastrophically ends at the sandbox's wall time as this trait's error, and never
    holds a service's event loop. Raises RegexTraitError."""
    reply = await (sandbox or get_sandbox()).call(
        "regex_trait", pattern=pattern, text=text, case_sensitive=case_sensitive, invert=invert,
        timeout_s=timeout_s, scope=scope,
    )
    if not reply["ok"]:
        raise RegexTraitError(str(reply["error"]))
    if not isinstance(reply["value"], bool):  # the scope's process may have been patched by its run
        raise RegexTraitError(f"regex trait returned a malformed result ({type(reply['value']).__name__})")
    return reply["value"]


def regex_trait_score(pattern: str, text: str, case_sensitive: bool, invert: bool) -> bool:
    """A regex rubric trait: does `pattern` occur in `text` (negated when `invert`). Runs in the
    sandbox (`run_regex_trait`); pure, so tests and the sandbox call it directly."""
    found = re.search(pattern, text, 0 if case_sensitive else re.IGNORECASE) is not None
    return not found if invert else found


# =========================================================================== worker side


class TemplateError(Exception):
    """The template cannot be used; the message is what the user sees."""


# key -> (code, class | error message, the class's module name or None)
_CLASSES: OrderedDict[str, tuple[str, Any, str | None]] = OrderedDict()
_CALLABLES: OrderedDict[str, tuple[str | bytes, Any]] = OrderedDict()
_CACHE_MAX = 256
_FILENAME = "<template>"


def _user_line(exc: BaseException, filename: str) -> str:
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line})" if line else ""


def _cache_get(cache: OrderedDict[str, Any], key: str, code: Any) -> Any:
    hit = cache.get(key)
    if hit is not None and hit[0] == code:
        cache.move_to_end(key)
        return hit[1]
    return None


def _cache_put(cache: OrderedDict[str, Any], key: str, code: Any, value: Any, *extra: Any) -> list[tuple[Any, ...]]:
    """Store `(code, value, *extra)`; returns the entries that left the cache (replaced, evicted)."""
    dropped = [cache.pop(key)] if key in cache else []
    cache[key] = (code, value, *extra)
    if len(cache) > _CACHE_MAX:
        dropped.append(cache.popitem(last=False)[1])
    return dropped


def _compile_template(code: str, module_name: str) -> Any:
    """Execute the template as module `module_name` (registered in sys.modules, so pydantic can
    resolve postponed annotations) and return its answer class."""
    try:
        compiled = compile(code, _FILENAME, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise TemplateError(syntax_message(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise TemplateError(f"template cannot be compiled: {type(exc).__name__}: {exc}") from None
    module = types.ModuleType(module_name)
    ns = module.__dict__
    ns.update(template_namespace())
    sys.modules[module_name] = module
    try:
        exec(compiled, ns)
    except MemoryError:
        raise
    except BaseException as exc:  # noqa: BLE001 - report whatever user code raised
        if isinstance(exc, SystemExit):
            raise TemplateError(f"template called sys.exit({exc.code!r})") from None
        raise TemplateError(
            f"error executing template: {type(exc).__name__}: {exc}{_user_line(exc, _FILENAME)}"
        ) from None
    cls = ns.get("Answer")
    if cls is None:
        own = [v for v in ns.values() if isinstance(v, type) and issubclass(v, BaseAnswer)
               and v is not BaseAnswer and v.__module__ == module_name]
        leaves = [c for c in own if not any(o is not c and issubclass(o, c) for o in own)]
        if len(leaves) != 1:
            raise TemplateError("no class named Answer")
        cls = leaves[0]
    if not isinstance(cls, type) or not issubclass(cls, BaseAnswer):
        raise TemplateError("Answer is not a BaseAnswer/pydantic model (it must subclass BaseAnswer)")
    return cls


def _template_class(code: str, template_id: str | None) -> Any:
    """The template's class, compiled once per worker (keyed by template_id, checked against code)."""
    digest = hashlib.md5(code.encode("utf-8")).hexdigest()
    key = template_id or digest
    cls = _cache_get(_CLASSES, key, code)
    if cls is None:
        module_name = "veribus_template_" + digest
        try:
            cls = _compile_template(code, module_name)
        except TemplateError as exc:
            sys.modules.pop(module_name, None)
            cls = str(exc)  # the message, so each use raises a fresh exception
        _put_class(key, code, cls, None if isinstance(cls, str) else module_name)
    if isinstance(cls, str):
        raise TemplateError(cls)
    return cls


_MODULE_USERS: dict[str, int] = {}  # template module name -> how many _CLASSES entries hold a class of it


def _put_class(key: str, code: str, cls: Any, module_name: str | None) -> None:
    """Cache a compiled class (or its error); a template module leaves sys.modules when the
    last cache entry holding one of its classes does. O(1) per put: with a template per
    question every put of a long run evicts, and a scan of sys.modules cost a quarter of a compile."""
    if module_name is not None:
        _MODULE_USERS[module_name] = _MODULE_USERS.get(module_name, 0) + 1
    for _code, _cls, old_module in _cache_put(_CLASSES, key, code, cls, module_name):
        _release_module(old_module)


def _release_module(module_name: str | None) -> None:
    if module_name is None:
        return
    left = _MODULE_USERS.get(module_name, 0) - 1
    if left > 0:
        _MODULE_USERS[module_name] = left
    else:
        _MODULE_USERS.pop(module_name, None)
        sys.modules.pop(module_name, None)


_WARM_UP = (  # trusted: what a template's first validation and verify() make pydantic load and cache
    "class Answer(BaseAnswer):\n    value: int = Field(description='n')\n\n"
    "    def model_post_init(self, __context):\n        self.correct = {'value': 1}\n\n"
    "    def verify(self) -> bool:\n        return self.value == self.correct['value']\n"
)


def warm_up() -> None:
    """(zygote, before it forks) Do once what every call process would otherwise do on its first
    template: pydantic's lazy imports and caches. Nothing of it is cached here or left in
    sys.modules: the class cache starts empty in every call process."""
    template_id = "warm-up"
    try:
        worker_validate(_WARM_UP, "q", template_id)
        worker_verify(_WARM_UP, {"value": 1}, "q", "1", template_id)
    finally:
        _CLASSES.clear()
        _MODULE_USERS.clear()
        for name in [m for m in sys.modules if m.startswith("veribus_template_")]:
            del sys.modules[name]


def _placeholder(ann: Any, depth: int = 0) -> Any:
    """A value of type `ann` good enough to instantiate a template (to read its `correct`)."""
    origin, args = get_origin(ann), get_args(ann)
    if ann in (int, float, str, bool, bytes):
        return ann()
    if origin is Literal:
        return args[0] if args else None
    if origin is typing.Annotated:
        return _placeholder(args[0], depth)
    if origin is typing.Union or origin is types.UnionType:
        return None if type(None) in args else _placeholder(args[0], depth)
    if ann in (list, set, frozenset, tuple) or origin in (list, set, frozenset, tuple) or (
        origin is not None and getattr(origin, "__name__", "") in ("Sequence", "Iterable", "Collection")
    ):
        return []
    if ann is dict or origin is dict or (origin is not None and getattr(origin, "__name__", "") == "Mapping"):
        return {}
    if isinstance(ann, type) and issubclass(ann, Enum):
        return next(iter(ann), None)
    if isinstance(ann, type) and issubclass(ann, BaseModel) and depth < 4:
        return {n: _placeholder(f.annotation, depth + 1) for n, f in ann.model_fields.items() if f.is_required()}
    return None


def _placeholder_instance(cls: Any) -> Any:
    values = {n: _placeholder(f.annotation) for n, f in cls.model_fields.items()
              if f.is_required() and n not in INTERNAL_FIELDS}
    try:
        return cls(**values)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - placeholders may violate validators: skip validation
        return cls.model_construct(**values)


def _jsonable(value: Any) -> Any:
    return to_jsonable_python(value, fallback=repr)


def worker_validate(code: str, question_id: str | None = None, template_id: str | None = None) -> dict[str, Any]:
    """(sandbox) Stage 1 checks; returns a TemplateInfo as a dict."""
    try:
        cls = _template_class(code, template_id)
    except TemplateError as exc:
        return {"ok": False, "error": str(exc)}
    name = cls.__name__
    try:
        schema = cls.judge_json_schema()
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "class_name": name, "error": f"cannot build the JSON schema: {type(exc).__name__}: {exc}"}
    instance, ground_truth = None, None
    try:
        instance = _placeholder_instance(cls)
        if question_id:
            instance.set_question_id(question_id)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - ground truth is best effort (the judge's values may fit better)
        instance = None
    if instance is not None:
        correct = getattr(instance, "correct", None)
        if correct is not None and not isinstance(correct, dict):
            return {"ok": False, "class_name": name,
                    "error": f"Answer.correct must be a dict, model_post_init set a {type(correct).__name__}"}
        ground_truth = _jsonable(correct)
    regex = instance.regex_specs() if instance is not None else {}
    if not cls.has_verify() and not regex:
        return {"ok": False, "class_name": name, "error": "Answer has no verify() method"}
    if not callable(getattr(cls, "verify", None)):
        return {"ok": False, "class_name": name, "error": "Answer.verify is not a method"}
    return {
        "ok": True,
        "class_name": name,
        "json_schema": schema,
        "field_names": cls.answer_field_names(),
        "ground_truth": ground_truth,
        "has_verify_granular": cls.has_verify_granular(),
        "regex_patterns": {str(k): str(v.get("pattern", "")) for k, v in regex.items() if isinstance(v, dict)},
        "composition_strategy": cls.composition_strategy(),
    }


def _validation_message(exc: Any) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
        parts.append(f"field '{loc}': {err.get('msg')} (got {err.get('input')!r:.60})")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return "; ".join(parts) + more


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if type(value).__name__ in ("bool_", "bool8") or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"verify() returned {type(value).__name__}, expected bool")


def worker_verify(
    code: str,
    parsed: dict[str, Any],
    question_id: str,
    raw_response: str | None = None,
    template_id: str | None = None,
) -> dict[str, Any]:
    """(sandbox) Stage 8; returns a VerifyOutcome as a dict."""

    try:
        cls = _template_class(code, template_id)
    except TemplateError as exc:
        return {"error": f"template invalid: {exc}"}
    if not isinstance(parsed, dict):
        return {"error": f"parsed response must be a JSON object, got {type(parsed).__name__}"}
    data = {k: v for k, v in parsed.items() if k not in INTERNAL_FIELDS}
    try:
        obj = cls.model_validate(data)
    except ValidationError as exc:
        return {"error": f"parsed response does not match the template: {_validation_message(exc)}"}
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - model_post_init / validators are user code
        return {"error": f"instantiating {cls.__name__} failed: {type(exc).__name__}: {exc}"
                         f"{_user_line(exc, _FILENAME)}"}
    obj.set_question_id(question_id)
    out: dict[str, Any] = {
        "template_verification_performed": True,
        "parsed_llm_response": _jsonable(obj.model_dump(mode="json", include=set(cls.answer_field_names()))),
        "parsed_gt_response": _jsonable(obj.correct),
        "composition_strategy": cls.composition_strategy(),
    }
    try:
        field_ok = _as_bool(obj.verify())
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - non-fatal per spec/003 stage 8
        field_ok = False
        out["field_verification_error"] = f"Field verification failed: {type(exc).__name__}: {exc}" \
                                          f"{_user_line(exc, _FILENAME)}"
    if cls.verified_fields():
        try:
            out["field_results"] = obj.field_results()
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001 - the same failure is already in field_verification_error
            pass
    regex_ok = True
    if obj.regex_specs():
        rx = obj.verify_regex(raw_response or "")
        regex_ok = bool(rx["success"])
        out.update(
            regex_validations_performed=bool(rx["results"]),
            regex_validation_results=rx["results"],
            regex_validation_details=_jsonable(rx["details"]),
            regex_overall_success=regex_ok,
            regex_extraction_results=_jsonable({k: d.get("matches_found", []) for k, d in rx["details"].items()}),
        )
    out["field_verification_result"] = field_ok
    out["verify_result"] = field_ok and regex_ok
    if "field_verification_error" not in out and cls.has_verify_granular():
        try:
            out["verify_granular_result"] = _jsonable(obj.verify_granular())
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001 - partial credit is optional; verify_result stands
            pass
    return out


_B64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")


def _load_callable(code: str | bytes) -> Callable[[str], Any]:
    """Source, base64 source, or (base64) cloudpickle -> the function to call."""
    raw: bytes | None = code if isinstance(code, bytes) else None
    source: str | None = None
    if raw is None:
        compact = "".join(str(code).split())
        if compact and len(compact) % 4 == 0 and _B64.fullmatch(compact):
            try:
                raw = base64.b64decode(compact, validate=True)
            except (binascii.Error, ValueError):
                raw = None
    if raw is not None and raw[:1] == b"\x80":  # pickle protocol >= 2: cloudpickle.dumps(fn)

        try:
            fn = cloudpickle.loads(raw)
        except Exception as exc:  # noqa: BLE001
            raise CallableTraitError(f"cannot unpickle callable_code: {type(exc).__name__}: {exc}") from None
        if not callable(fn):
            raise CallableTraitError(f"unpickled callable_code is a {type(fn).__name__}, not a function")
        return fn
    if raw is not None:
        try:
            text = raw.decode("utf-8")
            compile(text, "<callable trait>", "exec", dont_inherit=True)
            source = text
        except (UnicodeDecodeError, SyntaxError, ValueError):
            source = None
    if source is None:
        if isinstance(code, bytes):
            raise CallableTraitError("callable_code bytes are neither a pickle nor UTF-8 source")
        source = code
    try:
        compiled = compile(source, "<callable trait>", "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise CallableTraitError(f"callable trait source: {syntax_message(exc)}") from None
    ns: dict[str, Any] = {"__name__": "veribus_callable"}
    exec(compiled, ns)
    fn = ns.get("evaluate")
    if not callable(fn):
        own = [v for v in ns.values() if isinstance(v, types.FunctionType) and v.__module__ == "veribus_callable"]
        if len(own) != 1:
            raise CallableTraitError("callable trait source must define evaluate(trace: str) (or exactly one function)")
        fn = own[0]
    return fn


def worker_callable(
    code: str | bytes, text: str, kind: str, min_score: int | None = None, max_score: int | None = None
) -> bool | int:
    """(sandbox) Run a callable trait and check its return value against `kind`."""
    key = hashlib.md5(code if isinstance(code, bytes) else code.encode("utf-8")).hexdigest()
    fn = _cache_get(_CALLABLES, key, code)
    if fn is None:
        fn = _load_callable(code)
        _cache_put(_CALLABLES, key, code, fn)
    result = fn(text)
    if kind == "boolean":
        if isinstance(result, bool) or type(result).__name__ in ("bool_", "bool8"):
            return bool(result)
        raise CallableTraitError(f"callable trait of kind 'boolean' returned {type(result).__name__}, expected bool")
    if not isinstance(result, int | float) and not type(result).__name__.startswith(("int", "float")):
        raise CallableTraitError(f"callable trait of kind 'score' returned {type(result).__name__}, expected int")
    score = int(result)
    if min_score is not None and score < min_score:
        raise CallableTraitError(f"score {score} is below min_score {min_score}")
    if max_score is not None and score > max_score:
        raise CallableTraitError(f"score {score} is above max_score {max_score}")
    return score


__all__ = [
    "TemplateInfo", "VerifyOutcome", "CallableTraitError", "validate_template", "run_verify",
    "run_callable_trait", "regex_trait_score", "run_regex_trait", "RegexTraitError",
]
