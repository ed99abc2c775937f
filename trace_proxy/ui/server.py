"""`trace-proxy ui`: the rollout viewer, an aiohttp app over `StoreIndex`, and its start-up.

Pages are rendered on the server by Jinja2 with autoescaping on: every string a record holds
came from a model or a client, so it reaches the page only escaped. The Content-Security-Policy
allows only the viewer's own script and style, so even markup that slipped through could not
run. Requests whose Host is not the address served are refused while it listens on loopback,
so a web page cannot read the store through a rebound DNS name. Each page family attaches its
own routes (`pages/`); this module adds the guard, the static files and the start-up.
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from pathlib import Path

from aiohttp import web

from trace_proxy.config import Settings
from trace_proxy.exporters.leftovers import leftovers, notice
from trace_proxy.logtext import printable
from trace_proxy.proxy.limits import ClientLimits, LimitedAppRunner, Rejections
from trace_proxy.ui import views
from trace_proxy.ui.index import StoreIndex
from trace_proxy.ui.pages import compare, drift, prompt, runs, search, step, trajectory
from trace_proxy.ui.site import Site
from trace_proxy.ui.textindex import SearchUnavailable, TextIndex

STATIC = {  # every file the viewer serves besides its pages: fixed names, no path from a URL
    "viewer.css": "text/css",
    "viewer.js": "text/javascript",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
PAGES = (runs, step, trajectory, compare, prompt, drift, search)  # each attaches its routes

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Viewer(Site):
    """The app: every page family's routes behind one guard, the static files, and the address
    served."""

    def __init__(
        self, index: StoreIndex, piece: views.Piece | None = None, text: TextIndex | None = None
    ) -> None:
        super().__init__(index, piece, text)
        self.allowed_hosts: set[str] | None = None  # set once listening on loopback

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        for family in PAGES:
            family.attach(app, self)
        app.router.add_get("/api/generation", self.generation)
        app.router.add_get("/static/{name}", self.static)
        app.on_cleanup.append(self._close_text)
        return app

    async def _close_text(self, app: web.Application) -> None:
        await asyncio.to_thread(self.text.close)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.allowed_hosts is not None and request.host.lower() not in self.allowed_hosts:
            return web.Response(status=421, text="this viewer answers only on its own address\n")
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="read only\n")
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            exc.headers.update(SECURITY_HEADERS)
            raise
        response.headers.update(SECURITY_HEADERS)
        return response

    async def generation(self, request: web.Request) -> web.Response:
        """The index's generation, which the pages' script asks to tell that the store grew."""
        return web.json_response({"generation": await self.refreshed()})

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        data = resources.files("trace_proxy.ui").joinpath("static").joinpath(name).read_bytes()
        return web.Response(body=data, content_type=STATIC[name])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def start(
    stores: Sequence[str | Path],
    host: str = "127.0.0.1",
    port: int = 8300,
    piece: views.Piece | None = None,
    index_dir: str | Path | None = None,
) -> tuple[web.AppRunner, str, Viewer]:
    """Index the stores and listen; returns the runner (to clean up), the URL and the viewer.
    The search's index is a temporary directory in `index_dir` (else the system's)."""
    index = StoreIndex(stores)
    text = TextIndex(index_dir)
    text.attach(index)
    try:
        await asyncio.to_thread(index.refresh, True)
    except BaseException:
        text.close()
        raise
    viewer = Viewer(index, piece, text)
    limits = ClientLimits.of(Settings())  # the proxy's defaults
    runner = LimitedAppRunner(viewer.app(), limits, Rejections(None, "the viewer"), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()  # the search's index removed with the app
        raise
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    if is_loopback(host):
        names = {host.lower(), "localhost", "127.0.0.1", "[::1]"}
        viewer.allowed_hosts = {f"{name}:{bound}" for name in names}
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound}/", viewer


def index_dir_problem(index_dir: str | None, stores: Sequence[str]) -> str | None:
    """Why the search's index cannot go in `index_dir`: the viewer never writes into a store."""
    if index_dir is None:
        return None
    place = Path(index_dir).resolve()
    if not place.is_dir():
        return f"not a directory: {index_dir}"
    for store in stores:
        if place.is_relative_to(Path(store).resolve()):
            return f"{index_dir} is inside the store {store}, which the viewer only reads"
    return None


def token_pieces(source: str) -> views.Piece:
    """Each token id's text, from a tokenizer (a local directory: nothing is downloaded)."""
    from trace_proxy.text.token2text import decoder_for, load_tokenizer

    decode = decoder_for(load_tokenizer(source), skip_special_tokens=False)
    return lambda token: decode([token])


def run_ui(
    stores: Sequence[str],
    host: str,
    port: int,
    tokenizer: str | None = None,
    index_dir: str | None = None,
) -> int:
    from trace_proxy.text.token2text import TokenizerError

    missing = [s for s in stores if not Path(s).is_dir()]
    if missing:
        print(f"trace-proxy: error: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    problem = index_dir_problem(index_dir, stores)
    if problem:
        print(f"trace-proxy: error: invalid value for --index-dir: {problem}", file=sys.stderr)
        return 2
    try:
        piece = token_pieces(tokenizer) if tokenizer else None
    except TokenizerError as exc:
        print(f"trace-proxy: error: invalid value for --tokenizer: {exc}", file=sys.stderr)
        return 2
    print(f"trace-proxy ui: indexing {', '.join(stores)}...", flush=True)
    left = leftovers([Path(store) for store in stores])
    if left:
        print(printable(notice(left)), file=sys.stderr, flush=True)

    async def serve() -> int:
        try:
            runner, url, _ = await start(stores, host, port, piece, index_dir)
        except OSError as exc:
            print(f"trace-proxy: error: cannot listen on {host}:{port}: {exc.strerror or exc}",
                  file=sys.stderr)  # fmt: skip
            return 1
        except SearchUnavailable as exc:
            print(f"trace-proxy: error: {exc}", file=sys.stderr)
            return 2
        print(f"trace-proxy ui: {url}  (stores: {', '.join(stores)}; Ctrl-C stops)", flush=True)
        if not is_loopback(host):
            print(f"trace-proxy ui: warning: listening on {host}: whoever can reach this port "
                  "can read every record of these stores", file=sys.stderr, flush=True)  # fmt: skip
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await stopping.wait()
        await runner.cleanup()
        return 0

    return asyncio.run(serve())
