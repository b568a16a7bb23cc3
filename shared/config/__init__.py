"""Old import path of `shared.core.config` (documented API), kept as a re-export."""

from shared.core.config import (
    EvaluationMode,
    ModelConfig,
    Settings,
    StageOptions,
    VerificationConfig,
)

__all__ = [
    "EvaluationMode",
    "ModelConfig",
    "Settings",
    "StageOptions",
    "VerificationConfig",
]
