"""One definition of passed / failed / errored (shared.core.verdict), in Python and in SQL, and the
analyst views write the SQL out verbatim: a template whose verify() raised is an error, never a
fail nor a pass, as `shared.core.outcome.judge` counts it."""

from __future__ import annotations

import re
from importlib import resources

from shared.analysis.resultset import VerificationResultSet
from shared.core.outcome import error_kind
from shared.core.verdict import (
    SQL_ERRORED,
    SQL_FAILED,
    SQL_PASSED,
    SQL_VERIFIED,
    errored,
    failed,
    passed,
    verdict_of,
    verify_raised,
)
from tests.support.results import GPT, make

RAISED = {"field_verification_error": "Field verification failed: ValueError: bad"}


def test_python_counts_a_raised_verify_as_an_error_only() -> None:
    ok, fail, raised = make("s1", GPT, True), make("s2", GPT, False), make("s3", GPT, False, regex=RAISED)
    # the embedding check may raise a failed field verification to true: still never a pass
    rescued = make("s4", GPT, True, regex=RAISED)
    timeout = make("s5", GPT, True, error="generate_answer: LLMError: timeout")
    rows = [(verdict_of(r), passed(r), failed(r), errored(r), verify_raised(r))
            for r in (ok, fail, raised, rescued, timeout)]
    assert rows == [(True, True, False, False, False), (False, False, True, False, False),
                    (False, False, False, True, True), (False, False, False, True, True),
                    (None, False, False, True, False)]
    # errored is what judge counts as an error
    assert [errored(r) for r in (ok, fail, raised, rescued, timeout)] == \
        [error_kind(r) is not None for r in (ok, fail, raised, rescued, timeout)]


def test_python_summaries_count_a_raised_verify_as_an_error() -> None:
    rs = VerificationResultSet([make("s1", GPT, True), make("s2", GPT, False), make("s3", GPT, False, regex=RAISED)])
    s = rs.get_summary()
    assert (s["num_passed"], s["num_failed"], s["num_errors"], s["num_verify_raised"], s["num_verdicts"]) == \
        (1, 1, 1, 1, 3)
    t = rs.get_template_results().get_template_summary()
    assert (t["num_results"], t["num_passed"], t["num_failed"]) == (3, 1, 1)


def test_the_views_count_with_the_verdict_sql() -> None:
    """infra/clickhouse/004_views.sql cannot import shared.core.verdict: it writes the same
    expressions, and every count of errors, passes, fails and verdicts there is one of them."""
    text = resources.files("infra.clickhouse").joinpath("004_views.sql").read_text("utf-8")
    sql = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("--"))
    counts = re.findall(r"countIf\((.*)\)\s+AS (errors|passed|failed|verified|n|no_verdict)\s*,?$", sql, re.M)
    want = {"errors": SQL_ERRORED, "passed": SQL_PASSED, "failed": SQL_FAILED, "verified": SQL_VERIFIED,
            "n": SQL_VERIFIED, "no_verdict": f"NOT {SQL_VERIFIED}"}
    verdict_counts = [(expr, name) for expr, name in counts if "status" not in expr]  # not v_stage_latency's
    assert len(verdict_counts) == 10, verdict_counts  # v_pass_rates 5, v_replicate_outcomes 2, by replicate 3
    for expr, name in verdict_counts:
        assert expr == want[name], (name, expr)
    assert "NOT completed_without_errors)" not in sql.replace(SQL_ERRORED, "")
