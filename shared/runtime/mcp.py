"""MCP client side of tool-using agents: connect to MCP servers, list their tools, call them.

A model's `mcp_servers` maps a server name to a target:

- `http://host:port/mcp` or `https://...`: streamable HTTP;
- `stdio:<command line>`: a subprocess spoken to over stdin/stdout (`stdio:python -m pkg.server`);
- anything else is taken as a command line too (as the reference does for non-URL targets).
  `python`/`python3` as the command means this process's interpreter, so a server module that is
  installed next to veribus runs without a PATH set-up. The subprocess gets the `mcp` package's
  minimal environment (HOME, PATH, ...) plus PYTHONPATH/VIRTUAL_ENV, never our API keys.

Connections are pooled per (name, target) for the life of the process (`MCPPool`): spawning a
stdio server or re-handshaking for every answer would cost far more CPU than the answer itself.
Each connection is owned by one background task (the `mcp` SDK's anyio contexts must be entered
and left in the same task); calls from any task share its session. Every wait is bounded:
connecting (`connect_timeout`), each tool call (`call_timeout`), and closing. A server that
cannot be reached raises `MCPConnectionError` naming the server, its target and the cause (with
the tail of a stdio server's stderr); a tool call never raises: failures come back as an error
`ToolOutcome` for the model to read, and a broken connection is re-opened once and retried.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shlex
import sys
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from shared.core.config import Settings

log = logging.getLogger("veribus.mcp")

_timeouts = Settings.from_env("mcp_connect_timeout_s", "mcp_tool_timeout_s")  # one read, just these fields
DEFAULT_CONNECT_TIMEOUT_S = _timeouts.mcp_connect_timeout_s
DEFAULT_CALL_TIMEOUT_S = _timeouts.mcp_tool_timeout_s
CLOSE_TIMEOUT_S = 10.0
MAX_TOOL_PAGES = 100
TOOL_NAME_MAX = 64  # OpenAI function names: ^[a-zA-Z0-9_-]{1,64}$
_NAME_BAD = re.compile(r"[^A-Za-z0-9_-]+")
_PASS_ENV = ("PYTHONPATH", "VIRTUAL_ENV")


class MCPConnectionError(Exception):
    """An MCP server could not be reached (spawned, connected, handshaken or listed)."""

    def __init__(self, server: str, target: str, message: str) -> None:
        self.server = server
        self.target = target
        super().__init__(message)


@dataclass(frozen=True)
class MCPTool:
    """One tool of one server, with the name the model sees (`exposed`)."""

    server: str
    name: str
    exposed: str
    description: str
    input_schema: dict[str, Any]

    def openai_spec(self) -> dict[str, Any]:
        """The tool as an OpenAI-format function spec (what litellm's `tools=` takes)."""
        schema = dict(self.input_schema) if isinstance(self.input_schema, dict) else {}
        if schema.get("type") != "object":
            schema = {"type": "object", "properties": {}}
        schema.setdefault("properties", {})
        return {"type": "function",
                "function": {"name": self.exposed, "description": self.description, "parameters": schema}}


@dataclass
class ToolOutcome:
    """What a tool call gave back: its text for the model, and whether MCP flagged it an error."""

    text: str
    is_error: bool = False


def exposed_tool_name(server: str, tool: str) -> str:
    """`mcp__<server>__<tool>` (the Claude Agent SDK convention), made a valid function name."""
    name = _NAME_BAD.sub("_", f"mcp__{server}__{tool}")
    if len(name) > TOOL_NAME_MAX:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[:TOOL_NAME_MAX - 9]}_{digest}"
    return name


def parse_target(target: str) -> Any:
    """A URL string (streamable HTTP) or `StdioServerParameters` (a command line)."""
    from mcp import StdioServerParameters  # local import: mcp (~1 s); only MCP tools need it

    text = target.strip()
    if text.lower().startswith(("http://", "https://")):
        return text
    if text.lower().startswith("stdio:"):
        text = text[len("stdio:"):].strip()
    argv = shlex.split(text)
    if not argv:
        raise ValueError(f"empty MCP server command in target {target!r}")
    command = argv[0]
    if command in ("python", "python3"):
        command = sys.executable
    env = {k: os.environ[k] for k in _PASS_ENV if os.environ.get(k)}
    return StdioServerParameters(command=command, args=argv[1:], env=env or None)


