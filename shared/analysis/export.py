"""Exports of results: JSON (the reference's export format 2.2), JSONL, CSV and Parquet.

Every export is streamed: rows are read from ClickHouse in keyset pages
(`shared.results.iter_pages`) and written as they come, so a run of a million results exports
in bounded memory. The JSON file has the reference's layout, one result per line:

    {"format_version": "2.2", "metadata": {...}, "shared_data": {"rubric_definition": ...},"results":[
    {"metadata": {...}, "template": {...}, ...},
    ...
    ]}

`metadata` = export_timestamp, karenina_version ("veribus <version>"), job_id (the run id),
verification_config, job_summary; each result is a `VerificationResult` dump. The same files
load back with `VerificationResultSet.from_file`, as the reference's own exports do.

CSV starts with the reference's columns in its value formats (`shared.analysis.reference_csv`: 53 columns,
plus `rubric_<trait>` per global trait and `question_specific_rubrics`), then ours that it does not
have, then `result_json` (the whole result, so our CSV reads back exactly). Booleans are written
`True`/`False` throughout, as the reference does. Questions, replies and names are untrusted, and a
spreadsheet runs a cell that starts with `=`, `+`, `-` or `@` as a formula (CSV injection): every
text cell that would start one is written behind a `'` (`csv_cells.spreadsheet_safe`), unless the caller
asks for the cells as they are (`csv_raw=True`, `veribus export --csv-raw`) to feed a program.
`result_json` always starts with `{`, so veribus reads its own CSV back exactly either way.

Parquet is flat: one row per result with the typed columns of `verification_results` and one
column per rubric trait (`trait.<name>`, `trait.<name>.<metric>` for metric traits, `label.<name>`
for literal-trait labels), and `result_json`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import msgspec

from shared.analysis import reference_csv
from shared.analysis.csv_cells import write_csv
from shared.core.models import VerificationResult
from shared.core.rubric import Rubric, RubricError
from shared.store.reads import ResultFilter, RowSource, iter_pages, open_source, resolve_run
from shared.store.rows import RESULT_COLUMNS, result_to_row

if TYPE_CHECKING:
    from shared.core.config import Settings

FORMATS = ("json", "jsonl", "csv", "parquet")
FORMAT_VERSION = "2.2"

# (column, kind): kind drives the CSV text and the Parquet type.
BASE_COLUMNS: list[tuple[str, str]] = [
    ("run_id", "str"), ("result_id", "str"), ("run_name", "str"), ("question_id", "str"),
    ("question_text", "str"), ("template_id", "str"), ("keywords", "list"), ("answering_model", "str"),
    ("answering_interface", "str"), ("answering_model_name", "str"), ("answering_tools", "list"),
    ("parsing_model", "str"), ("parsing_interface", "str"), ("parsing_model_name", "str"), ("replicate", "int"),
    ("evaluation_mode", "str"), ("timestamp", "str"), ("execution_time", "float"),
    ("completed_without_errors", "bool"), ("error", "str"), ("failure_category", "str"), ("failure_stage", "str"),
    ("has_template", "bool"), ("template_verification_performed", "bool"), ("verify_result", "bool"),
    ("verify_granular_result", "float"), ("template_validation_error", "str"), ("field_verification_error", "str"),
    ("raw_llm_response", "str"), ("embedding_check_performed", "bool"), ("embedding_similarity_score", "float"),
    ("embedding_override_applied", "bool"), ("embedding_model_used", "str"), ("regex_validations_performed", "bool"),
    ("regex_overall_success", "bool"), ("recursion_limit_reached", "bool"), ("abstention_check_performed", "bool"),
    ("abstention_detected", "bool"), ("abstention_override_applied", "bool"),
    ("sufficiency_check_performed", "bool"), ("sufficiency_detected", "bool"),
    ("sufficiency_override_applied", "bool"), ("input_tokens", "int"), ("output_tokens", "int"),
    ("total_tokens", "int"), ("has_rubric", "bool"), ("rubric_evaluation_performed", "bool"),
    ("rubric_evaluation_strategy", "str"), ("deep_judgment_performed", "bool"),
    ("deep_judgment_rubric_performed", "bool"),
]
MAP_COLUMNS = ["llm_trait_scores", "llm_trait_labels", "regex_trait_scores", "callable_trait_scores",
               "metric_trait_scores"]
BASE_NAMES = [c for c, _ in BASE_COLUMNS]
_KINDS = dict(BASE_COLUMNS)

_enc = msgspec.json.Encoder()


@dataclass
class ExportStats:
    path: str
    format: str
    rows: int
    bytes: int
    seconds: float


def veribus_version() -> str:
    try:
        return version("veribus")
    except Exception:  # noqa: BLE001 - not installed as a distribution (source checkout)
        return "0.1.0"


# --------------------------------------------------------------------------------------------
# Flat rows
# --------------------------------------------------------------------------------------------


def trait_columns(llm: Iterable[str], labels: Iterable[str], other: Iterable[str],
                  metrics: Iterable[str]) -> list[str]:
    """Column names for traits: scores, `<trait>.<metric>` pairs, and literal labels."""
    cols = [f"trait.{n}" for n in sorted(set(llm) | set(other))]
    cols += [f"trait.{n}" for n in sorted(set(metrics))]
    cols += [f"label.{n}" for n in sorted(set(labels))]
    return cols


def flat_columns_for(results: Iterable[VerificationResult]) -> list[str]:
    """All flat columns for these results (base columns + their traits)."""
    llm: set[str] = set()
    labels: set[str] = set()
    other: set[str] = set()
    metrics: set[str] = set()
    for r in results:
        rub = r.rubric
        if rub is None:
            continue
        llm.update(rub.llm_trait_scores or {})
        labels.update(rub.llm_trait_labels or {})
        other.update(rub.regex_trait_scores or {})
        other.update(rub.callable_trait_scores or {})
        for name, ms in (rub.metric_trait_scores or {}).items():
            metrics.update(f"{name}.{m}" for m in (ms or {}))
    return BASE_NAMES + trait_columns(llm, labels, other, metrics)


_TRAIT_PREFIXES = ("trait.", "label.")
_SCORE_MAPS = ("llm_trait_scores", "regex_trait_scores", "callable_trait_scores")


def row_builder(columns: Sequence[str], source_columns: Sequence[str]) -> Callable[[Sequence[Any]], list[Any]]:
    """A function turning one row of `source_columns` (typed columns + the trait maps of
    `verification_results`) into the values of the flat `columns`, worked out once per page."""
    pos = {c: i for i, c in enumerate(source_columns)}
    idx = [None if c.startswith(_TRAIT_PREFIXES) else pos.get(c) for c in columns]
    traits = [(j, c) for j, c in enumerate(columns) if c.startswith(_TRAIT_PREFIXES)]
    score_maps = [pos[m] for m in _SCORE_MAPS if m in pos]
    metric_i, label_i = pos.get("metric_trait_scores"), pos.get("llm_trait_labels")
    json_j = columns.index("result_json") if "result_json" in columns else None

    def build(row: Sequence[Any]) -> list[Any]:
        out = [None if i is None else row[i] for i in idx]
        if traits:
            t: dict[str, Any] = {}
            for i in score_maps:
                for name, value in (row[i] or {}).items():
                    t["trait." + name] = value
            if metric_i is not None:
                for name, ms in (row[metric_i] or {}).items():
                    for metric, value in (ms or {}).items():
                        t[f"trait.{name}.{metric}"] = value
            if label_i is not None:
                for name, label in (row[label_i] or {}).items():
                    t["label." + name] = label
            for j, c in traits:
                out[j] = t.get(c)
        if json_j is not None and isinstance(out[json_j], bytes | bytearray):
            out[json_j] = bytes(out[json_j]).decode()
        return out

    return build


def flat_row(row: Mapping[str, Any], columns: Sequence[str]) -> dict[str, Any]:
    """A `verification_results` row dict (typed columns + trait maps) -> the flat export row."""
    keys = list(row)
    return dict(zip(columns, row_builder(columns, keys)([row[k] for k in keys]), strict=True))


def flat_rows_from_results(results: Iterable[VerificationResult], columns: Sequence[str],
                           run_id: str = "") -> Iterator[dict[str, Any]]:
    for r in results:
        yield flat_row(result_to_row(r, run_id, version=0), columns)


def flat_lists_from_results(results: Iterable[VerificationResult], columns: Sequence[str],
                            run_id: str = "") -> list[list[Any]]:
    build = row_builder(columns, RESULT_COLUMNS)
    return [build([row[c] for c in RESULT_COLUMNS]) for row in (result_to_row(r, run_id, version=0) for r in results)]


def _discover_trait_columns(source: RowSource, where: ResultFilter) -> list[str]:
    cond, params = where.sql()
    res = source.query(
        "SELECT groupUniqArrayArray(arrayConcat(mapKeys(llm_trait_scores))), "
        "groupUniqArrayArray(mapKeys(llm_trait_labels)), "
        "groupUniqArrayArray(arrayConcat(mapKeys(regex_trait_scores), mapKeys(callable_trait_scores))), "
        "groupUniqArrayArray(arrayFlatten(arrayMap((k, v) -> arrayMap(m -> concat(k, '.', m), mapKeys(v)), "
        "mapKeys(metric_trait_scores), mapValues(metric_trait_scores)))) "
        f"FROM verification_results WHERE {cond}", params)
    llm, labels, other, metrics = (list(v or []) for v in res.rows[0]) if res.rows else ([], [], [], [])
    return trait_columns(llm, labels, other, metrics)


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------


def csv_columns(global_traits: Sequence[str], question_traits: Sequence[str], ours: Sequence[str]) -> tuple[
        list[str], list[str]]:
    """(the reference's columns, ours that are not among them + result_json)."""
    ref = reference_csv.columns(global_traits, question_traits)
    taken = set(ref)
    return ref, [c for c in ours if c not in taken and c != "result_json"] + ["result_json"]


def csv_row(result: VerificationResult, blob: str, ours: list[Any], ref_layout: tuple[list[str], list[str]],
            export_meta: Mapping[str, Any]) -> list[Any]:
    """The reference's cells for `result`, then our own (`ours`, already in our-column order)."""
    glob, qs = ref_layout
    return reference_csv.row(result, glob, qs, export_meta) + ours + [blob]


def _arrow_schema(columns: Sequence[str]) -> Any:
    # local import: pyarrow is heavy; only Parquet export needs it
    import pyarrow as pa

    types = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
             "list": pa.list_(pa.string())}
    fields = []
    for c in columns:
        if c.startswith("label.") or c == "result_json":
            fields.append(pa.field(c, pa.string()))
        elif c.startswith("trait."):
            fields.append(pa.field(c, pa.float64()))
        else:
            fields.append(pa.field(c, types[_KINDS[c]]))
    return pa.schema(fields)


