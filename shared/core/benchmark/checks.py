"""Checks of benchmark parts that need no execution: templates compile (with the line of the
error), traits loaded, pydantic errors as one readable line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.core.benchmark.question import BenchmarkError
from shared.core.rubric import (
    CallableTrait,
)


def trait_problems(trait: Any, where: str) -> list[str]:
    out: list[str] = []
    if trait.load_error:
        out.append(f"{where}: trait {trait.name!r}: {trait.load_error}")
    elif isinstance(trait, CallableTrait) and trait.code_format == "source":
        if not trait.function_names():
            out.append(f"{where}: trait {trait.name!r}: callable_code defines no function")
    return out


def validation_message(err: ValidationError) -> str:
    parts: list[str] = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()))
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def check_template(code: Any, path: Path, label: str, qid: str, line_hint: int | None = None) -> str | None:
    """Template must be a string that compiles (not executed). '' means no template."""
    if code is None:
        return None
    if not isinstance(code, str):
        raise BenchmarkError(
            f"{path}: {label}: template: expected Python source text, got {type(code).__name__}",
            path=str(path), question_id=qid, field="template",
        )
    if not code.strip():
        return None
    try:
        compile(code, f"<template {qid}>", "exec")
    except SyntaxError as e:
        file_line = f", file line {line_hint + (e.lineno or 1)}" if line_hint is not None else ""
        raise BenchmarkError(
            f"{path}: {label}: template: does not compile: SyntaxError at template line {e.lineno}{file_line}: {e.msg}",
            path=str(path), question_id=qid, field="template",
        ) from e
    except (ValueError, MemoryError, RecursionError) as e:  # null bytes in source, absurd nesting
        raise BenchmarkError(
            f"{path}: {label}: template: does not compile: {type(e).__name__}: {e}", path=str(path), question_id=qid,
            field="template"
        ) from e
    return code
