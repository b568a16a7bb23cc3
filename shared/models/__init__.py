"""Old import path of `shared.core.models` (documented API), kept as a re-export."""

from shared.core.models import (
    ModelIdentity,
    VerificationResult,
    VerificationResultDeepJudgment,
    VerificationResultDeepJudgmentRubric,
    VerificationResultMetadata,
    VerificationResultRubric,
    VerificationResultTemplate,
)

__all__ = [
    "ModelIdentity",
    "VerificationResult",
    "VerificationResultDeepJudgment",
    "VerificationResultDeepJudgmentRubric",
    "VerificationResultMetadata",
    "VerificationResultRubric",
    "VerificationResultTemplate",
]
