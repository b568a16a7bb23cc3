"""Which deployment a command talks to, decided once, said out loud, and checked fast.

- configured: `--nats-url` or `VERIBUS_NATS_URL` (auth and TLS from `VERIBUS_NATS_USER` /
  `_PASSWORD` / `_TOKEN` / `_TLS_CA`), and `VERIBUS_CLICKHOUSE_URL` for the results. A configured
  deployment always wins: the CLI never starts a local stack beside it.
- local: the stack `veribus up` started from `VERIBUS_HOME` (its `stack.json`, NATS alive).
- degraded: the stack of `VERIBUS_HOME` has lost its bus (every NATS node dead) while some of it
  still runs. No command treats that as "no stack" (its projector may hold the chdb folder, and
  `veribus run` must never replace it with a temporary one): each says so and stops (exit 3),
  naming `veribus up` and `veribus down`.
- none: nothing configured and nothing running locally. Only then does `veribus run` start a
  temporary local stack; read commands open the embedded ClickHouse folder directly.

`check_bus` connects once, without reconnecting, within a few seconds, and raises
`Unreachable` with one line naming the URL, where it came from, and why (`with_adverts`: on a
configured deployment it also reads which provider keys its services hold, `Deployment.adverts`,
on the same connection). A clustered server that answers is given a while longer for its JetStream (a node just lost: the leader election).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from shared.control import stack
from shared.core.config import Settings
from shared.runtime import bus, bus_auth, service_keys

log = logging.getLogger("veribus.deployment")

FLAG_ENV = "VERIBUS_NATS_URL_FROM_FLAG"  # set by the CLI when --nats-url gave the URL
CHECK_TIMEOUT_S = 4.0  # the connect
JETSTREAM_READY_S = 20.0  # a clustered server electing a JetStream leader


class Unreachable(RuntimeError):
    """The deployment's bus (or store) cannot be reached; the message is one line."""


def mask_url(url: str) -> str:
    """The URL with any password replaced by ***, for printing."""
    return re.sub(r"(://[^:/@\s]+:)[^@/\s]+@", r"\1***@", url)


@dataclass
class Deployment:
    kind: str  # configured | local | degraded | none
    settings: Settings
    source: str = ""  # --nats-url, VERIBUS_NATS_URL, the local stack's home
    simulator_url: str | None = None
    dead: list[str] = field(default_factory=list)  # a local stack's processes that are not running
    problem: str = ""  # degraded: what is dead and what runs
    # a local stack whose projector is not running (none of its replicas): nothing writes the
    # stream's events to ClickHouse, and reads open the folder as the projector last wrote it
    projector_dead: bool = False
    state: stack.StackState | None = None  # local: the stack found in the home
    # configured: each live model-calling replica's provider key names, read from the bus by
    # `check_bus` or the first `calls_adverts` (None: no service of this version has said them)
    adverts: list[service_keys.Advert] | None = None
    adverts_read: bool = False

    def calls_environ(self) -> dict[str, str] | None:
        """The environment the model calls are made in, where it can be read: a running local
        stack's services' (what `up` gave them). None: this process's own (a temporary stack is
        started from it), or a configured deployment's, whose services say only their key names
        (`calls_adverts`)."""
        return stack.services_environ(self.state) if self.state else None

    def calls_adverts(self) -> list[service_keys.Advert] | None:
        """A configured deployment's replicas' key names (`service_keys`), where the calls are
        made; None elsewhere, and where none of its services has said them (then this process's
        environment is all there is to check)."""
        if not self.configured:
            return None
        if not self.adverts_read:
            asyncio.run(_read_adverts(self))
        return self.adverts

    def describe_services(self) -> list[str]:
        """A configured deployment's model-calling replicas as they said themselves on the bus
        (`service_keys`), with the key variables each holds: lines for `veribus status`."""
        adverts = self.calls_adverts()
        if adverts is None:
            return ["services: none of this deployment's services has said which ones run (none of this version "
                    "has started, or the bus refused the read)"]
        if not adverts:
            return [f"services: no model-calling service has said it runs in the last {service_keys.TTL_S:.0f} s"]
        counts = Counter(a.service for a in adverts)
        out = ["model-calling services (each replica says so every "
               f"{service_keys.REFRESH_S:.0f} s): " + ", ".join(f"{s} x{n}" for s, n in counts.items())]
        out += [f"  {a.service:<13} {a.producer:<40} keys: {', '.join(a.keys) or 'none'}"
                for a in sorted(adverts, key=lambda a: (a.service, a.producer))]
        return out

    def degraded_error(self) -> str:
        return (f"the local stack in {self.source} is degraded ({self.problem}): run `veribus up` to restart what "
                "died (or `veribus down` to stop the rest); `veribus status` shows each process")

    @property
    def configured(self) -> bool:
        return self.kind == "configured"

    def describe(self) -> str:
        """One line: bus, where it came from, and where results are read."""
        s = self.settings
        if s.clickhouse_url:
            store = f"ClickHouse server {mask_url(s.clickhouse_url)} (VERIBUS_CLICKHOUSE_URL)"
        elif self.projector_dead:
            store = (f"embedded ClickHouse folder {s.chdb_path} (opened directly: the stack's projector is DEAD, "
                     "so events it has not written are missing; `veribus up` restarts it)")
        elif self.kind in ("configured", "local"):
            store = "embedded ClickHouse (via the projector)"
        else:
            store = f"embedded ClickHouse folder {s.chdb_path} (opened directly)"
        auth = ""
        if s.nats_user:
            auth = f", user {s.nats_user}"
        elif s.nats_token:
            auth = ", token auth"
        if s.nats_tls_ca:
            auth += ", TLS"
        if self.kind == "configured":
            return f"deployment: NATS {mask_url(s.nats_url)} (from {self.source}{auth}); results: {store}"
        if self.kind == "local":
            dead = f"; DEAD: {', '.join(self.dead)} (`veribus up` restarts them)" if self.dead else ""
            return f"deployment: local stack in {self.source} (NATS {s.nats_url}{auth}{dead}); results: {store}"
        if self.kind == "degraded":
            return f"deployment: the local stack in {self.source}, degraded ({self.problem})"
        return f"deployment: none configured and no local stack running; results: {store}"


