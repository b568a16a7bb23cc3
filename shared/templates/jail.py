"""The worker side of the template sandbox: what runs inside a jailed worker process.

A worker is started by `shared.templates.sandbox` inside the jail that
`shared.templates.boundary` describes (bubblewrap namespaces, a separate uid, a cleared
environment) as `python -I -c …_worker_main`. It drops to the sandbox uid, makes itself not
dumpable, imports what calls need, loads the zygote's seccomp filter and becomes a *zygote*: it
never runs user code, and forks the processes that do. A call without a scope gets a fresh
process that sets its rlimits (memory, CPU, files, file size, NPROC=0, no core), loads the
per-call seccomp filter (no fork/clone/exec/signals/sockets), runs in an empty scratch folder
and exits; a call with a scope (a run id) goes to that scope's own process. The zygote enforces
the wall time (SIGKILL of the call process), reports how a call process died, and empties the
scratch folder after every one-shot call.

Protocol: length-prefixed msgpack frames over the worker's stdin/stdout (fd 1 is moved to
stderr; a call's prints go to a pipe the zygote drains): `shared.templates.protocol`. The
confinement a worker applies to itself: `shared.templates.confine`; the zygote:
`shared.templates.zygote`.
"""

from __future__ import annotations

import base64
import faulthandler
import gc
import importlib
import json
import os
import sys
import tempfile
from typing import Any

from shared.templates.answer import install_karenina_aliases
from shared.templates.confine import _die_with_parent, _drop_privileges, _load_seccomp, _not_dumpable
from shared.templates.protocol import _send
from shared.templates.zygote import _Zygote


def _ping(**kwargs: Any) -> dict[str, Any]:
    """Round-trip probe (tests, benchmarks): echoes its arguments with the worker's pid."""
    return {"pid": os.getpid(), "echo": kwargs}


def _exec_snippet(code: str) -> Any:
    """Run a code snippet and return its `result` variable (tests and ad-hoc user code)."""
    ns: dict[str, Any] = {"__name__": "veribus_snippet"}
    exec(compile(code, "<snippet>", "exec"), ns)
    return ns.get("result")


def _worker_main() -> None:
    """Entry point of a worker (zygote) process: confine itself, load what calls need, signal
    ready, then fork one child per call until its stdin closes."""
    cfg = json.loads(sys.argv[1])
    in_fd, out_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # input() sees EOF
    os.dup2(2, 1)  # print() goes to stderr, not into the protocol stream
    os.close(devnull)
    if cfg.get("drop_to"):
        _drop_privileges(*cfg["drop_to"])
    _die_with_parent()
    _not_dumpable()
    faulthandler.enable()  # a segfault leaves a traceback on stderr for the error message
    sys.dont_write_bytecode = True
    install_karenina_aliases()
    for mod in cfg["preload"]:
        warm = getattr(importlib.import_module(mod), "warm_up", None)
        if warm is not None:
            try:
                warm()  # our own code, before any user code: the call processes start warm
            except Exception as exc:  # noqa: BLE001 - only a speed-up: serve cold rather than not at all
                print(f"sandbox worker: warm-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    if not cfg.get("scratch"):
        cfg["scratch"] = os.path.realpath(tempfile.mkdtemp(prefix="veribus-sandbox-"))
    if cfg.get("seccomp_zygote"):
        _load_seccomp(base64.b64decode(cfg["seccomp_zygote"]))
    zygote = _Zygote(cfg, out_fd, in_fd)
    reader = os.fdopen(in_fd, "rb", buffering=1 << 16)
    gc.collect()
    gc.freeze()  # the calls' collector never walks (and so never copies) the zygote's pages
    _send(out_fd, zygote.enc.encode({"ready": True, "pid": os.getpid(), "uid": os.getuid()}))
    zygote.serve(reader)
