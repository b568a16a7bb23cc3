"""OpenAI-compatible LLM simulator: deterministic, scriptable answers, judge outputs and failures."""

from infra.simulator.server import (
    FINGERPRINT,
    Script,
    SimConfig,
    Simulator,
    create_app,
    fill_schema,
    find_schema_in_text,
)

__all__ = [
    "FINGERPRINT", "Script", "SimConfig", "Simulator", "create_app", "fill_schema", "find_schema_in_text",
]
