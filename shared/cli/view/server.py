"""The viewer's HTTP server (aiohttp): each handler reads the query string, runs the bounded
queries of `shared.cli.view.queries` and renders `shared.cli.view.pages`.

Only loopback by default. Requests whose Host header is not this server's own address are
refused (a web page elsewhere cannot reach it through DNS rebinding), responses carry a
Content-Security-Policy that allows only this origin's script and styles, and static files
come from a fixed list shipped in the package."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import sys
import webbrowser
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from shared.cli.aio import run_main
from shared.cli.view import markup, pages, queries, sample_page
from shared.cli.view.filters import FilterError, Filters, checked_value
from shared.cli.view.source import StoreUnavailable, ViewSource
from shared.core.config import Settings
from shared.store.engine import FolderHeld
from shared.store.reads import QueryError

STATIC = {"view.css": "text/css", "view.js": "application/javascript"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")

SOURCE: web.AppKey[Any] = web.AppKey("source", Any)
HOSTS: web.AppKey[set[str]] = web.AppKey("hosts", set)
log = logging.getLogger("veribus.view")


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def _int(request: web.Request, name: str, default: int = 0, limit: int = 1_000_000) -> int:
    raw = request.query.get(name, "")
    if not raw:
        return default
    if not raw.isdigit() or int(raw) > limit:
        raise FilterError(f"parameter {name!r}: {raw[:40]!r} is not a whole number between 0 and {limit}")
    return int(raw)


@web.middleware
async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Host check, security headers, and errors rendered as pages that say what is wrong."""
    hosts = request.app[HOSTS]
    if hosts and request.host.lower() not in hosts:
        return web.Response(text=f"refused: Host {request.host!r} is not this viewer's address\n", status=421)
    try:
        resp = await handler(request)
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "text/html":
            resp = _html(markup.error_page(exc.status, exc.text or exc.reason), exc.status)
        else:
            raise
    except FilterError as exc:
        resp = _html(markup.error_page(400, str(exc)), 400)
    except QueryError as exc:
        resp = _html(markup.error_page(502, f"the store refused or failed the query: {exc}"), 502)
    except FolderHeld as exc:  # no projector answered and another process has the folder
        resp = _html(markup.error_page(503, f"cannot read the results: {exc}. If a stack is starting, reload in a "
                                            "few seconds; `veribus status` shows whether one runs from this "
                                            "VERIBUS_HOME and which of its processes are dead (`veribus up` "
                                            "restarts them)"), 503)
    except StoreUnavailable as exc:
        resp = _html(markup.error_page(503, f"cannot read the results: {exc}"), 503)
    except Exception as exc:  # noqa: BLE001 - a page that says what failed, never a bare 500
        log.exception("veribus view: %s %s failed", request.method, request.path_qs)
        resp = _html(markup.error_page(500, f"the viewer failed to answer: {type(exc).__name__}: {exc}. Reload the "
                                            "page; if it keeps failing, restart `veribus view` (its terminal shows "
                                            "the traceback)"), 500)
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "no-referrer"
    resp.headers["Cache-Control"] = "no-store"
    return resp


async def runs_handler(request: web.Request) -> web.Response:
    src = request.app[SOURCE]
    q = request.query.get("q", "").strip()
    Filters.from_query({"q": q})  # length / NUL checks
    data = await queries.runs(src, q, _int(request, "page"))
    bus = await src.bus_status() if hasattr(src, "bus_status") else None
    return _html(pages.runs_page(data, q, bus, getattr(src, "backend", "")))


async def runs_api(request: web.Request) -> web.Response:
    src = request.app[SOURCE]
    data = await queries.runs(src, request.query.get("q", "").strip(), _int(request, "page"))
    out = [{**{k: v for k, v in r.items() if k not in ("rate", "requested_at", "last_event")},
            "requested_at": str(r["requested_at"] or ""), "pass_rate": r["rate"].rate,
            "verdicts": r["rate"].n} for r in data["runs"]]
    return web.json_response({"runs": out, "more": data["more"]})


async def _run_id(src: Any, raw: str) -> str:
    run_id = await queries.resolve(src, raw)
    if run_id is None:
        raise web.HTTPNotFound(text=f"no run with id or name {raw!r} in the store")
    return run_id


async def run_handler(request: web.Request) -> web.Response:
    src = request.app[SOURCE]
    f = Filters.from_query(request.query)
    page_no, hpage = _int(request, "page"), _int(request, "hpage")
    run_id = await _run_id(src, request.match_info["run_id"])
    h = await queries.run_header(src, run_id)
    models = await queries.rates_by(src, run_id, "answering_model", f)
    judges = await queries.rates_by(src, run_id, "parsing_model", f)
    heat = await queries.heatmap(src, run_id, f, hpage)
    err = await queries.errors(src, run_id, f)
    traits = await queries.traits(src, run_id, f)
    lat = await queries.stage_latency(src, run_id)
    tokens = await queries.tokens_by_stage(src, run_id, f)
    samples = await queries.samples(src, run_id, f, page_no)
    cost = await queries.cost(src, run_id, f)
    return _html(pages.run_page(h, f, models=models, judges=judges, heat=heat, err=err, traits=traits, lat=lat,
                                tokens=tokens, samples=samples, page_no=page_no, hpage=hpage, cost=cost))