def select(settings: Settings | None = None) -> Deployment:
    """The deployment this process talks to (see the module docstring)."""
    settings = settings or Settings.from_env()
    if Settings.given("nats_url"):  # the environment names a bus (not the default)
        given = Settings.from_env("nats_url", "nats_url_from_flag")
        source = "--nats-url" if given.nats_url_from_flag == given.nats_url else "VERIBUS_NATS_URL"
        return Deployment("configured", settings, source, settings.simulator_url)
    state = stack.running_stack(settings)
    if state is not None:
        settings.nats_url = state.nats_url
        settings.simulator_url = settings.simulator_url or state.simulator_url
        dead = [p.name for p in state.dead()]
        projector = [p.name for p in state.replicas_of("projector")]
        return Deployment("local", settings, str(state.home), settings.simulator_url, dead=dead,
                          projector_dead=bool(projector) and set(projector) <= set(dead), state=state)
    degraded = stack.degraded_stack(settings)
    if degraded is not None:
        state, problem = degraded
        settings.nats_url = state.nats_url
        return Deployment("degraded", settings, str(state.home), settings.simulator_url,
                          dead=[p.name for p in state.dead()], problem=problem)
    return Deployment("none", settings, "", settings.simulator_url)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    low = text.lower()
    if "authorization" in low or "authentication" in low:
        return "the server refused the credentials (set VERIBUS_NATS_USER/_PASSWORD or VERIBUS_NATS_TOKEN)"
    if "refused" in low or isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if "ssl" in low or "tls" in low or "certificate" in low:
        return f"TLS failed: {text.splitlines()[0][:200]}"
    if isinstance(exc, TimeoutError) or "timeout" in low or "timed out" in low:
        return f"no answer within {CHECK_TIMEOUT_S:.0f} s"
    if "no servers" in low:
        return "connection refused or host unreachable"
    return text.splitlines()[0][:200]


