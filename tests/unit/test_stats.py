"""Statistics against values worked out by hand or published: Wilson, t quantiles, exact
McNemar, pass@k / pass^k, the paired difference interval, and the reports built on them."""

from __future__ import annotations

import math

import pytest

from shared.analysis.resultset import VerificationResultSet
from shared.analysis.stats import (
    Proportion,
    binom_cdf,
    compare_models,
    describe,
    flakiness,
    mcnemar_exact,
    newcombe_paired_diff,
    pass_at_k,
    pass_at_k_report,
    pass_hat_k,
    t_value,
    wilson_interval,
    z_value,
)
from tests.support.results import grid_results


def test_wilson_known_values() -> None:
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = wilson_interval(0, 10)  # no collapse to a point at 0/n, unlike Wald
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(10, 10)
    assert lo == pytest.approx(0.7225, abs=1e-4) and hi == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(81, 263)  # a textbook example: 0.2553 to 0.3662
    assert lo == pytest.approx(0.2553, abs=1e-4) and hi == pytest.approx(0.3662, abs=1e-4)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_quantiles() -> None:
    assert z_value(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert t_value(0.95, 1) == pytest.approx(12.7062, abs=1e-4)
    assert t_value(0.95, 9) == pytest.approx(2.2622, abs=1e-4)
    assert t_value(0.95, 30) == pytest.approx(2.0423, abs=1e-4)
    assert t_value(0.99, 5) == pytest.approx(4.0321, abs=1e-4)


def test_exact_mcnemar_known_tables() -> None:
    # b=2, c=8: 2 * P(X <= 2), X ~ Bin(10, 1/2) = 2 * 56/1024
    assert mcnemar_exact(2, 8) == pytest.approx(0.109375, abs=1e-12)
    assert mcnemar_exact(8, 2) == mcnemar_exact(2, 8)
    assert mcnemar_exact(1, 6) == pytest.approx(0.125, abs=1e-12)  # 2 * 8/128
    assert mcnemar_exact(0, 5) == pytest.approx(0.0625, abs=1e-12)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0
    assert binom_cdf(2, 10) == pytest.approx(56 / 1024)


def test_pass_at_k_and_pass_hat_k_known_values() -> None:
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 4, 2) == 1.0  # fewer than k failures: always
    assert pass_hat_k(5, 2, 2) == pytest.approx(0.1)  # C(2,2)/C(5,2)
    assert pass_hat_k(5, 5, 5) == 1.0 and pass_hat_k(5, 4, 5) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    assert flakiness(4, 2) == 1.0 and flakiness(4, 4) == 0.0 and flakiness(4, 1) == pytest.approx(0.5)


def test_describe_uses_sample_std_and_t_interval() -> None:
    d = describe([1.0, 2.0, 3.0, 4.0])
    assert d["mean"] == 2.5 and d["std"] == pytest.approx(math.sqrt(5 / 3))
    half = 3.182446 * math.sqrt(5 / 3) / 2
    assert d["ci95_low"] == pytest.approx(2.5 - half, abs=1e-5) and d["ci95_high"] == pytest.approx(2.5 + half, abs=1e-5)
    assert describe([0.7])["std"] == 0.0 and describe([])["mean"] is None


def test_newcombe_paired_difference_interval() -> None:
    diff, lo, hi = newcombe_paired_diff(12, 9, 2, 21)
    assert diff == pytest.approx(7 / 44)
    assert lo < diff < hi and -1 <= lo and hi <= 1
    assert lo == pytest.approx(0.0182, abs=1e-3) and hi == pytest.approx(0.2892, abs=1e-3)
    # swapping the models mirrors the interval
    d2, lo2, hi2 = newcombe_paired_diff(12, 2, 9, 21)
    assert d2 == pytest.approx(-diff) and lo2 == pytest.approx(-hi) and hi2 == pytest.approx(-lo)
    # no discordant pairs: a zero difference with an interval around it
    d3, lo3, hi3 = newcombe_paired_diff(15, 0, 0, 5)
    assert d3 == 0.0 and lo3 < 0 < hi3


