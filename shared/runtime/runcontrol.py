"""Run control inside a running service: cancellation and token budgets, per message.

The service harness (`shared.runtime.harness`) asks `RunControl` before an `answer.requested` is
handled whether the run was cancelled or has spent its token budget, and after every handled
event of a run with a budget it adds the tokens that stage spent to the run's counter.
Cancellation is an event on the stream (`vb.run.cancelled.<run>._`, its last message wins); the
budget is `budget_tokens` in the run's `run.requested` config (or a newer value on the control
subject); the spent counter is one key per run in the JetStream KV bucket `vb_run_usage`,
updated by compare-and-set from every service process. The attempt key of re-run events
(`attempt_key`, `carry_attempt_key`) lives here too, because the harness threads it through."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus

log = logging.getLogger("veribus.lifecycle")


USAGE_BUCKET = "vb_run_usage"


class RunStopped(Exception):
    """The run's remaining answers are not dispatched; the job finalizes with this error."""


class RunCancelled(RunStopped):
    pass


class BudgetExhausted(RunStopped):
    pass


STOP_ERROR_TYPES = frozenset({"RunCancelled", "BudgetExhausted"})


class _UsageEntry(msgspec.Struct):
    total_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class _UsageState(msgspec.Struct):
    usage: dict[str, _UsageEntry | None] = {}


class _UsageProbe(msgspec.Struct):
    """The token counts of a StageEvent payload; everything else is skipped by the decoder."""

    state: _UsageState | None = None


_usage_probe = msgspec.json.Decoder(_UsageProbe)
_control_dec = msgspec.json.Decoder(events.RunControlChange)
USAGE_EVENTS = frozenset({events.ANSWER_GENERATED, events.GUARDS_CHECKED, events.TEMPLATE_PARSED,
                          events.TEMPLATE_VERIFIED, events.RUBRIC_EVALUATED})
"""The stage events whose state carries the usage a handled event added (tokens and cost)."""


def _entry_tokens(e: Any) -> int:
    if e is None:
        return 0
    if isinstance(e, dict):
        total = int(e.get("total_tokens") or 0)
        return total or int(e.get("input_tokens") or 0) + int(e.get("output_tokens") or 0)
    return int(e.total_tokens or 0) or int(e.input_tokens or 0) + int(e.output_tokens or 0)


def usage_tokens(usage: dict[str, Any] | None) -> int:
    """Total tokens of a state's `usage` map (per stage entries; a `total` entry is ignored)."""
    if not usage:
        return 0
    return sum(_entry_tokens(v) for k, v in usage.items() if k != "total")


def tokens_before(payload: Any) -> int:
    """Tokens already on an incoming event's state (read before the handler: stages update the
    state in place)."""
    return usage_tokens(payload.state.usage) if isinstance(payload, events.StageEvent) else 0


def usage_growth(before: int, outs: Iterable[events.Envelope], probe: msgspec.json.Decoder[Any],
                 measure: Callable[[Any], int]) -> int:
    """How much `measure` of the state's usage grew from the input event (`before`) to its
    outputs, each decoded with `probe` (a struct holding `state.usage`). Fan-out copies (one
    answer for several judges) count once: the max is taken."""
    spent = 0
    for out in outs:
        if out.event_type not in USAGE_EVENTS:
            continue
        try:
            decoded = probe.decode(out.payload)
        except msgspec.DecodeError:
            continue
        if decoded.state is not None:
            spent = max(spent, measure(decoded.state.usage) - before)
    return spent


def tokens_spent(before: int, outs: Iterable[events.Envelope]) -> int:
    """Tokens one handled event spent: the growth of the state's usage from the input event
    (`before`, see `tokens_before`) to its outputs."""
    return usage_growth(before, outs, _usage_probe, usage_tokens)


def _kv_key(run_id: str) -> str:
    """A KV-safe key for a run id (run ids we make are safe already)."""
    if re.fullmatch(r"[-_=A-Za-z0-9]{1,200}", run_id):
        return run_id
    return "h" + hashlib.sha256(run_id.encode()).hexdigest()[:32]


