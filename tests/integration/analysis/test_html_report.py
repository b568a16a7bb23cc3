"""The HTML report of a run read back from the real engine (chdb): self-contained, every
section filled, and rendered by headless Chromium into a non-trivial screenshot.

Chromium is a Debian package (`apt-get install -y chromium`); the rendering test is skipped
only when no chromium binary is installed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from shared.analysis.gates import evaluate_gates, parse_gate
from shared.analysis.html_report import RunData, load_run_data, render_html, write_html
from shared.store.engine import Store
from shared.store.reads import StoreSource
from tests.support.analysis_store import RUN_A
from tests.support.results import grid_results


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_report_from_the_store_has_every_section(store: Store) -> None:  # noqa: F811 - fixture
    data = load_run_data(StoreSource(store), "grid")
    assert data.run_id == RUN_A and data.run_name == "grid" and data.benchmark_name == "grid-bench"
    assert data.unfinished_skipped == ["draft-1", "draft-2"] and data.simulated is False
    assert len(data.results) == 36 and data.config and data.rubric_definition
    assert {x["stage"] for x in data.stage_latency} == {"generate_answer", "parse_template", "verify_template",
                                                         "rubric_evaluation"}
    page = render_html(data, ["Gate (accuracy >= 0.6): PASSED (actual 0.6571, 35 samples)"])
    for heading in ("1. Pass rate per model", "2. Questions × models", "3. Rubric trait scores",
                    "4. Token usage and latency per stage", "5. Replicates: pass@k and flakiness"):
        assert heading in page
    assert page.count("<svg") >= 7  # rates, heat map, 4 traits, tokens, latency
    assert "Wilson 95%" in page and "pass@2" in page and "generate_answer" in page and "PASSED" in page
    # self-contained: nothing is fetched (the only URL is the SVG namespace)
    urls = set(re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)""", page)) | set(re.findall(r"url\(", page))
    assert urls == set()
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {"http://www.w3.org/2000/svg"}
    assert "<script" not in page


def test_report_escapes_what_it_shows() -> None:
    rs = grid_results()
    rs[0].metadata.question_text = "<script>alert(1)</script> & friends"
    page = render_html(RunData(run_id="x<y", results=rs))
    assert "<script>alert" not in page and "&lt;script&gt;" in page and "x&lt;y" in page


def _png_info(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct byte values in the decompressed image data)."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", raw[16:24])
    pos, idat = 8, b""
    while pos < len(raw):
        (length,) = struct.unpack(">I", raw[pos:pos + 4])
        kind = raw[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += raw[pos + 8:pos + 8 + length]
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


def test_chromium_renders_the_report(store: Store, tmp_path: Path) -> None:  # noqa: F811 - fixture
    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium): cannot render the HTML report")
    data = load_run_data(StoreSource(store), RUN_A)
    rep = evaluate_gates(data.results, [parse_gate("accuracy>=0.6"), parse_gate("pass_rate:model-a>=0.8")])
    html_path = write_html(tmp_path / "report.html", data, rep.lines)
    png = tmp_path / "report.png"
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=1200,2000",
           html_path.resolve().as_uri()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # stop chromium and its helpers (its own process group)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert png.exists(), out.decode(errors="replace")[-2000:]
    assert png.stat().st_size > 30_000
    width, height, distinct = _png_info(png)
    assert (width, height) == (1200, 2000)
    assert distinct > 100  # text, bars and colours, not a blank page


def test_a_stored_runs_aggregates_match_the_same_results_in_memory(store: Store) -> None:  # noqa: F811 - fixture
    """The report of a stored run (end-to-end quantiles in SQL, everything else from one paged
    pass) draws the same numbers as the report of the same results held in a list."""
    from shared.analysis.html_digest import RunDigest
    from shared.store.rows import result_to_row

    rs = grid_results()
    for i, r in enumerate(rs):
        r.metadata.execution_time = round((i * 7919 % 101) / 10, 2)  # spread, so the quantiles differ
        r.metadata.run_name = "grid-times"
    store.insert_results([result_to_row(r, "20260101T000000-times001", version=1) for r in rs])
    data = load_run_data(StoreSource(store), "grid-times", page_size=5)
    stored, held = RunDigest.of(data.results), RunDigest.of(list(data.results))
    assert not stored.e2e and stored.e2e_rows is not None  # nothing per result kept
    assert len({q[2] for q in held.e2e_table()} | {q[3] for q in held.e2e_table()}) > 2
    for (m1, n1, *q1), (m2, n2, *q2) in zip(stored.e2e_table(), held.e2e_table(), strict=True):
        assert (m1, n1) == (m2, n2) and q1 == pytest.approx(q2)
    assert stored.per_model == held.per_model and stored.cells == held.cells and stored.tokens == held.tokens
    assert stored.error_groups() == held.error_groups() and stored.replicates == held.replicates


def test_a_run_judged_by_the_simulator_is_simulated_whatever_its_config_says(store: Store) -> None:  # noqa: F811
    """A regrade by the simulator keeps its parent's config (real models there): its rows say
    who answered and judged, and they make the run SIMULATED in every report."""
    from shared.store.rows import result_to_row

    row = result_to_row(grid_results()[0], "run-sim-judged", version=1)
    row["parsing_interface"] = "simulator"
    store.insert_results([row])
    data = load_run_data(StoreSource(store), "run-sim-judged")
    assert data.simulated is True
    assert render_html(data, []).count("SIMULATED") >= 1
