"""`veribus bench --analysis`: the analysis path at scale, on the embedded engine.

Generates a synthetic `verification_results` table of N rows (default 1,000,000: 4 answering
models x 2 judges x 5 replicates x N/40 questions, with rubric scores and token usage) in a temp
chdb folder, inserting in batches through the store, then measures:

- the summary queries analysts and `veribus report` run (per-model pass rates with Wilson
  bounds, the run totals), cold after the inserts and again after the parts are merged;
- a full streamed export (keyset-paged reads, written as they come) with the process RSS
  sampled throughout: peak and growth over the baseline, to show memory stays flat.

Figures, not assertions: the machine is shared. Runs in its own process (chdb opens one folder
per process).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil

from shared.analysis.export import export_from_source
from shared.core.config import Settings
from shared.core.ids import compute_result_id
from shared.core.models import (
    ModelIdentity,
    VerificationResult,
    VerificationResultMetadata,
    VerificationResultRubric,
    VerificationResultTemplate,
)
from shared.store.engine import open_store, preload_chdb
from shared.store.reads import StoreSource
from shared.store.rows import result_to_row

RUN_ID = "20260101T000000-bench000"
MODELS = ("openai/gpt-4.1-mini", "anthropic/claude-haiku-4-5", "openai/qwen2.5-7b", "openai/llama-3.1-8b")
JUDGES = ("openai/gpt-4.1-mini", "anthropic/claude-haiku-4-5")
REPLICATES = 5
SUMMARY_QUERIES = {
    "model_pass_rate": "SELECT * FROM v_model_pass_rate WHERE run_id = {r:String} ORDER BY answering_model, parsing_model",
    "run_results": "SELECT * FROM v_run_results WHERE run_id = {r:String}",
    "pass_rate_by_model": (
        "SELECT answering_model, count() AS results, countIf(completed_without_errors) AS attempted, "
        "countIf(verify_result = true) AS passed, passed / nullIf(countIf(verify_result IS NOT NULL), 0) AS rate "
        "FROM verification_results FINAL WHERE run_id = {r:String} GROUP BY answering_model ORDER BY answering_model"),
}


class RssSampler(threading.Thread):
    """Samples this process's RSS every `interval` seconds; keeps the peak."""

    def __init__(self, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process()
        self.interval = interval
        self.peak = self.proc.memory_info().rss
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def stop(self) -> int:
        self.stop_event.set()
        self.join(5)
        self.peak = max(self.peak, self.proc.memory_info().rss)
        return self.peak


def _prototype() -> dict[str, Any]:
    """One complete result dump; rows are made by changing its identifying fields."""
    r = VerificationResult(
        metadata=VerificationResultMetadata(
            question_id="q", question_text="", answering=ModelIdentity(model_name=MODELS[0]),
            parsing=ModelIdentity(model_name=JUDGES[0]), execution_time=1.0, timestamp="2026-01-01T00:00:00+00:00",
            run_name="bench-1m", evaluation_mode="template_and_rubric", raw_answer="42"),
        template=VerificationResultTemplate(
            raw_llm_response="", parsed_gt_response={"value": 42}, parsed_llm_response={"value": 42},
            template_verification_performed=True, verify_result=True,
            usage_metadata={"answer_generation": {"input_tokens": 120, "output_tokens": 60, "model": MODELS[0]},
                            "parsing": {"input_tokens": 300, "output_tokens": 20},
                            "total": {"input_tokens": 420, "output_tokens": 80, "total_tokens": 500}}),
        rubric=VerificationResultRubric(
            rubric_evaluation_performed=True, rubric_evaluation_strategy="batch",
            llm_trait_scores={"clarity": 4, "safe": True}, regex_trait_scores={"cites": True},
            metric_trait_scores={"coverage": {"precision": 1.0, "recall": 0.5, "f1": 0.667}}),
    )
    return r.model_dump(mode="json")


def generate_rows(n: int, batch: int, seed: int = 7) -> Any:
    """Batches of `verification_results` rows for n synthetic results of one run.

    Each (model, judge, outcome) combination is flattened once by `result_to_row`; every row is
    a copy of its combination's row with the varying fields set, and its JSON columns encoded
    from the same mutated dump, so the typed columns and `result_json` always agree."""

    enc = msgspec.json.Encoder()
    rng = random.Random(seed)
    proto = _prototype()
    meta, tpl, rub = proto["metadata"], proto["template"], proto["rubric"]
    per_q = len(MODELS) * len(JUDGES) * REPLICATES
    questions = max(1, (n + per_q - 1) // per_q)
    skill = {m: 0.55 + 0.1 * i for i, m in enumerate(MODELS)}
    bases: dict[tuple[str, str, str], dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    made = 0
    for qi in range(questions):
        qid = f"bench-q{qi:06d}"
        difficulty = rng.random() * 0.4 - 0.2
        meta["question_id"] = qid
        meta["question_text"] = f"Synthetic question {qi}: what is {qi} + {qi}?"
        for model in MODELS:
            meta["answering"]["model_name"] = model
            for judge in JUDGES:
                meta["parsing"]["model_name"] = judge
                for rep in range(1, REPLICATES + 1):
                    if made >= n:
                        break
                    err = rng.random() < 0.01
                    ok = not err and rng.random() < skill[model] - difficulty
                    outcome = "error" if err else ("pass" if ok else "fail")
                    meta["replicate"] = rep
                    meta["result_id"] = compute_result_id(qid, f"litellm:{model}:", f"litellm:{judge}:",
                                                          meta["timestamp"], rep)
                    meta["completed_without_errors"] = not err
                    meta["error"] = "generate_answer: TimeoutError: simulated" if err else None
                    meta["execution_time"] = round(0.5 + rng.random() * 3, 3)
                    tpl["verify_result"] = None if err else ok
                    tpl["raw_llm_response"] = f"The answer is {2 * qi if ok else qi}."
                    tpl["parsed_llm_response"]["value"] = 2 * qi if ok else qi
                    clarity = rng.randint(1, 5)
                    rub["llm_trait_scores"]["clarity"] = clarity
                    rub["regex_trait_scores"]["cites"] = ok
                    key = (model, judge, outcome)
                    if key not in bases:
                        bases[key] = result_to_row(proto, RUN_ID, version=1)
                    row = dict(bases[key])
                    row.update(
                        result_id=meta["result_id"], question_id=qid, question_text=meta["question_text"],
                        replicate=rep, execution_time=meta["execution_time"], raw_llm_response=tpl["raw_llm_response"],
                        llm_trait_scores={"clarity": float(clarity), "safe": 1.0},
                        template_json=enc.encode(tpl), rubric_json=enc.encode(rub), result_json=enc.encode(proto),
                    )
                    out.append(row)
                    made += 1
                    if len(out) >= batch:
                        yield out
                        out = []
    if out:
        yield out


def _timed(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, float, Any]:
    """(first seconds, best seconds, last value) over `repeat` calls."""
    times, value = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return times[0], min(times), value


def run_analysis_bench(rows: int = 1_000_000, *, batch: int = 50_000, page_size: int = 5_000,
                       export_format: str = "jsonl", workdir: Path | None = None, keep: bool = False,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Generate `rows` results in a temp chdb folder, time the summary queries and a streamed
    export, and return the figures (also logged as they come)."""
    preload_chdb()
    home = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="veribus-analysis-bench-"))
    settings = Settings(home=home, clickhouse_database="bench")
    figures: dict[str, Any] = {"rows": rows, "batch": batch, "page_size": page_size, "folder": str(home)}
    store = open_store(settings)
    try:
        t0 = time.perf_counter()
        gen_s = ins_s = 0.0
        done = 0
        it = generate_rows(rows, batch)
        while True:
            g0 = time.perf_counter()
            chunk = next(it, None)
            gen_s += time.perf_counter() - g0
            if chunk is None:
                break
            i0 = time.perf_counter()
            store.insert_results(chunk)
            ins_s += time.perf_counter() - i0
            done += len(chunk)
            if done % (batch * 4) == 0 or done == rows:
                log(f"  inserted {done:,}/{rows:,} rows ({done / (time.perf_counter() - t0):,.0f} rows/s)")
        figures["generate_s"] = round(gen_s, 2)
        figures["insert_s"] = round(ins_s, 2)
        figures["insert_rows_per_s"] = round(rows / ins_s) if ins_s else None
        n = store.count("verification_results", "run_id = {r:String}", {"r": RUN_ID})
        figures["rows_in_table"] = n
        log(f"table: {n:,} rows; generation {gen_s:.1f} s, insert {ins_s:.1f} s")

        src = StoreSource(store)
        for stage in ("after_insert", "after_merge"):
            if stage == "after_merge":
                m0 = time.perf_counter()
                store.client.command("OPTIMIZE TABLE verification_results FINAL")
                figures["merge_s"] = round(time.perf_counter() - m0, 2)
            for name, sql in SUMMARY_QUERIES.items():
                first, best, res = _timed(lambda sql=sql: src.query(sql, {"r": RUN_ID}))
                figures[f"summary_{name}_{stage}_first_s"] = round(first, 3)
                figures[f"summary_{name}_{stage}_best_s"] = round(best, 3)
                log(f"summary query {name} ({stage}): first {first * 1000:.0f} ms, best {best * 1000:.0f} ms, "
                    f"{len(res.rows)} rows")
        top = src.query(SUMMARY_QUERIES["run_results"], {"r": RUN_ID}).as_dicts()[0]
        figures["pass_rate"] = top["pass_rate"]
        figures["wilson"] = [top["wilson_low"], top["wilson_high"]]

        out = home / f"export.{export_format}"
        proc = psutil.Process()
        base = proc.memory_info().rss
        samples: list[tuple[int, int]] = []
        sampler = RssSampler()
        sampler.start()
        e0 = time.perf_counter()
        stats = export_from_source(src, RUN_ID, export_format, out, page_size=page_size,
                                   on_page=lambda k: samples.append((k, proc.memory_info().rss)))
        export_s = time.perf_counter() - e0
        peak = sampler.stop()
        tenth = next((rss for k, rss in samples if k >= rows // 10), base)
        figures.update({
            "export_format": export_format, "export_rows": stats.rows, "export_bytes": stats.bytes,
            "export_s": round(export_s, 2), "export_rows_per_s": round(stats.rows / export_s) if export_s else None,
            "rss_before_export_mb": round(base / 2**20, 1), "rss_at_10pct_mb": round(tenth / 2**20, 1),
            "rss_peak_mb": round(peak / 2**20, 1), "rss_growth_mb": round((peak - base) / 2**20, 1),
            "rss_growth_after_10pct_mb": round((peak - tenth) / 2**20, 1),
        })
        log(f"export {export_format}: {stats.rows:,} rows, {stats.bytes / 2**20:,.0f} MiB in {export_s:.1f} s "
            f"({figures['export_rows_per_s']:,} rows/s); RSS {figures['rss_before_export_mb']} MB before, "
            f"{figures['rss_at_10pct_mb']} MB at 10%, peak {figures['rss_peak_mb']} MB "
            f"(+{figures['rss_growth_mb']} MB overall, +{figures['rss_growth_after_10pct_mb']} MB after the first 10%)")
        out.unlink(missing_ok=True)
    finally:
        store.close()
        if not keep and workdir is None:
            shutil.rmtree(home, ignore_errors=True)
    figures["summary_under_1s"] = all(v < 1.0 for k, v in figures.items() if k.startswith("summary_") and
                                      k.endswith("_best_s") and "after_merge" in k)
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic results to generate")
    parser.add_argument("--batch", type=int, default=50_000, help="rows per insert")
    parser.add_argument("--page-size", type=int, default=5_000, help="rows per export page")
    parser.add_argument("--export-format", choices=["json", "jsonl", "csv", "parquet"], default="jsonl")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON at the end")


def main(args: argparse.Namespace) -> int:
    """Entry point for `veribus bench --analysis` (args: rows, batch, page_size, export_format, json)."""
    print(f"analysis bench: {getattr(args, 'rows', 1_000_000):,} synthetic results in a temp chdb folder")
    figures = run_analysis_bench(getattr(args, "rows", 1_000_000), batch=getattr(args, "batch", 50_000),
                                 page_size=getattr(args, "page_size", 5_000),
                                 export_format=getattr(args, "export_format", "jsonl"))
    if getattr(args, "json", False):
        print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    raise SystemExit(main(p.parse_args()))
