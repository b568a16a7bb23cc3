"""Credentials bound to endpoints by the operator, not by messages.

A job names a model, maybe an `api_base` and maybe `api_key_env` (the *name* of the variable
holding the key). Jobs arrive over the bus, so anything that can publish one could point a
service's key at its own listener. The service therefore sends a key only where the operator
allowed it:

- a provider's standard key variable (`OPENAI_API_KEY`, ...) to that provider's own base URL
  (no `api_base`, or exactly the provider's);
- any other (endpoint, variable) pair only when the operator listed it (`URL=*`: any variable,
  for an endpoint the operator runs itself, such as the local stack's simulator) in `VERIBUS_ENDPOINTS`
  (`"http://gpu-box:8000/v1=VLLM_KEY https://api.anthropic.com=MY_ANTHROPIC_KEY"`, separated by
  spaces or commas) or in the YAML/JSON file named by `VERIBUS_ENDPOINTS_FILE`
  (`endpoints: [{api_base: ..., api_key_env: ...}]`).

A call with no key variable carries no secret (the services send a dummy key to an explicit
`api_base`), so it may go to any `api_base`. `params` may not re-route a call (`base_url`,
`api_key`, `extra_headers`, ...). A refused job fails with an error on its own result; nothing
is sent.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from shared.core.config import Settings

# provider prefix -> (standard key variable(s), the provider's own base URL)
PROVIDERS: dict[str, tuple[tuple[str, ...], str]] = {
    "openai": (("OPENAI_API_KEY",), "https://api.openai.com/v1"),
    "anthropic": (("ANTHROPIC_API_KEY",), "https://api.anthropic.com"),
    "gemini": (("GEMINI_API_KEY", "GOOGLE_API_KEY"), "https://generativelanguage.googleapis.com"),
    "mistral": (("MISTRAL_API_KEY",), "https://api.mistral.ai/v1"),
    "groq": (("GROQ_API_KEY",), "https://api.groq.com/openai/v1"),
    "together_ai": (("TOGETHERAI_API_KEY", "TOGETHER_API_KEY"), "https://api.together.xyz/v1"),
    "deepseek": (("DEEPSEEK_API_KEY",), "https://api.deepseek.com"),
    "openrouter": (("OPENROUTER_API_KEY",), "https://openrouter.ai/api/v1"),
    "xai": (("XAI_API_KEY",), "https://api.x.ai/v1"),
    "cohere": (("COHERE_API_KEY",), "https://api.cohere.ai"),
    "fireworks_ai": (("FIREWORKS_AI_API_KEY", "FIREWORKS_API_KEY"), "https://api.fireworks.ai/inference/v1"),
}
# unprefixed model names litellm routes by name
_NAME_HINTS = (("gpt-", "openai"), ("o1", "openai"), ("o3", "openai"), ("o4", "openai"), ("chatgpt", "openai"),
               ("claude", "anthropic"), ("gemini", "gemini"))

# `params` keys that would change where a call goes or what credentials it carries
ROUTING_PARAMS = frozenset({
    "api_base", "base_url", "api_key", "api_version", "custom_llm_provider", "extra_headers", "headers",
    "azure_ad_token", "azure_ad_token_provider", "organization", "aws_access_key_id", "aws_secret_access_key",
    "aws_session_token", "aws_region_name", "vertex_credentials", "vertex_project", "vertex_location",
    "client", "http_client", "proxy", "proxies", "default_headers", "extra_query",
})


class EndpointRefused(ValueError):
    """A job asked to send a key somewhere the operator did not allow."""


def normalize_url(url: str) -> str:
    """scheme://host[:port]/path with scheme and host lower-cased, default ports and a trailing
    slash dropped: two spellings of one endpoint compare equal."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EndpointRefused(f"api_base {url[:200]!r} is not an http(s) URL")
    if parts.username or parts.password:
        raise EndpointRefused("api_base must not carry credentials in the URL")
    port = parts.port
    default = {"http": 80, "https": 443}[parts.scheme]
    netloc = parts.hostname.lower() + (f":{port}" if port and port != default else "")
    return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}"


def provider_of(model_name: str) -> str | None:
    prefix, sep, rest = model_name.partition("/")
    if sep and prefix.lower() in PROVIDERS:
        return prefix.lower()
    if not sep:
        low = model_name.lower()
        for hint, provider in _NAME_HINTS:
            if low.startswith(hint):
                return provider
    return None


