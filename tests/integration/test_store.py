"""The store against the real engine (embedded chdb): DDL, idempotent inserts, round trip, views,
the read-only guard and the direct-query fallback.

chdb opens one folder per process at a time, so every test here shares one folder (module fixture),
isolates itself with its own database, and closes its store (which frees the folder) at teardown.
"""

from __future__ import annotations

import itertools
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.clickhouse import TABLES, VIEWS
from shared.core import events
from shared.core.config import Settings
from shared.store.engine import Store, open_store
from shared.store.reads import QueryError, format_json, format_table, run_query
from shared.store.rows import project_envelopes, result_to_row, row_to_result
from shared.store.sql_guard import is_read_only_sql, read_only_refusal
from tests.support.rows import RUBRIC, USAGE, make_result, stage_env


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One chdb folder for the module (chdb refuses a second folder while one is open)."""
    return tmp_path_factory.mktemp("veribus-home")


@pytest.fixture
def settings(home: Path) -> Settings:
    return Settings(home=home, clickhouse_database=f"t_{uuid.uuid4().hex[:12]}",
                    nats_url="nats://127.0.0.1:1")  # nothing listens there: no projector


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    st = open_store(settings)
    try:
        yield st
    finally:
        st.client.command(f"DROP DATABASE IF EXISTS {settings.clickhouse_database}")
        st.close()


def _objects(store: Store) -> list[tuple[str, str]]:
    return store.query(
        "SELECT name, engine FROM system.tables WHERE database = {db:String} ORDER BY name",
        {"db": store.database},
    ).rows


def test_migrate_is_idempotent(store: Store) -> None:
    before = _objects(store)
    assert {n for n, _ in before} == set(TABLES) | set(VIEWS)
    store.insert_results([result_to_row(make_result(), "run1")])
    store.migrate()
    store.migrate()
    assert _objects(store) == before
    assert store.count("verification_results") == 1  # data survives a re-migrate


def _stage_events(rid: str, t0: float) -> list[events.Envelope]:
    """The stage events of one result, each carrying the cumulative stage log, as the services do."""
    gen = ("generate_answer", "performed", t0, t0 + 2.0)
    guard = ("abstention_check", "skipped", t0 + 2.1, t0 + 2.1)
    parse = ("parse_template", "performed", t0 + 2.2, t0 + 2.7)
    rubric = ("rubric_evaluation", "performed", t0 + 2.2, t0 + 3.2)
    verify = ("verify_template", "performed", t0 + 2.8, t0 + 2.81)
    return [
        stage_env(events.ANSWER_GENERATED, rid, [gen], usage={"answer_generation": {"input_tokens": 10, "output_tokens": 20}}),
        stage_env(events.GUARDS_CHECKED, rid, [gen, guard]),
        stage_env(events.TEMPLATE_PARSED, rid, [gen, guard, parse]),
        stage_env(events.RUBRIC_EVALUATED, rid, [gen, guard, rubric]),
        stage_env(events.TEMPLATE_VERIFIED, rid, [gen, guard, parse, verify]),
    ]


def test_duplicate_events_and_results_do_not_double_count(store: Store) -> None:
    envs = [e for i in range(20) for e in _stage_events(f"r{i}", 1000.0 + i)]
    store.insert_events(envs)
    store.insert_events(envs)  # a redelivered batch
    store.insert_events(envs[:7])  # and a partial one
    assert store.count("events") == len(envs)

    rows = [result_to_row(make_result(question=f"q{i}"), "run1", version=1) for i in range(10)]
    store.insert_results(rows)
    store.insert_results(rows)
    assert store.count("verification_results") == 10

    # a re-projection with a newer version replaces the row
    newer = result_to_row(make_result(question="q0", verify=False), "run1", version=2)
    store.insert_results([newer])
    got = store.query("SELECT verify_result, version FROM verification_results FINAL WHERE result_id = {r:String}",
                      {"r": newer["result_id"]}).rows
    assert got == [(False, 2)]
    assert store.count("verification_results") == 10


def test_result_round_trip_through_clickhouse(store: Store) -> None:
    originals = [
        make_result(rubric=RUBRIC, usage=USAGE, tools=["search"]),
        make_result(question="q2", verify=None, error="generate_answer: TimeoutError: timed out", replicate=None),
        make_result(question="q3", verify=False, mode="template_and_rubric", run_name=None),
    ]
    store.insert_results([result_to_row(r, "run1") for r in originals])
    res = store.query("SELECT result_id, result_json, verify_result, replicate, llm_trait_scores "
                      "FROM verification_results FINAL")
    by_id = {row[0]: row for row in res.rows}
    for r in originals:
        rid, rjson, verify, replicate, llm = by_id[r.metadata.result_id]
        assert row_to_result(rjson) == r
        assert verify == (r.template.verify_result if r.template else None)
        assert replicate == r.metadata.replicate
        assert llm == ({k: float(v) for k, v in r.rubric.llm_trait_scores.items()} if r.rubric else {})


def _synthetic() -> list[tuple[Any, ...]]:
    """2 models × 3 questions × 3 replicates with a varied, deterministic pass pattern, plus errors."""
    out = []
    for k, (model, q, rep) in enumerate(itertools.product(["gpt-a", "gpt-b"], ["q1", "q2", "q3"], [1, 2, 3])):
        if model == "gpt-b" and q == "q3" and rep == 3:
            verify, err = None, "parse_template: ValueError: bad"
        else:
            verify, err = (k * 7 + len(q) + rep) % 3 != 0, None
        usage = {"answer_generation": {"input_tokens": 10 + k, "output_tokens": 5}, "parsing": {"input_tokens": 3, "output_tokens": 1}}
        rubric = {"llm_trait_scores": {"clarity": 1 + k % 5}, "regex_trait_scores": {"cites": k % 2 == 0}}
        out.append((model, q, rep, verify, err, usage, rubric))
    return out


def test_views_compute_pass_rates_usage_and_traits(store: Store) -> None:
    data = _synthetic()
    results = [make_result(question=q, model=m, replicate=rep, verify=v, error=e, usage=u, rubric=rb)
               for m, q, rep, v, e, u, rb in data]
    rows = [result_to_row(r, "runV") for r in results]
    store.insert_results(rows)
    store.insert_results(rows)  # duplicates must not change any view
    store.insert_runs([events.RunRequested(run_id="runV", timestamp="t", job_count=len(rows) + 2, answer_count=1,
                                           benchmark_name="bench")] * 2)

    # expectations computed from the data, independently of SQL
    by_model: dict[str, list[bool | None]] = defaultdict(list)
    by_question: dict[str, list[bool | None]] = defaultdict(list)
    for m, q, _rep, v, *_ in data:
        by_model[f"litellm:{m}"].append(v)
        by_question[q].append(v)

    def rate(vs: list[bool | None]) -> float:
        verdicts = [v for v in vs if v is not None]
        return sum(verdicts) / len(verdicts)

    got = store.query("SELECT answering_model, results, passed, failed, errors, pass_rate FROM v_pass_rate_by_model "
                      "WHERE run_id = 'runV' ORDER BY answering_model").rows
    assert [(g[0], g[1], g[2], g[3]) for g in got] == [
        (m, len(vs), sum(v is True for v in vs), sum(v is False for v in vs)) for m, vs in sorted(by_model.items())
    ]
    assert [g[5] for g in got] == pytest.approx([rate(vs) for _, vs in sorted(by_model.items())])
    assert [g[4] for g in got] == [0, 1]

    got = store.query("SELECT question_id, pass_rate FROM v_pass_rate_by_question WHERE run_id = 'runV' "
                      "ORDER BY question_id").rows
    assert got == [(q, pytest.approx(rate(vs))) for q, vs in sorted(by_question.items())]

    (summary,) = store.query("SELECT job_count, total, passed, failed, no_verdict, errors, pass_rate, "
                             "benchmark_name FROM v_run_summary WHERE run_id = 'runV'").rows
    all_v = [d[3] for d in data]
    assert summary == (len(rows) + 2, len(rows), sum(v is True for v in all_v), sum(v is False for v in all_v),
                       1, 1, pytest.approx(rate(all_v)), "bench")

    usage = store.query("SELECT model, stage, results, input_tokens, output_tokens FROM v_usage_by_model "
                        "WHERE run_id = 'runV' ORDER BY model, stage").rows
    exp_usage: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for m, _q, _r, _v, _e, u, _rb in data:
        for stage, entry in u.items():
            key = (m if stage == "answer_generation" else "gpt-4o-mini", stage)
            exp_usage[key][0] += 1
            exp_usage[key][1] += entry["input_tokens"]
            exp_usage[key][2] += entry["output_tokens"]
    assert usage == [(m, s, *v) for (m, s), v in sorted(exp_usage.items())]

    traits = store.query("SELECT answering_model, trait_type, trait_name, n, mean_score FROM v_trait_scores "
                         "WHERE run_id = 'runV' ORDER BY answering_model, trait_type, trait_name").rows
    exp_traits = []
    for m in sorted({d[0] for d in data}):
        mine = [d for d in data if d[0] == m]
        exp_traits.append((f"litellm:{m}", "llm", "clarity", len(mine),
                           pytest.approx(sum(d[6]["llm_trait_scores"]["clarity"] for d in mine) / len(mine))))
        exp_traits.append((f"litellm:{m}", "regex", "cites", len(mine),
                           pytest.approx(sum(d[6]["regex_trait_scores"]["cites"] for d in mine) / len(mine))))
    assert traits == exp_traits


def test_stage_latency_counts_each_stage_record_once(store: Store) -> None:
    envs = [e for i in range(4) for e in _stage_events(f"s{i}", 2000.0 + i)]
    p = project_envelopes(envs)
    store.insert_projection(p)
    store.insert_projection(p)
    got = store.query("SELECT event_type, stage, status, n, p50_ms, max_ms FROM v_stage_latency "
                      "WHERE run_id = 'run1' ORDER BY stage").rows
    assert got == [
        ("guards.checked", "abstention_check", "skipped", 4, 0.0, 0.0),
        ("answer.generated", "generate_answer", "performed", 4, pytest.approx(2000.0), pytest.approx(2000.0)),
        ("template.parsed", "parse_template", "performed", 4, pytest.approx(500.0), pytest.approx(500.0)),
        ("rubric.evaluated", "rubric_evaluation", "performed", 4, pytest.approx(1000.0), pytest.approx(1000.0)),
        ("template.verified", "verify_template", "performed", 4, pytest.approx(10.0), pytest.approx(10.0)),
    ]
    counts = dict(store.query("SELECT event_type, events FROM v_event_counts WHERE run_id = 'run1'").rows)
    assert counts == {t: 4 for t in (events.ANSWER_GENERATED, events.GUARDS_CHECKED, events.TEMPLATE_PARSED,
                                     events.RUBRIC_EVALUATED, events.TEMPLATE_VERIFIED)}
    tokens = store.query("SELECT sum(input_tokens), sum(output_tokens) FROM events FINAL "
                         "WHERE event_type = 'answer.generated'").rows
    assert tokens == [(40, 80)]


READ_ONLY_CASES = [
    ("SELECT 1", True),
    ("select count() from verification_results FINAL where run_id = {r:String};", True),
    ("WITH x AS (SELECT 1 AS a) SELECT a FROM x", True),
    ("  (SELECT 1) UNION ALL (SELECT 2)", True),
    ("SHOW TABLES", True),
    ("SHOW CREATE TABLE events", True),
    ("DESCRIBE TABLE events", True),
    ("EXPLAIN SELECT 1", True),
    ("SELECT 'DROP TABLE x; INSERT' AS s -- a comment; DROP", True),
    ("SELECT `update` FROM t", True),
    ("INSERT INTO events (event_id) VALUES ('x')", False),
    ("ALTER TABLE events DELETE WHERE 1", False),
    ("DROP TABLE events", False),
    ("CREATE TABLE x (a Int8) ENGINE = Memory", False),
    ("SYSTEM SHUTDOWN", False),
    ("KILL QUERY WHERE 1", False),
    ("SET readonly = 0", False),
    ("TRUNCATE TABLE events", False),
    ("OPTIMIZE TABLE events FINAL", False),
    ("SELECT 1; DROP TABLE events", False),
    ("SELECT 1 /* ; */ ; SELECT 2", False),
    ("SELECT * FROM file('/etc/passwd', 'LineAsString')", False),
    ("SELECT file('/etc/hostname')", False),
    ("SELECT * FROM `url`('http://example.com', 'CSV')", False),
    ("SELECT * FROM s3('https://b/x.csv')", False),
    ("SELECT * FROM remote('h', db.t)", False),
    ("SELECT * FROM mysql('h:3306', 'db', 't', 'u', 'p')", False),
    ("SELECT * FROM postgresql('h', 'db', 't', 'u', 'p')", False),
    ("SELECT * FROM executable('x.sh', 'TSV', 'a String')", False),
    ("SELECT 1 INTO OUTFILE 'x.csv'", False),
    ("SELECT 1 SETTINGS readonly = 0", False),
    ("WITH 1 AS a INSERT INTO t SELECT a", False),
    ("", False),
    ("  ;  ", False),
]


@pytest.mark.parametrize(("sql", "ok"), READ_ONLY_CASES)
def test_read_only_guard(sql: str, ok: bool) -> None:
    assert is_read_only_sql(sql) is ok, read_only_refusal(sql)


def test_read_only_queries_use_a_read_only_handle(store: Store) -> None:
    store.insert_results([result_to_row(make_result(), "run1")])
    assert store.query_read_only("SELECT count() FROM verification_results FINAL").rows == [(1,)]
    with pytest.raises(ValueError, match="refused"):
        store.query_read_only("DROP TABLE verification_results")
    # even past the text guard, the engine refuses writes on the reader handle
    with pytest.raises(Exception, match="(?i)readonly"):
        store.reader().command(f"INSERT INTO {store.database}.runs (run_id) VALUES ('x')")
    assert store.count("verification_results") == 1 and store.count("runs") == 0
    df = store.query_df("SELECT result_id, verify_result FROM verification_results FINAL")
    assert list(df.columns) == ["result_id", "verify_result"] and len(df) == 1


def test_run_query_falls_back_to_the_folder_without_a_projector(store: Store, settings: Settings) -> None:
    results = [make_result(question=f"q{i}", verify=i % 2 == 0) for i in range(3)]
    store.insert_results([result_to_row(r, "runQ") for r in results])
    res = run_query(settings, "SELECT question_id, verify_result, execution_time FROM verification_results FINAL "
                              "WHERE run_id = {run:String} ORDER BY question_id", {"run": "runQ"})
    assert res.columns == ["question_id", "verify_result", "execution_time"]
    assert res.rows == [("q0", True, 1.25), ("q1", False, 1.25), ("q2", True, 1.25)]
    with pytest.raises(QueryError, match="refused"):
        run_query(settings, "DELETE FROM verification_results WHERE 1")

    table = format_table(res).splitlines()
    assert table[0].split() == ["question_id", "verify_result", "execution_time"]
    assert table[2].split() == ["q0", "True", "1.25"] and table[-1] == "(3 rows)"
    assert len({len(line) for line in table[:2]}) == 1  # header and rule aligned
    import json

    assert json.loads(format_json(res))[1] == {"question_id": "q1", "verify_result": False, "execution_time": 1.25}


async def test_projector_records_a_row_the_store_refuses_and_keeps_the_rest(settings: Settings) -> None:
    """A poison message (its row cannot be stored) is recorded and acked; the batch is not blocked."""
    from types import SimpleNamespace

    from shared.store.projection import Projector

    good = [make_result(question=f"g{i}") for i in range(3)]
    poison = make_result(question="poison").model_dump(mode="json")
    poison["metadata"]["replicate"] = 2**40  # does not fit the UInt32 column
    envs = [events.make_envelope(events.RESULT_FINALIZED, "runX", r["metadata"]["result_id"],
                                 events.ResultFinalized(result=r), "f/1")
            for r in [g.model_dump(mode="json") for g in good] + [poison]]
    msgs = [SimpleNamespace(subject=e.subject, data=events.encode(e)) for e in envs]
    msgs.append(SimpleNamespace(subject="vb.x.y.runX.z", data=b"garbage"))

    projector = Projector(settings)
    projector.open()
    try:
        ack, nak = await projector.handle_batch(msgs)
        assert len(ack) == len(msgs) and nak == []
        assert projector.stats.insert_failures == 1
        store = projector.store
        assert store is not None
        assert store.count("verification_results") == len(good)
        kinds = dict(store.query("SELECT event_type, count() FROM events FINAL GROUP BY event_type").rows)
        assert kinds == {"result.finalized": len(good), "projection_failed": 1, "undecodable": 1}
        (failed,) = store.query("SELECT subject, error_type FROM events FINAL WHERE event_type = 'projection_failed'").rows
        assert failed[0] == envs[-1].subject
    finally:
        store = projector.store
        if store is not None:
            store.client.command(f"DROP DATABASE IF EXISTS {settings.clickhouse_database}")
        projector.close()


def test_drop_all_then_migrate_rebuilds_an_empty_schema(store: Store) -> None:
    store.insert_results([result_to_row(make_result(), "run1")])
    store.drop_all()
    assert _objects(store) == []
    store.migrate()
    assert {n for n, _ in _objects(store)} == set(TABLES) | set(VIEWS)
    assert store.count("verification_results") == 0


def _table_rows(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    out = {}
    for table in ("events", "verification_results", "runs"):
        cols = [r[0] for r in store.query(f"DESCRIBE TABLE {table}").rows if r[0] != "ingested_at"]
        out[table] = store.query(f"SELECT {', '.join(cols)} FROM {table} FINAL ORDER BY {cols[0]}, {cols[1]}").rows
    return out


def test_arrow_inserts_store_the_same_rows_as_native_ones(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Arrow insert path (projector and rebuild) against clickhouse-connect's Native insert:
    maps, nested maps, nulls, arrays, timestamps and a payload that is not UTF-8, row for row."""
    from bench.rebuild import result_events
    from shared.store import arrow
    from shared.store.rows import undecodable_row

    envs = [e for i in range(3) for e in result_events("20250101T000000-arrowrun", i, "2025-01-01T00:00:00Z", 1.75e9)]
    envs.append(events.make_envelope(events.RUN_REQUESTED, "20250101T000000-arrowrun", events.RUN_KEY, events.RunRequested(
        run_id="20250101T000000-arrowrun", timestamp="t", job_count=3, answer_count=3, config={"a": [1, None]}), "cli"))
    p = project_envelopes(envs)
    row = result_to_row(make_result(rubric=RUBRIC, usage=USAGE), "20250101T000000-arrowrun", version=7)
    p.results.append(list(row.values()))  # a projection keeps result_values' lists, in RESULT_COLUMNS order
    p.events.append(undecodable_row("vb.x.y.r.s", b"\xff\xfe not utf-8 \x00", ValueError("bad")))
    assert row["metric_trait_scores"] or row["llm_trait_scores"]  # maps are exercised
    native = store.client.insert
    store.client.insert = lambda *a, **k: pytest.fail("the Arrow insert fell back to the Native one")
    store.insert_projection(p)
    store.client.insert = native
    via_arrow = _table_rows(store)
    store.drop_all()
    store.migrate()
    monkeypatch.setattr(arrow, "to_arrow", lambda *a, **k: (_ for _ in ()).throw(ValueError("native, please")))
    store.insert_projection(p)
    assert _table_rows(store) == via_arrow
    assert len(via_arrow["events"]) == len(p.events) and len(via_arrow["verification_results"]) == 4


