"""What a user found: `veribus run` checked its output paths only after the whole run (`--output
FILE` made every model call, then `FileExistsError ...`, exit 3), `report`/`export` said
`IsADirectoryError` (exit 3) for a folder given as a file, `--simulate --model ""` ran a model
named `simulator:openai/`, and a rubric trait gate in template_only mode ran the whole benchmark
to fail with "no data". Each is bad input now: exit 2, one line naming the option (or gate), the
path (or trait) and what is wrong, before a stack starts, a run is read or anything is written.
No bus, no store: the stack the run would start is replaced by one that says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.cli.commands import build_parser, main
from shared.core.benchmark.model import Benchmark
from tests.conftest import EXAMPLE, REFERENCE

FULL = REFERENCE / "export_format" / "results_export_full.json"  # a results file: RUN without a store


class WouldStart(RuntimeError):
    """What the replaced `stack.up` raises: the command got past its checks."""


@pytest.fixture
def no_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No deployment, and a temporary stack that is never started (a run that gets that far
    ends `WouldStart`, exit 3)."""
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    for var in ("VERIBUS_NATS_URL", "VERIBUS_CLICKHOUSE_URL", "VERIBUS_SIMULATOR_URL"):
        monkeypatch.delenv(var, raising=False)

    def up(*_a: object, **_k: object) -> None:
        raise WouldStart("a temporary stack would start now")

    monkeypatch.setattr("shared.control.stack.up", up)
    monkeypatch.setattr("shared.control.stack.down", lambda *_a, **_k: None)
    return tmp_path


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`veribus ARGV`: exit 2 and one line, which is returned."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err and "Error:" not in err, err
    return lines[0]


