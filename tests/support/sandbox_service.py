"""A stand-in service process for planted-key tests: it is started with an API key in its
*initial* environment (what /proc/<pid>/environ shows), runs hostile template code through the
sandbox as the verification and rubric services do, and prints what came back as JSON.

Usage: python -m tests.support.sandbox_service ATTACKS.json [--no-audit-hook]
ATTACKS.json: [{"name": ..., "as": "verify" | "class" | "callable", "code": ...}, ...]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import msgspec

from shared.templates.calls import CallableTraitError, run_callable_trait, run_verify, validate_template
from shared.templates.sandbox import Sandbox


async def main(path: str, audit_hook: bool) -> dict[str, str]:
    attacks = json.loads(open(path).read())
    pool = Sandbox(workers=1, timeout_s=10.0, memory_mb=512, audit_hook=audit_hook)
    out: dict[str, str] = {"_mode": pool.jail.mode, "_pid": str(os.getpid())}
    try:
        for a in attacks:
            if a["as"] == "verify":
                res = await run_verify(a["code"], {"result": 4}, "q-attack", sandbox=pool)
                out[a["name"]] = msgspec.json.encode(res).decode()
            elif a["as"] == "class":
                info = await validate_template(a["code"], "q-attack", sandbox=pool)
                out[a["name"]] = msgspec.json.encode(info).decode()
            else:
                try:
                    out[a["name"]] = repr(await run_callable_trait(a["code"], "trace", "boolean", sandbox=pool))
                except CallableTraitError as exc:
                    out[a["name"]] = str(exc)
    finally:
        await pool.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], "--no-audit-hook" not in sys.argv))))
