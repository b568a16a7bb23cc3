"""How a run ended, as an exit code and the words that go with it. The one place exit codes are
defined: every command (`run`, `report`, `resume`, `regrade`, `cancel`, ...) takes them from here,
so a CI job reads the same number for the same outcome whichever command it ran.

Pure: no I/O. `judge` turns what a run produced (results, what was expected, whether it timed out,
gates) into a `Verdict`; `error_kind` names an errored job's stage and type, by which the summary
(`shared.analysis.report`) and the HTML report group errors with one example message each, and
`error_lines` prints those groups on the console.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.core.models import VerificationResult

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_RESULTS_MISSING = 3  # results missing at --timeout, or the deployment could not be reached
EXIT_JOB_ERRORS = 4  # jobs ended in error (beyond --max-errors), or the run was cancelled / stopped by its budget
EXIT_INTERRUPTED = 130  # Ctrl-C (the shell's convention for SIGINT)

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "ok: every job completed and every gate passed",
    EXIT_GATE_FAILED: "a gate failed",
    EXIT_BAD_INPUT: "bad input, refused before anything was published",
    EXIT_RESULTS_MISSING: "results missing at --timeout, or the deployment could not be reached",
    EXIT_JOB_ERRORS: "jobs ended in error (more than --max-errors), or the run was cancelled or stopped by its budget",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); the run goes on in the deployment",
}

STOP_TYPES = {"RunCancelled": "cancelled", "BudgetExhausted": "budget"}
COST_BUDGET_MESSAGE = "cost budget exhausted"  # how a money-budget stop's message starts (runtime.costcontrol)
VERIFY_RAISED = "verify() raised"
NO_JOBS_HINT = ("0 jobs to run: every question is unfinished or filtered out; pass --include-unfinished to "
                "verify unfinished questions too")


class MaxErrors:
    """`--max-errors N` (a count) or `F%` (a share of the run's jobs); the default tolerates none."""

    def __init__(self, count: int | None = None, fraction: float | None = None, text: str = "0") -> None:
        self.count = count
        self.fraction = fraction
        self.text = text

    @classmethod
    def parse(cls, text: str | None) -> MaxErrors:
        if text is None or str(text).strip() == "":
            return cls(count=0, text="0")
        s = str(text).strip()
        if s.endswith("%"):
            try:
                pct = float(s[:-1])
            except ValueError:
                pct = -1.0
            if not 0.0 <= pct <= 100.0:
                raise ValueError(f"--max-errors {text!r}: a percentage must be between 0% and 100%")
            return cls(fraction=pct / 100.0, text=s)
        if not s.isdigit():
            raise ValueError(f"--max-errors {text!r}: expected a number of jobs (e.g. 5) or a percentage (e.g. 2%)")
        return cls(count=int(s), text=s)

    def allowed(self, total: int) -> int:
        """How many errored jobs a run of `total` jobs may have and still pass."""
        if self.fraction is not None:
            return int(self.fraction * total + 1e-9)
        return int(self.count or 0)


# --------------------------------------------------------------------------------------------
# Error groups
# --------------------------------------------------------------------------------------------

_KIND = re.compile(r"^(?P<kind>[a-z_]+): model ")


def error_kind(result: VerificationResult) -> tuple[str, str, str] | None:
    """(stage, type, message) of a result that ended in error, or whose verify() raised; None
    for a result that completed (pass or plain fail)."""
    m = result.metadata
    if not m.completed_without_errors:
        failure = m.failure if isinstance(m.failure, dict) else {}
        err = m.error or ""
        parts = err.split(": ", 2)
        if len(parts) == 3:  # ours: `stage: Type: message`
            stage, etype, message = parts
        else:  # a reference file's failure record
            details = failure.get("details") if isinstance(failure.get("details"), dict) else {}
            stage = str(failure.get("stage") or "pipeline")
            etype = str(details.get("type") or failure.get("category") or "error")
            message = str(details.get("error_message") or failure.get("reason") or err)
        kind = _KIND.match(message)
        if etype == "LLMError" and kind:
            etype = f"LLMError({kind.group('kind')})"
        return stage, etype, message or err
    t = result.template
    if t is not None and t.field_verification_error:
        text = t.field_verification_error
        found = re.search(r"Field verification failed: (\w+):", text)
        return "verify_template", f"{VERIFY_RAISED}: {found.group(1) if found else 'Exception'}", text
    return None


def error_lines(groups: Sequence[dict[str, Any]], indent: str = "    ") -> list[str]:
    """One line per group: count, stage / type, and its example message."""
    return [f"{indent}{g['count']:>5} x {g['stage']} / {g['type']}: {g['example'][:200]}" for g in groups]


# --------------------------------------------------------------------------------------------
# Verdict
# --------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    code: int
    status: str  # passed | gate_failed | errors | cancelled | budget_stopped | incomplete | no_jobs
    reasons: list[str] = field(default_factory=list)
    errors: int = 0  # jobs that ended in error (verify() raising included)
    verify_raised: int = 0
    stopped: int = 0
    missing: int = 0
    allowed_errors: int = 0
    failed_gates: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.code == EXIT_OK

    @property
    def headline(self) -> str:
        if self.ok:
            return "✓ PASSED"
        return "✗ FAILED: " + "; ".join(self.reasons)

    def as_dict(self) -> dict[str, Any]:
        return {"exit_code": self.code, "status": self.status, "meaning": EXIT_CODES.get(self.code, ""),
                "reasons": list(self.reasons), "errors": self.errors, "verify_raised": self.verify_raised,
                "stopped": self.stopped, "missing": self.missing, "allowed_errors": self.allowed_errors,
                "failed_gates": list(self.failed_gates)}


def judge(
    results: Sequence[VerificationResult], *, expected: int | None = None, timed_out: bool = False,
    failed_gates: Sequence[str] = (), max_errors: MaxErrors | None = None, run_ref: str = "RUN",
) -> Verdict:
    """The run's exit code and the reasons, worst first: results missing (3), jobs in error
    beyond the tolerance or a cancelled / budget-stopped run (4), a failed gate (1), else 0."""
    max_errors = max_errors or MaxErrors()
    total = len(results) if expected is None else expected
    stopped: dict[str, int] = {}
    errors = raised = 0
    for r in results:
        kind = error_kind(r)
        if kind is None:
            continue
        errors += 1
        if kind[1].startswith(VERIFY_RAISED):
            raised += 1
        if kind[1] in STOP_TYPES:
            why = STOP_TYPES[kind[1]]
            if why == "budget" and kind[2].startswith(COST_BUDGET_MESSAGE):
                why = "cost_budget"  # the money budget (--max-cost-usd), not the token budget
            stopped[why] = stopped.get(why, 0) + 1
    missing = max(0, total - len(results))
    allowed = max_errors.allowed(total)
    v = Verdict(EXIT_OK, "passed", errors=errors, verify_raised=raised, stopped=sum(stopped.values()),
                missing=missing, allowed_errors=allowed, failed_gates=list(failed_gates))
    if timed_out or missing:
        v.code, v.status = EXIT_RESULTS_MISSING, "incomplete"
        v.reasons.append(f"{missing} of {total} job(s) have no result"
                         + (" at --timeout" if timed_out else ""))
    if stopped.get("cancelled"):
        v.reasons.append(f"the run was cancelled ({stopped.get('cancelled', 0)} job(s) not run); "
                         f"`veribus resume {run_ref}` runs them")
        if v.code == EXIT_OK:
            v.code, v.status = EXIT_JOB_ERRORS, "cancelled"
    if stopped.get("budget"):
        v.reasons.append(f"the token budget stopped the run ({stopped['budget']} job(s) not run); "
                         f"`veribus resume {run_ref} --max-tokens-budget N` runs them")
        if v.code == EXIT_OK:
            v.code, v.status = EXIT_JOB_ERRORS, "budget_stopped"
    if stopped.get("cost_budget"):
        v.reasons.append(f"the cost budget (--max-cost-usd) stopped the run ({stopped['cost_budget']} job(s) not run); "
                         f"the run's budget is spent: `veribus resume {run_ref} --max-cost-usd USD` with a larger budget runs them")
        if v.code == EXIT_OK:
            v.code, v.status = EXIT_JOB_ERRORS, "budget_stopped"
    plain = errors - sum(stopped.values())
    if plain > allowed:
        what = f"{plain} of {total} job(s) ended in error"
        if raised:
            what += f" ({raised} where the template's verify() raised)"
        tolerance = f"--max-errors {max_errors.text}" if max_errors.text not in ("0", "") else "none tolerated"
        v.reasons.append(f"{what}; {tolerance}")
        if v.code == EXIT_OK:
            v.code, v.status = EXIT_JOB_ERRORS, "errors"
    if failed_gates:
        v.reasons.append("gate(s) failed: " + ", ".join(failed_gates))
        if v.code == EXIT_OK:
            v.code, v.status = EXIT_GATE_FAILED, "gate_failed"
    return v