async def _check(settings: Settings, dep: Deployment | None = None) -> None:
    """The probe; with `dep`, a configured deployment's services' key names are read on the same
    connection (`veribus run`, which checks its models' keys against them)."""
    # the connect gets one short try (reasons in `_reason`); a clustered server then gets up to
    # JETSTREAM_READY_S for JetStream to answer, since a node that just lost a peer (or the meta
    # leader) says "unavailable" until the election is over: that is not an unreachable bus
    async with bus.session(settings, name="veribus-cli-check", connect_timeout=min(2.0, CHECK_TIMEOUT_S),
                           within=CHECK_TIMEOUT_S, **bus.ONE_TRY) as nc:
        clustered = bus.clustered(nc)
        js = nc.jetstream(timeout=2.0)
        try:
            if clustered:
                await bus.retry_cluster(js.account_info, "JetStream probe", JETSTREAM_READY_S)
            else:
                await js.account_info()
        except Exception as exc:  # noqa: BLE001 - one line below
            role = bus_auth.connected_role(settings)
            if role is not None and bus.refused_inbox() is not None:
                raise Unreachable(
                    f"the NATS server at {mask_url(settings.nats_url)} refused the reply inboxes of bus role "
                    f"{role!r} ({bus_auth.inbox_prefix(role)}.>), so it answers nothing this process asks: its "
                    "permissions predate per-role reply inboxes; run it with the nats-auth.conf this version "
                    "writes (`veribus down` and `veribus up`; docker-compose: `up` runs bus-auth again, then "
                    "restart the nats nodes)") from None
            waited = f" within {JETSTREAM_READY_S:.0f} s" if clustered else ""
            raise Unreachable(f"the NATS server at {mask_url(settings.nats_url)} answers but its JetStream "
                              f"did not{waited} ({type(exc).__name__}: {exc}); start it with -js, or "
                              "check that the cluster has a majority of its nodes up") from None
        if dep is not None and dep.configured:
            await _read_adverts(dep, js)


async def _read_adverts(dep: Deployment, js: Any = None) -> None:
    """Fill `dep.adverts` once, on `js` when given, else on a connection of its own. A read that
    fails leaves None: this process's environment is then checked, as before."""
    dep.adverts_read = True
    try:
        if js is not None:
            dep.adverts = await service_keys.read_adverts(js)
            return
        async with bus.session(dep.settings, name="veribus-cli-keys", connect_timeout=min(2.0, CHECK_TIMEOUT_S),
                               within=CHECK_TIMEOUT_S, **bus.ONE_TRY) as nc:
            dep.adverts = await service_keys.read_adverts(nc.jetstream(timeout=2.0))
    except Exception as exc:  # noqa: BLE001 - the command that needs the bus says it cannot reach it
        log.warning("could not read the services' provider key names (%s: %s): checking this environment",
                    type(exc).__name__, exc)


def _tcp_reason(url: str) -> str | None:
    """Why nothing accepts TCP connections at a NATS URL (None when something does)."""
    for one in url.split(","):
        parsed = urlparse(one.strip())
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return None
        except ConnectionRefusedError:
            reason = "connection refused"
        except TimeoutError:
            reason = "no answer within 2 s"
        except OSError as exc:
            reason = str(exc) or type(exc).__name__
    return reason


def check_bus(dep: Deployment, with_adverts: bool = False) -> None:
    """Connect once (no reconnect loop) within a few seconds; raise Unreachable naming the URL,
    where it came from and why. The NATS handshake runs in a daemon thread, so a client that
    does not give up cannot hold the command past the deadline."""
    if dep.kind == "degraded":
        raise Unreachable(dep.degraded_error())
    where = f" (from {dep.source})" if dep.source else ""
    url = mask_url(dep.settings.nats_url)
    tcp = _tcp_reason(dep.settings.nats_url)
    if tcp is not None:
        raise Unreachable(f"cannot reach the NATS server at {url}{where}: {tcp}")
    box: dict[str, BaseException | None] = {}

    def target() -> None:
        try:
            asyncio.run(_check(dep.settings, dep if with_adverts else None))
            box["error"] = None
        except BaseException as exc:  # noqa: BLE001 - reported below as one line
            box["error"] = exc

    t = threading.Thread(target=target, name="veribus-bus-check", daemon=True)
    t.start()
    t.join(CHECK_TIMEOUT_S + JETSTREAM_READY_S + 3.0)
    if "error" not in box:
        raise Unreachable(f"cannot reach the NATS server at {url}{where}: no answer within "
                          f"{CHECK_TIMEOUT_S + JETSTREAM_READY_S:.0f} s")
    exc = box["error"]
    if exc is None:
        return
    if isinstance(exc, Unreachable):
        raise exc
    raise Unreachable(f"cannot reach the NATS server at {url}{where}: {_reason(exc)}") from None