def _arrow_value(value: Any, column: str) -> Any:
    if column.startswith("trait.") and isinstance(value, bool):
        return 1.0 if value else 0.0
    return value


def write_parquet(path: Path, columns: Sequence[str], pages: Iterable[list[list[Any]]]) -> int:
    """One row group per page (rows as lists in `columns` order), written as it arrives."""
    # local import: pyarrow is heavy; only Parquet export needs it
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _arrow_schema(columns)
    n = 0
    with pq.ParquetWriter(str(path), schema, compression="zstd") as writer:
        for page in pages:
            if not page:
                continue
            arrays = [pa.array([_arrow_value(r[j], c) for r in page], type=schema.field(c).type)
                      for j, c in enumerate(columns)]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
            n += len(page)
        if n == 0:
            writer.write_table(schema.empty_table())
    return n


REFERENCE_RUBRIC_KEYS = ("llm_traits", "regex_traits", "callable_traits", "metric_traits", "agentic_traits")


def reference_rubric_definition(definition: Any) -> Any:
    """`shared_data.rubric_definition` with the reference's keys: the four trait lists and
    `agentic_traits` (veribus has none: an empty list), each trait with all its fields, nulls
    included. Our dynamic traits, which the reference does not have, follow as `dynamic_traits`."""
    if not isinstance(definition, Mapping):
        return definition
    data = dict(definition)
    agentic = data.pop("agentic_traits", None) or []
    try:
        dumped = Rubric.model_validate(data).model_dump(mode="json")
    except ValueError:
        dumped = dict(data)
    for key in ("llm_traits", "regex_traits", "callable_traits", "metric_traits"):
        dumped[key] = [{k: v for k, v in t.items() if not (k == "load_error" and v is None)}
                       if isinstance(t, dict) else t for t in dumped.get(key) or []]
    out = {key: dumped.get(key) or [] for key in REFERENCE_RUBRIC_KEYS[:4]}
    out["agentic_traits"] = list(agentic)
    if dumped.get("dynamic_traits"):
        out["dynamic_traits"] = dumped["dynamic_traits"]
    return out


