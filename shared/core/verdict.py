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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.core.models import VerificationResult


def verdict_of(r: VerificationResult) -> bool | None:
    """True passed, False failed, None no verdict (an error, or no template verdict)."""
    if not r.metadata.completed_without_errors:
        return None
    t = r.template
    return t.verify_result if t is not None else None


def passed(r: VerificationResult) -> bool:
    return verdict_of(r) is True


# The same in ClickHouse, over `verification_results` columns (verify_result is Nullable(Bool)).
SQL_VERDICT = "if(completed_without_errors, verify_result, NULL)"
SQL_PASSED = f"ifNull({SQL_VERDICT}, false)"
SQL_FAILED = f"ifNull(NOT {SQL_VERDICT}, false)"
SQL_VERIFIED = f"({SQL_VERDICT} IS NOT NULL)"
