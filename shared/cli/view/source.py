"""Where the viewer reads from: `shared.store.reads.LiveSource`, which decides where reads go the
way `veribus query` does (a ClickHouse server directly; else the projector over NATS, one
connection kept open; else the chdb folder, let go after a few idle seconds).

The viewer lives longer than the stack it reads: `veribus down` and `veribus up` give the local
stack a new NATS port, and the view must ask the new projector rather than open the folder that
projector now holds. So, unless a bus is configured (`--nats-url`, `VERIBUS_NATS_URL`), each new
connection attempt reads the local stack's state again (`<home>/stack.json`: a file read and a
process check, only when no connection is open), and the folder is never opened while that stack
runs a projector that did not answer (it is starting, and the folder is its).

It also reads the bus: the JetStream stream and its consumers (pending and in-flight
messages), for the live status strip of the runs page.
"""

from __future__ import annotations

import contextlib
from typing import Any

from shared.control import stack
from shared.core.config import Settings
from shared.core.events import STREAM
from shared.store.reads import LiveSource, projector_first


class StoreUnavailable(RuntimeError):
    """The store cannot be read right now; the message says why and what to do."""


class ViewSource(LiveSource):
    """Async read-only queries for the viewer (`shared.store.reads.LiveSource`: where reads go
    is decided there), following the local stack of `settings.home` (see the module docstring),
    and the bus's live status. `follow`: re-read the local stack's NATS URL (default: unless
    the environment configures a bus)."""

    def __init__(self, settings: Settings, timeout: float = 30.0, *, follow: bool | None = None) -> None:
        super().__init__(settings.model_copy(), timeout, name="veribus-view")
        self.follow = (not Settings.given("nats_url")) if follow is None else follow

    # ---- the local stack ----
    def local_stack(self) -> stack.StackState | None:
        """The stack `veribus up` runs from this home (a NATS node alive), else None."""
        if not self.follow:
            return None
        try:
            return stack.running_stack(self.settings)
        except (OSError, ValueError, TypeError):  # a stack.json being rewritten or not ours: no stack
            return None

    async def _follow(self) -> stack.StackState | None:
        """Point at the local stack's bus when it moved (a stack started again); drop the
        connection to the old one."""
        state = self.local_stack()
        if state is not None and state.nats_url != self.settings.nats_url:
            self.settings = self.settings.model_copy(update={"nats_url": state.nats_url})
            old, self._nc = self._nc, None
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.close()
        return state

    async def connection(self) -> Any:
        if self._nc is None or not self._nc.is_connected:
            await self._follow()
        return await super().connection()

    async def _direct(self, sql: str, params: dict[str, Any] | None) -> Any:
        if projector_first(self.settings):
            state = self.local_stack()
            projector = [p for p in state.replicas_of("projector") if p.alive()] if state is not None else []
            if state is not None and projector:
                await self._close_store()  # held since before the stack started: its projector needs it
                raise StoreUnavailable(
                    f"the local stack in {state.home} runs (NATS {state.nats_url}) but its projector (pid "
                    f"{projector[0].pid}) did not answer, and the chdb folder is its: it is probably starting; "
                    "reload in a few seconds (`veribus status` shows its processes, `veribus up` restarts "
                    "what died)")
        return await super()._direct(sql, params)

    # ---- the bus ----
    async def bus_status(self) -> dict[str, Any] | None:
        """The stream's message count and each consumer's backlog, or None without a bus."""
        nc = await self.connection()
        if nc is None:
            return None
        try:
            js = nc.jetstream()
            info = await js.stream_info(STREAM)
            consumers = await js.consumers_info(STREAM)
        except Exception:  # noqa: BLE001 - a bus without the stream yet
            return None
        return {
            "messages": int(info.state.messages),
            "consumers": sorted(
                ({"name": c.name, "pending": int(c.num_pending or 0), "in_flight": int(c.num_ack_pending or 0),
                  "redelivered": int(c.num_redelivered or 0)} for c in consumers),
                key=lambda c: c["name"]),
        }
