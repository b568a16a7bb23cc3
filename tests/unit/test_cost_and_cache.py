"""Cost per call (litellm's shipped price map, config overrides), the usage counters, the money
budget's arithmetic, and the routing of the response cache between run scope and shared scope."""

from __future__ import annotations

import time

import pytest

from shared.core import events
from shared.core import usage as cost
from shared.core.config import ModelConfig, VerificationConfig
from shared.core.events import ModelSpec
from shared.core.fold import merge_usage
from shared.runtime import costcontrol as cost_budget
from shared.runtime.llm import pricing
from shared.runtime.llm.cache import CACHE_SCOPE, MemoryCache
from shared.runtime.llm.reply import LLMReply, add_usage, usage_entry
from shared.runtime.response_cache import CACHE_TTL, SHARED_SCOPE, ScopedCache, scope_for


def test_prices_come_from_litellms_map() -> None:
    # claude-haiku-4-5: $1 / $5 per million tokens in litellm's shipped map
    assert pricing.call_cost(ModelSpec(model_name="anthropic/claude-haiku-4-5"), 1_000_000, 0) == pytest.approx(1.0)
    assert pricing.call_cost(ModelSpec(model_name="anthropic/claude-haiku-4-5"), 0, 1_000_000) == pytest.approx(5.0)
    mini = pricing.call_cost(ModelSpec(model_name="openai/gpt-4.1-mini"), 1000, 1000)
    assert mini == pytest.approx(1000 * 0.4e-6 + 1000 * 1.6e-6)


def test_a_simulated_call_costs_nothing_unless_its_config_prices_it() -> None:
    """`--simulate --model gpt-4.1-mini` reported gpt-4.1-mini's price for calls only the
    simulator saw; a price given in the config still applies (budgets are tested that way)."""
    sim = ModelSpec(model_name="openai/gpt-4.1-mini", interface="simulator", api_base="http://sim/v1")
    assert pricing.call_cost(sim, 1000, 1000) == 0.0
    priced = ModelConfig(model_name="openai/gpt-4.1-mini", interface="simulator", input_cost_per_million_tokens=1000.0,
                         output_cost_per_million_tokens=2000.0).to_spec()
    assert pricing.call_cost(priced, 1000, 1000) == pytest.approx(3.0)


def test_a_provider_prefix_does_not_borrow_another_providers_price() -> None:
    assert pricing.prices_for(ModelSpec(model_name="openai/claude-haiku-4-5")) is None
    assert pricing.prices_for(ModelSpec(model_name="openai/qwen-private-7b")) is None


def test_config_overrides_win_for_private_endpoints() -> None:
    spec = ModelConfig(model_name="openai/qwen-private-7b", api_base="http://gpu:8000/v1",
                       input_cost_per_million_tokens=0.2, output_cost_per_million_tokens=0.6).to_spec()
    assert pricing.call_cost(spec, 500_000, 100_000) == pytest.approx(0.1 + 0.06)
    haiku = ModelConfig(model_name="anthropic/claude-haiku-4-5", input_cost_per_million_tokens=0.0,
                        output_cost_per_million_tokens=0.0).to_spec()
    assert pricing.call_cost(haiku, 1000, 1000) == 0.0


def test_negative_override_is_refused() -> None:
    with pytest.raises(ValueError, match="input_cost_per_million_tokens"):
        ModelConfig(model_name="openai/x", input_cost_per_million_tokens=-1)


def test_usage_entry_counts_calls_cached_replies_and_cost() -> None:
    paid = LLMReply(text="a", usage={"input_tokens": 100, "output_tokens": 20, "total_tokens": 120, "model": "m"},
                    attempts=3, cost_usd=0.0002)
    cached = LLMReply(text="a", usage=dict(paid.usage), cached=True, attempts=3, cost_usd=0.0002)
    assert usage_entry(paid)["model_calls"] == 3 and usage_entry(paid)["cost_usd"] == 0.0002
    entry = usage_entry(cached)  # a cached reply: nothing sent, nothing paid, tokens kept
    assert (entry["model_calls"], entry["cached_replies"], entry["cost_usd"], entry["total_tokens"]) == (0, 1, 0.0, 120)
    both = add_usage(usage_entry(paid), usage_entry(cached))
    assert (both["model_calls"], both["cached_replies"], both["cost_usd"]) == (3, 1, 0.0002)


