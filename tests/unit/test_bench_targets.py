"""`veribus bench`'s summary of issue 12's figures: every figure beside its target, and the
replica-scaling figure from `--scaling` (no stack is started here)."""

from __future__ import annotations

import math

from bench.__main__ import build_parser
from bench.run import SCALED, simulator_latency, targets_block
from bench.timing import slot_occupancy, steady_rate, timeline, timeline_line
from shared.core import events


def _row(lat: float, rate: float, cpu: float, frac: float | None) -> dict:
    return {"latency_ms": lat, "results_per_s": rate, "cpu_ms_per_result_services_total": cpu,
            "fraction_of_bound": frac, "stream_bytes_per_result": 5000}


def test_targets_block_points_at_the_scaling_mode_when_it_was_not_run() -> None:
    text = targets_block([_row(0.0, 130.0, 9.5, None), _row(300.0, 99.0, 9.0, 0.93)])
    assert "130.0   target >= 120" in text and "9.5   target <= 10" in text
    assert "fraction of C/(2L), whole run         0.93   target >= 0.90" in text
    assert "fraction of C/(2L), steady" not in text, "no steady figure measured, none shown"
    assert "replica scaling (>= 1.8x: `veribus bench --scaling`)" in text
    assert "rebuild events/s (>= 50,000: `veribus bench --rebuild`)" in text


def test_targets_block_shows_the_scaling_ratio_beside_its_target() -> None:
    result = {"latency_ms": 300.0, "model_limit": 32, "stages": list(SCALED), "ratio": 1.87, "ratio_whole_run": 1.75,
              "one": {"results_per_s": 23.4, "steady_results_per_s": 25.0},
              "two": {"results_per_s": 41.0, "steady_results_per_s": 46.8}}
    text = targets_block([], scaling=result)
    assert "2 replicas / 1 replica, steady        1.87   target >= 1.8  met   (46.8 vs 25.0 results/s" in text
    assert "2 replicas / 1 replica, whole         1.75" in text and "(41.0 vs 23.4 results/s" in text
    assert "generation and parsing" in text and "model limit 32" in text
    assert "replica scaling (>= 1.8x" not in text, "measured, so not listed as unmeasured"
    assert "rebuild events/s (>= 50,000: `veribus bench --rebuild`)" in text


def test_rebuild_mode_is_selected_by_its_flag() -> None:
    args = build_parser().parse_args(["--rebuild", "--rebuild-events", "6000", "--rebuild-runs", "2"])
    assert args.rebuild and (args.rebuild_events, args.rebuild_runs) == (6000, 2)


def test_scaling_mode_is_selected_by_its_flag() -> None:
    args = build_parser().parse_args(["--scaling", "--scaling-workers", "4", "--latency-ms", "0", "250"])
    assert args.scaling and args.scaling_workers == 4 and args.latency_ms == [0.0, 250.0]


def test_steady_rate_leaves_out_the_fill_and_the_drain() -> None:
    # 100 results: the first 10 trickle in over 5 s (fill), then one every 0.1 s
    arrivals = [0.5 * i for i in range(10)] + [5.0 + 0.1 * i for i in range(90)]
    assert steady_rate(arrivals) == 10.0
    assert steady_rate(arrivals[:5]) is None, "too few results for percentiles"


def test_defaults_are_issue_12s_workload() -> None:
    args = build_parser().parse_args([])
    assert (args.questions, args.concurrency, args.latency_ms) == (1000, 64, [0.0, 300.0])
    assert args.latency_dist == "lognormal" and not args.all
    assert build_parser().parse_args(["--all"]).all


def test_a_lognormal_latency_has_the_requested_mean() -> None:
    argv = simulator_latency(300.0, "lognormal", 0.5)
    median, sigma = float(argv[argv.index("--latency-ms") + 1]), float(argv[argv.index("--latency-sigma") + 1])
    assert argv[argv.index("--latency-dist") + 1] == "lognormal"
    assert abs(median * math.exp(sigma * sigma / 2) - 300.0) < 0.01, "C/(2L) is a bound only with L the mean"
    assert simulator_latency(300.0, "fixed") == ["--latency-ms", "300"]
    assert simulator_latency(0.0) == ["--latency-ms", "0"]


