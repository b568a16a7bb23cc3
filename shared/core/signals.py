"""Typed signals: the flags one stage leaves for a later one in `State.signals`.

They are not result fields: the fold reads the auto-fail flags (`recursion_limit`,
`trace_validation_failed`, `dj_autofail`, `dj_rubric_autofail`) and `rubric_error`; the stages
read the rest. On the wire `signals` is still a JSON object with these keys (the
same names the untyped dict used), so events published before the signals were typed decode
unchanged, and a field left at its default is not written.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Signals(msgspec.Struct, omit_defaults=True):
    """One attribute per signal; the stage that sets it and the stages that read it in brackets."""

    recursion_limit: bool = False  # the agent hit its recursion limit (guards -> verification)
    trace_validation_failed: bool = False  # the agent trace does not end in an AI message (guards -> verification, rubric)
    abstention: bool = False  # the answer abstains (guards -> verification, parsing, rubric)
    insufficient: bool = False  # the answer lacks what the template needs (guards -> verification)
    agent_trace: bool = False  # the answer is an MCP agent trace (guards -> evaluation_text)
    final_ai_message: str | None = None  # the trace's final AI message (guards -> evaluation_text)
    parsed: dict[str, Any] | None = None  # the judge's parsed template fields (parsing -> verification)
    field_verification_result: bool | None = None  # verify() before regex/embedding (verification)
    dj_autofail: bool = False  # deep judgment found no excerpt for an attribute (verification -> fold)
    dj_rubric_autofail: bool = False  # a deep-judged trait found no valid excerpt (rubric -> fold)
    rubric_error: str | None = None  # the rubric stage gave up with this message (rubric -> fold)
