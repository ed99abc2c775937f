"""A fake Weave trace server: the routes weave 0.54.0's `WeaveClient` uses to write traces.

Weave's wheel ships no trace server to test against, so this follows the client side of the
wire, as installed: the stainless client vendored in weave 0.54.0
(`weave/vendor/weave_server_sdk/resources/`: `v2_calls.py`, `calls.py`, `objects/`, `files.py`,
`services.py`, and the request and response models in `types/`) as driven by
`weave/trace_server_bindings/remote_http_trace_server.py`:

- `POST /v2/{entity}/{project}/calls/complete`: `{"batch": [complete call, ...]}`, each item
  as `types/v2_call_complete_params.Batch` (`project_id`, `id`, `trace_id`, `parent_id`,
  `op_name`, `display_name`, `started_at`, `ended_at`, `attributes`, `inputs`, `output`,
  `summary`, `exception`, ...); answers `{}`. An upsert by id: a call written again replaces
  the stored one (`calls` keeps arrival order, `stored` the latest version per id).
- `POST /calls/stream_query`: the stored calls of `project_id` as NDJSON, one call per line,
  narrowed to `filter.call_ids` and `limit` when given (other query fields are ignored).
- `POST /obj/create` (`{"obj": {...}}`) and `POST /file/create` (multipart: `project_id`,
  `expected_digest`, `file`): answer `{"digest": ...}`, computed the way the server does
  (`weave/trace/serialization/digest.py`, which weave keeps identical on both sides), so refs
  such as an op's `weave:///{entity}/{project}/op/{name}:{digest}` are the real ones.
- `GET /server_info`: the fields of `types/server_info_res.ServerInfoRes`.
- anything else: 404, recorded, so a test sees a route it did not expect.

Every request is recorded (`requests`). `fail_with` makes every route answer that status (after
`fail_after` more requests answered normally), with a JSON body `{"reason": ...}` (one of the
fields weave's `handle_response_error` reads), to test failed sends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from fakes.serving import serve_app

# Weave decides when first imported whether it reports errors to Sentry: never from a test.
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
from weave.trace.serialization.digest import compute_file_digest, compute_object_digest


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeWeaveServer:
    fail_with: int | None = None
    fail_after: int = 0  # requests still answered normally before `fail_with` applies
    requests: list[Recorded] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call written, in order
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)  # latest version by id
    objects: dict[str, str] = field(default_factory=dict)  # object id -> latest digest

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/obj/create", self._obj_create)
        app.router.add_post("/file/create", self._file_create)
        app.router.add_post("/v2/{entity}/{project}/calls/complete", self._calls_complete)
        app.router.add_post("/calls/stream_query", self._stream_query)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        return app

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        async with serve_app(self.app()) as url:
            yield url

    def paths(self) -> list[str]:
        return [f"{r.method} {r.path}" for r in self.requests]

    async def _record(self, request: web.Request) -> Any:
        raw = await request.read()
        body: Any = orjson.loads(raw) if raw else None
        self.requests.append(Recorded(request.method, request.path, dict(request.headers), body))
        return body

    def _failure(self) -> web.Response | None:
        if self.fail_with is None:
            return None
        if self.fail_after > 0:
            self.fail_after -= 1
            return None
        return web.json_response({"reason": "fake failure"}, status=self.fail_with)

    async def _server_info(self, request: web.Request) -> web.Response:
        await self._record(request)
        return self._failure() or web.json_response(
            {"min_required_weave_python_version": "0.0.1", "trace_server_version": "fake"}
        )

    async def _obj_create(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        failure = self._failure()
        if failure is not None:
            return failure
        obj = body["obj"]
        digest = compute_object_digest(obj["val"], obj.get("builtin_object_class"))
        self.objects[obj["object_id"]] = digest
        return web.json_response({"digest": digest})

    async def _file_create(self, request: web.Request) -> web.Response:
        form = await request.post()
        upload = form["file"]
        assert isinstance(upload, web.FileField), "file/create takes the file as multipart"
        content = upload.file.read()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        self.requests.append(
            Recorded(request.method, request.path, dict(request.headers), (fields, content))
        )
        return self._failure() or web.json_response({"digest": compute_file_digest(content)})

    async def _calls_complete(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        failure = self._failure()
        if failure is not None:
            return failure
        for call in body["batch"]:
            self.calls.append(call)
            self.stored[call["id"]] = call
        return web.json_response({})

    async def _stream_query(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        failure = self._failure()
        if failure is not None:
            return failure
        ids = (body.get("filter") or {}).get("call_ids")
        found = [
            call
            for call in self.stored.values()
            if call["project_id"] == body["project_id"] and (ids is None or call["id"] in ids)
        ]
        if body.get("limit") is not None:
            found = found[: body["limit"]]
        return web.Response(
            body=b"".join(orjson.dumps(call) + b"\n" for call in found),
            content_type="application/jsonl",
        )

    async def _unknown(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"reason": f"not faked: {request.path}"}, status=404)
