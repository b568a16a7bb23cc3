"""Checks of template code that run nothing of it, safe in any process (the CLI runs them before
publishing): does it compile, and does it name what validation will need. Everything that
executes template code is `shared.templates.calls`, in the sandbox."""

from __future__ import annotations


def syntax_message(exc: SyntaxError) -> str:
    where = f" at line {exc.lineno}" if exc.lineno else ""
    text = (exc.text or "").strip()
    return f"syntax error{where}: {exc.msg}" + (f" ({text[:80]})" if text else "")


def compile_check(code: str) -> str | None:
    """Syntax check without executing anything (usable by the CLI before publishing)."""
    try:
        compile(code, "<template>", "exec", dont_inherit=True)
    except SyntaxError as exc:
        return syntax_message(exc)
    except (ValueError, MemoryError, RecursionError) as exc:  # NUL bytes, absurd nesting
        return f"template cannot be compiled: {type(exc).__name__}: {exc}"
    return None


def template_shape_problem(code: str) -> str | None:
    """Why code that compiles cannot be an answer template, seen without running it: validation
    needs `class Answer(BaseAnswer)` (or one BaseAnswer subclass) with a `verify()` method, and
    code that never names `Answer`, or never names `verify`, has neither; None otherwise (what it
    does define is the sandbox's to find). Found here, the run is refused before any model call."""
    if "Answer" not in code:
        return "it defines no answer class: a template needs `class Answer(BaseAnswer)`"
    if "verify" not in code:
        return "its answer class has no verify() method: a template needs `def verify(self) -> bool`"
    return None
