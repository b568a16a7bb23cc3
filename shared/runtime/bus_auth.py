"""Bus access by role: NATS users and subject permissions for the local stack (and the same
roles for docker-compose and a cluster, see the README).

`veribus up` generates, under `<home>/auth/` (0700):
- `nats-auth.conf` (0600): an `authorization { users: [...] }` block for nats-server, one user
  per role with its publish/subscribe permissions;
- `credentials.json` (0600): each role's user and random password.

Roles (what each may publish; every role may subscribe only to its own reply inboxes,
`_INBOX_<role>.>` (`inbox_prefix`), unless stated, and none but the projector, answering a query,
may publish to another's):
- `cli` (the operator's commands): run requests, answer requests, cancellations and the stored
  answers `regrade` re-publishes; queries on
  `veribus.query`; the JetStream API to create the stream when it is missing, read and follow it,
  resume and rebuild (`CLI_JS_API`) through consumers of its own, each named in its request's
  subject (`CLI_CONSUMER_API`), and job contents; never a verdict or a give-up
  (`guards.checked` ... `result.finalized`, `stage.failed`, `dead.letter`), so a forged result or
  dead letter cannot come from it; nor what would make one by another way: change a stream's
  configuration, create another stream, touch a service's durable consumer, write its response
  caches, spending counters or model-limit ledgers;
- one role per service: pull from its own durable consumer(s) and ack them, direct reads of the
  stream (the finalizer's join, run control), its KV buckets, and publish its own output event
  types plus `stage.failed` and `dead.letter`; nothing else;
- `projector`: its own durable consumer, and answering queries on `veribus.query` (on the
  inboxes of `QUERY_ROLES` alone);
- `admin`: everything, for maintenance by hand (and tests that replay service events on purpose);
  no process of the stack uses it.

Processes find their credentials from the file, not from the environment (where template code
could read them): `VERIBUS_NATS_ROLE` names the role (default `cli`), `VERIBUS_NATS_CREDENTIALS`
the file (default `<home>/auth/credentials.json`). Explicit `VERIBUS_NATS_USER`/`_PASSWORD` or
`VERIBUS_NATS_TOKEN` win over the file.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shared.core import events
from shared.core.scrub import is_secret_name

STREAM = events.STREAM
# every KV bucket a stage service uses: run-scoped and shared response caches, run usage and cost
# (budgets), the deployment's model limits (watched: ordered consumers), job contents by hash, and
# its provider key names
CONTENT_BUCKET = "vb_content"
LIMITS_BUCKET = "vb_model_limits"
# the provider key *names* each model-calling service holds (`shared.runtime.service_keys`): written
# by services alone, read by `cli` through the stream info and direct gets it already has
SERVICE_KEYS_BUCKET = "vb_service_keys"
KV_BUCKETS = ("vb_llm_cache", "vb_llm_cache_shared", "vb_run_usage", "vb_run_cost", LIMITS_BUCKET, "vb_content",
              SERVICE_KEYS_BUCKET)


@dataclass(frozen=True)
class Role:
    """One NATS user's permissions."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()
    durables: tuple[str, ...] = field(default=())


# (inputs, outputs) of each stage service: the contract of `services/<name>/app.py`
SERVICE_IO: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    # durable -> input event type
    "generation": ({"generation": events.ANSWER_REQUESTED}, (events.ANSWER_GENERATED,)),
    "guards": ({"guards": events.ANSWER_GENERATED}, (events.GUARDS_CHECKED,)),
    "parsing": ({"parsing": events.GUARDS_CHECKED}, (events.TEMPLATE_PARSED,)),
    "verification": ({"verification": events.TEMPLATE_PARSED}, (events.TEMPLATE_VERIFIED,)),
    "rubric": ({"rubric": events.GUARDS_CHECKED}, (events.RUBRIC_EVALUATED,)),
    "finalization": ({"finalization-template": events.TEMPLATE_VERIFIED,
                      "finalization-rubric": events.RUBRIC_EVALUATED,
                      "finalization-dead": events.DEAD_LETTER}, (events.RESULT_FINALIZED,)),
}
SERVICE_DURABLES = tuple(d for inputs, _ in SERVICE_IO.values() for d in inputs)  # every stage service's
SERVICE_OUTPUTS_ALL = tuple(sorted({o for _, outs in SERVICE_IO.values() for o in outs}
                                   | {events.STAGE_FAILED, events.DEAD_LETTER}))
