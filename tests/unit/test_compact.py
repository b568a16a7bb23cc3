"""The lean `result.finalized`: a result travels without its default values and comes back key
for key and byte for byte, events written before (full results) still read, and the projector's
row is the same either way."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared.analysis.resultset import VerificationResultSet
from shared.core import events
from shared.core.compact import compact, expand
from shared.core.models import VerificationResult
from shared.store.rows import project_envelopes
from tests.conftest import REFERENCE
from tests.support.results import grid_results, spec_results

REF_FULL = REFERENCE / "export_format" / "results_export_full.json"


def _dumps() -> list[dict]:
    results = [*spec_results(), *grid_results(),
               *VerificationResultSet.from_file(REF_FULL).results]
    return [r.model_dump(mode="json") for r in results]


@pytest.mark.parametrize("dump", _dumps())
def test_expand_restores_the_dump_exactly(dump: dict) -> None:
    small = compact(dump)
    back = expand(small)
    assert json.dumps(back) == json.dumps(dump)  # same keys, same order, same values
    assert len(json.dumps(small)) < len(json.dumps(dump))
    assert VerificationResult.model_validate(small).model_dump(mode="json") == dump


def test_defaults_are_left_out_and_falsy_values_that_differ_are_kept() -> None:
    dump = spec_results()[0].model_dump(mode="json")
    dump["template"]["verify_result"] = False  # default None: kept
    dump["template"]["embedding_similarity_score"] = 0.0  # default None: kept
    dump["metadata"]["few_shot_example_count"] = 0  # default 0: left out
    dump["used_full_trace"] = False  # default True: kept
    small = compact(dump)
    assert small["template"]["verify_result"] is False
    assert small["template"]["embedding_similarity_score"] == 0.0
    assert "few_shot_example_count" not in small["metadata"]
    assert "caveats" not in small["metadata"] and "scenario_id" not in small["metadata"]
    assert small["used_full_trace"] is False
    assert small["metadata"]["answering"].get("interface", "litellm") == dump["metadata"]["answering"]["interface"]
    assert json.dumps(expand(small)) == json.dumps(dump)


def test_extra_fields_of_reference_files_survive() -> None:
    dump = spec_results()[0].model_dump(mode="json")
    dump["metadata"]["from_a_newer_reference"] = {"x": None}
    dump["future_section"] = None
    assert json.dumps(expand(compact(dump))) == json.dumps(dump)


def _finalized(payload: object) -> events.Envelope:
    return events.make_envelope(events.RESULT_FINALIZED, "20250101T000000-aaaaaaaa", "0123456789abcdef",
                                payload, "finalization/test")


def test_wire_payload_is_compact_and_decodes_to_the_full_dump() -> None:
    dump = spec_results()[1].model_dump(mode="json")
    lean_env = _finalized(events.ResultFinalized.wire(dump))
    old_env = _finalized(events.ResultFinalized(result=dump))  # as finalizers wrote it before
    assert len(lean_env.payload) < len(old_env.payload) * 0.6
    for env in (lean_env, old_env):
        again = events.decode(events.encode(env))
        assert json.dumps(events.payload_as(again, events.ResultFinalized).result) == json.dumps(dump)
    lean_row = project_envelopes([lean_env]).results[0]
    old_row = project_envelopes([old_env]).results[0]
    assert lean_row["result_json"] == old_row["result_json"] == msgspec.json.encode(dump)
    assert {k: v for k, v in lean_row.items() if k != "version"} == {k: v for k, v in old_row.items() if k != "version"}
