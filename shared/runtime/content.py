"""A lean log: a job's question, template, rubric and run options are stored once, by content
hash, in a JetStream KV bucket (`vb_content`); events carry the hashes (`Job.refs`) instead of
repeating them on every stage event, and services keep what they read in an in-process cache.

- `runner.submit` writes the contents, then publishes lean jobs (`lean_jobs`);
- the service harness fills a job back in when it takes an event (`ContentStore.hydrate`), and
  strips it again in the events it publishes (`lean`), so a stage sees the same full `Job` as
  before and only the wire is smaller;
- a field is stripped only when it equals the stored content: a job whose template was changed
  on the way (`regrade`) keeps the new one inline.

The bucket has no age limit by default: the stream's retention (`VERIBUS_STREAM_MAX_AGE_S`) may
drop old events, and what is kept must still hydrate. `VERIBUS_LEAN_EVENTS=false` publishes fat
jobs as before (both kinds are read).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from nats.js.api import KeyValueConfig
from nats.js.errors import APIError, InvalidKeyError, KeyNotFoundError, NotFoundError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from shared.core import events
from shared.core.ids import template_id_for
from shared.core.limits import check_job
from shared.runtime.bus import cluster_not_ready, ensure_kv, retry_cluster

log = logging.getLogger("veribus.content")

BUCKET = "vb_content"
CODE = "s"  # the run's code manifest: a digest of every template and callable trait its jobs bring
QUESTION = "q"  # question text, template, rubric, keywords, expected answer, few-shot examples
OPTIONS = "o"  # the run's stage options
MODELS = "m"  # the answering and parsing model specs
_FIELDS: dict[str, tuple[str, ...]] = {
    QUESTION: ("question_id", "question_text", "template_code", "template_id", "rubric", "keywords", "raw_answer",
               "few_shot_examples"),
    OPTIONS: ("options", "timestamp"),
    MODELS: ("answering", "parsing"),
}
_NO_MODEL = events.NO_MODEL
_EMPTY: dict[str, Any] = {"question_id": "", "question_text": "", "template_code": None, "template_id": "no_template", "rubric": None,
                          "keywords": None, "raw_answer": None, "few_shot_examples": [], "options": {},
                          "timestamp": "", "answering": _NO_MODEL, "parsing": _NO_MODEL}
_NOT_QUESTION = frozenset({OPTIONS, MODELS})
_TYPES: dict[str, Any] = {"answering": events.ModelSpec, "parsing": events.ModelSpec}
_enc = msgspec.json.Encoder(order="sorted")
_KEY = re.compile(r"[-/_=a-zA-Z0-9][-/_=.a-zA-Z0-9]*(?<!\.)")  # nats-py's rule for a KV key (it names a subject)


class ContentMissing(LookupError):
    """A job refers to content the store does not have (deleted, or never written)."""


def _blob(job: events.Job, kind: str) -> dict[str, Any]:
    """One kind of a job's contents, as plain data."""
    return {f: msgspec.to_builtins(getattr(job, f)) for f in _FIELDS[kind]}


def content_key(data: bytes) -> str:
    """`c_` + 96 bits of the content's SHA-256, base64url (a KV key; keys of older runs, 40 hex
    digits, are read the same way)."""
    return _key_of(hashlib.sha256(data).digest())


def _key_of(digest: bytes) -> str:
    return "c_" + base64.urlsafe_b64encode(digest[:12]).decode()


def key_matches(key: str, data: bytes) -> bool:
    """Whether `data` is what `key` names: its hash, in this key form or an earlier one (`c_` +
    40 hex digits; `c_` + 22 base64url characters of the whole digest)."""
    digest = hashlib.sha256(data).digest()
    return key in (_key_of(digest), "c_" + digest.hex()[:40], "c_" + base64.urlsafe_b64encode(digest).decode()[:22])


def codes_of(job: events.Job) -> list[str]:
    """The code a (full) job brings to the sandbox: its template and its callable traits'."""
    out = [job.template_code] if job.template_code else []
    rubric = job.rubric or {}
    for group in ("traits", "dynamic_traits"):
        for trait in rubric.get(group) or ():
            code = trait.get("callable_code") if isinstance(trait, dict) else None
            if isinstance(code, str) and code:
                out.append(code)
    return out