def test_timeline_spans_each_stage_from_the_start_of_submit() -> None:
    times = {events.ANSWER_REQUESTED: [100.02, 100.1], events.ANSWER_GENERATED: [100.4, 109.0],
             events.TEMPLATE_PARSED: [100.7, 109.5], events.RESULT_FINALIZED: [100.75, 109.6]}
    tl = timeline(times, 100.0, 0.12, 1000, 300.0, 64)
    assert tl["requested"] == (0.02, 0.1) and tl["finalized"] == (0.75, 9.6) and tl["submit_s"] == 0.12
    assert tl["ideal_s"] == 9.675  # 1000 * 0.6 / 64 + 0.3
    assert "ideal_s" not in timeline(times, 100.0, 0.1, 1000, 0.0, 64)
    line = timeline_line({**tl, "last_arrival_s": 9.61, "collected_s": 9.7, "queryable_s": 10.1})
    assert "finalized 0.75..9.6" in line and "all rows queryable 10.1" in line


def test_all_shows_the_rebuild_and_the_queryable_figures_beside_the_run() -> None:
    row = {**_row(0.0, 118.0, 9.8, None), "steady_results_per_s": 125.0, "queryable_results_per_s": 114.0,
           "results": 1000, "concurrency": 64}
    lat = {**_row(300.0, 96.0, 9.0, 0.9), "latency_dist": "lognormal", "latency_sigma": 0.5,
           "steady_fraction_of_bound": 0.95, "queryable_fraction_of_bound": 0.88, "simulator_ceiling_fraction": 0.97}
    text = targets_block([row, lat], rebuilt={"events": 120010, "fold_events_per_s": 51000, "events_per_s": 40000})
    assert "results/s, steady                    125.0   target >= 120" in text
    assert "results/s, rows queryable            114.0" in text
    assert "latency 300 ms lognormal (mean; sigma 0.5)" in text
    assert "fraction of C/(2L), queryable         0.88" in text
    assert "simulator's own ceiling               0.97" in text
    assert "rebuild events/s, fold               51000   target >= 50,000" in text
    assert "rebuild events/s (>= 50,000" not in text, "measured, so not listed as unmeasured"
    assert "replica scaling (>= 1.8x" in text


def test_all_adds_hedged_runs_at_the_first_latency_and_labels_them(monkeypatch: object) -> None:
    """`--all` on the simulator runs the first latency again hedged after 1.5 latencies, with the
    main runs' replicas, per model and then with one limit on the endpoint, and the targets block
    says so; it adds none against a server or when the main runs were hedged."""
    from bench import run

    calls: list[tuple[float, dict]] = []

    def fake_run_once(n: int, lat: float, c: int, replicas: dict, **kw: object) -> dict:
        calls.append((lat, {**kw, "replicas": replicas}))
        return {**_row(lat, 90.0, 12.0, 0.88), "results": n, "hedge_after_ms": kw["hedge_after_ms"],
                "limit_scope": kw["limit_scope"],
                "hedged_calls": 30, "hedged_zero_overhead_fraction": 0.912, "latency_dist": kw["latency_dist"], "latency_sigma": kw["latency_sigma"],
                "steady_results_per_s": 100.0, "bound_results_per_s": 106.7, "steady_fraction_of_bound": 0.95,
                "timeline": {}, "cpu_ms_per_result": {}, "peak_rss_mb": {}, "elapsed_s": 11.0,
                "cpu_ms_per_result_services_total": 12.0, "stream_bytes_per_result": 5900}

    monkeypatch.setattr(run, "run_once", fake_run_once)  # type: ignore[attr-defined]
    monkeypatch.setattr(run, "timeline_line", lambda tl: "")  # type: ignore[attr-defined]
    rows = run.hedged_run(build_parser().parse_args(["--all", "--latency-ms", "0", "300", "--replicas", "parsing=2",
                                                     "--seeds", "1"]))
    assert [(lat, kw["hedge_after_ms"], kw["replicas"], kw["limit_scope"]) for lat, kw in calls] == [
        (300.0, 450, {"parsing": 2}, "model"), (300.0, 450, {"parsing": 2}, "endpoint")]
    text = targets_block(rows)
    assert "hedged after 450 ms (30 copies):" in text
    assert "hedged after 450 ms (30 copies), one limit of C shared by both models on their endpoint:" in text
    assert "zero-overhead pipeline, hedged       0.912" in text and "veribus reached 0.965 of it" in text
    for argv in (["--all", "--api-base", "http://x/v1"], ["--all", "--hedge-after-ms", "400"],
                 ["--all", "--latency-ms", "0"]):
        assert run.hedged_run(build_parser().parse_args(argv)) == []
    assert len(calls) == 2
    calls.clear()  # every run already on the endpoint's limit: one hedged run, on it
    rows = run.hedged_run(build_parser().parse_args(["--all", "--latency-ms", "300", "--limit-scope", "endpoint",
                                                     "--seeds", "1"]))
    assert [kw["limit_scope"] for _, kw in calls] == ["endpoint"] and len(rows) == 1