def display_target(target: str) -> str:
    """The target as it may appear in messages: URL credentials and query strings removed."""
    text = target.strip()
    if text.lower().startswith(("http://", "https://")):
        scheme, _, rest = text.partition("://")
        authority, slash, path = rest.partition("/")
        authority = authority.rpartition("@")[2]
        path = path.split("?", 1)[0].split("#", 1)[0]
        return f"{scheme}://{authority}{slash}{path}"
    return text


def _leaf(exc: BaseException) -> BaseException:
    """The first real cause inside (nested) exception groups (anyio task groups wrap errors)."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)] or list(exc.exceptions)
        exc = inner[0]
    return exc


def _describe(exc: BaseException) -> str:
    leaf = _leaf(exc)
    code = getattr(leaf, "code", None)
    text = str(leaf) or type(leaf).__name__
    if type(leaf).__name__ == "MCPError" and code is not None:
        text = f"MCP error {code}: {getattr(leaf, 'message', text)}"
    return f"{type(leaf).__name__}: {text}"


def _is_connection_failure(exc: BaseException) -> bool:
    """A transport-level failure (the session is unusable), as opposed to a tool/protocol error."""
    leaf = _leaf(exc)
    if type(leaf).__name__ == "MCPError":
        return getattr(leaf, "code", None) == -32000  # CONNECTION_CLOSED
    if isinstance(leaf, anyio.ClosedResourceError | anyio.BrokenResourceError | anyio.EndOfStream
                  | ConnectionError | EOFError):
        return True
    return type(leaf).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2")


def result_text(result: Any) -> str:
    """The text of an MCP CallToolResult: its text blocks, else its structured content as JSON."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(getattr(block, "text", "") or "")
        elif kind == "resource":
            res = getattr(block, "resource", None)
            text = getattr(res, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource {getattr(res, 'uri', '')}]")
        elif kind == "resource_link":
            parts.append(f"[resource link {getattr(block, 'uri', '')}]")
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {getattr(block, 'mime_type', '') or ''}]".replace(" ]", "]"))
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        return json.dumps(structured, ensure_ascii=False, sort_keys=True, default=str)
    return "\n".join(parts)


class _StderrTail:
    """Keeps the last lines a stdio server wrote to stderr (for error messages), bounded."""

    def __init__(self, server: str, max_lines: int = 30) -> None:
        self.server = server
        r, w = os.pipe()
        self.writer = os.fdopen(w, "w")  # handed to the subprocess as its stderr
        self._reader_file = os.fdopen(r, "rb", buffering=0)
        self.lines: deque[str] = deque(maxlen=max_lines)
        self._partial = ""
        self._task: asyncio.Task[None] | None = None
        self._transport: asyncio.ReadTransport | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        self._transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), self._reader_file)
        self._task = asyncio.create_task(self._pump(reader), name=f"mcp-stderr:{self.server}")

    async def _pump(self, reader: asyncio.StreamReader) -> None:
        while True:
            chunk = await reader.read(8192)
            if not chunk:
                return
            lines = (self._partial + chunk.decode("utf-8", errors="replace")).split("\n")
            self._partial = lines.pop()[-2000:]
            for line in lines:
                if line.strip():
                    self.lines.append(line[:500])
                    log.debug("mcp %s stderr: %s", self.server, line[:500])

    def text(self) -> str:
        tail = list(self.lines) + ([self._partial] if self._partial.strip() else [])
        return "\n".join(tail[-10:])

    async def settle(self) -> None:
        """Give the pump a moment to read what a just-exited process wrote."""
        for _ in range(5):
            await asyncio.sleep(0.02)

    async def aclose(self) -> None:
        try:
            self.writer.close()
        except OSError:
            pass
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._transport is not None:
            self._transport.close()
        else:
            self._reader_file.close()


