"""Reading a whole JetStream stream fast, for `projections rebuild`: the messages of one pull
consumer taken straight off the connection's bytes.

nats-py turns every message into a `Msg` (its headers parsed into a dict), queues it for the
subscription's task and awaits a callback, after a parser that tries a regex per frame: ~8 us
of Python per message, as much as projecting half an event, and a rebuild reads every event
there is. `StreamReader` keeps the connection nats-py's (auth, TLS, pings, other
subscriptions) and, while it reads, handles on that connection only the `HMSG`/`MSG` frames
itself: their byte offsets from the control line, the frames of its own inbox appended as
(subject, data, reply subject) to the batch, any other frame handed to the client's own
`_process_msg` as its parser would, and anything that is not a message frame (PING, INFO,
-ERR) left to the client's parser: ~2 us a message. Written against nats-py 2.16's parser
state (`Parser.buf`, `state`, `msg_arg`, `needed`, `header_needed`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.msg import Msg
from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, MAX_CONTROL_LINE_SIZE

from shared.core import events


class RawMsg:
    """A stream message as the rebuild reads it: subject and data (all `Projector.project_batch`
    uses) and the JetStream reply subject its stream sequence is read from when needed."""

    __slots__ = ("subject", "data", "reply")

    def __init__(self, subject: str, data: bytes, reply: bytes) -> None:
        self.subject, self.data, self.reply = subject, data, reply

    @property
    def metadata(self) -> Any:
        return Msg.Metadata._from_reply(self.reply.decode())


class _Lean:
    """The frame handling installed on one connection while a `StreamReader` reads (see the
    module's docstring); `take` gets the frames of subscription `sid`."""

    def __init__(self, nc: Any, sid: int, take: Any) -> None:
        self.nc, self.sid, self.take = nc, sid, take
        self.ps = nc._ps
        self.parse_all = self.ps.parse  # the client's parser, for what is not a message frame
        self.process = nc._process_msg

    def install(self) -> None:
        self.ps.parse = self.parse
        self.nc._process_msg = self.process_msg

    def remove(self) -> None:
        for obj, name, fn in ((self.ps, "parse", self.parse), (self.nc, "_process_msg", self.process_msg)):
            if obj.__dict__.get(name) == fn:
                delattr(obj, name)

    async def process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        """A frame the client's parser read (it had started before the reader was installed)."""
        if sid == self.sid:
            self.take(subject, reply, data, headers)
        else:
            await self.process(sid, subject, reply, data, headers)

    async def parse(self, data: bytes = b"") -> None:
        ps = self.ps
        ps.buf.extend(data)
        if ps.state == AWAITING_MSG_PAYLOAD:  # a frame whose control line the client's parser read
            buf = ps.buf
            if len(buf) < ps.needed + 2:
                return
            arg, hl = ps.msg_arg, ps.header_needed
            hdr = bytes(buf[:hl]) if hl > 0 else None
            payload = bytes(buf[hl:ps.needed])
            del buf[:ps.needed + 2]
            ps.header_needed, ps.state = 0, AWAITING_CONTROL_LINE
            await self.process_msg(arg["sid"], arg["subject"], arg["reply"], payload, hdr)
        while True:
            other, rest = self._frames()
            if other is not None:  # a frame of another subscription: the client's way, in order
                await self.process(*other)
            elif rest:
                await self.parse_all()
                return
            else:
                return

    def _frames(self) -> tuple[tuple[Any, ...] | None, bool]:
        """Take the complete message frames of our subscription off the head of the buffer;
        stop at a frame of another one (returned, to be processed), at something that is not a
        message frame (True: the client's parser reads the rest) or at the end of what came."""
        buf = self.ps.buf
        n = len(buf)
        pos = 0
        mine, take = self.sid, self.take
        other: tuple[Any, ...] | None = None
        rest = False
        with memoryview(buf) as mv:
            while pos < n:
                if buf.startswith(b"HMSG ", pos):
                    skip = 5
                elif buf.startswith(b"MSG ", pos):
                    skip = 4
                else:  # another operation, or the first bytes of a frame
                    head = bytes(mv[pos:pos + 5])
                    rest = not (b"HMSG ".startswith(head) or b"MSG ".startswith(head)) or n - pos >= 5
                    break
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    rest = n - pos > MAX_CONTROL_LINE_SIZE  # the client's parser says what is wrong
                    break
                args = bytes(mv[pos + skip:eol]).split()
                if skip == 5 and len(args) in (4, 5):  # HMSG subject sid [reply] header_len total_len
                    hl, tl = int(args[-2]), int(args[-1])
                elif skip == 4 and len(args) in (3, 4):  # MSG subject sid [reply] total_len
                    hl, tl = 0, int(args[-1])
                else:
                    rest = True
                    break
                start = eol + 2
                end = start + tl
                if end + 2 > n:
                    break  # the rest of the frame is still on its way
                subject, sid = args[0], int(args[1])
                reply = args[2] if len(args) == (5 if skip == 5 else 4) else b""
                hdr = bytes(mv[start:start + hl]) if hl else None
                payload = bytes(mv[start + hl:end])
                pos = end + 2
                if sid == mine:
                    take(subject, reply, payload, hdr)
                else:
                    other = (sid, subject, reply, payload, hdr)
                    break
        del buf[:pos]
        return other, rest


class StreamReader:
    """Reads a whole stream through an ephemeral pull consumer, a batch per pull request (see
    the module's docstring for how the messages are taken). (`PullSubscription.fetch` awaits
    each message with its own timeout: slower still.)"""

    def __init__(self, nc: Any, consumer: str, max_bytes: int = 32 * 2**20) -> None:
        self.nc, self.consumer, self.max_bytes = nc, consumer, max_bytes
        self.inbox = nc.new_inbox()
        self.msgs: list[RawMsg] = []
        self.want = 0
        self.ended = asyncio.Event()

    def _take(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        # a status and no data ends the pull request: expired (408), over max_bytes (409),
        # nothing left (404); a message's own headers start "NATS/1.0\r\n"
        if not data and headers and headers[8:9] == b" ":
            self.ended.set()
            return
        self.msgs.append(RawMsg(subject.decode(), data, reply))
        if len(self.msgs) >= self.want:
            self.ended.set()

    async def _on_msg(self, msg: Any) -> None:
        """Where a message of the inbox would go through nats-py (nothing arrives here while
        the lean handling is installed, from before the first request to after the last)."""
        status = b"NATS/1.0 " if msg.headers and msg.headers.get("Status") else None
        self._take(msg.subject.encode(), (msg.reply or "").encode(), msg.data, status)

    async def batches(self, remaining: int, batch: int, end_seq: int | None = None) -> Any:
        """Yield lists of messages until `remaining` (the consumer's pending count) are read, or,
        with `end_seq`, until stream sequence `end_seq` (the messages after it are left out)."""
        sub = await self.nc.subscribe(self.inbox, cb=self._on_msg, pending_msgs_limit=4 * batch,
                                      pending_bytes_limit=4 * self.max_bytes)
        lean = _Lean(self.nc, sub._id, self._take)
        lean.install()
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{events.STREAM}.{self.consumer}"
        try:
            while remaining > 0:
                self.msgs, self.want = [], min(batch, remaining)
                self.ended.clear()
                req = {"batch": self.want, "max_bytes": self.max_bytes, "expires": 5_000_000_000}
                await self.nc.publish(subject, events.to_json(req), reply=self.inbox)
                await self.ended.wait()
                msgs = self.msgs
                if not msgs:
                    continue
                meta = msgs[-1].metadata
                remaining = meta.num_pending
                if end_seq is not None:
                    last = meta.sequence.stream
                    if last > end_seq:
                        msgs = [m for m in msgs if m.metadata.sequence.stream <= end_seq]
                    remaining = min(remaining, max(0, end_seq - last))
                yield msgs
        finally:
            lean.remove()
            await sub.unsubscribe()
