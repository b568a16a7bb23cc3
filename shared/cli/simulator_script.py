"""Loading a benchmark's script into the LLM simulator, as `run --simulate` and `regrade
--simulate` both do before they publish: the script `infra.simulator.from_benchmark` makes,
merged with the `<name>.simulator.yaml` beside the benchmark, posted to each simulator a
judge or answering model goes to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def script_beside(benchmark_path: str | Path | None) -> dict[str, Any] | None:
    """The `<name>.simulator.yaml` beside a benchmark file, read; None when there is none."""
    if not benchmark_path:
        return None
    path = Path(benchmark_path)
    extra = path.with_name(path.stem + ".simulator.yaml")
    return (yaml.safe_load(extra.read_text()) or {}) if extra.exists() else None


def merge_scripts(base: dict, extra: dict) -> dict:
    """`base` with `extra`'s keys, its questions replacing or adding by their `match`."""
    by_match = {q["match"]: q for q in base.get("questions", [])}
    for q in extra.get("questions", []):
        by_match[q["match"]] = {**by_match.get(q["match"], {}), **q}
    return {**base, **{k: v for k, v in extra.items() if k != "questions"}, "questions": list(by_match.values())}


def post_script(simulator_url: str, script: dict) -> None:
    """Load `script` into the simulator at `simulator_url` (its OpenAI-style `/v1` base);
    RuntimeError naming it when it does not take it."""
    import httpx  # local import: httpx loads click, rich, pygments (~0.4 s); only --simulate posts

    base = simulator_url.removesuffix("/v1")
    try:
        resp = httpx.post(f"{base}/simulator/script", json=script, timeout=10)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot load the benchmark's script into the simulator at {simulator_url}: {exc}") from exc
