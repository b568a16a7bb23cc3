"""The AsyncAPI document of the event catalogue: generated from `shared.core.events`, committed
under docs/, and this test fails when the committed file is stale, when an event type is left
out, or when a reference in it points nowhere."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from shared.cli import asyncapi
from shared.core import events

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "asyncapi.json"


def _event_types() -> set[str]:
    return {v for k, v in vars(events).items() if k.isupper() and isinstance(v, str)
            and re.fullmatch(r"[a-z]+\.[a-z]+", v) and k != "QUERY_SUBJECT"}


def test_the_committed_document_is_the_generated_one() -> None:
    assert COMMITTED.read_text(encoding="utf-8") == asyncapi.render(), (
        "docs/asyncapi.json is stale: run `veribus docs asyncapi` (python -m shared.cli docs asyncapi)")


def test_every_event_type_has_a_channel_a_message_and_its_payload_schema() -> None:
    doc = asyncapi.build()
    assert {d.event_type for d in asyncapi.CATALOGUE} == _event_types()
    for d in asyncapi.CATALOGUE:
        key = d.event_type.replace(".", "_")
        ch = doc["channels"][key]
        assert ch["address"].startswith(f"vb.{d.event_type}.{{run_id}}.")
        msg = doc["components"]["messages"][key]
        payload = msg["payload"]["allOf"][1]["properties"]
        assert payload["event_type"] == {"const": d.event_type}
        assert payload["payload"]["$ref"] == f"#/components/schemas/{d.payload.__name__}"
        actions = {op["action"] for op in doc["operations"].values() if op["channel"]["$ref"] == f"#/channels/{key}"}
        assert actions == {"send", "receive"}
    # the envelope's fields are the struct's
    env = doc["components"]["schemas"]["Envelope"]
    assert set(env["properties"]) == set(events.Envelope.__struct_fields__)
    assert doc["channels"]["query"]["address"] == events.QUERY_SUBJECT


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_every_reference_resolves_and_faststream_reads_it() -> None:
    from faststream.specification.asyncapi.v3_0_0.schema import ApplicationSchema

    doc = asyncapi.build()
    for ref in _refs(doc):
        node: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            assert isinstance(node, dict) and part in node, f"dangling {ref}"
            node = node[part]
    doc["servers"]["local"]["pathname"] = ""  # FastStream's model wants it; the spec does not
    parsed = json.loads(ApplicationSchema.model_validate(doc).to_json())
    assert set(parsed["channels"]) == set(doc["channels"]) and set(parsed["operations"]) == set(doc["operations"])


def test_check_mode_fails_on_a_stale_file(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "asyncapi.json"
    assert asyncapi.main(["--output", str(out), "--check"]) == 1
    assert asyncapi.main(["--output", str(out)]) == 0
    assert asyncapi.main(["--output", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace('"run.requested"', '"run.requested.old"', 1))
    assert asyncapi.main(["--output", str(out), "--check"]) == 1
    assert "is stale" in capsys.readouterr().err