class MCPConnection:
    """One live MCP session, owned by a background task (see module docstring)."""

    def __init__(self, name: str, target: str, *, server_object: Any = None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 call_timeout: float = DEFAULT_CALL_TIMEOUT_S) -> None:
        self.name = name
        self.target = target
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self._server_object = server_object
        self.tools: list[MCPTool] = []
        self.client: Any = None
        self.broken = False
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stderr: _StderrTail | None = None

    @property
    def alive(self) -> bool:
        return self._ready.is_set() and not self.broken and self._task is not None and not self._task.done()

    def _error(self, why: str) -> MCPConnectionError:
        msg = f"MCP server {self.name!r} ({display_target(self.target)}) could not be reached: {why}"
        tail = self._stderr.text() if self._stderr is not None else ""
        if tail:
            msg += f"\nserver stderr (last lines):\n{tail}"
        return MCPConnectionError(self.name, display_target(self.target), msg)

    async def open(self) -> None:
        """Connect, handshake and list tools, within `connect_timeout`; raises MCPConnectionError."""
        try:
            from mcp import Client  # local import: mcp (~1 s); only MCP tools need it
        except ImportError as exc:
            raise self._error(f"the `mcp` Python package is not importable ({exc})") from None
        if self._server_object is not None:
            server: Any = self._server_object
        else:
            try:
                server = parse_target(self.target)
            except ValueError as exc:
                raise self._error(str(exc)) from None
        errlog = None
        if not isinstance(server, str) and self._server_object is None:
            self._stderr = _StderrTail(self.name)
            await self._stderr.start()
            errlog = self._stderr.writer
        self._task = asyncio.create_task(self._run(Client, server, errlog), name=f"mcp:{self.name}")
        ready = asyncio.create_task(self._ready.wait())
        try:
            await asyncio.wait({self._task, ready}, timeout=self.connect_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if self._ready.is_set():
            return
        if self._task.done():
            exc = self._task.exception() or RuntimeError("the connection ended during the handshake")
            if self._stderr is not None:
                await self._stderr.settle()
            err = self._error(_describe(exc))
        else:
            err = self._error(f"no answer within {self.connect_timeout:g} s (connect, handshake and tools/list)")
        await self.aclose()
        raise err

    async def _run(self, client_cls: Any, server: Any, errlog: Any) -> None:
        from mcp.client.stdio import stdio_client  # local import: mcp (~1 s); only MCP tools need it

        if errlog is not None:  # a stdio server whose stderr we keep
            client = client_cls(stdio_client(server, errlog=errlog), read_timeout_seconds=self.call_timeout)
        else:
            client = client_cls(server, read_timeout_seconds=self.call_timeout)
        try:
            async with client:
                self.tools = await self._list_tools(client)
                self.client = client
                self._ready.set()
                await self._stop.wait()
        finally:
            self.broken = True

    async def _list_tools(self, client: Any) -> list[MCPTool]:
        tools: list[MCPTool] = []
        cursor: str | None = None
        for _ in range(MAX_TOOL_PAGES):
            page = await client.list_tools(cursor=cursor) if cursor else await client.list_tools()
            for t in page.tools:
                tools.append(MCPTool(
                    server=self.name, name=t.name, exposed=exposed_tool_name(self.name, t.name),
                    description=(t.description or "").strip(),
                    input_schema=dict(t.input_schema or {}),
                ))
            cursor = page.next_cursor
            if not cursor:
                break
        return tools

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Call `tool`; failures come back as an error outcome (and mark a dead connection broken)."""
        if not self.alive:
            return ToolOutcome(f"Error: MCP server {self.name!r} is not connected", True)
        try:
            async with asyncio.timeout(self.call_timeout + 5.0):
                result = await self.client.call_tool(tool, arguments, read_timeout_seconds=self.call_timeout)
        except TimeoutError:
            return ToolOutcome(f"Error: tool {tool!r} on MCP server {self.name!r} timed out after "
                               f"{self.call_timeout:g} s", True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # MCP protocol errors, transport failures
            if _is_connection_failure(exc):
                self.broken = True
                log.warning("mcp %s: connection lost during %s: %s", self.name, tool, _describe(exc))
            leaf = _leaf(exc)
            if type(leaf).__name__ == "MCPError" and getattr(leaf, "code", None) == -32001:  # REQUEST_TIMEOUT
                return ToolOutcome(f"Error: tool {tool!r} on MCP server {self.name!r} timed out after "
                                   f"{self.call_timeout:g} s", True)
            return ToolOutcome(f"Error calling tool {tool!r} on MCP server {self.name!r}: {_describe(exc)}", True)
        return ToolOutcome(result_text(result), bool(getattr(result, "is_error", False)))

    async def aclose(self) -> None:
        """Leave the session (stops a stdio server) within a bounded time."""
        self._stop.set()
        task = self._task
        if task is not None and not task.done():
            # A session that is up leaves cleanly on `_stop`; one still handshaking is cancelled.
            done: set[Any] = set()
            if self._ready.is_set():
                done, _ = await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S)
            if not done:
                task.cancel()
                await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S)
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            log.debug("mcp %s closed with %s", self.name, _describe(task.exception()))  # type: ignore[arg-type]
        if self._stderr is not None:
            await self._stderr.aclose()
            self._stderr = None


@dataclass
class MCPToolbox:
    """The tools of one agent run: specs for the model, and calls routed to their server."""

    pool: MCPPool
    servers: dict[str, str]
    tools: list[MCPTool]
    _by_exposed: dict[str, MCPTool] = field(default_factory=dict)
    _by_bare: dict[str, list[MCPTool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for t in self.tools:
            self._by_exposed[t.exposed] = t
            self._by_bare.setdefault(t.name, []).append(t)

    @property
    def specs(self) -> list[dict[str, Any]]:
        return [t.openai_spec() for t in self.tools]

    def resolve(self, name: str) -> MCPTool | None:
        """The tool the model means: its exposed name, or a bare tool name unique across servers."""
        tool = self._by_exposed.get(name)
        if tool is None:
            bare = self._by_bare.get(name) or []
            tool = bare[0] if len(bare) == 1 else None
        return tool

    async def call(self, name: str, arguments: dict[str, Any]) -> tuple[MCPTool | None, ToolOutcome]:
        tool = self.resolve(name)
        if tool is None:
            known = ", ".join(sorted(self._by_exposed)) or "none"
            return None, ToolOutcome(f"Error: unknown tool {name!r}; available tools: {known}", True)
        outcome = await self.pool.call(tool.server, self.servers[tool.server], tool.name, arguments)
        return tool, outcome


class MCPPool:
    """Process-wide MCP connections, keyed by (server name, target); see module docstring.

    `server_objects` maps a target string to an in-process MCP server object (an `MCPServer`),
    connected without a transport: embedded tool sets, and tests without subprocesses.
    """

    def __init__(self, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 call_timeout: float = DEFAULT_CALL_TIMEOUT_S,
                 server_objects: Mapping[str, Any] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self.server_objects = dict(server_objects or {})
        self._conns: dict[tuple[str, str], MCPConnection] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._closed = False

    async def connection(self, name: str, target: str, *, fresh: bool = False) -> MCPConnection:
        """A live connection to (name, target), opened (or re-opened) if needed."""
        if self._closed:
            raise RuntimeError("MCPPool is closed")
        key = (name, target)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            conn = self._conns.get(key)
            if conn is not None and conn.alive and not fresh:
                return conn
            if conn is not None:
                self._conns.pop(key, None)
                await conn.aclose()
            conn = MCPConnection(name, target, server_object=self.server_objects.get(target),
                                 connect_timeout=self.connect_timeout, call_timeout=self.call_timeout)
            await conn.open()
            self._conns[key] = conn
            log.info("mcp %s: connected to %s (%d tools)", name, display_target(target), len(conn.tools))
            return conn

    async def toolbox(self, servers: Mapping[str, str]) -> MCPToolbox:
        """Connect every server (in parallel) and gather their tools; raises MCPConnectionError."""
        names = sorted(servers)
        results = await asyncio.gather(*(self.connection(n, servers[n]) for n in names), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                if isinstance(res, MCPConnectionError | asyncio.CancelledError):
                    raise res
                raise MCPConnectionError("", "", f"MCP connection failed: {_describe(res)}") from res
        tools = [t for conn in results for t in conn.tools]  # type: ignore[union-attr]
        return MCPToolbox(self, {n: servers[n] for n in names}, tools)

    async def call(self, name: str, target: str, tool: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Call a tool; a connection found dead is re-opened once and the call retried."""
        conn = self._conns.get((name, target))
        if conn is None or not conn.alive:
            try:
                conn = await self.connection(name, target)
            except MCPConnectionError as exc:
                return ToolOutcome(f"Error: {exc}", True)
        outcome = await conn.call(tool, arguments)
        if conn.broken:
            try:
                conn = await self.connection(name, target, fresh=True)
            except MCPConnectionError as exc:
                return ToolOutcome(f"{outcome.text}\nReconnecting failed: {exc}", True)
            outcome = await conn.call(tool, arguments)
        return outcome

    async def aclose(self) -> None:
        """Close every connection (stdio servers exit); the pool cannot be used afterwards."""
        self._closed = True
        conns = list(self._conns.values())
        self._conns.clear()
        await asyncio.gather(*(c.aclose() for c in conns), return_exceptions=True)


_default_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, MCPPool] = weakref.WeakKeyDictionary()


def default_pool() -> MCPPool:
    """The pool of the running event loop (connections cannot outlive the loop they run on)."""
    loop = asyncio.get_running_loop()
    pool = _default_pools.get(loop)
    if pool is None or pool._closed:
        pool = _default_pools[loop] = MCPPool()
    return pool