def test_hedge_after_takes_milliseconds_or_auto_and_refuses_the_rest() -> None:
    import argparse

    import pytest

    from bench.ideal import lognormal_quantile
    from bench.run import hedge_after_arg, hedge_label

    assert hedge_after_arg("450") == 450.0 and hedge_after_arg("auto") == "auto"
    for bad in ("0", "-5"):
        with pytest.raises(argparse.ArgumentTypeError, match="above 0 or 'auto'"):
            hedge_after_arg(bad)
    with pytest.raises(ValueError):
        hedge_after_arg("soon")
    assert hedge_label(450.0) == "450 ms" and "95th percentile (auto)" in hedge_label("auto")
    # the bench's lognormal (mean 300 ms, sigma 0.5): median 265 ms, 95th percentile 603 ms
    assert round(lognormal_quantile(300, 0.5, 0.5)) == 265 and round(lognormal_quantile(300, 0.5, 0.95)) == 603


def test_slot_occupancy_splits_idle_slots_into_fill_steady_and_drain() -> None:
    # two slots; results at 1..10 s: the fill is 0..2 (10th percentile), steady 2..9, drain 9..10
    arrivals = [float(i) for i in range(1, 11)]
    drawn = [("answer", 2000.0, "a", 0.0),   # slot 1 busy 0..2: the whole fill
             ("judge", 7000.0, "b", 2.0),    # slot 1 busy 2..9: the whole steady part
             ("judge", 3500.0, "c", 2.0),    # slot 2 busy 2..5.5 only: half the steady part
             ("judge", 500.0, "d", 9.0)]     # one slot of two for half the drain
    occ = slot_occupancy(drawn, 0.0, arrivals, concurrency=2)
    assert occ == {"fill": 0.5, "steady": 0.75, "drain": 0.25, "whole": 0.65}
    # a call lasting past the run's last result counts only up to it; too few results: no figure
    assert slot_occupancy([("judge", 20_000.0, "e", 9.0)], 0.0, arrivals, 2)["drain"] == 0.5
    assert slot_occupancy(drawn, 0.0, arrivals[:5], 2) is None


def test_targets_block_says_in_which_part_of_the_run_the_slots_idled() -> None:
    row = {**_row(300.0, 96.0, 11.0, 0.9), "slot_occupancy": {"fill": 0.93, "steady": 0.979, "drain": 0.512,
                                                               "whole": 0.906}}
    text = targets_block([row])
    assert "model slots busy, whole run          0.906" in text
    assert "fill 0.93, steady 0.979, drain 0.512" in text
    assert "model slots busy" not in targets_block([_row(300.0, 96.0, 11.0, 0.9)]), "not measured: not shown"


def test_each_target_says_whether_it_is_met_and_the_block_names_the_missed_ones() -> None:
    """A missed target reads as missed: `NOT MET` on its line and named in the last line, with the
    run it belongs to (the hedged runs repeat the same figure names)."""
    zero = {**_row(0.0, 302.5, 4.91, None), "results": 1000, "concurrency": 64}
    slow = {**_row(300.0, 83.0, 8.4, 0.778), "latency_dist": "lognormal", "latency_sigma": 0.5,
            "steady_fraction_of_bound": 0.979, "results": 1000, "concurrency": 64}
    hedged = {**slow, "fraction_of_bound": 0.905, "hedge_after_ms": 450, "hedged_calls": 25, "limit_scope": "endpoint"}
    text = targets_block([zero, slow, hedged], rebuilt={"events": 120010, "fold_events_per_s": 49_999,
                                                         "events_per_s": 40000})
    assert "302.5   target >= 120  met" in text and "4.91   target <= 10  met" in text
    assert "0.778   target >= 0.90  NOT MET   (with the pipeline's fill and drain)" in text
    assert "0.905   target >= 0.90  met" in text
    assert "49999   target >= 50,000  NOT MET" in text
    last = text.splitlines()[-1]
    assert last.startswith("  8 of 10 targets met: not met: ")
    assert "fraction of C/(2L), whole run (latency 300 ms lognormal (mean; sigma 0.5))" in last
    assert "hedged" not in last and "rebuild events/s, fold (projections rebuild)" in last