def code_digest(code: str) -> str:
    """128 bits of the code's SHA-256: what a run's code manifest lists."""
    return hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@functools.lru_cache(maxsize=4096)
def _code_ids(code: str) -> tuple[str, str]:
    """(template id, digest) of a piece of code, once per code: every message of a template's jobs
    asks again (a hydrated job's code is the content cache's own string, whose hash Python keeps)."""
    return template_id_for(code), code_digest(code)


def code_manifest(jobs: Iterable[events.Job]) -> tuple[str, bytes]:
    """(key, content) of the manifest of every piece of code the jobs bring (`codes_of`)."""
    data = _enc.encode({"code": sorted({code_digest(c) for job in jobs for c in codes_of(job)})})
    return content_key(data), data


def blobs_of(job: events.Job) -> dict[str, tuple[str, bytes]]:
    """kind -> (key, encoded content) of one (full) job."""
    out = {}
    for kind in _FIELDS:
        data = _enc.encode(_blob(job, kind))
        out[kind] = (content_key(data), data)
    return out


def lean(job: events.Job, known: dict[str, dict[str, Any]]) -> events.Job:
    """The job without the fields that equal its referenced content (`known`: key -> content)."""
    if not job.refs:
        return job
    changes: dict[str, Any] = {}
    for kind, key in job.refs.items():
        content = known.get(key)
        if content is None:
            continue
        for f in _FIELDS.get(kind, ()):
            value = getattr(job, f)
            if value != _EMPTY[f] and msgspec.to_builtins(value) == content.get(f):
                changes[f] = _EMPTY[f]
    return msgspec.structs.replace(job, **changes) if changes else job


def fill(job: events.Job, contents: dict[str, dict[str, Any]], refs: dict[str, str] | None = None) -> events.Job:
    """The job with its empty fields taken from its referenced content (of `refs`: default all)."""
    changes: dict[str, Any] = {}
    for kind, key in (job.refs if refs is None else refs).items():
        content = contents[key]
        for f in _FIELDS.get(kind, ()):
            if getattr(job, f) == _EMPTY[f] and content.get(f) not in (None, _EMPTY[f]):
                t = _TYPES.get(f)
                changes[f] = msgspec.convert(content[f], t) if t is not None else content[f]
    if not changes:
        return job
    filled = msgspec.structs.replace(job, **changes)
    check_job(filled)  # content from the store is held to the same limits as a job on the wire
    return filled


async def _put(kv: Any, key: str, data: bytes) -> None:
    """One content written, retried while the cluster is not ready: a bucket just created on a
    three-node cluster has no stream leader for a moment, and a put then found no responders
    (a run's submit failed in the fresh-clone CI, `test_cluster_stack`'s first run)."""
    try:
        await kv.put(key, data)
    except Exception as exc:  # noqa: BLE001 - filtered: only what a forming cluster says is retried
        if not cluster_not_ready(exc):
            raise
        await retry_cluster(lambda: kv.put(key, data), f"content put {key}")


