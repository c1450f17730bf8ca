"""Decode by id: start a generation, get its result later, cancel it (router.dialects.background).

* ``POST /v1/decode`` — the body of ``/v1/chat/completions`` (it has ``messages``) or of
  ``/v1/completions`` (it has ``prompt``); both or neither is a 400. ``"background": true``
  may be given (it is what this route means; ``false`` is a 400); ``stream`` and
  ``stream_options`` are a 400 (the result is read with GET). Validated, then admitted
  to the model's queue exactly as the synchronous routes do (400 / 404 / 503 at once);
  answered as soon as it is admitted: ``{"id": "decode_...", "object":
  "chat.completion" | "text_completion", "status": "queued" | "in_progress", "model",
  "created_at", "worker": {"pid", "fingerprint"} | null, "error": null}`` — ``worker``
  is the worker it runs on and the GGUF content fingerprint that worker announced,
  once it has one (at once when a slot was free; GET shows it later otherwise).
* ``GET /v1/decode/{id}`` — while it runs: the route's SSE stream from its first event
  (any number of readers, each from the start; leaving never cancels it); once it has
  ended: JSON, the fields above plus ``result`` (the non-streaming route's answer,
  assembled from the chunks). ``?stream=true`` asks for the SSE replay even when ended,
  ``?stream=false`` for the JSON while it runs (``result`` null).
* ``DELETE /v1/decode/{id}`` — cancels it if it runs (the worker gets Cancel; its KV
  slot is free once the worker answers) and forgets it: ``{"id", "object":
  "decode.deleted", "deleted": true, "status"}`` (the status it ended with). A deleted
  or expired id is a 404 from then on.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.dialects.background import Handler, Job, new_job_id, store_of
from router.dialects.background_reads import job_events, stream_query
from router.http.errors import BadRequest, NotFound
from router.http.params import get_bool, read_json
from router.http.responses import JSONResponse
from router.http.sse import SSEResponse
from router.http.routes import route_table

#: The two bodies /v1/decode takes: (the field that tells them apart, route, kind). The handler is
#: the one the app serves that route with (no dialect imports another).
_DIALECTS: tuple[tuple[str, str, str], ...] = (
    ("messages", "/v1/chat/completions", "chat.completion"),
    ("prompt", "/v1/completions", "text_completion"),
)


def _handler(request: Request, path: str) -> Handler:
    """The endpoint the app serves ``POST path`` with."""
    for route in request.app.routes:
        if isinstance(route, Route) and route.path == path and route.methods and "POST" in route.methods:
            endpoint: Handler = route.endpoint
            return endpoint
    raise LookupError(f"no POST {path} route")  # pragma: no cover - the app always has both


def _not_found(job_id: str) -> NotFound:
    return NotFound(f"no background generation with id '{job_id}' (unknown, deleted or expired)",
                    code="not_found", param="id")


async def create(request: Request) -> Response:
    body = await read_json(request)
    given = [d for d in _DIALECTS if d[0] in body]
    if len(given) != 1:
        raise BadRequest("a /v1/decode body has either 'messages' (a chat completion) or 'prompt' "
                         "(a text completion)", param="messages")
    _, path, kind = given[0]
    handler = _handler(request, path)
    for key in ("stream", "stream_options"):
        if key in body:
            raise BadRequest(f"'{key}' is not used by /v1/decode: read the result (SSE while it runs) "
                             "with GET /v1/decode/{id}", param=key)
    if not get_bool(body, "background", True):
        raise BadRequest("/v1/decode always runs in the background; leave 'background' out or true",
                         param="background")
    inner = {k: v for k, v in body.items() if k != "background"}
    inner["stream_options"] = {"include_usage": True}  # the usage chunk: the result's usage
    job = Job(new_job_id("decode_"), kind, str(body.get("model", "")))
    await store_of(request).start(request, job, handler, path, inner)
    return JSONResponse(job.describe())


async def retrieve(request: Request) -> Response | SSEResponse:
    job_id = request.path_params["decode_id"]
    job = store_of(request).get(job_id)
    if job is None:
        raise _not_found(job_id)
    want_stream = stream_query(request)
    if want_stream is True or (want_stream is None and job.running):
        return job_events(job)
    return JSONResponse({**job.describe(), "result": job.result()})


async def delete(request: Request) -> Response:
    job_id = request.path_params["decode_id"]
    job = store_of(request).cancel(job_id, forget=True)
    if job is None:
        raise _not_found(job_id)
    return JSONResponse({"id": job.id, "object": "decode.deleted", "deleted": True, "status": job.status})


routes = route_table({
    "POST /v1/decode": create, "GET /v1/decode/{decode_id}": retrieve, "DELETE /v1/decode/{decode_id}": delete
})