def test_a_figure_without_a_number_has_no_verdict() -> None:
    from bench.targets import figure, met

    assert met(None, ">= 120") is None and met(True, ">= 1") is None and met(0.9, "about 1") is None
    assert met(10, "<= 10") is True and met(50_000, ">= 50,000") is True and met(1.79, ">= 1.8") is False
    assert figure("x", None, ">= 1").endswith("target >= 1")


def test_a_lognormal_run_is_measured_on_several_seeds_and_reported_as_their_mean(monkeypatch: object) -> None:
    """`--all` measures each lognormal run on 3 simulator seeds (3 sets of draws): the figures
    are their means, each seed's whole-run fraction is named beside the mean, and a zero or a
    fixed latency, or a server, is measured once."""
    from bench import run

    seeds: list[int] = []
    fractions = {0: 0.77, 1: 0.89, 2: 0.88}

    def fake_run_once(n: int, lat: float, c: int, replicas: dict, *server: object, **kw: object) -> dict:
        seed = int(kw.get("seed", 0))  # type: ignore[call-overload]
        seeds.append(seed)
        return {**_row(lat, 80.0 + seed, 12.0 + seed, fractions[seed] if lat else None), "results": n,
                "concurrency": c, "latency_dist": kw["latency_dist"], "latency_sigma": kw["latency_sigma"],
                "zero_overhead_fraction": 0.8 + 0.05 * seed if lat else None, "steady_fraction_of_bound": 0.96,
                "bound_results_per_s": 106.7 if lat else None, "slot_occupancy": {"whole": 0.7 + 0.1 * seed},
                "timeline": {}, "cpu_ms_per_result": {"parsing": 1.0 + seed}, "peak_rss_mb": {"parsing": 70.0 + seed},
                "elapsed_s": 11.0, "steady_results_per_s": 100.0, "passed": n}

    monkeypatch.setattr(run, "run_once", fake_run_once)  # type: ignore[attr-defined]
    monkeypatch.setattr(run, "timeline_line", lambda tl: "")  # type: ignore[attr-defined]
    rows = run.main_runs(build_parser().parse_args(["--all", "--latency-ms", "0", "300"]))
    assert seeds == [0, 0, 1, 2], "latency 0 once, the lognormal run on seeds 0, 1 and 2"
    zero, mean = rows
    assert "seeds" not in zero
    assert mean["fraction_of_bound"] == 0.847 and mean["zero_overhead_fraction"] == 0.85
    assert mean["cpu_ms_per_result"] == {"parsing": 2.0} and mean["peak_rss_mb"] == {"parsing": 72.0}
    assert mean["slot_occupancy"] == {"whole": 0.8} and mean["results"] == 1000
    assert [s["fraction_of_bound"] for s in mean["seeds"]] == [0.77, 0.89, 0.88]
    text = targets_block(rows)
    assert "fraction of C/(2L), whole run        0.847   target >= 0.90  NOT MET" in text
    assert "mean of 3 simulator seeds: 0.77, 0.89, 0.88" in text
    assert "1000 results on each of 3 simulator seeds, C = 64:" in text
    assert "the 3 runs' own drawn latencies (mean)" in text
    seeds.clear()
    run.main_runs(build_parser().parse_args(["--latency-ms", "300"]))
    assert seeds == [0], "one seed unless asked"
    seeds.clear()
    run.main_runs(build_parser().parse_args(["--all", "--latency-ms", "300", "--latency-dist", "fixed"]))
    assert seeds == [0], "fixed latencies draw nothing"
    seeds.clear()
    run.main_runs(build_parser().parse_args(["--latency-ms", "300", "--seeds", "2"]))
    assert seeds == [0, 1]
