"""What the sandbox's parent (`shared.templates.sandbox`) and its workers share: length-prefixed
msgpack frames over the worker's stdin/stdout, the functions a worker may run by short name
(`BUILTINS`, resolved only inside `shared.`), and how a call is named in errors."""

from __future__ import annotations

import importlib
import os
import signal
import struct
from collections.abc import Callable
from typing import Any

_HDR = struct.Struct("<I")
_MB = 1024 * 1024
# a reply frame's most (a template's description or verdict is kilobytes): msgpack's one-byte
# values become eight-byte references and more in the service, so a template writing its own
# frame of nils could otherwise make a service hold ~8x this per call
_MAX_REPLY = 16 * _MB

# Functions a worker may run, by short name: (module:function, what to call it in errors).
BUILTINS: dict[str, tuple[str, str]] = {
    "ping": ("shared.templates.jail:_ping", "code"),
    "exec": ("shared.templates.jail:_exec_snippet", "code"),
    "validate_template": ("shared.templates.calls:worker_validate", "template"),
    "verify_template": ("shared.templates.calls:worker_verify", "template"),
    "callable_trait": ("shared.templates.calls:worker_callable", "callable trait"),
    "regex_trait": ("shared.templates.calls:regex_trait_score", "regex trait"),
}
PRELOAD: tuple[str, ...] = ("shared.templates.calls",)


def _label(fn_name: str) -> str:
    return BUILTINS[fn_name][1] if fn_name in BUILTINS else "code"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _send(fd: int, payload: bytes) -> None:
    data = memoryview(_HDR.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _resolve(fn_name: str, cache: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    fn = cache.get(fn_name)
    if fn is None:
        target = BUILTINS[fn_name][0] if fn_name in BUILTINS else fn_name
        mod_name, sep, attr = target.partition(":")
        if not sep or not mod_name.startswith("shared."):
            raise ValueError(f"unknown sandbox function {fn_name!r}")
        fn = getattr(importlib.import_module(mod_name), attr)
        cache[fn_name] = fn
    return fn