def json_header(metadata: Mapping[str, Any], rubric_definition: Any) -> str:
    """The export's first line, ending in `"results":[` as the reference writes it."""
    head = {"format_version": FORMAT_VERSION, "metadata": dict(metadata),
            "shared_data": {"rubric_definition": reference_rubric_definition(rubric_definition)}}
    return json.dumps(head, ensure_ascii=False, default=str)[:-1] + ',"results":['


def write_json(fh: IO[str], metadata: Mapping[str, Any], rubric_definition: Any, results_json: Iterable[str]) -> int:
    fh.write(json_header(metadata, rubric_definition) + "\n")
    n = 0
    for blob in results_json:
        fh.write((",\n" if n else "") + blob)
        n += 1
    fh.write("\n]}\n")
    return n


def write_jsonl(fh: IO[str], results_json: Iterable[str]) -> int:
    n = 0
    for blob in results_json:
        fh.write(blob + "\n")
        n += 1
    return n


# --------------------------------------------------------------------------------------------
# Export metadata
# --------------------------------------------------------------------------------------------


def _model_entry(m: Mapping[str, Any]) -> dict[str, Any]:
    name = str(m.get("model_name", ""))
    provider = m.get("model_provider") or (name.split("/", 1)[0] if "/" in name else None)
    return {"provider": provider, "name": name, "temperature": m.get("temperature"),
            "interface": m.get("interface", "litellm")}


