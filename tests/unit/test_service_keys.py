"""Provider keys checked where a configured deployment's services make the calls: each live
replica's key *names* (`shared.runtime.service_keys`), read against the run's models and the
stages that call them (`shared.control.credentials`)."""

from __future__ import annotations

import msgspec

from shared.control.credentials import (
    calling_stages,
    config_problems,
    credential_problems,
    missing_key,
    recorded_stages,
    unadvertised_notes,
    unadvertised_stages,
)
from shared.core.config import ModelConfig, VerificationConfig
from shared.runtime.service_keys import Advert, entry_key, key_names


def _advert(service: str, replica: str, *keys: str) -> Advert:
    return Advert(service, f"{service}/0.1.0@{replica}", keys)


def test_only_the_names_of_set_credential_variables_are_said() -> None:
    env = {"OPENAI_API_KEY": "sk-secret-value", "MY_TEAM_TOKEN": "t", "EMPTY_API_KEY": "", "PATH": "/usr/bin",
           "HOME": "/root", "VERTEXAI_PROJECT": "p"}
    names = key_names(env)
    assert names == ("MY_TEAM_TOKEN", "OPENAI_API_KEY")
    said = msgspec.json.encode(Advert("generation", "g", names))
    assert b"sk-secret-value" not in said and b"/usr/bin" not in said


def test_an_entry_key_is_a_valid_kv_key_per_replica() -> None:
    key = entry_key("parsing", "parsing/0.1.0@host.example:4242")
    assert key == "parsing.parsing_0_1_0_host_example_4242"
    assert entry_key("parsing", "parsing/0.1.0@h:1") != entry_key("parsing", "parsing/0.1.0@h:2")


def test_the_stages_that_call_each_role_follow_the_runs_mode() -> None:
    assert calling_stages("answering") == ("generation",)
    assert calling_stages("judge", VerificationConfig.model_construct(evaluation_mode="template_only")) == ("parsing",)
    assert calling_stages("judge", VerificationConfig.model_construct(evaluation_mode="rubric_only")) == ("rubric",)
    both = recorded_stages({"evaluation_mode": "template_and_rubric", "abstention_enabled": True, "answering_models": 1})
    assert calling_stages("judge", both) == ("guards", "parsing", "rubric")
    assert calling_stages("judge", recorded_stages({})) == ("parsing",)  # the default mode: template_only


def test_every_live_replica_of_a_calling_stage_must_hold_the_key() -> None:
    model = ModelConfig(model_name="gpt-4.1-mini")
    adverts = [_advert("generation", "a:1", "OPENAI_API_KEY"), _advert("generation", "b:2"),
               _advert("parsing", "c:3", "OPENAI_API_KEY"), _advert("finalization", "d:4")]
    problems = credential_problems([("answering", model), ("judge", model)], adverts=adverts)
    assert problems == ["answering model 'gpt-4.1-mini': no API key in the deployment's generation service, which "
                        "makes its calls (1 of 2 running replica(s) lack OPENAI_API_KEY: generation/0.1.0@b:2): "
                        "restart them with OPENAI_API_KEY set (or give the model an api_base, or run with "
                        "--simulate for the simulator)"]
    healed = [a for a in adverts if a.producer != "generation/0.1.0@b:2"]
    assert credential_problems([("answering", model), ("judge", model)], adverts=healed) == []


def test_this_processs_environment_does_not_count_on_a_configured_deployment(monkeypatch) -> None:
    monkeypatch.setenv("TEAM_JUDGE_KEY", "here-only")
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    cfg = VerificationConfig(answering_models=[ModelConfig(model_name="anthropic/claude-haiku-4-5")],
                             parsing_models=[ModelConfig(model_name="openai/j", api_key_env="TEAM_JUDGE_KEY")],
                             evaluation_mode="template_and_rubric")
    adverts = [_advert("generation", "g:1", "ANTHROPIC_API_KEY"), _advert("parsing", "p:1", "TEAM_JUDGE_KEY"),
               _advert("rubric", "r:1")]
    problems = config_problems(cfg, adverts=adverts)
    assert len(problems) == 1 and problems[0].startswith(
        "judge model 'openai/j': no API key in the deployment's rubric service") and "lack TEAM_JUDGE_KEY" in problems[0]
    assert "or give the model an api_base" not in problems[0]  # its key variable is named: that is the fix
    assert config_problems(cfg) != []  # here, ANTHROPIC_API_KEY is missing: only the services' names count there


def test_a_keyless_model_and_a_variable_no_name_can_tell_are_not_refused() -> None:
    adverts = [_advert("generation", "g:1"), _advert("parsing", "p:1")]
    sim = ModelConfig(model_name="sim", interface="simulator", api_base="http://127.0.0.1:1/v1")
    own = ModelConfig(model_name="openai/own", api_base="http://10.0.0.1:8000/v1")  # the server decides
    assert credential_problems([("answering", sim), ("judge", own)], adverts=adverts) == []
    # a provider's project or region variable is not a credential name: a replica never says it
    vertex = ModelConfig(model_name="vertex_ai/gemini-1.5-pro")
    assert missing_key(vertex, {}) == ["VERTEXAI_PROJECT", "VERTEXAI_LOCATION"]  # what litellm asks for
    assert credential_problems([("judge", vertex)], adverts=adverts) == []


def test_a_stage_none_of_whose_replicas_said_its_keys_is_named() -> None:
    model = ModelConfig(model_name="gpt-4.1-mini")
    sim = ModelConfig(model_name="sim", interface="simulator")
    cfg = VerificationConfig.model_construct(evaluation_mode="template_and_rubric")
    adverts = [_advert("generation", "g:1", "OPENAI_API_KEY")]
    assert unadvertised_stages([("answering", model), ("judge", model)], adverts, cfg) == ["parsing", "rubric"]
    assert unadvertised_stages([("answering", model), ("judge", sim)], adverts, cfg) == []
    # and no replica is no refusal: the run waits for one (the CLI notes it)
    assert credential_problems([("judge", model)], adverts=adverts, config=cfg) == []


def test_the_note_names_each_stage_whose_keys_went_unchecked() -> None:
    model = ModelConfig(model_name="gpt-4.1-mini")
    cfg = VerificationConfig(answering_models=[model], parsing_models=[model], evaluation_mode="template_only")
    notes = unadvertised_notes(cfg, [_advert("generation", "g:1", "OPENAI_API_KEY")])
    assert len(notes) == 1 and notes[0].startswith("no running parsing service of this deployment has said")
    assert unadvertised_notes(cfg, None) == []  # no service says any: this process's environment was checked