def test_unknown_cost_stays_unknown_in_sums_and_totals() -> None:
    known = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "model_calls": 1, "cost_usd": 0.5}
    unknown = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "model_calls": 1}
    assert "cost_usd" not in add_usage(known, unknown)
    state = events.State(usage={"answer_generation": known, "parsing": unknown})
    total = merge_usage(state)["total"]  # type: ignore[index]
    assert total["model_calls"] == 2 and "cost_usd" not in total
    state = events.State(usage={"answer_generation": known, "parsing": dict(known, cost_usd=0.25)})
    assert merge_usage(state)["total"]["cost_usd"] == 0.75  # type: ignore[index]


def test_usage_tally_names_models_without_a_price() -> None:
    results = [{"template": {"usage_metadata": {
        "answer_generation": {"total_tokens": 5, "model": "openai/a", "model_calls": 1, "cached_replies": 0},
        "parsing": {"total_tokens": 5, "model": "anthropic/claude-haiku-4-5", "model_calls": 0,
                    "cached_replies": 1, "cost_usd": 0.0},
        "total": {"total_tokens": 10}}}}] * 3
    tally = cost.UsageTally()
    for r in results:
        tally.add(r)
    u = tally.as_dict()
    assert u == {"model_calls": 3, "cached_replies": 3, "cost_usd": 0.0, "cost_unknown_models": ["openai/a"],
                 "results_without_usage": 0}
    text = "\n".join(cost.usage_lines(u))
    assert "Model calls: 3 (3 replies without a call: response cache or regraded answers)" in text and "unknown for openai/a" in text
    # $0 is the priced calls' sum, never said as if it were the run's cost
    assert "Cost: $0.000000 for the priced calls; unknown for openai/a" in text


def test_money_spent_by_an_event_counts_fan_out_once() -> None:
    job = events.Job(run_id="r", result_id="x", answer_id="a", question_id="q", question_text="?",
                     answering=ModelSpec(model_name="m"), parsing=ModelSpec(model_name="j"), timestamp="t")
    state = events.State(usage={"answer_generation": {"cost_usd": 0.001}})
    outs = [events.make_envelope(events.ANSWER_GENERATED, "r", rid, events.StageEvent(job, state), "p")
            for rid in ("x", "y", "z")]
    assert cost_budget.cost_spent(0, outs) == 1000  # micro-dollars, once for three judges
    run = events.RunRequested(run_id="r", timestamp="t", job_count=1, answer_count=1)
    cost_budget.set_cost_budget(run, 0.5)
    assert run.config["budget_cost_usd"] == 0.5
    with pytest.raises(ValueError, match="positive"):
        cost_budget.set_cost_budget(run, 0)
    with pytest.raises(ValueError, match="budget_cost_usd"):
        cost_budget.pop_cost_budget({"budget_cost_usd": "lots"})


def _job(**options: object) -> events.StageEvent:
    job = events.Job(run_id="r", result_id="x", answer_id="a", question_id="q", question_text="?",
                     answering=ModelSpec(model_name="m"), parsing=ModelSpec(model_name="j"), timestamp="t",
                     options=dict(options))
    return events.StageEvent(job, events.State())


def test_scope_follows_the_runs_opt_in() -> None:
    assert scope_for("run-1", _job()) == "run-1"
    assert scope_for("run-1", _job(response_cache=True)) == SHARED_SCOPE
    assert scope_for("run-1", events.AnswerRequested(jobs=[_job(response_cache=True).job])) == SHARED_SCOPE
    opts = VerificationConfig(answering_models=[ModelConfig(model_name="m")],
                              parsing_models=[ModelConfig(model_name="j")]).stage_options().model_dump()
    assert opts["response_cache"] is False  # opt-in


