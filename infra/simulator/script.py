"""The simulator's script and settings: scripted questions (answer, parsed judge output, tool
calls, forced faults) matched against requests, and the latency / error-injection config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra.simulator.schema import DEFAULT_TRUE_FIELDS, _interior_words, words_of

DEFAULT_ERROR_MIX = {"429": 0.4, "500": 0.4, "slow": 0.2}
LATENCY_DISTS = ("fixed", "uniform", "lognormal")
CONTENT_FAULTS = frozenset({"malformed", "invalid", "empty", "fenced"})  # 200 with unusable/odd content
DELAY_FAULTS = frozenset({"slow", "timeout"})  # answer only after --slow-ms


def _valid_forced(item: Any) -> bool:
    if isinstance(item, int) and not isinstance(item, bool):
        return 400 <= item <= 599
    text = str(item)
    return text in CONTENT_FAULTS or text in DELAY_FAULTS or (text.isdigit() and 400 <= int(text) <= 599)


@dataclass(frozen=True)
class SimConfig:
    """Process-level knobs (the CLI flags)."""

    latency_ms: float = 0.0
    latency_dist: str = "fixed"
    latency_sigma: float = 0.5
    error_rate: float = 0.0
    error_mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_ERROR_MIX))
    retry_after_s: float = 0.1
    slow_ms: float = 30_000.0
    seed: int = 0
    max_in_flight: int = 0  # per model, like a provider's concurrency limit: 429 beyond it (0: none)

    def __post_init__(self) -> None:
        if self.latency_dist not in LATENCY_DISTS:
            raise ValueError(f"latency_dist must be one of {LATENCY_DISTS}, got {self.latency_dist!r}")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be within [0, 1], got {self.error_rate}")
        bad = set(self.error_mix) - {"429", "500", "503", "slow"}
        if bad:
            raise ValueError(f"error_mix has unknown kinds {sorted(bad)}; use 429, 500, 503, slow")


@dataclass
class Entry:
    """One scripted question. `values` = judge fields overlaid by parsed fields."""

    index: int
    match: str
    answer: str | None = None
    answers_by_model: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    abstain: bool = False
    tool_calls: list[Any] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    answer_errors: list[Any] = field(default_factory=list)
    judge_errors: list[Any] = field(default_factory=list)

    @classmethod
    def from_dict(cls, index: int, raw: dict[str, Any]) -> Entry:
        if not isinstance(raw, dict) or not isinstance(raw.get("match"), str) or not raw["match"]:
            raise ValueError(f"script question #{index} needs a non-empty string 'match'")
        by_model: dict[str, str] = {}
        for name, text in (raw.get("answers_by_model") or {}).items():
            by_model[name] = str(text)
        for name, text in (raw.get("answers_by_model") or {}).items():
            # litellm strips the provider prefix ("openai/x" arrives as "x"): answer to both.
            if "/" in name:
                by_model.setdefault(name.split("/", 1)[1], str(text))
        values = dict(raw.get("judge") or {})
        values.update(raw.get("parsed") or {})
        abstain = bool(raw.get("abstain", False))
        if abstain:
            values.setdefault("abstention_detected", True)
        answer = raw.get("answer")
        lists = {name: list(raw.get(name) or []) for name in ("errors", "answer_errors", "judge_errors")}
        for name, items in lists.items():
            for item in items:
                if not _valid_forced(item):
                    raise ValueError(
                        f"script question {raw['match']!r}: {name} item {item!r} is not an HTTP status 400-599 "
                        f"or one of {sorted(CONTENT_FAULTS | DELAY_FAULTS)}"
                    )
        return cls(
            index=index,
            match=raw["match"],
            answer=None if answer is None else str(answer),
            answers_by_model=by_model,
            values=values,
            abstain=abstain,
            tool_calls=list(raw.get("tool_calls") or []),
            errors=lists["errors"],
            answer_errors=lists["answer_errors"],
            judge_errors=lists["judge_errors"],
        )


class Script:
    """Parsed script with a word index so matching does not scan every entry's text.

    An entry is found by an *interior* word of its `match` (a word that has non-word characters
    on both sides inside the match, hence is a whole word of any text containing the match);
    matches too short to have one are checked linearly.
    """

    def __init__(self, raw: dict[str, Any] | None = None) -> None:
        self.defaults: dict[str, Any] = {}
        self._by_match: dict[str, Entry] = {}
        self._raw_by_match: dict[str, dict[str, Any]] = {}  # each entry as given (`raw()`)
        self._index: dict[str, list[Entry]] = {}
        self._linear: list[Entry] = []
        self._next_index = 0
        self.true_fields: frozenset[str] = frozenset(DEFAULT_TRUE_FIELDS)
        if raw:
            self.merge(raw)

    @classmethod
    def load(cls, path: str | Path) -> Script:
        p = Path(path)
        text = p.read_text(encoding="utf-8")
        if p.suffix.lower() in (".yaml", ".yml"):
            raw = yaml.safe_load(text) or {}
        else:
            raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: a script must be a mapping with 'defaults' and 'questions'")
        return cls(raw)

    @property
    def entries(self) -> list[Entry]:
        return list(self._by_match.values())

    def merge(self, raw: dict[str, Any]) -> int:
        """Add or replace entries (same `match` replaces); update defaults. Returns entry count."""
        unknown = set(raw) - {"defaults", "questions"}
        if unknown:
            raise ValueError(f"unknown script keys {sorted(unknown)}; expected 'defaults', 'questions'")
        defaults = raw.get("defaults") or {}
        if not isinstance(defaults, dict):
            raise ValueError("script 'defaults' must be a mapping")
        self.defaults.update(defaults)
        self.true_fields = frozenset(self.defaults.get("true_fields", DEFAULT_TRUE_FIELDS))
        questions = raw.get("questions") or []
        if not isinstance(questions, list):
            raise ValueError("script 'questions' must be a list")
        parsed = [Entry.from_dict(self._next_index + i, q) for i, q in enumerate(questions)]
        self._next_index += len(parsed)
        for entry, q in zip(parsed, questions, strict=True):
            self._by_match[entry.match] = entry
            self._raw_by_match[entry.match] = q
        self._reindex()
        return len(self._by_match)

    def raw(self) -> dict[str, Any]:
        """The script as one mapping (defaults and every entry as given, a replaced one as it was
        last given): `Script(script.raw())` answers as `script` does."""
        return {"defaults": dict(self.defaults), "questions": list(self._raw_by_match.values())}

    def _reindex(self) -> None:
        interiors: list[tuple[Entry, set[str]]] = []
        freq: dict[str, int] = {}
        for entry in self._by_match.values():
            words = set(_interior_words(entry.match))
            interiors.append((entry, words))
            for w in words:
                freq[w] = freq.get(w, 0) + 1
        index: dict[str, list[Entry]] = {}
        linear: list[Entry] = []
        for entry, words in interiors:
            if words:  # the rarest interior word (longest on ties) keeps buckets small
                index.setdefault(min(words, key=lambda w: (freq[w], -len(w), w)), []).append(entry)
            else:
                linear.append(entry)
        for bucket in index.values():
            bucket.sort(key=lambda e: -len(e.match))
        self._index = index
        self._linear = sorted(linear, key=lambda e: -len(e.match))

    def find(self, text: str, words: frozenset[str] | set[str] | None = None) -> Entry | None:
        """The entry with the longest `match` contained in `text` (`words`: text's word set)."""
        best: Entry | None = None
        index = self._index
        if index:
            if words is None:
                words = words_of(text)
            keys = [w for w in words if w in index] if len(words) <= len(index) else [
                k for k in index if k in words
            ]
            for key in keys:
                for entry in index[key]:
                    if best is not None and len(entry.match) <= len(best.match):
                        break
                    if entry.match in text:
                        best = entry
                        break
        for entry in self._linear:
            if best is not None and len(entry.match) <= len(best.match):
                break
            if entry.match in text:
                best = entry
                break
        return best