# answer.generated: `regrade` re-publishes stored answers (no more than a manual trace can say);
# verdict-bearing events (parsed, verified, rubric, finalized) and give-ups only come from services
CLI_EVENTS = (events.RUN_REQUESTED, events.ANSWER_REQUESTED, events.RUN_CANCELLED, events.ANSWER_GENERATED)
QUERY_ROLES = ("cli", "admin")  # who may ask `veribus.query` (the projector replies to their inboxes alone)


# What the CLI may ask of JetStream: read and follow the stream, create it (and the content bucket)
# when missing, its own consumers, empty the response caches. Never change, delete or create
# another stream: a subject transform on the stream (or a republish or source on any stream)
# stored what cli may publish (`vb.run.cancelled...`) as `vb.result.finalized...`, a verdict.
CLI_JS_API = ("$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST", "$JS.API.STREAM.INFO.>",
              f"$JS.API.STREAM.CREATE.{STREAM}", f"$JS.API.STREAM.CREATE.KV_{CONTENT_BUCKET}",
              "$JS.API.STREAM.MSG.GET.>", "$JS.API.DIRECT.GET.>",
              "$JS.API.STREAM.PURGE.KV_vb_llm_cache", "$JS.API.STREAM.PURGE.KV_vb_llm_cache_shared")
# ... and its consumers: on the events stream alone, each named in the request's subject (a create
# with no name there, `$JS.API.CONSUMER.CREATE.VERIBUS`, went past every per-durable deny and the
# server applied its body to the durable it named: `verification` re-pointed at `vb.nothing.*.*`
# stalled every later run). A named create whose body names another consumer is refused by the
# server itself; the services' durables are denied by name (`_durable_control`). No reset (it set
# a service's ack floor past its queued jobs), pause, unpin, leader stepdown or peer removal.
CLI_CONSUMER_API = (f"$JS.API.CONSUMER.CREATE.{STREAM}.*", f"$JS.API.CONSUMER.CREATE.{STREAM}.*.>",
                    f"$JS.API.CONSUMER.INFO.{STREAM}.*", f"$JS.API.CONSUMER.NAMES.{STREAM}",
                    f"$JS.API.CONSUMER.LIST.{STREAM}", f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.*",
                    f"$JS.API.CONSUMER.DELETE.{STREAM}.*", f"$JS.ACK.{STREAM}.>", f"$JS.FC.{STREAM}.>")


def inbox_prefix(role: str) -> str:
    """The reply-inbox prefix of a role's connections: every request's answer (a direct get of the
    stream or a bucket, a PubAck, a pulled message, a query's reply) comes on a subject under it,
    and only that role may subscribe there. With one `_INBOX.>` for all, a `cli` client read every
    service's replies and, publishing there, answered a service's read before the server did."""
    return f"_INBOX_{role}"


# the consumer API requests of nats-server 2.15 that act on one named consumer, besides create, info,
# next and delete
DURABLE_ADMIN_OPS = ("RESET", "PAUSE", "UNPIN", "LEADER.STEPDOWN", "PEER.REMOVE", "PEER.EVACUATE")


def _durable_control(durable: str, delete: bool) -> list[str]:
    """Every JetStream API request on a durable but reading its info, for the deny list of a role
    that is not its service's: (re)create it (a new filter fed the finalizer events of other types),
    pull and ack its messages (took the service's work), reset it (moved its ack floor past queued
    jobs), pause or unpin it, step its leader down or remove its peers; and delete it (`projections
    rebuild` deletes the projector's, which the projector makes again)."""
    out = [f"$JS.API.CONSUMER.CREATE.{STREAM}.{durable}", f"$JS.API.CONSUMER.CREATE.{STREAM}.{durable}.>",
           f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.{durable}", f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{durable}",
           *(f"$JS.API.CONSUMER.{op}.{STREAM}.{durable}" for op in DURABLE_ADMIN_OPS), f"$JS.ACK.{STREAM}.{durable}.>"]
    return out + [f"$JS.API.CONSUMER.DELETE.{STREAM}.{durable}"] if delete else out


def _consumer_api(durable: str) -> list[str]:
    """A service's requests on its own durable: make it or change it to its configuration, pull
    and ack it, and repair it (`bus.settle_consumer`: reset it after a wrong filter passed its
    jobs over, resume it when paused)."""
    return [
        f"$JS.API.CONSUMER.INFO.{STREAM}.{durable}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}.{durable}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}.{durable}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{durable}",
        f"$JS.API.CONSUMER.RESET.{STREAM}.{durable}",
        f"$JS.API.CONSUMER.PAUSE.{STREAM}.{durable}",
        f"$JS.ACK.{STREAM}.{durable}.>",
    ]