async def test_scoped_cache_routes_and_expires() -> None:
    run, shared = MemoryCache(), MemoryCache()
    cache = ScopedCache(run, shared)
    CACHE_SCOPE.set("run-1")
    await cache.put("k", {"text": "run reply"})
    assert len(run) == 1 and len(shared) == 0
    CACHE_SCOPE.set(SHARED_SCOPE)
    CACHE_TTL.set(60.0)
    assert await cache.get("k") is None  # run-scoped entries are not shared
    await cache.put("k", {"text": "shared reply"})
    hit = await cache.get("k")
    assert hit is not None and hit["text"] == "shared reply"
    shared._data["k"]["stored_at"] = time.time() - 120  # older than this run's TTL
    assert await cache.get("k") is None and cache.stale == 1
    no_run = ScopedCache(None, shared)  # VERIBUS_LLM_CACHE off: run scope caches nothing
    CACHE_SCOPE.set("run-2")
    await no_run.put("z", {"text": "x"})
    assert await no_run.get("z") is None


def test_event_rows_carry_the_stage_cost() -> None:
    from shared.store.rows import EVENT_COLUMNS, event_row

    ev = _job()
    ev.state.usage = {"parsing": {"input_tokens": 5, "output_tokens": 5, "total_tokens": 10, "cost_usd": 0.125}}
    row = event_row(events.make_envelope(events.TEMPLATE_PARSED, "r", "x", ev, "p"))
    assert row[EVENT_COLUMNS.index("cost_usd")] == 0.125
    ev.state.usage = {"parsing": {"input_tokens": 5, "output_tokens": 5, "total_tokens": 10, "model_calls": 1}}
    row = event_row(events.make_envelope(events.TEMPLATE_PARSED, "r", "x", ev, "p"))
    assert row[EVENT_COLUMNS.index("cost_usd")] is None  # unknown price: NULL, not 0


def test_every_output_of_a_run_shows_the_same_cost(tmp_path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """100 calls of $0.00030302 cost $0.030302. The console summary rounded each result's cost
    to 6 places before adding ($0.030300) and the HTML report's key figure showed 4 places
    ($0.0303), while the HTML cost section said $0.030302: now every output sums exactly and
    rounds once (`usage.usd`), shown by one function (`usage.money`)."""
    import json

    from shared.analysis import report
    from shared.cli.commands import main
    from shared.cli.view import pages
    from tests.support.results import make

    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    entry = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15, "model": "openai/gpt-x", "model_calls": 1,
             "cached_replies": 0, "cost_usd": 0.00030302}
    results = [make(f"q{i}", "gpt-x", True, usage={"answer_generation": entry}) for i in range(100)]
    summary = report.summarize(results)  # what `veribus run` prints (report.print_results)
    assert summary["usage"]["cost_usd"] == 0.030302
    assert "Cost: $0.030302" in report.results_block(summary)
    report.write_outputs(tmp_path / "run", "s", "r1", results, summary, {}, False)
    assert main(["report", str(tmp_path / "run" / "results.jsonl"), "--html", str(tmp_path / "r.html"),
                 "--output", str(tmp_path / "again")]) == 0
    assert "Cost: $0.030302" in capsys.readouterr().out
    written = json.loads((tmp_path / "again" / "summary.json").read_text())["metrics"]["usage"]
    assert written["cost_usd"] == 0.030302
    html = (tmp_path / "r.html").read_text()
    assert "<b>$0.030302</b><span>cost</span>" in html and "Total cost: <b>$0.030302</b>" in html
    assert "0.0303<" not in html
    viewer = pages._cost_section({"total_usd": 100 * 0.00030302, "calls": 100, "cached": 0, "priced_results": 100,
                                  "unpriced_results": 0, "unknown_models": [],
                                  "by_model": [{"model": "openai/gpt-x", "cost_usd": 100 * 0.00030302}],
                                  "by_stage": []})
    assert "Total cost: <b>$0.030302</b>" in viewer and "<td>0.030302</td>" in viewer
    assert cost.money(1234.5) == "$1,234.500000" and cost.format_usd(0.1 + 0.2) == "0.300000"