def verification_config_of(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Our run config -> the reference's `verification_config` shape (models as provider/name/
    temperature/interface), with the other public settings kept beside them."""
    config = dict(config or {})
    out: dict[str, Any] = {
        "answering_models": [_model_entry(m) for m in config.pop("answering_models", []) or []],
        "parsing_models": [_model_entry(m) for m in config.pop("parsing_models", []) or []],
    }
    for key in ("replicate_count", "evaluation_mode", "run_name", "rubric_evaluation_strategy",
                "abstention_enabled", "sufficiency_enabled", "embedding_check_enabled", "deep_judgment_enabled"):
        if key in config:
            out[key] = config[key]
    return out


def export_metadata(job_id: str | None, config: Mapping[str, Any] | None, job_summary: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "export_timestamp": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "karenina_version": f"veribus {veribus_version()}",
        "job_id": job_id,
        "verification_config": verification_config_of(config),
        "job_summary": dict(job_summary),
    }


def job_summary_of(results: Sequence[VerificationResult]) -> dict[str, Any]:
    """The export's job summary of results held in memory: they carry no run's start and end
    time nor job count, so those are unknown and the set is taken as complete."""
    ok = sum(1 for r in results if r.metadata.completed_without_errors)
    return {
        "total_questions": len(results), "successful_count": ok, "failed_count": len(results) - ok,
        "distinct_questions": len({r.metadata.question_id for r in results}),
        "start_time": None, "end_time": None, "total_duration": None, "is_complete": True,
    }


def _store_run_info(source: RowSource, run_id: str, where: ResultFilter) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(job_summary, run config) of a run, from `verification_results` and `runs`."""
    cond, params = where.sql()
    res = source.query(
        "SELECT count(), countIf(completed_without_errors), uniqExact(question_id), "
        "toUnixTimestamp64Micro(max(ingested_at)) / 1e6 "
        f"FROM verification_results FINAL WHERE {cond}", params)
    total, ok, questions, last = res.rows[0] if res.rows else (0, 0, 0, None)
    run = source.query("SELECT job_count, toUnixTimestamp64Micro(requested_at) / 1e6, config_json FROM runs FINAL "
                       "WHERE run_id = {r:String}", {"r": run_id})
    job_count, start, config = (None, None, None)
    if run.rows:
        job_count, start, raw = run.rows[0]
        try:
            config = json.loads(raw) if raw else None
        except (TypeError, ValueError):
            config = None
    total, ok = int(total or 0), int(ok or 0)
    end = float(last) if last else None
    start = float(start) if start else None
    summary = {
        "total_questions": total, "successful_count": ok, "failed_count": total - ok,
        "distinct_questions": int(questions or 0), "start_time": start, "end_time": end,
        "total_duration": (end - start) if start is not None and end is not None else None,
        "is_complete": job_count is None or total >= int(job_count),
    }
    return summary, config


