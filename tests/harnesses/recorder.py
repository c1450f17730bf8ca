"""A recording reverse proxy between a real harness and a live router.

The harness talks to the proxy as it would to modelyard; the proxy relays every
request to the router unchanged and every response byte back as it arrives (SSE
events are not held back: a client's first-byte timeout sees what it would see
without the proxy), and writes each exchange to ``out_dir`` as one JSON file
(``NNN-METHOD-path.json``: the request's method, path, headers, body; the
response's status, headers, body text; ``consumed``: the whole upstream answer was
handed to the harness before the connection ended — or the harness left right after
it was handed the stream's own end event (:func:`ends_answer`: ``[DONE]``,
``message_stop``, ``response.completed|incomplete|failed``, Ollama's ``"done": true``),
before the proxy had read the body's closing chunk: a client may close once it has
the whole answer, and Codex does). Authorization-like headers are
masked. The files are the suite's artifacts: what a harness sends, kept per run,
never committed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length",
        "proxy-connection", "accept-encoding"}
_SECRET = {"authorization", "x-api-key", "api-key", "cookie"}


_END_EVENTS = (b"data: [DONE]", b'"type":"message_stop"', b'"type":"response.completed"',
               b'"type":"response.incomplete"', b'"type":"response.failed"', b'"done":true')


def ends_answer(tail: bytes) -> bool:
    """True if ``tail`` (the last bytes handed to the harness) ends with a stream's own end
    event: the last non-empty line (SSE ``data:`` or NDJSON) is one of :data:`_END_EVENTS`
    (spaces ignored). A stream cut before it (a client that gave up) is never taken for one."""
    lines = [ln for ln in tail.replace(b" ", b"").splitlines() if ln.strip()]
    if not lines:
        return False
    last = lines[-1]
    if last.startswith(b"event:") and len(lines) > 1:  # a closing event line split from its data
        last = lines[-2]
    return any(e.replace(b" ", b"") in last for e in _END_EVENTS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _masked(headers: Any) -> dict[str, str]:
    return {k: ("<masked>" if k.lower() in _SECRET else v) for k, v in headers.items()}


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw.decode("utf-8", "replace")


class Recorder:
    """``Recorder(upstream, out_dir)``: a proxy on ``self.url`` (127.0.0.1, a free port)
    relaying to ``upstream`` (``http://127.0.0.1:PORT``). ``exchanges()``: the records
    written so far, in order. ``close()`` stops it."""

    def __init__(self, upstream: str, out_dir: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._n = 0
        self._lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        app = Starlette(routes=[Route("/{path:path}", self._relay,
                                      methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="off", timeout_keep_alive=75))
        self._thread = threading.Thread(target=self._server.run, name="harness-recorder", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def exchanges(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.records)

    def _save(self, rec: dict[str, Any]) -> None:
        with self._lock:
            self._n += 1
            rec["n"] = self._n
            name = rec["request"]["path"].strip("/").replace("/", "_") or "root"
            path = self.out_dir / f"{self._n:03d}-{rec['request']['method']}-{name}.json"
            path.write_text(json.dumps(rec, indent=1, ensure_ascii=False))
            rec["file"] = str(path)
            self.records.append(rec)

    async def _relay(self, request: Request) -> Response:
        raw = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        rec: dict[str, Any] = {
            "started": time.time(),
            "request": {"method": request.method, "path": path, "headers": _masked(request.headers),
                        "body": _body(raw) if raw else None},
        }
        client = httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10))
        try:
            upstream = await client.send(client.build_request(request.method, self.upstream + path,
                                                              headers=headers, content=raw), stream=True)
        except httpx.HTTPError as e:
            await client.aclose()
            rec["response"] = {"status": None, "error": repr(e)}
            rec["consumed"] = False
            self._save(rec)
            return Response(f"recording proxy: upstream failed: {e!r}", status_code=502)
        rec["response"] = {"status": upstream.status_code, "headers": dict(upstream.headers)}
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP
                       and k.lower() != "content-encoding"}
        chunks: list[bytes] = []
        state = {"done": False, "end_delivered": False}

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    chunks.append(chunk)
                    if "first_byte_s" not in rec:
                        rec["first_byte_s"] = round(time.time() - rec["started"], 3)
                    yield chunk  # resumes once the chunk was sent to the harness
                    state["end_delivered"] = ends_answer(b"".join(chunks[-2:]))
                state["done"] = True
            except (httpx.HTTPError, asyncio.CancelledError) as e:
                rec["response"]["error"] = repr(e)
                raise

        async def finish() -> None:
            await upstream.aclose()
            await client.aclose()

        def record() -> None:
            if "consumed" in rec:  # once: the end of the stream or the client's leaving
                return
            rec["response"]["body"] = _body(b"".join(chunks))
            rec["consumed"] = state["done"] or state["end_delivered"]
            if not state["done"] and state["end_delivered"]:
                rec["response"]["left_after_end_event"] = True
            rec["duration_s"] = round(time.time() - rec["started"], 3)
            self._save(rec)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in body():
                    yield chunk
            finally:  # ended, or the client left (the generator is closed or cancelled)
                record()
                await finish()

        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out_headers)