def test_results_without_a_usage_section_never_claim_zero_calls(tmp_path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """rubric_only results have no `template`, where `usage_metadata` lives (spec/001): a results
    file of them (no store to ask) said "Model calls: 0", "Cost: $0.000000". It says the usage is
    not recorded, in the console, summary.json and the HTML report; so does the reference export,
    whose results carry `usage_metadata: null`."""
    import json

    from shared.analysis import report
    from shared.cli.commands import main
    from tests.conftest import REFERENCE
    from tests.support.results import make

    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    results = [make(f"q{i}", "gpt-x", None, with_template=False, rubric={"llm_trait_scores": {"clarity": 4}})
               for i in range(3)]
    report.write_outputs(tmp_path / "run", "s", "r1", results, report.summarize(results), {}, False)
    assert main(["report", str(tmp_path / "run" / "results.jsonl"), "--html", str(tmp_path / "r.html"),
                 "--output", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert "Model calls: not recorded (rubric_only results carry no usage section)" in out, out
    assert "Cost: not recorded (rubric_only results carry no usage section)" in out
    assert "Model calls: 0" not in out and "$0.000000" not in out
    usage = json.loads((tmp_path / "again" / "summary.json").read_text())["metrics"]["usage"]
    assert (usage["model_calls"], usage["cost_usd"], usage["not_recorded"]) == (
        None, None, "rubric_only results carry no usage section")
    html = (tmp_path / "r.html").read_text()
    assert "<b>not recorded</b><span>cost</span>" in html and "<b>not recorded</b><span>model calls</span>" in html
    assert "Model calls and cost not recorded: rubric_only results carry no usage section." in html
    assert main(["report", str(REFERENCE / "export_format" / "results_export_full.json")]) == 4
    out = capsys.readouterr().out
    assert "Model calls: not recorded (these results carry no usage section)" in out and "$0.000000" not in out
    # some results without one: the figure is that of the others, and says how many it leaves out
    paid = make("q9", "gpt-x", True, usage={"answer_generation": {"total_tokens": 5, "model": "gpt-x",
                                                                  "model_calls": 1, "cached_replies": 0,
                                                                  "cost_usd": 0.25}})
    text = "\n".join(cost.usage_lines(report.summarize([*results, paid])["usage"]))
    assert "Model calls: 1" in text and "Cost: $0.250000" in text
    assert "(3 results carry no usage section: not counted in the calls and cost above)" in text


def test_cache_info_says_a_bucket_not_made_yet_and_its_max_age_in_days(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Before the first --cache run the shared bucket was said to have 'no max age (kept until
    cleared)', and after it 'max age 2.592e+06 s': it did not exist yet, and it keeps 30 days."""
    import argparse

    from shared.cli import scale

    info = {"vb_llm_cache_shared": {"entries": 4, "bytes": 900, "max_age_s": 2_592_000.0, "exists": True},
            "vb_llm_cache": {"entries": 0, "bytes": 0, "max_age_s": None, "exists": False}}
    monkeypatch.setattr(scale, "_settings", lambda: None)
    monkeypatch.setattr(scale, "run_main", lambda coro: (coro.close(), info)[1])
    assert scale.cmd_cache_info(argparse.Namespace(format="text")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["vb_llm_cache_shared: 4 entries, 900 bytes, max age 30 days",
                   "vb_llm_cache: not created yet (the first run that uses it creates it)"]
    assert [scale._duration(s) for s in (86400, 7200, 90, 1.5)] == ["1 day", "2 h", "90 s", "1.5 s"]
