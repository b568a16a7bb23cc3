"""`shared.control.stream_read`'s frame handling, fed the bytes a NATS server sends cut at every
place a socket read may end: the frames of the reader's own subscription reach it whole and in
order, everything else (other subscriptions' messages, PING, +OK, INFO) goes where nats-py's
own parser sends it, and nothing is lost or reordered across the cuts."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from nats.protocol.parser import Parser

from shared.control.stream_read import RawMsg, _Lean

MINE, OTHER = 7, 3


class _Client:
    """The parts of a nats-py client its parser calls."""

    def __init__(self) -> None:
        self._ps = Parser(self)
        self.seen: list[tuple[Any, ...]] = []

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        self.seen.append(("msg", sid, subject, reply, data, headers))

    async def _process_ping(self) -> None:
        self.seen.append(("ping",))

    async def _process_pong(self) -> None:
        self.seen.append(("pong",))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.seen.append(("info", info))

    async def _process_err(self, err: str) -> None:
        self.seen.append(("err", err))


def _hmsg(subject: bytes, sid: int, reply: bytes, headers: bytes, data: bytes) -> bytes:
    head = f"HMSG {subject.decode()} {sid} " + (f"{reply.decode()} " if reply else "")
    return head.encode() + f"{len(headers)} {len(headers) + len(data)}\r\n".encode() + headers + data + b"\r\n"


def _msg(subject: bytes, sid: int, reply: bytes, data: bytes) -> bytes:
    head = f"MSG {subject.decode()} {sid} " + (f"{reply.decode()} " if reply else "")
    return head.encode() + f"{len(data)}\r\n".encode() + data + b"\r\n"


ACK = b"$JS.ACK.VERIBUS.c1.1.%d.%d.1700000000000000000.%d"
HDR = b"NATS/1.0\r\nNats-Msg-Id: x\r\n\r\n"


def _wire() -> tuple[bytes, list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """A server's bytes, the frames the reader must get, and what the client must get."""
    out, mine, other = [], [], []
    for i in range(1, 30):
        subject, reply = f"vb.a.b.r{i}.x{i}".encode(), ACK % (i, i, 30 - i)
        data = (b'{"k":"%d\r\nHMSG fake 7 2 2\r\n"}' % i) * (i % 4)  # data that looks like frames
        if i % 7 == 3:
            out.append(_msg(b"_INBOX.other", OTHER, b"", b"reply %d" % i))
            other.append(("msg", OTHER, b"_INBOX.other", b"", b"reply %d" % i, None))
        if i % 5 == 0:
            out.append(b"PING\r\n")
            other.append(("ping",))
        if i % 9 == 0:
            out.append(b"+OK\r\n")
        if i % 6 == 1:
            out.append(_msg(subject, MINE, reply, data))
            mine.append((subject, reply, data, None))
        else:
            out.append(_hmsg(subject, MINE, reply, HDR, data))
            mine.append((subject, reply, data, HDR))
    status = b"NATS/1.0 404 No Messages\r\n\r\n"
    out.append(_hmsg(b"_INBOX.mine", MINE, b"", status, b""))
    mine.append((b"_INBOX.mine", b"", b"", status))
    out.append(b'INFO {"server_id":"x"}\r\n')
    other.append(("info", {"server_id": "x"}))
    return b"".join(out), mine, other


async def _feed(chunks: list[bytes], installed_after: int = 0) -> tuple[list[Any], list[Any]]:
    client = _Client()
    got: list[tuple[Any, ...]] = []
    lean = _Lean(client, MINE, lambda *frame: got.append(frame))
    for k, chunk in enumerate(chunks):
        if k == installed_after:
            lean.install()
        await client._ps.parse(chunk)
    lean.remove()
    before = [f[2:] for f in client.seen if f[0] == "msg" and f[1] == MINE]  # read before installing
    mine = before + got
    return mine, [f for f in client.seen if not (f[0] == "msg" and f[1] == MINE)]


def test_every_cut_of_the_bytes_gives_the_same_frames_in_order() -> None:
    wire, mine, other = _wire()

    async def every_cut() -> None:
        for cut in range(1, len(wire)):
            got, rest = await _feed([wire[:cut], wire[cut:]])
            assert got == mine, cut
            assert rest == other, cut

    asyncio.run(every_cut())


def test_many_small_reads_and_a_reader_installed_mid_frame() -> None:
    wire, mine, other = _wire()
    rng = random.Random(12)

    async def random_cuts() -> None:
        for _ in range(200):
            cuts = sorted(rng.sample(range(1, len(wire)), 40))
            chunks = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
            # installed after some chunks: the client's parser may be half way through a frame of
            # ours (then it hands that frame to `_process_msg`, which the reader wraps too)
            got, rest = await _feed(chunks, installed_after=rng.randrange(0, 3))
            assert got == mine
            assert rest == other

    asyncio.run(random_cuts())


def test_the_client_gets_its_parser_and_dispatch_back() -> None:
    client = _Client()
    parse, process = client._ps.parse, client._process_msg
    lean = _Lean(client, MINE, lambda *frame: None)
    lean.install()
    assert client._ps.parse != parse and client._process_msg != process
    lean.remove()
    assert client._ps.parse == parse and client._process_msg == process


def test_stream_sequence_and_pending_from_the_reply_subject() -> None:
    meta = RawMsg("vb.a.b.r.x", b"{}", ACK % (41, 40, 9)).metadata
    assert (meta.sequence.stream, meta.sequence.consumer, meta.num_pending) == (41, 40, 9)
