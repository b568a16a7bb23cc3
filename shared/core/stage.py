"""What every stage function shares, with no bus and no harness: the stage log (`record`), the
error a stage reports (`stage_error`) and the text later stages evaluate (`evaluation_text`).

A stage is pure in the house's sense: `(job, state, ports) -> new state`, where the ports are
the model client, the sandbox and the search tool it is handed; it reads and writes nothing
else, so it runs the same in a service, a regrade or a unit test.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

from shared.core.events import StageError, StageRecord, State
from shared.core.scrub import scrub_text

SANDBOX_SCOPE: ContextVar[str | None] = ContextVar("veribus_sandbox_scope", default=None)
"""The sandbox process the job being handled may share with the other jobs of its run (the
`scope` of a template or trait call), or None: a fresh process of its own. The service harness
sets it for each message, to the run's scope only when every piece of code the job brings is
code its run announced when it was submitted (`shared.runtime.content.ContentStore.sandbox_scope`):
a job another client published into the run cannot run its code in that run's process, where a
class body could patch what the run's own `verify()`s return. Unset (a stage called outside a
service, as in unit tests): fresh processes, slower and as safe."""


def stage_error(stage: str, exc: BaseException, attempt: int = 1) -> StageError:
    """The error a stage reports for `exc` (secrets scrubbed, message and traceback bounded for the wire)."""
    return StageError(
        stage=stage,
        type=type(exc).__name__,
        message=scrub_text(str(exc))[:2000] or type(exc).__name__,
        traceback=scrub_text("".join(traceback.format_exception(exc)))[-4000:],
        attempt=attempt,
    )


def record(state: State, stage: str, status: str, started: float, reason: str = "") -> None:
    """Append this stage's outcome to the state's stage log (for timing and skip analysis)."""
    state.stages.append(
        StageRecord(stage=stage, status=status, reason=reason, started_at=started, ended_at=time.time())  # type: ignore[arg-type]
    )


def evaluation_text(state: State, use_full_trace: bool) -> str:
    """The text later stages evaluate: the full response/trace, or the extracted final AI message."""
    if use_full_trace or not state.signals.agent_trace:
        return state.template.get("raw_llm_response", "")
    return state.signals.final_ai_message or state.template.get("raw_llm_response", "")


def require_fields(keys: Sequence[str], *, expected: str = "a JSON object",
                   missing: str = "field(s)") -> Callable[[Any], Any]:
    """A judge reply's cheap in-process check: a JSON object with every one of `keys` (the
    client retries a reply that fails it). The messages read `expected <expected>` and
    `missing <missing>: ...`."""
    keys = list(keys)

    def check(obj: Any) -> Any:
        if not isinstance(obj, dict):
            raise ValueError(f"expected {expected}")
        absent = [k for k in keys if k not in obj]
        if absent:
            raise ValueError(f"missing {missing}: {', '.join(absent)}")
        return obj

    return check