def _stream_read_api() -> list[str]:
    out = ["$JS.API.INFO", f"$JS.API.STREAM.INFO.{STREAM}", f"$JS.API.DIRECT.GET.{STREAM}",
           f"$JS.API.DIRECT.GET.{STREAM}.>", f"$JS.API.STREAM.MSG.GET.{STREAM}"]
    for b in KV_BUCKETS:
        out += [f"$JS.API.STREAM.INFO.KV_{b}", f"$JS.API.STREAM.CREATE.KV_{b}", f"$KV.{b}.>",
                f"$JS.API.DIRECT.GET.KV_{b}", f"$JS.API.DIRECT.GET.KV_{b}.>", f"$JS.API.STREAM.MSG.GET.KV_{b}",
                # a watch is an ordered push consumer on the bucket's stream, with flow control
                f"$JS.API.CONSUMER.CREATE.KV_{b}", f"$JS.API.CONSUMER.CREATE.KV_{b}.>",
                f"$JS.API.CONSUMER.DELETE.KV_{b}.>", f"$JS.API.CONSUMER.INFO.KV_{b}.>", f"$JS.FC.KV_{b}.>"]
    return out


def roles() -> dict[str, Role]:
    """Every role of the local stack."""
    out: dict[str, Role] = {}
    for name, (inputs, outputs) in SERVICE_IO.items():
        pub = [events.subscription(t) for t in (*outputs, events.STAGE_FAILED, events.DEAD_LETTER)]
        for durable in inputs:
            pub += _consumer_api(durable)
        # the model-limit ledgers are watched by a core subscription on their KV subjects: without
        # it another process's wait went unseen until a lease renewal (seconds of a starved stage)
        out[name] = Role(publish=tuple(pub + _stream_read_api()), durables=tuple(inputs),
                         subscribe=(f"{inbox_prefix(name)}.>", f"$KV.{LIMITS_BUCKET}.>"))
    b = CONTENT_BUCKET  # the projector copies job contents into ClickHouse: it reads that bucket
    content_read = [f"$JS.API.STREAM.INFO.KV_{b}", f"$JS.API.STREAM.CREATE.KV_{b}", f"$JS.API.DIRECT.GET.KV_{b}",
                    f"$JS.API.DIRECT.GET.KV_{b}.>", f"$JS.API.STREAM.MSG.GET.KV_{b}"]
    # the projector answers queries on the asker's reply inbox, and only there: with NATS's
    # `allow_responses` it could publish to whatever reply subject a request named (the server lets
    # a reply through its deny lists), and a `cli` client's query with `vb.result.finalized.R.X`
    # as its reply had the projector store a result event
    replies = [f"{inbox_prefix(r)}.>" for r in QUERY_ROLES]
    out["projector"] = Role(
        publish=tuple(_consumer_api("projector") + ["$JS.API.INFO", f"$JS.API.STREAM.INFO.{STREAM}", *content_read,
                                                    *replies]),
        subscribe=(f"{inbox_prefix('projector')}.>", events.QUERY_SUBJECT), durables=("projector",),
    )
    out["cli"] = Role(
        publish=(*(events.subscription(t) for t in CLI_EVENTS), events.QUERY_SUBJECT, *CLI_JS_API, *CLI_CONSUMER_API,
                 f"$KV.{CONTENT_BUCKET}.>"),
        subscribe=(f"{inbox_prefix('cli')}.>",),
        deny_publish=tuple(f"vb.{t}.>" for t in SERVICE_OUTPUTS_ALL if t not in CLI_EVENTS)
        + tuple(s for d in (*SERVICE_DURABLES, "projector") for s in _durable_control(d, delete=d != "projector")),
    )
    # maintenance and tests that replay or forge service events on purpose; no process uses it by default
    out["admin"] = Role(publish=(">",), subscribe=(">",))
    return out


def _perm_block(role: Role) -> dict[str, object]:
    perms: dict[str, object] = {"publish": {"allow": list(role.publish)}, "subscribe": {"allow": list(role.subscribe)}}
    if role.deny_publish:
        perms["publish"]["deny"] = list(role.deny_publish)  # type: ignore[index]
    return perms


def auth_block(creds: dict[str, dict[str, str]]) -> str:
    """The nats-server `authorization { users: [...] }` block for `creds` (role -> user/password).
    JSON is valid NATS config syntax, so every value is quoted safely."""
    rs = roles()
    users = [{"user": c["user"], "password": c["password"], "permissions": _perm_block(rs[role])}
             for role, c in creds.items() if role in rs]
    return "authorization " + json.dumps({"users": users}, indent=2) + "\n"