def test_pass_at_k_report_on_the_grid() -> None:
    rep = pass_at_k_report(grid_results())
    assert rep.ks == [1, 2, 3]
    a1 = next(m for m in rep.per_model if m["answering_model"] == "litellm:model-a" and m["parsing_model"] == "litellm:judge-1")
    # q1 3/3, q2 2/3, q3 0/3
    assert a1["pass@1"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert a1["pass@2"] == pytest.approx((1 + 1 + 0) / 3)
    assert a1["pass^2"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert a1["pass^3"] == pytest.approx(1 / 3)
    assert a1["flaky_questions"] == 1
    b2 = next(m for m in rep.per_model if m["answering_model"] == "litellm:model-b" and m["parsing_model"] == "litellm:judge-2")
    assert b2["questions@3"] == 2 and b2["min_replicates"] == 2  # the errored job is not a sample
    q = next(x for x in rep.per_question if x["answering_model"] == "litellm:model-a" and x["question_id"] == "q2"
             and x["parsing_model"] == "litellm:judge-1")
    assert (q["n"], q["passed"], q["flaky"]) == (3, 2, True)
    assert q["ci_low"] < 2 / 3 < q["ci_high"]
    assert VerificationResultSet(grid_results()).pass_at_k([2]).ks == [2]


def test_paired_comparison_on_the_grid() -> None:
    cmp = compare_models(grid_results(), "model-a", "model-b")
    assert cmp.pairs == 17 and cmp.unpaired_a == 1 and cmp.unpaired_b == 0
    assert (cmp.both_pass, cmp.a_only, cmp.b_only, cmp.both_fail) == (6, 4, 7, 0)
    assert cmp.pass_rate_a.rate == pytest.approx(10 / 17) and cmp.pass_rate_b.rate == pytest.approx(13 / 17)
    assert cmp.difference == pytest.approx(-3 / 17)
    assert cmp.mcnemar_p == pytest.approx(2 * (1 + 11 + 55 + 165 + 330) / 2048)
    assert cmp.diff_ci_low < cmp.difference < cmp.diff_ci_high
    assert any("McNemar" in line for line in cmp.lines())
    # two runs: model B read from the second set
    two = VerificationResultSet(grid_results()).compare("model-a", "litellm:model-b",
                                                        VerificationResultSet(grid_results()))
    assert two.pairs == 17
    with pytest.raises(ValueError):
        compare_models(grid_results(), "model-a", "model-z")


def test_proportion_of() -> None:
    p = Proportion.of(8, 10)
    assert p.rate == 0.8 and p.ci_low == pytest.approx(0.4902, abs=1e-4)
    assert Proportion.of(0, 0).rate is None


def test_compare_names_a_model_the_run_does_not_have(tmp_path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Not "no paired verdicts": the model is not in the run, and the run's models are listed (exit 2)."""
    import shared.analysis.stats as stats
    from shared.analysis import report
    from shared.cli.commands import main
    from tests.support.results import make

    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    for name, models in (("one", ("openai/gpt-x", "openai/gpt-y")), ("two", ("openai/gpt-x",))):
        results = [make("q1", m, True) for m in models]
        report.write_outputs(tmp_path / name, "s", name, results, report.summarize(results), {}, False)
    one, two = str(tmp_path / "one" / "results.jsonl"), str(tmp_path / "two" / "results.jsonl")

    def no_verdicts(*_a: object) -> object:
        raise AssertionError("verdicts read for a model the run does not have")

    monkeypatch.setattr(stats, "_verdicts", no_verdicts)
    assert main(["compare", one, "--model-a", "gpt-x", "--model-b", "gpt-z"]) == 2
    said = capsys.readouterr()
    assert said.out == ""
    assert said.err == (f"veribus: error: --model-b 'gpt-z' is not an answering model of run {one}: "
                        "its answering models are openai/gpt-x, openai/gpt-y\n")
    # with two runs, each model is looked for in its own run
    assert main(["compare", one, two, "--model-a", "gpt-x", "--model-b", "gpt-y"]) == 2
    assert ("--model-b 'gpt-y' is not an answering model of run " + two) in capsys.readouterr().err
    assert main(["compare", one, two, "--model-a", "nope", "--model-b", "gpt-x"]) == 2
    assert "--model-a 'nope' is not an answering model of run " + one in capsys.readouterr().err


def test_a_one_replicate_run_pairs_with_the_first_replicate_of_a_multi_replicate_run(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """Replicates are numbered from 1 (spec/001); a run of one replicate records none. Its results
    were paired as replicate 0 (the viewer) or None (compare), so "no paired verdicts" against a
    run of three replicates of the same checkpoint: they pair with replicate 1."""
    import json

    from shared.analysis import report
    from shared.cli.commands import main
    from tests.support.results import make

    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    single = [make(q, "gpt-x", q != "q2") for q in ("q1", "q2")]
    multi = [make(q, "gpt-y", rep != 2, replicate=rep) for q in ("q1", "q2") for rep in (1, 2, 3)]
    cmp = compare_models(single, "gpt-x", "gpt-y", multi)
    assert (cmp.pairs, cmp.unpaired_a, cmp.unpaired_b) == (2, 0, 4)
    assert (cmp.both_pass, cmp.a_only, cmp.b_only, cmp.both_fail) == (1, 0, 1, 0)
    for name, results in (("single", single), ("multi", multi)):
        report.write_outputs(tmp_path / name, "s", name, results, report.summarize(results), {}, False)
    assert main(["compare", str(tmp_path / "single" / "results.jsonl"), str(tmp_path / "multi" / "results.jsonl"),
                 "--model-a", "gpt-x", "--model-b", "gpt-y", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["pairs"] == 2