# The rubric each job of a run carried: inline on its answer.generated event (jobs before lean
# events, and a job whose rubric was changed on the way), else in the `contents` row its
# question ref (payload.job.refs.q) names; the projector copies contents into ClickHouse.
_RUN_RUBRICS_SQL = (
    "SELECT DISTINCT if(e.inline IN ('', 'null'), c.rubric, e.inline) FROM ("
    "SELECT DISTINCT JSONExtractRaw(payload, 'job', 'rubric') AS inline, "
    "JSONExtractString(payload, 'job', 'refs', 'q') AS ref FROM events "
    "WHERE run_id = {r:String} AND event_type = 'answer.generated') AS e "
    "LEFT JOIN (SELECT key, JSONExtractRaw(body, 'rubric') AS rubric FROM contents FINAL WHERE key IN ("
    "SELECT JSONExtractString(payload, 'job', 'refs', 'q') FROM events "
    "WHERE run_id = {r:String} AND event_type = 'answer.generated')) AS c ON c.key = e.ref "
    "LIMIT 10000"
)


def run_rubrics_from_store(source: RowSource, run_id: str) -> list[dict[str, Any]]:
    """The distinct rubric wires (`traits`, `provenance`) the jobs of a run carried."""
    out = []
    for (raw,) in source.query(_RUN_RUBRICS_SQL, {"r": run_id}).rows:
        raw = raw.decode() if isinstance(raw, bytes | bytearray) else raw
        if not raw or raw == "null":
            continue
        try:
            wire = json.loads(raw)
        except (TypeError, ValueError):
            continue
        if isinstance(wire, dict):
            out.append(wire)
    return out


def trait_split_from_store(source: RowSource, run_id: str, where: ResultFilter) -> tuple[list[str], list[str]]:
    """(global, question-specific) trait names of a run's results, by the provenance the plan put
    on each job's rubric (traits it does not call global are question-specific)."""
    cond, params = where.sql()
    res = source.query(
        "SELECT groupUniqArrayArray(arrayConcat(mapKeys(llm_trait_scores), mapKeys(regex_trait_scores), "
        "mapKeys(callable_trait_scores), mapKeys(metric_trait_scores))) "
        f"FROM verification_results WHERE {cond}", params)
    names = set(res.rows[0][0] or []) if res.rows else set()
    glob: set[str] = set()
    for wire in run_rubrics_from_store(source, run_id):
        prov = wire.get("provenance")
        if isinstance(prov, dict):
            glob.update(k for k, v in prov.items() if v == "global")
    return sorted(names & glob), sorted(names - glob)


def rubric_definition_from_store(source: RowSource, run_id: str) -> dict[str, Any] | None:
    """The run's rubric (every trait any job carried, global and question-specific), in the
    reference's `Rubric` shape, read from the jobs' rubrics (`run_rubrics_from_store`)."""
    traits: dict[str, dict[str, Any]] = {}
    for wire in run_rubrics_from_store(source, run_id):
        for t in wire.get("traits") or []:
            if isinstance(t, dict) and t.get("name"):
                traits.setdefault(str(t["name"]), t)
    if not traits:
        return None
    try:
        rubric = Rubric.from_wire({"traits": list(traits.values())})
    except (RubricError, ValueError):
        return None
    return reference_rubric_definition(rubric.model_dump(mode="json"))


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def check_format(fmt: str, csv_raw: bool = False) -> str:
    """The export format, lower-cased; refused when unknown, or when `csv_raw` is asked of a format
    that is not CSV (only CSV cells are ever escaped: the flag would do nothing there)."""
    fmt = fmt.lower()
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    if csv_raw and fmt != "csv":
        raise ValueError(f"--csv-raw (csv_raw) applies to the csv format only, not {fmt}: "
                         "no other format is escaped")
    return fmt