def _part_types(store: Store, table: str) -> list[str]:
    return [r[0] for r in store.query(
        "SELECT part_type FROM system.parts WHERE database = {db:String} AND table = {t:String} AND active",
        {"db": store.database, "t": table}).rows]


def test_a_rebuild_sized_insert_writes_one_compact_part(store: Store) -> None:
    """A rebuild inserts ~40 MB blocks: over ClickHouse's default 10 MB they were Wide parts (two
    files per column stream), whose file creation cost the rebuild's inserting process a third of
    its CPU. Under the tables' 256 MiB threshold they are Compact, also on a table made before it."""
    store.client.command(f"ALTER TABLE {store.database}.events RESET SETTING min_bytes_for_wide_part")
    store.migrate()  # an existing deployment's table gains the setting on the next start
    answer = "x" * 20_000
    envs = [events.make_envelope(events.ANSWER_GENERATED, "run1", f"r{i}", {"status": "performed", "answer": answer},
                                 "generation/test") for i in range(700)]
    store.insert_events(envs)  # ~14 MB of payloads in one insert
    assert store.count("events") == 700
    assert _part_types(store, "events") == ["Compact"]
    engine = store.query("SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = 'events'",
                         {"db": store.database}).rows[0][0]
    assert "min_bytes_for_wide_part = 268435456" in engine