class ContentStore:
    """Contents by key on JetStream KV, with an in-process LRU cache (contents never change)."""

    def __init__(self, js: Callable[[], Any], *, max_cached: int = 20_000) -> None:
        self._js = js
        self._kv: Any = None
        self._lock = asyncio.Lock()
        self.cache: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.max_cached = max_cached
        self.reads = 0
        self._manifests: dict[str, frozenset[str]] = {}  # code manifest key -> its digests

    async def _bucket(self) -> Any:
        if self._kv is None:
            async with self._lock:
                if self._kv is None:
                    # direct gets: a read is a plain request answered with the raw value, not a
                    # JSON API reply with the value in base64 (about a quarter less CPU per read)
                    cfg = KeyValueConfig(bucket=BUCKET, history=1, direct=True,
                                         description="veribus job contents by hash")
                    self._kv = await ensure_kv(self._js(), cfg)  # replicated like the stream
        return self._kv

    def _remember(self, key: str, content: dict[str, Any]) -> None:
        self.cache[key] = content
        self.cache.move_to_end(key)
        while len(self.cache) > self.max_cached:
            self.cache.popitem(last=False)

    async def put_many(self, items: Iterable[tuple[str, bytes]], window: int = 256) -> int:
        """Write contents (idempotent: same key, same bytes); returns how many were written."""
        kv = await self._bucket()
        todo = list({k: d for k, d in items if k not in self.cache}.items())
        for i in range(0, len(todo), window):  # pipelined: a run of 10,000 questions is one burst
            chunk = todo[i:i + window]
            await asyncio.gather(*(_put(kv, k, d) for k, d in chunk))
            for k, d in chunk:
                self._remember(k, msgspec.json.decode(d))
        return len(todo)

    async def get(self, key: str) -> dict[str, Any]:
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit

        value = await self._read(key)
        if value is None:
            raise ContentMissing(f"job content {key} is not in the content store (bucket {BUCKET}): it was "
                                 "deleted or changed there, or the run was published without it")
        content = msgspec.json.decode(value)
        self._remember(key, content)
        return content

    async def _replica_reply(self, kv: Any, key: str) -> Any:
        """The reply to a direct get of the key (any replica of the bucket answers it)."""
        js = self._js()
        return await js._nc.request(f"{js._prefix}.DIRECT.GET.{kv._stream}.{kv._pre}{key}", b"",
                                    timeout=js._timeout)

    async def _leader_get(self, kv: Any, key: str) -> bytes | None:
        """The value as the stream's leader has it. Any replica answers a direct get, and one that
        has not applied a put yet says "not found": content is written before the jobs that refer
        to it, so a miss is asked again where the write was acknowledged (misses are rare)."""
        try:
            msg = await self._js().get_msg(kv._stream, subject=kv._pre + key)
        except NotFoundError:
            return None
        if msg.headers and msg.headers.get(KV_OP) in (KV_DEL, KV_PURGE):
            return None
        return msg.data

    async def get_raw(self, key: str) -> bytes | None:
        """A content's stored bytes, uncached, or None when the bucket does not have it (the
        projector copies each content into ClickHouse once: `shared.store.projection`)."""
        value = await self._read(key)
        return None if value is None else bytes(value)

    async def _read(self, key: str) -> bytes | None:
        """A content's value from the bucket (asking the leader on a direct-get miss), or None;
        None too for a value that is not what its key names (the key is its hash): anyone who
        may write the bucket (the `cli` role submits contents) could otherwise put another
        template or question under a key another run's jobs refer to."""
        kv = await self._bucket()
        self.reads += 1
        if getattr(kv, "_direct", False):
            value = await self._direct_get(kv, key)
        else:
            try:
                value = (await kv.get(key)).value
            except KeyNotFoundError:
                return None
        if value is not None and not key_matches(key, bytes(value)):
            log.error("job content %s in bucket %s is not the content its key names (changed in the bucket); "
                      "treated as missing", key[:80], BUCKET)
            return None
        return value

    async def _direct_get(self, kv: Any, key: str) -> bytes | None:
        """The value by a direct get of the key's subject, read off the reply as it is: nats-py's
        `kv.get` also parses every header and the time stamp into two objects around the same
        bytes, a third of the read's CPU (profiled, issue 12; every stage reads a question)."""
        if not _KEY.fullmatch(key):  # a key from an event: it must not become another subject
            raise InvalidKeyError(key)
        msg = await self._replica_reply(kv, key)
        headers = msg.headers or {}
        status = headers.get("Status")
        if status == "404" or headers.get(KV_OP) in (KV_DEL, KV_PURGE):
            return await self._leader_get(kv, key)  # not (yet) on the replica that answered
        if status and not msg.data:
            raise APIError.from_msg(msg)
        return msg.data

    async def hydrate(self, job: events.Job, kinds: frozenset[str] | None = None) -> events.Job:
        """The job with its contents filled in: all of them, or only those of `kinds`."""
        if not job.refs:
            return job
        refs = job.refs if kinds is None else {k: v for k, v in job.refs.items() if k in kinds}
        return fill(job, {key: await self.get(key) for key in refs.values()}, refs)

    async def hydrate_payload(self, payload: Any, needs_question: Callable[[events.Job], bool] | None = None) -> Any:
        """Fill in the job(s) of a StageEvent or AnswerRequested (in place); other payloads pass.

        A StageEvent's stage log is emptied: each event carries the records of the stage that
        published it, not those of every stage before (they are on the earlier events, and no
        stage reads them), so the log is not repeated down the pipeline.

        `needs_question(job)`: asked of a StageEvent's job with its options and models filled in;
        False leaves the question's content (text, template, rubric) out, unread: a stage that
        does not use it (guards with no judge check enabled) then costs no read, and the job it
        publishes still refers to that content."""
        if isinstance(payload, events.StageEvent):
            if needs_question is not None and QUESTION in payload.job.refs:
                job = await self.hydrate(payload.job, _NOT_QUESTION)
                payload.job = await self.hydrate(job) if needs_question(job) else job
            else:
                payload.job = await self.hydrate(payload.job)
            payload.state.stages = []
        elif isinstance(payload, events.AnswerRequested):
            payload.jobs = [await self.hydrate(j) for j in payload.jobs]
        return payload

    async def sandbox_scope(self, payload: Any) -> str | None:
        """The sandbox scope a (hydrated) StageEvent's job may use (`shared.core.stage.SANDBOX_SCOPE`):
        its run's, named by the run's code manifest (`refs[CODE]`, stored when the run was submitted,
        by hash: no client can change it), when every piece of code the job brings is listed there
        and its template id is its template's; else None, a fresh process. So a job another client
        published under the run's id (`cli` may publish answer requests and stored answers) runs its
        code apart from the run's, and a class body's patch reaches only the jobs of its own code."""
        if not isinstance(payload, events.StageEvent):
            return None
        job = payload.job
        key = job.refs.get(CODE)
        if not key or not job.run_id:
            return None
        if job.template_code and job.template_id not in (_code_ids(job.template_code)[0], "no_template"):
            return None  # a template under another's id would be cached as that one
        codes = codes_of(job)
        if codes:
            listed = self._manifests.get(key)
            if listed is None:
                listed = frozenset((await self.get(key)).get("code") or ())
                self._manifests[key] = listed
                while len(self._manifests) > 256:
                    self._manifests.pop(next(iter(self._manifests)))
            if any(_code_ids(c)[1] not in listed for c in codes):
                log.warning("a job of run %s brings code its run did not announce: it runs in a fresh sandbox "
                            "process, apart from the run's", job.run_id)
                return None
        return f"{job.run_id}.{key}"

    def lean_payload(self, payload: Any) -> Any:
        """A copy of a StageEvent whose job is lean (for publishing), with its stage log compact
        (`events.lean_state`); other payloads pass. The job's run and result ids are left out
        too: the envelope names them (`events.payload_as` puts them back)."""
        if not isinstance(payload, events.StageEvent):
            return payload
        job = payload.job
        if job.refs:
            job = msgspec.structs.replace(lean(job, self.cache), run_id="", result_id="")
        return msgspec.structs.replace(payload, job=job, state=events.lean_state(payload.state))


