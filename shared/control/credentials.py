"""Can a model be called at all? Checked before a run is published, so a missing provider key is
one clear refusal naming the model and the variable to set, instead of a run of errors (or, as
before, a silent switch to the simulator).

- `manual` and `simulator` models need no key.
- `api_key_env: NAME` needs NAME set.
- an explicit `api_base` (vLLM, Ollama, any OpenAI-compatible server) is used as given; a key is
  optional there (the server decides).
- otherwise the provider's key: from the model string's provider prefix (or the bare name:
  `gpt-*` is OpenAI, `claude-*` Anthropic; `shared.runtime.endpoints.provider_of`), else
  litellm's own table.

Where the key is looked for is where the calls are made: a running local stack's services' own
environment (what `up` gave them), this process's for a temporary stack, and on a configured
deployment each live replica's key *names* as it said them on the bus (`service_keys`): every
replica of each stage that calls the model must hold its key.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from shared.core.config import ModelConfig, VerificationConfig
from shared.core.scrub import is_secret_name
from shared.runtime.endpoints import PROVIDERS, provider_of
from shared.runtime.service_keys import Advert

KEYLESS_INTERFACES = ("manual", "simulator")
# provider -> its key variables, any one of which is enough: a view of the one provider table
# (`shared.runtime.endpoints.PROVIDERS`, which also binds each key to the provider's base URL)
PROVIDER_KEYS: dict[str, tuple[str, ...]] = {name: keys for name, (keys, _base) in PROVIDERS.items()}


def _litellm_missing(model: ModelConfig) -> list[str]:
    """What litellm says the environment lacks for this model ([] when it cannot tell)."""
    try:
        # local import: shared.runtime.llm would slow the CLI's start-up; only this check asks litellm
        from shared.runtime.llm.transport import _get_litellm

        litellm = _get_litellm()
        env = litellm.validate_environment(model.model_name, api_base=model.api_base)
    except Exception:  # noqa: BLE001 - an unknown provider: the call itself will say
        return []
    return [] if env.get("keys_in_environment") else list(env.get("missing_keys") or [])


def unknown_provider(model: ModelConfig) -> bool:
    """True when no provider can be told for the model string (litellm would refuse every call
    with "LLM Provider NOT provided"): a bare name litellm does not know, e.g. a typo."""
    if model.interface in KEYLESS_INTERFACES or provider_of(model.model_name) is not None:
        return False
    try:
        # local import: shared.runtime.llm would slow the CLI's start-up; only this check asks litellm
        from shared.runtime.llm.transport import _get_litellm

        litellm = _get_litellm()
    except Exception:  # noqa: BLE001 - no litellm here: the services will say
        return False
    try:
        litellm.get_llm_provider(model.model_name, api_base=model.api_base)
    except Exception:  # noqa: BLE001 - litellm raises its BadRequestError for an unknown provider
        return True
    return False


def missing_key(model: ModelConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """The environment variables one of which must be set for this model to be called ([] when
    nothing is missing), in `environ` (default: this process's)."""
    env = os.environ if environ is None else environ
    if model.interface in KEYLESS_INTERFACES:
        return []
    if model.api_key_env:
        return [] if env.get(model.api_key_env) else [model.api_key_env]
    if model.api_base:
        return []
    provider = provider_of(model.model_name)
    if provider in PROVIDER_KEYS:
        names = PROVIDER_KEYS[provider]
        return [] if any(env.get(n) for n in names) else list(names)
    if environ is not None:  # litellm reads this process's environment only
        with _environment(environ):
            return _litellm_missing(model)
    return _litellm_missing(model)


@contextlib.contextmanager
def _environment(environ: Mapping[str, str]) -> Iterator[None]:
    """This process's environment replaced by `environ` for the duration (litellm's own key
    table reads os.environ)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def calling_stages(role: str, config: VerificationConfig | None = None) -> tuple[str, ...]:
    """The stage services that call a run's models of `role` (answering, judge), by what the run
    asks of them (`config`; None: every stage that may call a judge). The embedding check's judge
    is left out: its failure is recorded on the stage, never on the result."""
    if role == "answering":
        return ("generation",)
    if config is None:
        return ("guards", "parsing", "rubric")
    mode = config.evaluation_mode
    guards = ("guards",) if config.abstention_enabled or config.sufficiency_enabled else ()
    return (guards + (("parsing",) if mode != "rubric_only" else ())
            + (("rubric",) if mode != "template_only" else ()))


def recorded_stages(config: Mapping[str, Any]) -> VerificationConfig:
    """A recorded run config (a dict) reduced to what `calling_stages` reads, without validating
    the rest (models, which a regrade replaces)."""
    keys = ("evaluation_mode", "abstention_enabled", "sufficiency_enabled")
    return VerificationConfig.model_construct(**{k: config[k] for k in keys if config.get(k) is not None})


def unadvertised_stages(models: Iterable[tuple[str, ModelConfig]], adverts: Sequence[Advert],
                        config: VerificationConfig | None = None) -> list[str]:
    """The stages that would call these models (keyless ones aside) of which no live replica has
    said its key names: none runs (the run waits for one), or it predates `service_keys`."""
    live = {a.service for a in adverts}
    needed = {s for role, m in models if m.interface not in KEYLESS_INTERFACES for s in calling_stages(role, config)}
    return sorted(needed - live)


def unadvertised_notes(config: VerificationConfig, adverts: Sequence[Advert] | None) -> list[str]:
    """A note per stage of a configured deployment whose keys could not be checked because no
    live replica of it has said them (nothing when the deployment's services say none at all:
    then this process's environment was checked)."""
    if adverts is None:
        return []
    return [f"no running {stage} service of this deployment has said which provider keys it holds (none runs "
            "yet, or it predates this check): its keys are not checked, and the jobs wait for one"
            for stage in unadvertised_stages(config_models(config), adverts, config)]


def _advertised_missing(model: ModelConfig, advert: Advert) -> list[str]:
    """The key variables the replica lacks for the model, of those its key names can tell (a
    credential-like name; a provider's project or region variable is not said, so not judged)."""
    names = missing_key(model, dict.fromkeys(advert.keys, "set"))
    return names if names and all(is_secret_name(n) for n in names) else []


def _unknown_provider_line(role: str, m: ModelConfig) -> str:
    return (f"{role} model {m.model_name!r}: no provider known for this name: write it as "
            f"provider/model (openai/{m.model_name} for an OpenAI-compatible server, or anthropic/..., "
            "ollama/...), or run with --simulate for the offline simulator")


def credential_problems(models: Iterable[tuple[str, ModelConfig]],
                        services_environ: Mapping[str, str] | None = None, *,
                        adverts: Sequence[Advert] | None = None,
                        config: VerificationConfig | None = None) -> list[str]:
    """One line per model (role, config) that cannot be called: no provider can be told for its
    name, or its key is missing. The key is looked for where the calls are made: with `adverts`
    (a configured deployment's services' key names), in every live replica of each stage that
    calls the model (`calling_stages` by `config`); else in `services_environ` (the running local
    stack's services, which `up` started with its own environment) when given, else here (a
    temporary stack is started from this environment)."""
    out = []
    seen: set[tuple[str, str]] = set()
    for role, m in models:
        if (role, m.model_name) in seen:
            continue
        if unknown_provider(m):
            out.append(_unknown_provider_line(role, m))
        seen.add((role, m.model_name))
        if adverts is not None:
            out += _advertised_problems(role, m, adverts, config)
            continue
        names = missing_key(m, services_environ)
        if not names:
            continue
        var = " or ".join(names)
        if services_environ is not None and not missing_key(m):
            out.append(f"{role} model {m.model_name!r}: {var} is set here, but the local stack's services were "
                       f"started without it, and they make the model calls: `veribus down`, then `veribus up` "
                       f"with {var} set")
            continue
        out.append(f"{role} model {m.model_name!r}: no API key: set {var} "
                   + ("where `veribus up` runs (the local stack's services make the calls; "
                      "`veribus down` first) " if services_environ is not None else "")
                   + "(or give the model an api_base, or run with --simulate for the offline simulator)")
    return out


def _advertised_problems(role: str, m: ModelConfig, adverts: Sequence[Advert],
                         config: VerificationConfig | None) -> list[str]:
    """A model's key missing in live replicas of a configured deployment, one line per stage."""
    out = []
    for stage in calling_stages(role, config):
        replicas = [a for a in adverts if a.service == stage]
        lacking = [(a, names) for a in replicas if (names := _advertised_missing(m, a))]
        if not lacking:
            continue
        names = lacking[0][1]
        var = " or ".join(names)
        who = ", ".join(a.producer for a, _ in lacking[:3]) + (", ..." if len(lacking) > 3 else "")
        other = "" if m.api_key_env else " (or give the model an api_base, or run with --simulate for the simulator)"
        out.append(f"{role} model {m.model_name!r}: no API key in the deployment's {stage} service, which makes "
                   f"its calls ({len(lacking)} of {len(replicas)} running replica(s) lack {var}: {who}): restart "
                   f"them with {var} set{other}")
    return out


def config_models(config: VerificationConfig) -> list[tuple[str, ModelConfig]]:
    """A run's models with their roles (answering, judge)."""
    return [("answering", m) for m in config.answering_models] + [("judge", m) for m in config.parsing_models]


def config_problems(config: VerificationConfig, services_environ: Mapping[str, str] | None = None, *,
                    adverts: Sequence[Advert] | None = None) -> list[str]:
    return credential_problems(config_models(config), services_environ, adverts=adverts, config=config)


def base_reachable(api_base: str, timeout: float = 2.0) -> str | None:
    """None when something accepts TCP connections at the api_base's host and port, else why not."""
    parsed = urlparse(api_base)
    host = parsed.hostname
    if not host:
        return f"api_base {api_base!r} has no host"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        reason = "connection refused" if isinstance(exc, ConnectionRefusedError) else (str(exc) or type(exc).__name__)
        return f"{api_base}: {reason}"