def test_a_query_stopped_by_the_row_limit_does_not_answer_the_next_one(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the projector runs for each `veribus.query` request (`query_read_only`), on chdb. A
    query stopped by `max_result_rows` left its unread blocks on its handle, and the next query
    there read them as its own rows: the guard's re-write of that next SQL came back as the
    attacker's first row, a statement then checked and run in place of the victim's, so a
    `cli` client chose what another client's query returned."""
    monkeypatch.setenv("VERIBUS_QUERY_CONCURRENCY", "1")  # one handle: the next query lands on it
    st = open_store(settings)
    try:
        forged = "SELECT 42 AS forged"
        with pytest.raises(Exception, match="TOO_MANY_ROWS_OR_BYTES"):
            st.query_read_only(f"SELECT '{forged}' AS s FROM numbers(5000000)")
        victim = st.query_read_only("SELECT count() AS runs FROM runs FINAL")
        assert (victim.columns, victim.rows) == (["runs"], [(0,)])  # before: (['forged'], [(42,)])
        assert st.query_read_only("SELECT {r:String} AS r", {"r": "x"}).rows == [("x",)]
    finally:
        st.client.command(f"DROP DATABASE IF EXISTS {settings.clickhouse_database}")
        st.close()


def test_a_writer_stopped_between_two_inserts_never_leaves_a_result_without_its_run(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A projector killed mid-batch (kill -9 between two of its inserts) must not leave results
    whose run ClickHouse lacks: every read that names a run (results, status, report) looks the run
    up first and would call a stored result "not in ClickHouse yet". Runs go in before results."""
    from bench.rebuild import result_events

    run_id = "20250101T000000-killedrun"
    envs = [events.make_envelope(events.RUN_REQUESTED, run_id, events.RUN_KEY, events.RunRequested(
        run_id=run_id, timestamp="t", job_count=2, answer_count=2, config={}), "cli")]
    envs += [e for i in range(2) for e in result_events(run_id, i, "2025-01-01T00:00:00Z", 1.75e9)]
    p = project_envelopes(envs)
    assert p.runs and p.results
    done: list[str] = []
    real = store._insert

    def dies_after_the_first_results(table: str, *a: Any, **k: Any) -> None:
        if "verification_results" in done:
            raise KeyboardInterrupt("the writer is killed here")
        real(table, *a, **k)
        done.append(table)

    monkeypatch.setattr(store, "_insert", dies_after_the_first_results)
    with pytest.raises(KeyboardInterrupt):
        store.insert_projection(p)
    assert "verification_results" in done
    stored = store.query("SELECT count() FROM verification_results FINAL WHERE run_id = {r:String}", {"r": run_id})
    assert int(stored.rows[0][0]) == 2
    runs = store.query("SELECT job_count FROM runs FINAL WHERE run_id = {r:String}", {"r": run_id}).rows
    assert runs == [(2,)]


def test_a_query_the_engine_rejects_says_the_engines_message_not_the_clients_class(
        store: Store, settings: Settings) -> None:
    """`veribus query 'SELECT nosuchcol ...'` said `StreamFailureError: Code: 47. ...`: the client's
    class names nothing the user wrote. ClickHouse's message is said as it is, by the local read
    and by the projector's reply, and the exit code still reads its (UNKNOWN_IDENTIFIER) as bad input."""
    import json

    from shared.cli.stack import query_error_code
    from shared.store.projection import Projector
    from shared.store.reads import store_query

    with pytest.raises(QueryError) as caught:
        store_query(store, "SELECT nosuchcol FROM verification_results")
    said = str(caught.value)
    assert said.startswith("Code: 47. DB::Exception: Unknown expression identifier `nosuchcol`"), said
    assert query_error_code(said) == 2
    projector = Projector(settings)
    projector.store = store
    reply = json.loads(projector.answer_query(b'{"sql": "SELECT nosuchcol FROM verification_results"}'))["error"]
    assert reply.startswith("Code: 47. DB::Exception: Unknown expression identifier `nosuchcol`"), reply


def test_inf_and_nan_are_said_as_such_never_as_null(store: Store, settings: Settings) -> None:
    """`veribus query "SELECT 1/0, nan, -inf"` showed NULL NULL NULL, in the table and in JSON,
    like a real NULL (JSON has no number for them and the encoder wrote null): through the
    projector's reply and read back, the table says inf/nan and JSON the strings."""
    import asyncio
    import json

    from shared.store.projection import Projector
    from shared.store.reads import ask_projector, store_query

    sql = "SELECT 1/0 AS a, nan AS b, -inf AS c, CAST(NULL AS Nullable(Float64)) AS d, 2.5 AS e"
    projector = Projector(settings)
    projector.store = store

    class Reply:
        def __init__(self, data: bytes) -> None:
            self.data = data

    class Bus:  # the projector's reply as the request returns it
        async def request(self, subject: str, body: bytes, timeout: float) -> Reply:
            return Reply(projector.answer_query(body))

    for res in (store_query(store, sql), asyncio.run(ask_projector(Bus(), sql, None, 5.0))):
        table = format_table(res)
        assert table.splitlines()[2].split() == ["inf", "nan", "-inf", "NULL", "2.5"], table
        assert json.loads(format_json(res)) == [{"a": "inf", "b": "nan", "c": "-inf", "d": None, "e": 2.5}]