async def sample_handler(request: web.Request) -> web.Response:
    src = request.app[SOURCE]
    f = Filters.from_query(request.query)
    run_id = await _run_id(src, request.match_info["run_id"])
    result_id = request.match_info["result_id"]
    s = await queries.sample(src, run_id, result_id)
    if s is None:
        raise web.HTTPNotFound(text=f"run {run_id} has no result {result_id!r}")
    s["prev"], s["next"] = await queries.neighbours(src, run_id, result_id, f)
    return _html(sample_page.sample_page(run_id, s, f))


async def compare_handler(request: web.Request) -> web.Response:
    src = request.app[SOURCE]
    # the same length / NUL checks as every filter, naming this parameter (not the filter 'q')
    form = {k: checked_value(k, request.query.get(k, ""), "parameter") for k in ("run", "a", "run_b", "b")}
    f = Filters.from_query({k: v for k, v in request.query.items() if k in ("judge", "keyword", "q")})
    runs = (await queries.runs(src, "", 0, page_size=200))["runs"]
    models: list[str] = []
    problem, result = "", None
    if form["run"]:
        run_a = await queries.resolve(src, form["run"])
        run_b = await queries.resolve(src, form["run_b"]) if form["run_b"] else run_a
        if run_a is None:
            problem = f"run A: no run with id or name {form['run']!r}"
        elif run_b is None:
            problem = f"run B: no run with id or name {form['run_b']!r}"
        else:
            form["run"] = run_a
            form["run_b"] = run_b if form["run_b"] else ""
            models = sorted(set((await queries.run_header(src, run_a))["models"])
                            | (set((await queries.run_header(src, run_b))["models"]) if run_b != run_a else set()))
            one_run = not form["run_b"]
            unknown = await _unknown_model(src, (("A", run_a, form["a"]), ("B", run_b, form["b"])))
            if unknown:
                problem = unknown
            elif one_run and not (form["a"] and form["b"]):
                problem = "two models of one run: choose model A and model B (or choose a second run)"
            elif one_run and form["a"] == form["b"]:
                problem = "model A and model B are the same model of the same run: nothing to compare"
            else:
                result = await queries.compare(src, queries.Side(run_a, form["a"]), queries.Side(run_b, form["b"]), f)
    status = 400 if problem else 200
    return _html(pages.compare_page(form, runs, models, result, problem), status)


async def _unknown_model(src: Any, sides: tuple[tuple[str, str, str], ...]) -> str:
    """The problem with a model A or B its run does not have (named, with the run's answering
    models, as `veribus compare` refuses it), else ""."""
    for label, run_id, model in sides:
        if not model:
            continue
        shown, names = await queries.answering_models(src, run_id)
        if model not in names:
            return (f"model {label} {model!r} is not an answering model of run {run_id}: its answering models are "
                    f"{', '.join(shown) or 'none'}")
    return ""


async def static_handler(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC:
        raise web.HTTPNotFound(text=f"no static file {name!r}")
    body = resources.files("shared.cli.view").joinpath("static", name).read_bytes()
    return web.Response(body=body, content_type=STATIC[name], charset="utf-8")


def build_app(source: Any, allowed_hosts: set[str] | None = None) -> web.Application:
    """The viewer over `source` (a ViewSource, or anything with async `query`). `allowed_hosts`:
    Host header values accepted (lower case, with port); empty accepts any."""
    app = web.Application(middlewares=[guard])
    app[SOURCE] = source
    app[HOSTS] = set(allowed_hosts or ())
    app.router.add_get("/", runs_handler)
    app.router.add_get("/api/runs", runs_api)
    app.router.add_get("/run/{run_id}", run_handler)
    app.router.add_get("/run/{run_id}/sample/{result_id}", sample_handler)
    app.router.add_get("/compare", compare_handler)
    app.router.add_get("/static/{name}", static_handler)

    async def close_source(app: web.Application) -> None:
        close = getattr(app[SOURCE], "close", None)
        if close is not None:
            await close()

    app.on_cleanup.append(close_source)
    return app


def _hosts_for(host: str, port: int) -> set[str]:
    names = {host.lower()}
    try:
        if ipaddress.ip_address(host).is_loopback:
            names |= {"127.0.0.1", "localhost", "[::1]"}
    except ValueError:
        pass
    return {f"{n}:{port}" for n in names}


async def _serve(settings: Settings, host: str, port: int, open_browser: bool,
                 ready: Callable[[str], None] | None = None) -> None:
    source = ViewSource(settings)
    app = build_app(source)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:  # bad input, said in one line (`veribus` exits 2 on a ValueError)
        await runner.cleanup()
        hint = ("another program (a `veribus view`?) listens there; `--port 0` takes any free port"
                if exc.errno == errno.EADDRINUSE else "`--host` must be an address of this machine")
        why = (exc.strerror or str(exc)).rsplit(": ", 1)[-1]  # asyncio repeats the address before the reason
        raise ValueError(f"cannot listen on {host}:{port}: {why}; {hint}") from exc
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    app[HOSTS] |= _hosts_for(host, bound)
    url = f"http://{'localhost' if host in ('127.0.0.1', 'localhost') else host}:{bound}/"
    print(f"veribus view: {url}  (store: {source.backend}; Ctrl+C to stop)", flush=True)
    if ready is not None:
        ready(url)
    if open_browser:
        with contextlib.suppress(Exception):
            webbrowser.open(url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8765, open_browser: bool = False) -> int:
    """Serve until interrupted (`veribus view`). Returns the exit code."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {host}: anyone who reaches this address can read every result",
              file=sys.stderr)
    try:
        run_main(_serve(settings, host, port, open_browser))
    except KeyboardInterrupt:
        pass
    return 0
