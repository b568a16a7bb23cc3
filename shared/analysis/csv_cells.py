"""CSV cells as veribus writes them: booleans as `True`/`False` and lists as JSON (the reference's
format), and every text cell safe to open in a spreadsheet. Questions, model replies and names are
untrusted, and a spreadsheet runs a cell that starts with `=`, `+`, `-` or `@` as a formula (CSV
injection), so such a cell is written behind a `'` unless the caller asks for the cells as they
are (`raw`, `veribus export --csv-raw`, for a program)."""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Sequence
from typing import IO, Any

import msgspec

_enc = msgspec.json.Encoder()

# A spreadsheet takes a cell starting with one of these as a formula (OWASP, CSV injection); tab and
# carriage return because some apps drop them and read on; full-width forms because some apps read
# them as their ASCII forms (an IME types them).
FORMULA_TRIGGERS = frozenset("=+-@\t\r\uff1d\uff0b\uff0d\uff20")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def spreadsheet_safe(value: Any) -> Any:
    """`value` as a CSV cell a spreadsheet shows as text: a string that starts with a formula
    trigger, or with whitespace and then one (apps trim before they look), gets a leading `'`.
    Anything else is returned as it is: non-strings (a score of -1.5 stays a number) and strings
    that are a plain number (`-1.5`, the reference's `rubric_<trait>` cells), which no spreadsheet
    runs."""
    if not isinstance(value, str) or not value:
        return value
    first = value[0]
    if first not in FORMULA_TRIGGERS and not first.isspace():
        return value  # the common case, decided on one character
    if first in "\t\r" or value.lstrip()[:1] in FORMULA_TRIGGERS:
        return value if _PLAIN_NUMBER.fullmatch(value) else "'" + value
    return value


def write_csv(fh: IO[str], columns: Sequence[str], pages: Iterable[list[list[Any]]], *, raw: bool = False) -> int:
    """Rows (lists in `columns` order) as CSV, converting by value: booleans as True/False (the
    reference's format), lists as JSON, NULL empty; text (already formatted cells) as it is, but
    behind a `'` where a spreadsheet would run it as a formula (`spreadsheet_safe`), unless `raw`.
    The one CSV writer of veribus: every CSV export goes through it."""
    w = csv.writer(fh)
    w.writerow(columns if raw else [spreadsheet_safe(c) for c in columns])
    n = 0
    for page in pages:
        for row in page:
            for j, v in enumerate(row):
                if isinstance(v, bool):
                    row[j] = "True" if v else "False"
                elif isinstance(v, list | tuple):
                    row[j] = _enc.encode(list(v)).decode()
                elif not raw:
                    row[j] = spreadsheet_safe(v)
        w.writerows(page)
        n += len(page)
    return n
