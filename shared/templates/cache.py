"""Per-process cache of validated templates, keyed by template_id: a template is validated
(in the sandbox) once per process, not once per result.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shared.templates.calls import TemplateInfo, validate_template


class TemplateInfoCache:
    def __init__(self, max_entries: int = 4096) -> None:
        self._infos: dict[str, TemplateInfo] = {}
        self._pending: dict[str, asyncio.Future[TemplateInfo]] = {}
        self._max = max_entries

    async def get(self, template_id: str, code: str, question_id: str | None = None,
                  scope: str | None = None) -> TemplateInfo:
        """The template's TemplateInfo; validated in the sandbox on first use (`scope`: the run id,
        so one run's validations share a sandbox process and no other run's)."""
        info = self._infos.get(template_id)
        if info is not None:
            return info
        fut = self._pending.get(template_id)
        if fut is None:
            fut = asyncio.ensure_future(validate_template(code, question_id, scope=scope))
            self._pending[template_id] = fut
            try:
                info = await fut
            finally:
                self._pending.pop(template_id, None)
            if len(self._infos) >= self._max:
                self._infos.pop(next(iter(self._infos)))
            self._infos[template_id] = info
            return info
        return await fut

    async def schema(self, template_id: str, code: str | None, scope: str | None = None) -> dict[str, Any] | None:
        """The template's JSON schema (None when it is invalid); `scope` as for `get` (without
        one, every validation forks a fresh sandbox process: some ms more each)."""
        if not code:
            return None
        info = await self.get(template_id, code, scope=scope)
        return info.json_schema if info.ok else None
