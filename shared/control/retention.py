"""Stream retention and what a rebuild can still see.

The event stream may be bounded (`VERIBUS_STREAM_MAX_AGE_S`, `VERIBUS_STREAM_MAX_BYTES`; the
oldest events go first). `veribus projections rebuild` refolds the tables from what is kept;
this module says plainly what that is, and which runs (or how many of their results) could not
be rebuilt because their events are gone. A result needs only its `result.finalized` event
(it carries the whole VerificationResult), a run's row its `run.requested`; the stage events
feed the `events` table and the latency views.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus


@dataclass
class StreamRetention:
    messages: int
    bytes: int
    first_seq: int
    first_ts: datetime | None
    removed: int  # messages no longer in the stream (retention, or deleted)
    max_age_s: float | None
    max_bytes: int | None

    def lines(self) -> list[str]:
        limits = []
        if self.max_age_s:
            limits.append(f"max age {self.max_age_s:g} s")
        if self.max_bytes and self.max_bytes > 0:
            limits.append(f"max {self.max_bytes} bytes")
        policy = ", ".join(limits) or "no limits (every event is kept)"
        out = [f"stream retention: {policy}; it holds {self.messages} events ({self.bytes} bytes)"]
        if self.removed:
            since = self.first_ts.isoformat() if self.first_ts else "?"
            out.append(f"  {self.removed} older events are gone (the stream starts at {since}): results and runs "
                       "known only from them cannot be rebuilt")
        return out


async def stream_retention(settings: Settings) -> StreamRetention:
    """The stream's limits and what it holds (the oldest kept event's time from its envelope)."""
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        info = await js.stream_info(events.STREAM)
        st, cfg = info.state, info.config
        first_seq = int(st.first_seq or 0)
        ts = None
        if st.messages:
            try:
                msg = await js.get_msg(events.STREAM, seq=first_seq)
                ts = datetime.fromtimestamp(events.decode(msg.data, msg.subject).occurred_at, UTC)
            except Exception:  # noqa: BLE001 - an undecodable first message: time unknown
                ts = None
    removed = max(0, first_seq - 1) + int(st.num_deleted or 0)
    return StreamRetention(messages=int(st.messages or 0), bytes=int(st.bytes or 0), first_seq=first_seq,
                           first_ts=ts, removed=removed,
                           max_age_s=float(cfg.max_age) if cfg.max_age else None,
                           max_bytes=int(cfg.max_bytes) if cfg.max_bytes and cfg.max_bytes > 0 else None)


@dataclass
class RebuildLoss:
    lost_runs: list[str] = field(default_factory=list)  # runs with rows before and none after
    partial_runs: dict[str, tuple[int, int]] = field(default_factory=dict)  # run -> (before, after) results

    def lines(self) -> list[str]:
        if not self.lost_runs and not self.partial_runs:
            return ["  every run in the tables before the rebuild was rebuilt with all its results"]
        out = []
        if self.lost_runs:
            out.append(f"  {len(self.lost_runs)} run(s) could not be rebuilt (their events are gone): "
                       + ", ".join(self.lost_runs[:20]) + (" ..." if len(self.lost_runs) > 20 else ""))
        for run, (b, a) in list(self.partial_runs.items())[:20]:
            out.append(f"  run {run}: {a} of its {b} results rebuilt (the others' result.finalized events are gone)")
        return out


def results_per_run(query: Any) -> dict[str, int]:
    """run_id -> finalized results in the tables (`query(sql)` returns an object with `.rows`)."""
    try:
        rows = query("SELECT run_id, count() FROM verification_results FINAL GROUP BY run_id").rows
    except Exception:  # noqa: BLE001 - no tables yet
        return {}
    return {str(r): int(n) for r, n in rows}


def compare(before: dict[str, int], after: dict[str, int]) -> RebuildLoss:
    loss = RebuildLoss()
    for run, n in sorted(before.items()):
        got = after.get(run, 0)
        if got == 0:
            loss.lost_runs.append(run)
        elif got < n:
            loss.partial_runs[run] = (n, got)
    return loss
