"""Issue 12's figures as `veribus bench` prints them: a figure, its value, its target and whether
the value meets it, so a missed target reads as missed, not as a number to compare by eye."""

from __future__ import annotations

import operator
import re
from typing import Any

_COMPARE = {">=": operator.ge, "<=": operator.le}
_TARGET = re.compile(r"(>=|<=)\s*([0-9][0-9,]*(?:\.[0-9]+)?)")


def met(value: Any, target: str) -> bool | None:
    """Whether `value` meets `target` (">= 0.90", "<= 10", ">= 50,000"); None when either is not
    a number."""
    m = _TARGET.fullmatch(target.strip())
    if m is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return _COMPARE[m[1]](value, float(m[2].replace(",", "")))


def figure(name: str, value: Any, target: str | None = None, note: str | None = None) -> str:
    """One line: the figure, its value, its target with `met` / `NOT MET`, and a note, in columns."""
    line = f"    {name:<32}{value!s:>10}"
    if target:
        ok = met(value, target)
        line += f"   target {target}" + ("" if ok is None else "  met" if ok else "  NOT MET")
    if note:
        line += ("   " if target else " " * 18) + f"({note})"
    return line