def test_run_output_paths_are_refused_before_a_stack_starts(no_deployment: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    tmp = no_deployment
    afile, adir = tmp / "afile", tmp / "adir"
    afile.write_text("mine")
    adir.mkdir()
    run = ["run", str(EXAMPLE), "--simulate"]
    said = refusal([*run, "--output", str(afile)], capsys)
    assert said.startswith(f"veribus: error: --output {afile}: exists and is a file, where a folder is needed"), said
    said = refusal([*run, "--junit", str(adir)], capsys)
    assert f"--junit {adir}: is a folder, where a file is needed" in said and "junit.xml" in said, said
    said = refusal([*run, "--junit", str(afile / "j.xml")], capsys)
    assert f"--junit {afile / 'j.xml'}: cannot be created: {afile} is not a folder" in said, said
    said = refusal([*run, "--junit", str(tmp / "new") + "/"], capsys)
    assert "ends with '/'" in said and "a file is needed" in said, said
    (adir / "run_2").write_text("in the way")
    said = refusal([*run, "--num-runs", "2", "--output", str(adir)], capsys)
    assert f"--output {adir}: holds a file run_2, where the folder run_2/ is written" in said, said
    said = refusal([*run, "--output", str(adir), "--junit", str(adir / "results.jsonl")], capsys)
    assert "name the same file" in said and "--junit" in said and "--output" in said, said
    assert afile.read_text() == "mine" and not (tmp / "home").exists() and not (tmp / "new").exists()

    # what worked still does: an existing folder is written into, missing parents are made
    (adir / "summary.json").write_text("{}")
    for argv in ([*run, "--output", str(adir)], [*run, "--output", str(tmp / "a" / "b"), "--junit",
                                                  str(tmp / "c" / "d" / "j.xml")]):
        assert main(argv) == 3  # past every check: the stack would start now
        assert "a temporary stack would start now" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["report", "{run}", "--html", "{adir}"], "--html {adir}: is a folder, where a file is needed"),
    (["report", "{run}", "--html", "{adir}/"], "--html {adir}/: is a folder, where a file is needed"),
    (["report", "{run}", "--junit", "{adir}"], "--junit {adir}: is a folder, where a file is needed"),
    (["report", "{run}", "--output", "{afile}"], "--output {afile}: exists and is a file, where a folder is needed"),
    (["report", "{run}", "--output", "{tmp}/ok", "--html", "{adir}"], "--html {adir}: is a folder"),
    (["report", "{run}", "--html", "{afile}/r.html"], "--html {afile}/r.html: cannot be created: {afile} is not a"),
    (["export", "{run}", "--format", "json", "--output", "{adir}"],
     "--output {adir}: is a folder, where a file is needed: name the file, e.g. {adir}/results.json"),
    (["export", "{run}", "--output", "{afile}/x.csv"], "--output {afile}/x.csv: cannot be created"),
])
def test_report_and_export_output_paths_are_refused_before_the_run_is_read(
        argv: list[str], says: str, no_deployment: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp = no_deployment
    (tmp / "afile").write_text("mine")
    (tmp / "adir").mkdir()
    paths = {"run": str(FULL), "tmp": str(tmp), "afile": str(tmp / "afile"), "adir": str(tmp / "adir")}
    said = refusal([a.format(**paths) for a in argv], capsys)
    assert says.format(**paths) in said, said
    assert (tmp / "afile").read_text() == "mine" and list((tmp / "adir").iterdir()) == []
    assert not (tmp / "ok").exists()  # nothing written before the refusal


def test_report_writes_into_an_existing_folder_and_makes_missing_parents(
        no_deployment: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What worked before stays: with a bad --junit beside them refused first."""
    tmp = no_deployment
    out = tmp / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    said = refusal(["report", str(FULL), "--output", str(out), "--junit", str(out)], capsys)
    assert f"--junit {out}: is a folder" in said and (out / "summary.json").read_text() == "{}"
    assert main(["report", str(FULL), "--output", str(out), "--html", str(tmp / "x" / "y" / "r.html"),
                 "--junit", str(tmp / "j" / "junit.xml"), "--max-errors", "1"]) == 0, capsys.readouterr().err
    assert (out / "summary.json").read_text() != "{}" and (tmp / "x" / "y" / "r.html").is_file()
    assert (tmp / "j" / "junit.xml").is_file()
    assert main(["export", str(FULL), "--output", str(tmp / "e" / "f" / "r.jsonl")]) == 0
    assert (tmp / "e" / "f" / "r.jsonl").is_file()


@pytest.mark.parametrize("models", [["--model", "", "--judge", " "], ["--model", "openai/", "--judge", "j"],
                                    ["--model", "a", "--judge", "  "]])
def test_an_empty_model_name_is_refused_with_simulate_too(models: list[str], no_deployment: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """It ran a model named `simulator:openai/`: --simulate kept the part after the provider."""
    said = refusal(["run", str(EXAMPLE), "--simulate", *models], capsys)
    flags = [f for f, v in zip(models[::2], models[1::2], strict=True) if not v.split("/", 1)[-1].strip()]
    assert said == "veribus: error: " + "; ".join(f"{f}: model_name must not be empty" for f in flags), said


def _validate(*argv: str) -> tuple[object, list[object], object]:
    from shared.cli.run import _validate_run

    args = build_parser().parse_args(["run", str(EXAMPLE), "--simulate", *argv])
    return _validate_run(args, Benchmark.load(EXAMPLE), True)


def test_a_gate_the_mode_leaves_without_data_is_refused(tmp_path: Path) -> None:
    """`--gate "Clarity>=4"` in the default template_only mode ran the whole benchmark, then
    failed the gate with no data: rubric traits are not evaluated in that mode."""
    with pytest.raises(ValueError, match=r"gate 'Clarity>=4': 'Clarity' is a rubric trait, and rubric traits are "
                                         r"not evaluated in template_only mode \(the default mode\).*"
                                         r"--mode template_and_rubric or --mode rubric_only"):
        _validate("--gate", "Clarity>=4")
    with pytest.raises(ValueError, match=r"'Clarity' is a rubric trait.*template_only mode \(--mode\)"):
        _validate("--mode", "template_only", "--gate", "Clarity:sim-answerer>=0.5")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("evaluation_mode: template_only\ngates: ['Clarity>=0.5']\n")
    with pytest.raises(ValueError, match=rf"template_only mode \(evaluation_mode in {cfg}\)"):
        _validate("--config", str(cfg))
    with pytest.raises(ValueError, match=r"gate 'accuracy>=0.8': accuracy is the answer template's verdict, and "
                                         r"templates are not run in rubric_only mode"):
        _validate("--mode", "rubric_only", "--gate", "accuracy>=0.8")
    # where the gate has data it stands, read as before
    _, gates, _ = _validate("--mode", "template_and_rubric", "--gate", "Clarity>=4", "--gate", "accuracy>=0.5")
    assert [(g.metric, g.value) for g in gates] == [("Clarity", 0.75), ("accuracy", 0.5)]  # type: ignore[attr-defined]
    _, gates, _ = _validate("--mode", "rubric_only", "--gate", "Clarity>=4", "--gate", "pass_rate>=0.5")
    assert [g.metric for g in gates] == ["Clarity", "pass_rate"]  # type: ignore[attr-defined]
    _, gates, _ = _validate("--gate", "accuracy>=0.5", "--gate", "error_rate<=0.1")
    assert [g.metric for g in gates] == ["accuracy", "error_rate"]  # type: ignore[attr-defined]


def test_the_gate_refusal_reaches_the_user_before_a_stack_starts(no_deployment: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    said = refusal(["run", str(EXAMPLE), "--simulate", "--gate", "Clarity>=4"], capsys)
    assert "'Clarity' is a rubric trait" in said and "template_only" in said, said
