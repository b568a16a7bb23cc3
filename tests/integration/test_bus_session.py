"""`bus.session`, the one connect / close of every command, against a real nats-server: the
stream is there when asked for, and the connection is closed however the block ends."""

from __future__ import annotations

from typing import Any

import pytest

from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus


async def test_session_ensures_the_stream_and_closes(nats_server: Any, tmp_path: Any) -> None:
    settings = Settings(home=tmp_path, nats_url=nats_server.url)
    async with bus.session(settings, ensure=True) as nc:
        info = await nc.jetstream().stream_info(events.STREAM)
        assert info.config.name == events.STREAM and nc.is_connected
    assert nc.is_closed


async def test_session_closes_when_the_block_raises(nats_server: Any, tmp_path: Any) -> None:
    settings = Settings(home=tmp_path, nats_url=nats_server.url)
    with pytest.raises(KeyError, match="boom"):
        async with bus.session(settings) as nc:
            assert nc.is_connected
            raise KeyError("boom")
    assert nc.is_closed
