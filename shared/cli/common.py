"""What every `veribus` command module shares: the deployment's settings, a run argument resolved
to its run id, and one line on stderr for an error or a note."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from shared.control.deployment import Deployment, select
from shared.control.runref import RunNotFound, resolve
from shared.control.status import store_lag
from shared.control.wait import projected_rows, wait_projected
from shared.runtime.bus import server_reachable


def deployment() -> Deployment:
    """The deployment this command talks to (flags, environment, local stack)."""
    return select()


def deployment_settings() -> Any:
    """The settings of the deployment this command talks to."""
    return deployment().settings


def err(msg: str | BaseException) -> None:
    """One line on stderr; an exception is said by `error_text` (a pydantic error readably)."""
    print(f"veribus: error: {error_text(msg) if isinstance(msg, BaseException) else msg}", file=sys.stderr)


def error_text(exc: BaseException) -> str:
    """What an exception says to the user: a pydantic ValidationError as `validation_text` (never
    its multi-line dump with type tags, inputs and errors.pydantic.dev links), others as str()."""
    return validation_text(exc) if isinstance(exc, ValidationError) else str(exc)


_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def validation_text(exc: ValidationError, names: Mapping[str, str] | None = None) -> str:
    """A pydantic ValidationError as one line, each error `NAME: what is allowed, got VALUE`.
    NAME: `names[field]` for the top-level field, either the option that sets it (`--replicates`)
    or where it was read (`in run.yaml`, after the field's dotted path); else that path."""
    names = names or {}
    parts: list[str] = []
    for e in exc.errors(include_url=False):
        loc = [str(x) for x in e.get("loc", ())]
        path = ".".join(loc)
        where = names.get(loc[0], "") if loc else ""
        if where.startswith("-"):  # a part of what the option gave, e.g. --model's model_name: said by `what`
            name = where
        else:
            name = f"{path} {where}".strip()
        kind, ctx = e.get("type", ""), e.get("ctx") or {}
        if kind in _BOUNDS and _BOUNDS[kind][1] in ctx:
            bound = ctx[_BOUNDS[kind][1]]
            what = f"must be {_BOUNDS[kind][0]} {f'{bound:g}' if isinstance(bound, float) else bound}"
        elif kind == "extra_forbidden":
            what = f"not a {exc.title} field" if exc.title else "not a known field"
        elif kind == "missing":
            what = "is required"
        else:
            what = str(e.get("msg", "")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
            what = what.replace("Input should be", "must be", 1)
        value = e.get("input")
        if kind not in ("missing", "extra_forbidden", "value_error", "assertion_error") \
                and isinstance(value, str | int | float | bool):
            shown = repr(value) if isinstance(value, str) else str(value)
            what += f", got {shown[:40] + '...' if len(shown) > 40 else shown}"
        parts.append(f"{name}: {what}" if name else what)
    return "; ".join(parts)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def number_arg(kind: type, *, low: float | None = None, high: float | None = None, low_open: bool = False,
               what: str = "") -> Callable[[str], Any]:
    """An argparse `type` for a number in a range: a value out of it is refused while the command
    line is read (exit 2, naming the option and the range), before anything is published."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low:g}{what}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}{what}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


SECONDS = number_arg(float, low=0, low_open=True, what=" seconds")  # a --timeout


def resolve_run_arg(settings: Any, ref: str, *, stream: bool) -> str:
    """A run id or name -> the run id, from the stream (`stream=True`) or the store (the most
    recent run of a name; said when it is ambiguous). Raises RunNotFound, which `main` turns
    into one line and exit 2, when neither knows the run; NotStored (exit 3) when only the
    stream does (the projector has not written it: dead, or behind)."""
    try:
        picked = resolve(settings, ref, stream=stream)
    except RunNotFound:
        in_stream = None if stream else resolve_in_stream(ref)
        if in_stream is None:
            raise
        named = f"run {ref!r}" + (f" ({in_stream})" if in_stream != ref else "")
        raise NotStored(f"{named} is in the event stream but not in ClickHouse yet: "
                        f"{projector_trouble(select())}") from None
    if picked.note:
        say(f"note: {picked.note}")
    return picked.run_id


class NotStored(RuntimeError):
    """The stream holds results (or a run) that ClickHouse does not: the projector is dead or
    behind. One line and exit 3 (results missing), never an empty answer with exit 0."""


PROJECTOR_GRACE_S = 3.0  # how long a live projector is given to write what the stream already holds


def resolve_in_stream(ref: str) -> str | None:
    """The id of the run `ref` names in the event stream, when this command has a bus to ask
    (a configured deployment or the local stack); None otherwise, or when it names none."""
    dep = select()
    if dep.kind not in ("configured", "local") or not server_reachable(dep.settings.nats_url):
        return None
    try:
        return resolve(dep.settings, ref, stream=True).run_id
    except Exception:  # noqa: BLE001 - RunNotFound, or a bus that does not answer: the store's answer stands
        return None


def projector_trouble(dep: Any, pending: int | None = None) -> str:
    """Why ClickHouse lacks what the stream holds, and what to do, for the deployment `dep`."""
    if dep.projector_dead:
        return (f"the local stack's projector is DEAD (`veribus up` restarts it, and it writes what it missed from "
                f"the stream){f'; {pending} event(s) not written' if pending else ''}")
    return ("the projector is behind: it has not written them within "
            f"{PROJECTOR_GRACE_S:g} s" + (f" ({pending} event(s) still to write)" if pending else "")
            + "; ask again shortly, and check that it runs (`veribus status`)")


def unstored(run_id: str) -> str | None:
    """Why ClickHouse has fewer of the run's results than the event stream holds (the projector
    dead or behind), as one line; None when it has them all, or when there is no bus to compare
    with (no deployment: the folder is all there is). A live projector gets PROJECTOR_GRACE_S to
    write what the stream held when asked (a run in progress keeps adding results). When the
    projector has handled every event and rows are still missing, it refused them (malformed
    results): a note is said and None returned, since waiting or restarting changes nothing."""
    dep = select()
    if dep.kind not in ("configured", "local"):
        return None
    lag = store_lag(dep.settings, run_id)
    if lag is None or not lag.streamed:
        return None
    grace = 0.0 if dep.projector_dead else PROJECTOR_GRACE_S
    if wait_projected(dep.settings, run_id, lag.streamed, timeout=grace):
        return None
    stored = projected_rows(dep.settings, run_id)
    short = (f"ClickHouse has {stored} of the {lag.streamed} finalized results of run {run_id} that the event stream "
             f"holds; {lag.streamed - stored} are missing from what is shown")
    if lag.pending == 0:
        # the projector has handled every event: what it did not store it refused (a malformed
        # or forged result.finalized is recorded, not stored); waiting will not change it
        say(f"note: {short}: the projector has handled every event and did not store them (malformed results: "
            f"`veribus status {run_id}` and the projector's log say why)")
        return None
    return f"{short}: {projector_trouble(dep, lag.pending)}"


def stale_store(dep: Any) -> str | None:
    """For reads over every run (`runs`, `query`): why ClickHouse is known to lack events the
    stream holds and will not catch up by itself (the local stack's projector is DEAD with events
    left to write), as one line; None otherwise (a live projector's lag is a moment's)."""
    if not dep.projector_dead:
        return None
    lag = store_lag(dep.settings)
    if lag is None or not lag.pending:
        return None
    return f"ClickHouse lacks what the stream holds: {projector_trouble(dep, lag.pending)}"