def _write_private(path: Path, text: str) -> None:
    """Write a 0600 file (created with that mode: never readable by others, even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def auth_dir(home: Path) -> Path:
    return Path(home) / "auth"


def credentials_path(home: Path) -> Path:
    return auth_dir(home) / "credentials.json"


def cli_credentials_path(home: Path) -> Path:
    """The `cli` entry alone: what to hand a CLI user (credentials.json holds `admin` and every
    service's password too, and with those no role's limits hold)."""
    return auth_dir(home) / "cli-credentials.json"


def generate(home: Path, keep: bool = False) -> Path:
    """Random credentials for every role and the server config that enforces them; returns the
    config path (for `nats-server -c`). Existing credentials are replaced (a new stack), or with
    `keep` kept, only a role they lack is added: docker-compose runs this on every `up`, and its
    running nats nodes and services must go on matching."""
    d = auth_dir(home)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    old: dict[str, dict[str, str]] = {}
    if keep and credentials_path(home).exists():
        old = json.loads(credentials_path(home).read_text())
    creds = {role: old.get(role) or {"user": f"vb-{role}", "password": secrets.token_urlsafe(24)} for role in roles()}
    _write_private(credentials_path(home), json.dumps(creds, indent=2))
    _write_private(cli_credentials_path(home), json.dumps({"cli": creds["cli"]}, indent=2))
    conf = d / "nats-auth.conf"
    _write_private(conf, auth_block(creds))
    return conf


def load_credentials(path: Path, role: str) -> tuple[str, str] | None:
    """(user, password) of `role` from a credentials file, or None when there is no file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    if role not in data:
        raise KeyError(f"no NATS role {role!r} in {path} (have: {', '.join(sorted(data))})")
    return data[role]["user"], data[role]["password"]


def resolve(settings: object) -> tuple[str | None, str | None, str | None]:
    """(user, password, token) a process connects with: explicit settings first, else its role's
    entry in the credentials file (`VERIBUS_NATS_CREDENTIALS`, default under the home)."""
    user = getattr(settings, "nats_user", None)
    token = getattr(settings, "nats_token", None)
    if user or token:
        return user, getattr(settings, "nats_password", None), token
    found = load_credentials(_credentials_file(settings), _role(settings))
    if found is None:
        return None, None, None
    return found[0], found[1], None


def connected_role(settings: object) -> str | None:
    """The role a process connects as (its reply inboxes are `inbox_prefix(role)`), or None when it
    connects as an explicit user or token, or without credentials (the default `_INBOX`)."""
    if getattr(settings, "nats_user", None) or getattr(settings, "nats_token", None):
        return None
    return _role(settings) if _credentials_file(settings).exists() else None


def _role(settings: object) -> str:
    return getattr(settings, "nats_role", None) or "cli"


def _credentials_file(settings: object) -> Path:
    return Path(getattr(settings, "nats_credentials", None)
                or credentials_path(Path(getattr(settings, "home", ".veribus"))))


NO_MODEL_CALLS = frozenset({"projector", "finalization"})


def service_env(process_name: str, env: dict[str, str]) -> dict[str, str]:
    """The environment of one stack process: its role, and no provider keys for the services
    that never call a model (keys live only where the calls are made); VERIBUS_* settings stay."""
    out = {**env, **role_env(process_name)}
    if out.get("VERIBUS_NATS_ROLE") in NO_MODEL_CALLS:
        out = {k: v for k, v in out.items() if k.startswith("VERIBUS_") or not is_secret_name(k)}
    return out


def role_env(process_name: str) -> dict[str, str]:
    """VERIBUS_NATS_ROLE for a stack process (`parsing-2` is a `parsing` replica); {} for
    processes that do not connect (nats, simulator)."""
    base = process_name.rsplit("-", 1)[0] if process_name.rsplit("-", 1)[-1].isdigit() else process_name
    return {"VERIBUS_NATS_ROLE": base} if base in roles() else {}


def main(argv: list[str] | None = None) -> int:
    """`python -m shared.runtime.bus_auth [--keep] DIR`: generate role credentials and the server
    config in DIR/auth (for docker-compose or a cluster: mount the config into nats-server, the
    credentials file into each service with VERIBUS_NATS_ROLE set); `--keep`: keep what DIR has."""
    args = sys.argv[1:] if argv is None else list(argv)
    keep = "--keep" in args
    args = [a for a in args if a != "--keep"]
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m shared.runtime.bus_auth [--keep] HOME_DIR", file=sys.stderr)
        return 2
    conf = generate(Path(args[0]), keep=keep)
    print(conf)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