def export_from_source(
    source: RowSource, run_id: str, fmt: str, output: str | Path, *, where: ResultFilter | None = None,
    page_size: int = 2000, on_page: Callable[[int], None] | None = None, csv_raw: bool = False,
) -> ExportStats:
    """Stream one run (optionally filtered) from the store into `output`. CSV text cells that a
    spreadsheet would run as formulas get a leading `'` unless `csv_raw` (see `csv_cells.spreadsheet_safe`)."""
    fmt = check_format(fmt, csv_raw)
    where = where or ResultFilter(run_id=run_id)
    where.run_id = run_id
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    done = [0]

    def counted(it: Iterable[Any], size: Callable[[Any], int]) -> Iterator[Any]:
        for item in it:
            yield item
            done[0] += size(item)
            if on_page is not None:
                on_page(done[0])

    if fmt in ("json", "jsonl"):
        def blobs() -> Iterator[str]:
            for page in counted(iter_pages(source, "result_json", where, page_size=page_size), len):
                for row in page.rows:
                    b = row[2]
                    yield b.decode() if isinstance(b, bytes | bytearray) else str(b)

        with out.open("w", encoding="utf-8") as fh:
            if fmt == "json":
                summary, config = _store_run_info(source, run_id, where)
                meta = export_metadata(run_id, config, summary)
                n = write_json(fh, meta, rubric_definition_from_store(source, run_id), blobs())
            else:
                n = write_jsonl(fh, blobs())
    else:
        columns = BASE_NAMES + _discover_trait_columns(source, where)
        selected = [c for c in BASE_NAMES if c not in ("run_id", "result_id")] + MAP_COLUMNS + ["result_json"]
        if fmt == "parquet":
            columns.append("result_json")

            def pages() -> Iterator[list[list[Any]]]:
                for page in counted(iter_pages(source, ", ".join(selected), where, page_size=page_size), len):
                    build = row_builder(columns, page.columns)
                    yield [build(row) for row in page.rows]

            n = write_parquet(out, columns, pages())
        else:
            glob, qs = trait_split_from_store(source, run_id, where)
            ref_cols, our_cols = csv_columns(glob, qs, columns)
            summary, config = _store_run_info(source, run_id, where)
            meta = export_metadata(run_id, config, summary)

            def csv_pages() -> Iterator[list[list[Any]]]:
                for page in counted(iter_pages(source, ", ".join(selected), where, page_size=page_size), len):
                    build = row_builder(our_cols, page.columns)
                    rows = []
                    for raw in page.rows:
                        ours = build(raw)
                        blob = ours.pop()  # result_json, decoded by the builder
                        rows.append(csv_row(VerificationResult.model_validate_json(blob), blob, ours, (glob, qs),
                                            meta))
                    yield rows

            with out.open("w", encoding="utf-8", newline="") as fh:
                n = write_csv(fh, ref_cols + our_cols, csv_pages(), raw=csv_raw)
    return ExportStats(str(out), fmt, n, out.stat().st_size, time.perf_counter() - t0)


def export_run(settings: Settings, run: str, fmt: str, output: str | Path, *, page_size: int = 2000,
               where: ResultFilter | None = None, csv_raw: bool = False) -> ExportStats:
    """`veribus export RUN`: resolve the run (id or name) and stream it out, reading from the
    projector when a stack runs, else from the store directly. `csv_raw`: CSV cells as they are
    (for a program; a spreadsheet would run some as formulas)."""
    check_format(fmt, csv_raw)  # before the store is opened
    with open_source(settings) as source:
        run_id = resolve_run(source, run)
        return export_from_source(source, run_id, fmt, output, where=where, page_size=page_size, csv_raw=csv_raw)


def export_results(
    results: Iterable[VerificationResult], fmt: str, output: str | Path, *, job_id: str | None = None,
    config: Mapping[str, Any] | None = None, rubric_definition: Any = None, run_id: str = "", csv_raw: bool = False,
) -> ExportStats:
    """Export results held in memory (a `VerificationResultSet`, a list) in any format. CSV text
    cells that a spreadsheet would run as formulas get a leading `'` unless `csv_raw`."""
    fmt = check_format(fmt, csv_raw)
    rs = list(results)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    blobs = (_enc.encode(r.model_dump(mode="json")).decode() for r in rs)
    if fmt == "json":
        with out.open("w", encoding="utf-8") as fh:
            n = write_json(fh, export_metadata(job_id or run_id or None, config, job_summary_of(rs)),
                           rubric_definition, blobs)
    elif fmt == "jsonl":
        with out.open("w", encoding="utf-8") as fh:
            n = write_jsonl(fh, blobs)
    elif fmt == "csv":
        glob, qs = reference_csv.trait_split(rs)
        ref_cols, our_cols = csv_columns(glob, qs, flat_columns_for(rs))
        ours = flat_lists_from_results(rs, our_cols[:-1], run_id)
        meta = export_metadata(job_id or run_id or None, config, job_summary_of(rs))
        page = [csv_row(r, b, o, (glob, qs), meta) for r, b, o in zip(rs, blobs, ours, strict=True)]
        with out.open("w", encoding="utf-8", newline="") as fh:
            n = write_csv(fh, ref_cols + our_cols, [page], raw=csv_raw)
    else:
        columns = flat_columns_for(rs) + ["result_json"]
        n = write_parquet(out, columns, [flat_lists_from_results(rs, columns, run_id)])
    return ExportStats(str(out), fmt, n, out.stat().st_size, time.perf_counter() - t0)
