"""What "passed" means, in one place: for Python (`verdict_of`, `passed`) and for SQL over the
`verification_results` columns (`SQL_VERDICT`, `SQL_PASSED`, ...), so every output counts the
same results as passes: the console summary, `results`, `report`, the HTML report, `veribus
view`, `compare`, gates, `status`, `runs`, and the analyst views (infra/clickhouse/004_views.sql
writes the same expression; a view file cannot import it).

A failure is never reported as success: a result that did not complete without errors is an
error, whatever its template says. A reference export (format 2.2) can record `verify_result:
true` beside a `failure` of a retry or system category (a timeout, say): it is an error there
too (`completed_without_errors` is derived from the failure, see
`VerificationResultMetadata._status_from_failure`), not a pass and not a fail. A result without
a template verdict (rubric_only, a template that never ran) has no verdict either.

A template whose `verify()` raised is a template error (`errored`, `SQL_ERRORED`): spec/003 stage
8 keeps it non-fatal (`completed_without_errors` stays true, `field_verification_error` holds the
message, `verify_result` false), so it keeps its verdict, false, and counts in a pass rate as a
result that did not pass, as the console summary counts it; but it is counted in `errors`, never
in `failed` (`failed`, `SQL_FAILED`), and never as a pass, even when the embedding check raised
its verify_result to true (`shared.core.outcome.error_kind` and `judge` count it the same way).

In `rubric_only` mode no template runs, so no result has a verdict. The outputs that count
verdicts (`status`, `runs`, `results`, `veribus view`) show passed and failed as `-` there, never
as 0 of a run that failed nothing; the summary (spec/004) passes a sample on its score, which in
that mode is the mean of its rubric traits, and labels its `Passed` line with that rule
(`shared.analysis.report`), as the run's progress line does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.core.models import VerificationResult


RUBRIC_ONLY = "rubric_only"
NO_TEMPLATE_VERDICTS = ("rubric_only: no template runs, so no result has a template verdict; the summary passes "
                        "a result on the mean of its rubric traits (`veribus report RUN`)")


def has_verdicts(evaluation_mode: str | None) -> bool:
    """Whether a run in this evaluation mode gives its results template verdicts (every mode but
    rubric_only; an unknown mode, as of a run ClickHouse has no `runs` row for, is assumed to)."""
    return evaluation_mode != RUBRIC_ONLY


def verify_raised(r: VerificationResult) -> bool:
    """The template's verify() raised (`template.field_verification_error`)."""
    t = r.template
    return bool(t is not None and t.field_verification_error)


def verdict_of(r: VerificationResult) -> bool | None:
    """True passed, False did not pass (a fail, or verify() raised), None no verdict (an error,
    or no template verdict)."""
    if not r.metadata.completed_without_errors:
        return None
    t = r.template
    if t is None:
        return None
    return False if verify_raised(r) else t.verify_result


def passed(r: VerificationResult) -> bool:
    return verdict_of(r) is True


def errored(r: VerificationResult) -> bool:
    """An error: it did not complete without errors, or its template's verify() raised."""
    return not r.metadata.completed_without_errors or verify_raised(r)


def failed(r: VerificationResult) -> bool:
    """A plain fail: a false verdict whose verify() did not raise (that is an error)."""
    return verdict_of(r) is False and not verify_raised(r)


# The same in ClickHouse, over `verification_results` columns (verify_result is Nullable(Bool)).
# infra/clickhouse/004_views.sql writes these expressions out verbatim (a unit test checks it).
SQL_VERIFY_RAISED = "(ifNull(field_verification_error, '') != '')"
SQL_VERDICT = f"if(completed_without_errors, if({SQL_VERIFY_RAISED}, false, verify_result), NULL)"
SQL_PASSED = f"ifNull({SQL_VERDICT}, false)"
SQL_FAILED = f"(ifNull(NOT {SQL_VERDICT}, false) AND NOT {SQL_VERIFY_RAISED})"
SQL_ERRORED = f"(NOT completed_without_errors OR {SQL_VERIFY_RAISED})"
SQL_VERIFIED = f"({SQL_VERDICT} IS NOT NULL)"