async def put_manifest(store: ContentStore, jobs: Iterable[events.Job]) -> str:
    """Store the code manifest of a run's jobs (`code_manifest`); returns its key (`refs[CODE]`)."""
    key, data = code_manifest(jobs)
    await store.put_many([(key, data)])
    return key


def with_manifest(job: events.Job, manifest: str) -> events.Job:
    return msgspec.structs.replace(job, refs={**job.refs, CODE: manifest})


async def lean_requests(store: ContentStore, requests: list[events.AnswerRequested],
                        manifest: str | None = None) -> list[events.AnswerRequested]:
    """Store every job's contents once and return the requests with lean jobs (what `submit`
    sends), each referring to the run's code manifest (`manifest`, the key `put_manifest` gave)."""
    items: dict[str, bytes] = {}
    out = []
    for req in requests:
        jobs = []
        for job in req.jobs:
            refs = {CODE: manifest} if manifest else {}
            for kind, (key, data) in blobs_of(job).items():
                items[key] = data
                refs[kind] = key
            jobs.append(msgspec.structs.replace(job, refs=refs))
        out.append(events.AnswerRequested(jobs=jobs))
    await store.put_many(items.items())
    # the envelope names the run and the answer (`events.payload_as` puts them back)
    return [events.AnswerRequested(jobs=[msgspec.structs.replace(lean(j, store.cache), run_id="", answer_id="")
                                         for j in r.jobs]) for r in out]