@dataclass
class RunState:
    """What the stream says of a run: its `run.requested` config and its newest control change
    (cancel, or a budget set by `resume`), as read at `checked_at`."""

    loaded: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    control: events.RunControlChange | None = None
    checked_at: float = -1e9  # monotonic, when the newest read (answered or failed) was asked
    checked_wall: float = 0.0  # time.time() when the newest answered read was asked
    read_failed: bool = False  # the newest read was not answered (the gate fails open)

    @property
    def cancelled(self) -> bool:
        return bool(self.control is not None and self.control.cancelled)


class RunStates:
    """A process's cached reads of its runs' `RunState`, one read per run at most every `ttl_s`,
    shared by the token and the money budget's controls (the harness gives both the same one)."""

    def __init__(self, js: Callable[[], JetStreamContext], *, ttl_s: float = 1.0, max_runs: int = 4096) -> None:
        self._js = js
        self.ttl_s = ttl_s
        self.max_runs = max_runs
        self._runs: OrderedDict[str, RunState] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    def _fresh(self, run_id: str, newer_than: float) -> RunState | None:
        state = self._runs.get(run_id)
        if state is not None and time.monotonic() - state.checked_at < self.ttl_s and state.checked_wall >= newer_than:
            return state
        return None

    async def get(self, run_id: str, newer_than: float = 0.0) -> RunState:
        """The run's state, read at most `ttl_s` ago and (wall clock) after `newer_than`."""
        state = self._fresh(run_id, newer_than)
        if state is not None:
            return state
        async with self._locks.setdefault(run_id, asyncio.Lock()):
            state = self._fresh(run_id, newer_than)  # read meanwhile by the holder of the lock
            if state is not None:
                return state
            # a new snapshot, never the cached one changed in place: a gate holding the cached one
            # across an await (its usage read) decides on one consistent read, not on a budget of
            # one read and the read time of the next
            old = self._runs.get(run_id)
            state = replace(old) if old is not None else RunState()
            js = self._js()
            control_subject = events.subject(events.RUN_CANCELLED, run_id)
            # stamped as the read is asked, not as it is answered: a reply that arrives after a
            # request was published may have been read before the change published ahead of it
            asked_at, asked_wall = time.monotonic(), time.time()
            try:
                if not state.loaded:  # the config once, read beside the first control read
                    run_env, ctl = await asyncio.gather(
                        bus.last_event(js, events.subject(events.RUN_REQUESTED, run_id)),
                        bus.last_event(js, control_subject))
                    if run_env is not None:
                        state.config = events.payload_as(run_env, events.RunRequested).config
                    state.loaded = True
                else:
                    ctl = await bus.last_event(js, control_subject)
                state.control = _control_dec.decode(ctl.payload) if ctl is not None else None
                state.checked_wall, state.read_failed = asked_wall, False
            except Exception as exc:  # noqa: BLE001 - fail open, retry on the next message
                # `checked_wall` stays: what was read before is no newer than it was
                log.warning("run control: cannot read the state of run %s: %s", run_id, exc)
                state.read_failed = True
            state.checked_at = asked_at
            self._runs[run_id] = state
            self._runs.move_to_end(run_id)
            while len(self._runs) > self.max_runs:
                gone, _ = self._runs.popitem(last=False)
                self._locks.pop(gone, None)
            return state

    async def for_request(self, run_id: str, state: RunState, published_at: float) -> RunState | None:
        """The state to stop a request published at `published_at` on: `state` when it was read
        after that, else a new read (a `resume` publishes its lift or raise, then its requests,
        which must see it); None when that read failed (the gate fails open)."""
        if state.checked_wall >= published_at:
            return state
        state = await self.get(run_id, newer_than=published_at)
        return None if state.read_failed else state


@dataclass
class _Usage:
    seen: int = 0  # the run's counter as last read
    read_at: float = -1e9  # monotonic


