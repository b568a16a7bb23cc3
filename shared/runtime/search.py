"""Grounding text: verbatim-excerpt matching and the pluggable search tools of deep judgment.

Two things live here because template and rubric deep judgment both need them, the same way:

- **The one fuzzy rule** (`excerpt_similarity`, `excerpt_matches`, `validate_excerpts`): an excerpt
  the judge quotes counts as found in the evaluated text when rapidfuzz's `partial_ratio` (best
  aligned substring, 0..100, normalised to 0..1) reaches the threshold. Both sides are normalised
  first (whitespace collapsed, typographic quotes/dashes made ASCII), so a judge that re-flows
  lines or "smartens" quotes is not punished. Improvement over the reference's difflib
  longest-common-block ratio: rapidfuzz is C++ (cheap on long traces) and tolerant of a changed
  character inside the quote; and an excerpt *longer* than the text is scored with the full
  `ratio`, so a judge cannot pass by padding a short answer with invented context (a plain
  partial ratio would align the short text inside the long excerpt and score 1.0).
- **Search tools** (`SearchTool`, `register_search_tool`, `get_search_tool`): a tool is anything
  with `async search(query) -> list[str]`, registered by name (`deep_judgment_search_tool`).
  The built-in `"local"` tool ranks the snippets of a local corpus (`VERIBUS_SEARCH_CORPUS`: a
  directory of .txt/.md/.jsonl/.json files, or one such file) with rapidfuzz, so search-enhanced
  hallucination checks run offline. `assess_hallucination` asks the judge, in ONE batched call,
  for a risk (none|low|medium|high) per excerpt given its search results; the reference makes
  one call per excerpt for rubric traits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rapidfuzz import fuzz, process, utils

from shared.core import prompts
from shared.core.config import Settings
from shared.core.events import ModelSpec
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError, LLMReply

log = logging.getLogger("veribus.search")

CONFIDENCES = ("low", "medium", "high")
RISK_LEVELS = ("none", "low", "medium", "high")
_RISK_ORDER = {r: i for i, r in enumerate(RISK_LEVELS)}
CORPUS_ENV = "VERIBUS_SEARCH_CORPUS"

# ---------------------------------------------------------------- the fuzzy excerpt rule

_TRANSLATE = str.maketrans({
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u2033": '"',
    "\u2013": "-", "\u2014": "-", "\u2212": "-", "\u00a0": " ", "\u2026": "...",
})


def normalize_text(text: str) -> str:
    """Whitespace collapsed, typographic quotes/dashes/ellipsis as ASCII (case is kept: quotes are verbatim)."""
    return " ".join(text.translate(_TRANSLATE).split())


def excerpt_similarity(excerpt: str, text: str) -> float:
    """0..1: how well `excerpt` occurs verbatim in `text` (see module docstring)."""
    ex, tx = normalize_text(excerpt or ""), normalize_text(text or "")
    if not ex or not tx:
        return 0.0
    if ex in tx:
        return 1.0
    if len(ex) > len(tx):
        return fuzz.ratio(ex, tx) / 100.0
    return fuzz.partial_ratio(ex, tx) / 100.0


def excerpt_matches(excerpt: str, text: str, threshold: float) -> tuple[bool, float]:
    """(found, similarity) under THE fuzzy rule shared by template and rubric deep judgment."""
    score = excerpt_similarity(excerpt, text)
    return score >= threshold and score > 0.0, score


def _confidence(value: Any) -> str:
    conf = str(value or "").strip().lower()
    return conf if conf in CONFIDENCES else "medium"


def validate_excerpts(
    entries: Any, text: str, threshold: float, max_excerpts: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """Judge excerpt entries -> (valid, failed, explanation-of-absence).

    Entries are `{"text", "confidence"[, "explanation"]}` objects (or bare strings). An entry with
    empty text and an explanation is the judge saying "no evidence" (kept as the explanation). Valid
    excerpts are deduplicated and capped at `max_excerpts`; each carries its `similarity_score`.
    """
    if isinstance(entries, dict | str):
        entries = [entries]
    if not isinstance(entries, list):
        return [], [], None
    valid: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    explanation: str | None = None
    seen: set[str] = set()
    for entry in entries:
        if isinstance(entry, str):
            entry = {"text": entry}
        if not isinstance(entry, dict):
            continue
        quote = str(entry.get("text") or entry.get("excerpt") or "").strip()
        if not quote:
            note = entry.get("explanation") or entry.get("reason")
            if note:
                explanation = str(note)
            continue
        key = normalize_text(quote)
        if key in seen:
            continue
        seen.add(key)
        ok, score = excerpt_matches(quote, text, threshold)
        item = {"text": quote, "confidence": _confidence(entry.get("confidence")), "similarity_score": round(score, 4)}
        (valid if ok else failed).append(item)
    return valid[:max_excerpts], failed, explanation


# ---------------------------------------------------------------- search tools


@runtime_checkable
class SearchTool(Protocol):
    """A source of external text to check claims against."""

    async def search(self, query: str) -> list[str]: ...


class SearchToolError(RuntimeError):
    """The search tool cannot be used (unknown name, missing corpus)."""


_FACTORIES: dict[str, Callable[[], SearchTool]] = {}
_INSTANCES: dict[str, SearchTool] = {}
_LOCK = threading.Lock()


def register_search_tool(name: str, factory: Callable[[], SearchTool]) -> None:
    """Make `factory()` the tool for `deep_judgment_search_tool == name` (replaces an earlier one)."""
    with _LOCK:
        _FACTORIES[name] = factory
        _INSTANCES.pop(name, None)


def get_search_tool(name: str) -> SearchTool:
    """The registered tool for `name`, created once per process."""
    with _LOCK:
        tool = _INSTANCES.get(name)
        if tool is not None:
            return tool
        factory = _FACTORIES.get(name)
        if factory is None:
            raise SearchToolError(f"unknown search tool {name!r}; registered: {sorted(_FACTORIES)}")
        tool = _INSTANCES[name] = factory()
        return tool


class LocalCorpusSearch:
    """Ranks the snippets of a local corpus against a query (rapidfuzz WRatio, case/punct-insensitive).

    Corpus layout (`path`, else env `VERIBUS_SEARCH_CORPUS`, read when first searched):
    a directory (recursively) or a single file; `.txt`/`.md` files are split into paragraphs at
    blank lines; `.jsonl` lines and `.json` arrays hold strings or objects with a `text` field
    (an optional `title` is prefixed). Loaded once per path and modification time.
    """

    name = "local"
    _cache: dict[tuple[str, float], list[str]] = {}
    _cache_lock = threading.Lock()

    def __init__(self, path: str | Path | None = None, top_k: int = 3, min_score: float = 40.0) -> None:
        self.path = Path(path) if path else None
        self.top_k = top_k
        self.min_score = min_score

    def _root(self) -> Path:
        if self.path is not None:
            return self.path
        corpus = Settings.from_env("search_corpus").search_corpus  # per search call: just this field
        if corpus is None:
            raise SearchToolError(f"local search tool: set {CORPUS_ENV} to a corpus directory or file")
        return corpus

    def snippets(self) -> list[str]:
        root = self._root()
        if not root.exists():
            raise SearchToolError(f"local search tool: corpus {root} does not exist")
        key = (str(root.resolve()), root.stat().st_mtime)
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is None:
                files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
                cached = [s for f in files for s in _read_snippets(f)]
                self._cache[key] = cached
            return cached

    async def search(self, query: str) -> list[str]:
        snippets = self.snippets()
        if not snippets or not query.strip():
            return []

        def rank() -> list[str]:
            hits = process.extract(query, snippets, scorer=fuzz.WRatio, processor=utils.default_process,
                                   limit=self.top_k, score_cutoff=self.min_score)
            return [snippets[i] for _s, _score, i in hits]

        return await asyncio.to_thread(rank) if len(snippets) > 5000 else rank()


def _read_snippets(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("local search: skipping unreadable corpus file %s: %s", path, exc)
        return []
    if suffix in (".txt", ".md"):
        return [" ".join(p.split()) for p in raw.split("\n\n") if p.strip()]
    items: list[Any] = []
    if suffix == ".jsonl":
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError:
                    log.warning("local search: %s line %d is not JSON; skipped", path, n)
    elif suffix == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            log.warning("local search: %s is not JSON; skipped", path)
            return []
        items = data if isinstance(data, list) else [data]
    out: list[str] = []
    for item in items:
        if isinstance(item, str) and item.strip():
            out.append(item.strip())
        elif isinstance(item, dict) and str(item.get("text") or "").strip():
            title = str(item.get("title") or "").strip()
            text = str(item["text"]).strip()
            out.append(f"{title}: {text}" if title else text)
    return out


register_search_tool("local", LocalCorpusSearch)


# ---------------------------------------------------------------- search-enhanced hallucination risk


def max_risk(risks: list[str]) -> str:
    """The highest of several risk levels (unknown values count as high)."""
    return max(risks, key=lambda r: _RISK_ORDER.get(r, 3)) if risks else "high"


async def attach_search_results(tool: SearchTool, excerpts: list[dict[str, Any]]) -> bool:
    """Search every excerpt's text (concurrently) and store the hits as `search_results` (one string,
    snippets separated by blank lines). Returns False (and leaves the excerpts alone) when the tool fails."""
    if not excerpts:
        return True
    try:
        results = await asyncio.gather(*(tool.search(e["text"]) for e in excerpts))
    except Exception as exc:  # any tool failure: search is an enhancement, never fatal
        log.warning("deep judgment search failed (continuing without): %s: %s", type(exc).__name__, exc)
        return False
    for excerpt, hits in zip(excerpts, results, strict=True):
        excerpt["search_results"] = "\n\n".join(str(h) for h in hits or [])
    return True


def _risk_validator(obj: Any) -> Any:
    if not isinstance(obj, dict) or not isinstance(obj.get("excerpt_assessments"), list):
        raise ValueError('expected {"excerpt_assessments": [...]}')
    return obj


async def assess_hallucination(
    llm: LLMClient, model: ModelSpec, question: str, items: list[tuple[str, dict[str, Any]]],
    options: dict[str, Any], *, stage: str,
) -> LLMReply | None:
    """One judge call rating every (label, excerpt-with-search_results) item; writes
    `hallucination_risk` and `hallucination_justification` into each excerpt. Items the judge
    does not rate get "high" (unverified). Returns the reply (for usage), None when the call failed."""
    if not items:
        return None
    listing = [
        {"excerpt_id": str(i), "about": label, "excerpt": ex["text"], "search_results": ex.get("search_results") or ""}
        for i, (label, ex) in enumerate(items)
    ]
    msgs = prompts.hallucination_messages(question, listing, options)
    try:
        reply = await llm.complete(model, msgs, stage=stage, response_schema=prompts.HALLUCINATION_SCHEMA,
                                   schema_name="hallucination_assessment", validate=_risk_validator)
    except LLMError as exc:
        log.warning("hallucination assessment failed (non-fatal): %s", exc)
        return None
    rated: dict[str, dict[str, Any]] = {}
    for a in reply.parsed.get("excerpt_assessments") or []:
        if isinstance(a, dict) and "excerpt_id" in a:
            rated[str(a["excerpt_id"])] = a
    for i, (_label, ex) in enumerate(items):
        a = rated.get(str(i), {})
        risk = str(a.get("hallucination_risk") or a.get("risk") or "").strip().lower()
        ex["hallucination_risk"] = risk if risk in _RISK_ORDER else "high"
        ex["hallucination_justification"] = str(a.get("justification") or ("not assessed by the judge" if not a else ""))
    return reply
