"""Where the viewer reads from: `shared.store.reads.LiveSource`, which decides where reads go the
way `veribus query` does (a ClickHouse server directly; else the projector over NATS, one
connection kept open; else the chdb folder, let go after a few idle seconds).

It also reads the bus: the JetStream stream and its consumers (pending and in-flight
messages), for the live status strip of the runs page.
"""

from __future__ import annotations

from typing import Any

from shared.core.config import Settings
from shared.core.events import STREAM
from shared.store.reads import LiveSource


class ViewSource(LiveSource):
    """Async read-only queries for the viewer (`shared.store.reads.LiveSource`: where reads go
    is decided there), and the bus's live status."""

    def __init__(self, settings: Settings, timeout: float = 30.0) -> None:
        super().__init__(settings, timeout, name="veribus-view")

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
