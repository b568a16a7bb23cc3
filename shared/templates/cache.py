"""Per-process cache of validated templates, keyed by run and template_id: a template is
validated (in the sandbox) once per run in a process, not once per result.

Why per run: a run's validations share that run's sandbox process, where its own templates may
have patched anything (their own business). Shared across runs, a benchmark holding a copy of a
public template and a patch to the judge schema's builder would hand its poisoned schema to
every later run that uses the same template.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from shared.core.ids import template_id_for
from shared.templates.calls import TemplateInfo, validate_template
from shared.templates.sandbox import Sandbox


class TemplateInfoCache:
    """`max_entries` and `max_bytes` (of the entries as JSON, about what they hold in memory):
    a template's description comes from its own sandbox process, which may make it as large as
    a reply frame may be, so the cache is bounded by size as well as by count."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 * 1024 * 1024,
                 sandbox: Sandbox | None = None) -> None:
        self._sandbox = sandbox  # None: the process-wide pool
        self._infos: dict[tuple[str, str], TemplateInfo] = {}
        self._sizes: dict[tuple[str, str], int] = {}
        self._pending: dict[tuple[str, str], asyncio.Future[TemplateInfo]] = {}
        self._max = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0

    async def get(self, template_id: str, code: str, question_id: str | None = None,
                  scope: str | None = None) -> TemplateInfo:
        """The template's TemplateInfo; validated in the sandbox on first use (`scope`: the run id,
        so one run's validations share a sandbox process and no other run's, nor its cache entries)."""
        # by the code itself, not the id a job names: a job could pair one template's id with
        # another's code, and the other's schema would then be served for this one
        key = (scope or "", template_id_for(code))
        info = self._infos.get(key)
        if info is not None:
            return info
        fut = self._pending.get(key)
        if fut is None:
            fut = asyncio.ensure_future(validate_template(code, question_id, scope=scope, sandbox=self._sandbox))
            self._pending[key] = fut
            try:
                info = await fut
            finally:
                self._pending.pop(key, None)
            self._put(key, info)
            return info
        return await fut

    def _put(self, key: tuple[str, str], info: TemplateInfo) -> None:
        size = len(msgspec.json.encode(info))
        if size > self._max_bytes:
            return  # used once, not kept
        while self._infos and (len(self._infos) >= self._max or self._bytes + size > self._max_bytes):
            old = next(iter(self._infos))
            del self._infos[old]
            self._bytes -= self._sizes.pop(old)
        self._infos[key] = info
        self._sizes[key] = size
        self._bytes += size

    async def schema(self, template_id: str, code: str | None, scope: str | None = None) -> dict[str, Any] | None:
        """The template's JSON schema (None when it is invalid); `scope` as for `get` (without
        one, every validation forks a fresh sandbox process: some ms more each)."""
        if not code:
            return None
        info = await self.get(template_id, code, scope=scope)
        return info.json_schema if info.ok else None