@dataclass(frozen=True)
class Policy:
    """The operator's allow-list: (normalized endpoint, key variable) pairs."""

    allowed: frozenset[tuple[str, str]] = frozenset()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Policy:
        """The policy of `Settings.endpoints` / `endpoints_file` (`VERIBUS_ENDPOINTS`,
        `VERIBUS_ENDPOINTS_FILE` of `environ`, default this process's)."""
        return cls.from_settings(Settings.from_env("endpoints", "endpoints_file", environ=environ))

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        pairs: set[tuple[str, str]] = set()
        for item in (settings.endpoints or "").replace(",", " ").split():
            url, sep, var = item.rpartition("=")
            if not sep or not url or not var:
                raise EndpointRefused(f"VERIBUS_ENDPOINTS entry {item!r} is not URL=KEY_VARIABLE")
            pairs.add((normalize_url(url), var))
        path = settings.endpoints_file
        if path:
            pairs |= _pairs_from_file(Path(path))
        return cls(frozenset(pairs))

    def check(self, model_name: str, api_base: str | None, api_key_env: str | None,
              params: dict[str, Any] | None = None) -> None:
        """Raise EndpointRefused unless this call may carry its key where it goes."""
        bad = sorted(k for k in (params or {}) if k.lower() in ROUTING_PARAMS)
        if bad:
            raise EndpointRefused(f"params.{bad[0]} would re-route the call or its credentials; "
                                  "endpoints and keys are set by the operator (VERIBUS_ENDPOINTS)")
        base = normalize_url(api_base) if api_base else None
        if not api_key_env:
            return  # no secret leaves: litellm's own provider key to its own endpoint, or a dummy key
        provider = provider_of(model_name)
        own_vars, own_base = PROVIDERS.get(provider, ((), None)) if provider else ((), None)
        endpoint = base or own_base
        if endpoint is None:
            raise EndpointRefused(
                f"model {model_name!r} names api_key_env {api_key_env} but no api_base, and its provider's "
                "endpoint is unknown: give the api_base and allow it with VERIBUS_ENDPOINTS")
        if api_key_env in own_vars and endpoint == own_base:
            return
        if (endpoint, api_key_env) in self.allowed or (endpoint, "*") in self.allowed:
            return
        raise EndpointRefused(
            f"refused to send {api_key_env} to {endpoint}: that key is not allowed for that endpoint; the operator "
            f"allows it with VERIBUS_ENDPOINTS='{endpoint}={api_key_env}' (or VERIBUS_ENDPOINTS_FILE) where the "
            "services run")


def _pairs_from_file(path: Path) -> set[tuple[str, str]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise EndpointRefused(f"VERIBUS_ENDPOINTS_FILE {path}: cannot read: {exc.strerror or exc}") from exc
    if path.suffix.lower() == ".json":
        data = json.loads(text)
    else:
        data = yaml.safe_load(text)
    entries = data.get("endpoints") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise EndpointRefused(f"VERIBUS_ENDPOINTS_FILE {path}: expected `endpoints:` a list of "
                              "{api_base, api_key_env}")
    out = set()
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not e.get("api_base") or not e.get("api_key_env"):
            raise EndpointRefused(f"VERIBUS_ENDPOINTS_FILE {path}: endpoints[{i}] needs api_base and api_key_env")
        out.add((normalize_url(str(e["api_base"])), str(e["api_key_env"])))
    return out


_cached: tuple[tuple[str | None, str | None], Policy] | None = None


def current_policy() -> Policy:
    """The policy of this process's environment (re-read when the variables change). Keyed on
    the raw variables: every model call asks, and `Settings` (validation) only when they change."""
    global _cached
    key = (os.environ.get("VERIBUS_ENDPOINTS"), os.environ.get("VERIBUS_ENDPOINTS_FILE"))
    if _cached is None or _cached[0] != key:
        _cached = (key, Policy.from_settings(Settings.from_env("endpoints", "endpoints_file")))
    return _cached[1]


def check_model(model: Any) -> None:
    """Check a ModelSpec (or anything with model_name/api_base/api_key_env/params)."""
    current_policy().check(model.model_name, model.api_base, model.api_key_env, getattr(model, "params", None))