class RunControl:
    """Per-process view of run cancellation and token budgets (see module docstring).

    Reads are cached (`RunStates`, `usage_ttl_s`), so the per-message cost is a dict lookup; each
    process adds its spent tokens to the run's KV counter every `flush_s`. A read that fails (the
    server is away) never stops a run: the gate fails open and retries on the next message.
    """

    bucket = USAGE_BUCKET  # the KV bucket of the run counters (`CostControl`: its own)

    def __init__(self, js: Callable[[], JetStreamContext], *, states: RunStates | None = None,
                 ttl_s: float = 1.0, usage_ttl_s: float = 0.25, flush_s: float = 0.2, max_runs: int = 4096) -> None:
        self._js = js
        self.states = states if states is not None else RunStates(js, ttl_s=ttl_s, max_runs=max_runs)
        self.usage_ttl_s = usage_ttl_s
        self.flush_s = flush_s
        self.max_runs = max_runs
        self._usage: OrderedDict[str, _Usage] = OrderedDict()
        self._pending: dict[str, int] = {}
        self._kv: Any = None
        self._flusher: asyncio.Task[None] | None = None

    def _usage_of(self, run_id: str) -> _Usage:
        """The run's counter cache, the least recently used run's dropped past `max_runs`."""
        u = self._usage.get(run_id)
        if u is not None:
            self._usage.move_to_end(run_id)
            return u
        u = self._usage[run_id] = _Usage()
        while len(self._usage) > self.max_runs:
            self._usage.popitem(last=False)
        return u

    # ---- the budget: tokens here, micro-dollars in `CostControl` ----
    def config_budget(self, config: dict[str, Any]) -> int | None:
        """The budget a run's `run.requested` config sets (None: none)."""
        b = positive(config.get("budget_tokens"))
        return None if b is None else int(b)

    def control_budget(self, control: events.RunControlChange) -> int | None:
        """The budget a control change (`resume --max-tokens-budget`) puts in force (None: unchanged)."""
        return control.budget_tokens

    def _budget(self, state: RunState) -> int | None:
        """The newest control change's budget, else the run's config's."""
        if state.control is not None:
            changed = self.control_budget(state.control)
            if changed is not None:
                return changed
        return self.config_budget(state.config)

    def exhausted(self, run_id: str, used: int, budget: int) -> BudgetExhausted:
        return BudgetExhausted(f"budget exhausted: run {run_id} has used {used} of its {budget}-token "
                               "budget; this answer was not generated")

    async def budget(self, run_id: str) -> int | None:
        """The run's budget, or None (no budget)."""
        return self._budget(await self.states.get(run_id))

    async def budget_stop(self, run_id: str, info: RunState, published_at: float) -> BudgetExhausted | None:
        """The budget's stop, or None. A spent budget read before the request was published is
        read again: a `resume` raises it, then publishes its requests, which must see the raise."""
        budget = self._budget(info)
        if budget is None:
            return None
        used = await self.usage(run_id)
        if used >= budget:
            confirmed = await self.states.for_request(run_id, info, published_at)
            budget = None if confirmed is None else self._budget(confirmed)
        if budget is not None and used >= budget:
            return self.exhausted(run_id, used, budget)
        return None

    async def usage(self, run_id: str) -> int:
        """Tokens the run has spent as far as this process knows (counter + unflushed)."""
        u = self._usage_of(run_id)
        now = time.monotonic()
        if now - u.read_at >= self.usage_ttl_s:
            try:
                u.seen = await self._read_counter(run_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("run control: cannot read the usage of run %s: %s", run_id, exc)
            u.read_at = now
        return u.seen + self._pending.get(run_id, 0)

    async def stop_reason(self, run_id: str, published_at: float = 0.0) -> RunStopped | None:
        """Why the run's next answer must not be generated, or None.

        `published_at`: when the request was published. A stop seen before that is read again
        (a `resume` lifts the stop, then publishes its requests: they must see the lift)."""
        info = await self.states.get(run_id)
        if info.cancelled:
            confirmed = await self.states.for_request(run_id, info, published_at)
            if confirmed is None:
                return None
            info = confirmed
        if info.cancelled:
            why = f" ({info.control.reason})" if info.control and info.control.reason else ""
            return RunCancelled(f"cancelled: run {run_id} was cancelled before this answer was generated{why}")
        return await self.budget_stop(run_id, info, published_at)

    # ---- spending ----
    def record_usage(self, run_id: str, tokens: int) -> None:
        """Add tokens this process spent for the run (flushed to the shared counter soon)."""
        if tokens <= 0:
            return
        self._pending[run_id] = self._pending.get(run_id, 0) + tokens
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        while self._pending:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        for run_id in list(self._pending):
            delta = self._pending.pop(run_id, 0)
            if delta <= 0:
                continue
            try:
                total = await self._add_counter(run_id, delta)
            except Exception as exc:  # noqa: BLE001 - keep it for the next flush
                log.warning("run control: cannot add %d tokens to run %s: %s", delta, run_id, exc)
                self._pending[run_id] = self._pending.get(run_id, 0) + delta
                continue
            u = self._usage.get(run_id)
            if u is not None:
                u.seen = max(u.seen, total)

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
        if self._pending:
            try:
                await asyncio.wait_for(self.flush(), 5.0)
            except Exception:  # noqa: BLE001 - shutting down: best effort
                pass

    # ---- the KV counter ----
    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await usage_bucket(self._js(), self.bucket)
        return self._kv

    async def _read_counter(self, run_id: str) -> int:
        kv = await self._bucket()
        try:
            entry = await kv.get(_kv_key(run_id))
        except KeyNotFoundError:
            return 0
        return int(entry.value or b"0")

    async def _add_counter(self, run_id: str, delta: int) -> int:
        """Compare-and-set add; returns the new total."""
        kv = await self._bucket()
        key = _kv_key(run_id)
        for _ in range(50):
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                try:
                    await kv.create(key, str(delta).encode())
                    return delta
                except KeyWrongLastSequenceError:
                    continue
            total = int(entry.value or b"0") + delta
            try:
                await kv.update(key, str(total).encode(), last=entry.revision)
                return total
            except KeyWrongLastSequenceError:
                await asyncio.sleep(0.005)
        raise RuntimeError(f"usage counter of run {run_id}: too much contention")


async def usage_bucket(js: JetStreamContext, bucket: str = USAGE_BUCKET) -> Any:
    """A run-usage KV bucket (created on first use): tokens, or micro-dollars (runtime.costcontrol)."""
    return await bus.ensure_kv(js, KeyValueConfig(
        bucket=bucket, history=1, ttl=30 * 24 * 3600, description="veribus spending per run"))


async def run_usage(settings: Settings, run_id: str) -> int:
    """Tokens the run's services have reported spending so far (the budget counter)."""
    async with bus.session(settings) as nc:
        return await RunControl(lambda: nc.jetstream())._read_counter(run_id)


def positive(x: Any) -> float | None:
    """A budget as read back from a stored event: a positive number (not a bool), else None."""
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and x > 0 else None


def check_budget(tokens: Any) -> int:
    """A token budget as given (`--max-tokens-budget`, `budget_tokens`): a positive integer."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"--max-tokens-budget / budget_tokens must be a positive number of tokens (an integer), "
                         f"got {tokens!r}")
    return tokens


def set_budget(run_event: events.RunRequested, budget_tokens: int | None) -> None:
    """Record a token budget in the run's config (what `veribus run --max-tokens-budget N` does
    before submitting); the generation service stops dispatching once the run has spent it."""
    if budget_tokens is None:
        return
    run_event.config = {**run_event.config, "budget_tokens": check_budget(budget_tokens)}


def pop_budget(config_data: dict[str, Any]) -> int | None:
    """Take `budget_tokens` out of a run-config mapping (it is not a VerificationConfig field)."""
    raw = config_data.pop("budget_tokens", None)
    return None if raw is None else check_budget(raw)


# =========================================================================== event ids of re-runs


def attempt_key(env: events.Envelope) -> str:
    """The `resume` attempt an event belongs to, '' for a first run.

    `resume` publishes answer requests with a key; every event a service publishes in reply
    carries the same key (`carry_attempt_key`), so a resumed job's chain is not deduplicated
    against the events of an earlier, broken one. The key is the envelope's `attempt_key`; an
    event published before that field existed carries it only as its id's suffix
    (`<id>:<type>:<key>`), which is read instead."""
    if env.attempt_key:
        return env.attempt_key
    if env.event_type == events.DEAD_LETTER:  # its id's suffix names the service and the bad bytes, not an attempt
        return ""
    key = env.result_id if env.result_id != events.RUN_KEY else env.run_id
    base = f"{key}:{env.event_type}"
    if env.event_id.startswith(base + ":"):
        return env.event_id[len(base) + 1:]
    return ""


def carry_attempt_key(key: str, outs: list[events.Envelope]) -> list[events.Envelope]:
    """Give outgoing events the attempt key of the event they answer (see `attempt_key`): the
    envelope field, and the event id's suffix derived from it."""
    if key:
        for out in outs:
            out.attempt_key = key
            if not out.event_id.endswith(":" + key):
                out.event_id = f"{out.event_id}:{key}"
    return outs
