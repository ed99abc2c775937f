"""A fast fake vLLM: answers the canned `/v1/completions` requests with pre-serialised bytes.

Run as its own process (`python -m benchlib.upstream --port 0`); it prints
`upstream listening on PORT` when ready and stops on SIGTERM. The request body selects the
answer by exact bytes, so an altered request body is caught here (HTTP 400, counted in
`GET /_bench/stats`) rather than silently answered. A proxy that re-serialises requests
(LiteLLM) is answered by the request's meaning instead (its prompt and stream flag), and
counted apart (`reserialized`). Keeping the upstream this cheap makes the
proxies, not the upstream, the thing being measured.

A request with `X-Bench-Delay-Us` is answered that many microseconds later (a generation time;
for a stream, the time to its first event), and the answer says in `X-Bench-Waited-Us` how
long the upstream really waited.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from benchlib.aio import run
from benchlib.workload import (
    CREATED,
    DELAY_HEADER,
    JSON_TYPE,
    MODEL,
    PATH,
    PROMPT_TOKENS,
    UNRECORDED_PATH,
    WAITED_HEADER,
    Turn,
    build_turns,
)

STATS_PATH = "/_bench/stats"
MODELS_PATH = "/v1/models"
MODELS = orjson.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": CREATED, "owned_by": "vllm", "root": MODEL}
]})  # fmt: skip
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def make_handler(turns: list[Turn], stats: dict[str, int], pace: float = 0.0) -> Handler:
    """One handler for every route: canned answers keyed by the exact request body."""
    table = {turn.request: turn for turn in turns}
    by_meaning = {_meaning(orjson.loads(turn.request)): turn for turn in turns}

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.path == STATS_PATH:
            return web.Response(body=orjson.dumps(stats), headers={"Content-Type": JSON_TYPE})
        if request.method == "GET" and request.path == MODELS_PATH:  # LiteLLM asks at start
            stats["probes"] += 1
            return web.Response(body=MODELS, headers={"Content-Type": JSON_TYPE})
        body = await request.read()
        stats["requests"] += 1
        routed = request.method == "POST" and request.path in (PATH, UNRECORDED_PATH)
        turn = table.get(body) if routed else None
        if turn is None and routed:
            turn = _by_meaning(by_meaning, body)
            stats["reserialized"] += turn is not None
        if turn is None:
            stats["unknown"] += 1
            error = {"error": {"message": "benchmark upstream: unexpected request", "code": 400}}
            return web.Response(
                status=400, body=orjson.dumps(error), headers={"Content-Type": JSON_TYPE}
            )
        headers = {"Content-Type": turn.content_type}
        delay = request.headers.get(DELAY_HEADER)
        if delay is not None:
            headers[WAITED_HEADER] = str(await _wait(delay))
        if len(turn.chunks) == 1:
            return web.Response(body=turn.chunks[0], headers=headers)
        return await _stream(request, turn, pace, headers)

    return handle


def _meaning(request: Any) -> tuple[Any, ...]:
    return (tuple(request.get("prompt") or ()), bool(request.get("stream")))


def _by_meaning(by_meaning: dict[tuple[Any, ...], Turn], body: bytes) -> Turn | None:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return by_meaning.get(_meaning(request)) if isinstance(request, dict) else None


async def _wait(delay: str) -> int:
    """Take the generation time the load generator asked for; how long it took (µs)."""
    start = time.perf_counter()
    await asyncio.sleep(int(delay) / 1e6)
    return round((time.perf_counter() - start) * 1e6)


async def _stream(
    request: web.BaseRequest, turn: Turn, pace: float, headers: dict[str, str]
) -> web.StreamResponse:
    """Send the SSE events as separate writes, as a streaming server does; `pace` seconds
    apart when a token rate is simulated."""
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    for index, chunk in enumerate(turn.chunks):
        if pace and index:
            await asyncio.sleep(pace)
        await response.write(chunk)
    await response.write_eof()
    return response


async def serve(
    port: int, turns: int, seed: int, pace: float = 0.0, sizes: tuple[int, ...] = (PROMPT_TOKENS,)
) -> None:
    """Listen on loopback until SIGTERM/SIGINT; print the bound port once ready."""
    stats = {"requests": 0, "unknown": 0, "reserialized": 0, "probes": 0}
    canned = [
        turn
        for size in sizes
        for stream in (False, True)
        for turn in build_turns(turns, stream, seed, size)
    ]
    server = web.Server(make_handler(canned, stats, pace), access_log=None)
    runner = web.ServerRunner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
    await site.start()
    bound = _bound_port(site)
    print(f"upstream listening on {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def _bound_port(site: web.TCPSite) -> int:
    server: Any = site._server
    return int(server.sockets[0].getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--chunk-interval-ms",
        type=float,
        default=0.0,
        help="pause between the SSE events of a response (a token rate)",
    )
    parser.add_argument(
        "--prompt-tokens",
        default=str(PROMPT_TOKENS),
        help="first-prompt sizes to answer, comma-separated",
    )
    args = parser.parse_args()
    sizes = tuple(int(size) for size in args.prompt_tokens.split(","))
    run(serve(args.port, args.turns, args.seed, args.chunk_interval_ms / 1000, sizes))


if __name__ == "__main__":
    main()
