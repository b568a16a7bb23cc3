"""The static report tells why: errors grouped by stage and type with an example, a SIMULATED
banner for simulator runs, question names in the heat map, a collapsed per-question appendix of
responses, and no "No token usage recorded" excuse when every job errored."""

from __future__ import annotations

import re

from shared.analysis.html_report import RunData, error_groups, render_html
from tests.support.results import grid_results, make


def _section(page: str, heading: str) -> str:
    return page.split(heading, 1)[1].split("<h2>", 1)[0]


def test_errors_are_grouped_by_stage_and_type_with_an_example() -> None:
    rs = grid_results()
    rs += [make("q9", "model-c", None, error="parse_template: ValueError: judge reply is not JSON"),
           make("q8", "model-c", None, error="parse_template: ValueError: judge reply is not JSON either")]
    groups = error_groups(rs)
    assert [(g["stage"], g["type"], g["count"]) for g in groups] == [("parse_template", "ValueError", 2),
                                                                     ("generate_answer", "TimeoutError", 1)]
    page = render_html(RunData(run_id="r", results=rs))
    errors = _section(page, "6. Errors by stage and type")
    assert "parse_template" in errors and "judge reply is not JSON" in errors and "model took too long" in errors
    assert "3 of 38 results errored; most often parse_template / ValueError (2)" in page


def test_a_run_where_every_job_errored_says_why() -> None:
    rs = [make(f"q{i}", "m", None, error="generate_answer: APIConnectionError: connection refused") for i in range(18)]
    page = render_html(RunData(run_id="r", results=rs))
    assert "No token usage recorded" not in page
    assert "every job errored before a model reported usage" in page
    assert "18 of 18 results errored" in page and "connection refused" in page
    assert "generate_answer" in _section(page, "6. Errors by stage and type")


def test_simulated_runs_carry_a_banner() -> None:
    sim = [make("q1", "sim-a", True, interface="simulator")]
    assert "id='simulated'" in render_html(RunData(run_id="r", results=sim))
    assert "id='simulated'" in render_html(RunData(run_id="r", results=grid_results(), simulated=True))
    assert "id='simulated'" not in render_html(RunData(run_id="r", results=grid_results()))


def test_heat_map_rows_are_question_names() -> None:
    page = render_html(RunData(run_id="r", results=grid_results()))
    heat = _section(page, "2. Questions × models")
    svg = heat.split("</svg>")[0]
    assert "What is the putative target of venetoclax?" in svg and "Question q2?" in svg
    assert re.search(r">\s*1\s*<title>", svg) is None  # no bare column numbers


def test_appendix_holds_every_response_collapsed_and_escaped() -> None:
    rs = grid_results()
    rs[0].template.raw_llm_response = "<script>alert(1)</script> the answer"
    page = render_html(RunData(run_id="r", results=rs))
    appendix = _section(page, "7. Appendix: questions and responses")
    assert appendix.count("<details class='resp'>") == len(rs)
    assert "<details open" not in appendix  # collapsed
    assert "&lt;script&gt;alert(1)&lt;/script&gt; the answer" in appendix and "<script>" not in appendix
    assert "ground truth: <code>BCL2</code>" in appendix
    assert "generate_answer: TimeoutError" in appendix


def test_cost_is_shown_in_total_per_model_and_per_stage() -> None:
    rs = grid_results()
    for i, r in enumerate(rs):
        assert r.template is not None
        r.template.usage_metadata = {
            "answer_generation": {"input_tokens": 100, "output_tokens": 50, "model": r.metadata.answering.model_name,
                                  "model_calls": 1, "cached_replies": 0, "cost_usd": 0.001},
            "parsing": {"input_tokens": 80, "output_tokens": 20, "model": r.metadata.parsing.model_name,
                        "model_calls": 1, "cached_replies": 0, "cost_usd": 0.0005 if i % 2 else 0.0015},
        }
    page = render_html(RunData(run_id="r", results=rs))
    cost = page.split("id='cost'", 1)[1].split("<h2>", 1)[0]
    # 36 x 0.001 + 18 x 0.0005 + 18 x 0.0015 = 0.072
    assert "Total cost: <b>$0.072000</b>" in cost
    rows = dict(re.findall(r"<tr><td>([^<]+)</td><td>(0\.\d{6})</td></tr>", cost))
    assert rows["model-a"] == "0.018000" and rows["model-b"] == "0.018000"
    assert abs(float(rows["judge-1"]) + float(rows["judge-2"]) - 0.036) < 1e-9
    assert "<td>model-a</td><td>answer_generation</td><td>18</td><td>0</td><td>0.018000</td>" in cost


def test_cost_without_a_price_is_named_and_no_usage_says_so() -> None:
    page = render_html(RunData(run_id="r", results=grid_results()))  # token usage, no price recorded
    cost = page.split("id='cost'", 1)[1].split("<h2>", 1)[0]
    assert "Total cost: <b>$0.000000</b>" in cost and "(priced calls only; unknown for m, parsing: no price" in cost
    rs = grid_results()
    for r in rs:
        assert r.template is not None
        r.template.usage_metadata = {}
    page = render_html(RunData(run_id="r", results=rs))
    assert "No model calls recorded: no cost to show." in page.split("id='cost'", 1)[1]
