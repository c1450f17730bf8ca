"""OpenAI's Responses API: ``POST /v1/responses`` (JSON or SSE, or in the background),
``POST /v1/responses/input_tokens``, ``GET`` / ``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``.

Request in: ``input`` (a string, or items: ``message`` with ``input_text`` /
``output_text`` parts and role user / assistant / system / developer,
``function_call``, ``function_call_output``; ``reasoning`` items are dropped, as
they carry nothing for these models; images and files are a 400),
``instructions`` (a system message for this response only: not carried over by
``previous_response_id``), ``tools`` (``function`` tools, ``custom`` tools whose
free-text input may follow a ``grammar`` format in Lark or regex syntax, as Codex's
``apply_patch``, and ``namespace`` tools — a named group of those, as Codex's
``multi_agent_v1`` — flattened to their tools: the model sees ``<namespace>__<name>``,
the client gets its calls back as ``name`` + ``namespace``, and sends them so in
``input``; hosted built-in tools — ``web_search``, ``file_search``,
``code_interpreter``, ``computer_use_preview``, ``image_generation``, ``mcp``,
``local_shell``, any other type — cannot run here and are set aside: served without,
a warning logged and the ``X-Modelyard-Set-Aside`` header naming them, see
``router.http.set_aside``), ``tool_choice`` (``none`` / ``auto`` / ``required`` /
``{"type": "function" | "custom", "name", "namespace"?}`` / ``{"type":
"allowed_tools", "mode", "tools"}``; one naming a built-in tool is set aside as
``auto``),
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``,
``text.format`` (``text``, ``json_object``, ``json_schema``), ``include`` with
``message.output_text.logprobs`` (the output text's token logprobs, ``top_logprobs``
alternatives each; other ``include`` values are ignored), ``store`` (default
true) and ``previous_response_id`` (the stored conversation is continued, see
``router.dialects.response_store``). ``metadata`` is stored and echoed; ``reasoning``,
``user``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``, ``truncation``, ``max_tool_calls`` (it bounds built-in tool
calls; there are none) and unknown fields are ignored; ``prompt`` and
``conversation`` are a 400, and so is a field that changes the answer in another
dialect or llama.cpp (``seed``, ``stop``, ``max_tokens``, ``response_format``, ...:
``router.dialects.field_policy``).

``background: true`` (OpenAI's background mode, through ``router.dialects.background``): the
answer is the response object at once, ``status`` ``queued`` or ``in_progress``;
``GET /v1/responses/{id}`` shows it as it goes (the output so far) and then done
(``completed``, ``incomplete``, ``failed`` or ``cancelled``); ``?stream=true`` replays
its events from the first (``starting_after=N``: after sequence number N) and follows
it; ``POST /v1/responses/{id}/cancel`` stops it (the worker's slot is freed) and
answers it ``cancelled``; ``DELETE`` cancels and forgets it. It needs ``store`` (a 400
with ``store: false``, as OpenAI) and cannot be combined with ``stream`` here (read
the events with GET).

Answer out: a ``response`` object with ``output`` items (one ``message`` with an
``output_text`` part, or ``function_call`` items), ``status`` ``completed`` or
``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``) and
``usage``. Streams are named SSE events, each with a ``sequence_number``:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.content_part.done``, ``response.function_call_arguments.delta`` /
``.done``, ``response.output_item.done``, then ``response.completed`` or
``response.incomplete``; a failure after the first byte is ``response.failed``.

Shared with the other dialects: admission, the worker run, cancel-on-disconnect and
the error path (``router.serving.generation``); tools, the constraint and the answer's parser
(``router.dialects.shared.prepare``: the template's own tool syntax, else the generic tool

Where it lives: the request read in ``router.dialects.responses_input``, the response object and
its output items in ``router.dialects.responses_output``, the SSE events in
``router.dialects.responses_events``; here the routes and the background mode.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from router.dialects.background import Job, new_job_id
from router.dialects.background import store_of as background_of
from router.dialects.background_reads import job_events, stream_query
from router.dialects.field_policy import refuse_ignored
from router.dialects.response_store import store_of
from router.dialects.responses_events import EventStream
from router.dialects.responses_input import generate, parse
from router.dialects.responses_output import Answer, call_item, hex_id, message_item, output_logprobs
from router.http.errors import BadRequest, NotFound
from router.http.params import INT32_MAX, get_bool, get_int, read_json
from router.http.responses import JSONResponse
from router.http.sse import SSEResponse
from router.http.routes import route_table
from router.serving.generation import begin, collect, stream


async def create(request: Request) -> Response | SSEResponse:
    body = await read_json(request)
    refuse_ignored(body, "/v1/responses")  # seed, stop, max_tokens, response_format, ...: not Responses fields
    job = getattr(request.state, "background_job", None)  # set when this runs a background response
    if job is None and get_bool(body, "background", False):
        return await _start_background(request, body)
    req = parse(request, body)
    max_tokens = get_int(body, "max_output_tokens", None, 1, INT32_MAX)
    streaming = get_bool(body, "stream", False)
    ans = Answer(req, job.id if job is not None else "resp_" + hex_id())
    if job is not None:
        job.snapshot = ans.obj
    msg = generate(req, body, max_tokens, ans.id)
    run, first = await begin(request, req.slot, msg, grammar_param=req.prep.constraint_param, early=streaming)
    parser = req.prep.parser()
    mid = "msg_" + hex_id()

    if not streaming:
        tokens, done = await collect(request, run, first)
        out = parser.read([*(t.text for t in tokens), done.text])
        status = "incomplete" if done.finish_reason == "length" else "completed"
        if out.content is None:
            ans.output = [call_item(req, c, "completed") for c in out.calls]
        if not ans.output:
            ans.output = [message_item(mid, out.content or "", status, output_logprobs(req, tokens))]
        return JSONResponse(ans.finish(request, done, out.calls, out.content))

    events = EventStream(request, ans, parser, mid)
    return SSEResponse(stream(run, first, events.on_frame, on_error=events.on_error, on_open=events.on_open),
                       run.close)


async def input_tokens(request: Request) -> Response:
    """``{"object": "response.input_tokens", "input_tokens": N}``: the prompt tokens
    ``POST /v1/responses`` would have for this body (counted by the worker as a
    generation of 0 tokens: exact, and it warms the prefix cache)."""
    body = await read_json(request)
    req = parse(request, body)
    msg = generate(req, body, 0, "count-" + hex_id())
    run, first = await begin(request, req.slot, msg, grammar_param=req.prep.constraint_param)
    _, done = await collect(request, run, first)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": done.prompt_tokens})


def _not_found(rid: str) -> NotFound:
    return NotFound(f"No response with id '{rid}' found.", code="not_found", param="response_id")


async def _start_background(request: Request, body: dict[str, Any]) -> Response:
    if not get_bool(body, "store", True):
        raise BadRequest("background responses must be stored: 'store' cannot be false with 'background'",
                         param="store")
    if get_bool(body, "stream", False):
        raise BadRequest("'stream' with 'background' is not supported: follow the events with "
                         "GET /v1/responses/{id}?stream=true", param="stream")
    job = Job(new_job_id("resp_"), "response", str(body.get("model", "")))
    await background_of(request).start(request, job, create, "/v1/responses", body)
    return JSONResponse(_job_object(job))


def _job_object(job: Job) -> dict[str, Any]:
    """A background response as it stands: the final object once it has one, else the
    object so far with the job's status (and its error)."""
    obj = job.result() if not job.running else None
    if obj is None:
        obj = job.snapshot(job.status) if job.snapshot is not None else {"id": job.id, "object": "response",
                                                                            "status": job.status, "output": []}
    if job.status in ("cancelled", "failed"):  # ended without a final object of its own: say how
        obj = {**obj, "status": job.status, "error": obj.get("error") or job.error}
    return obj


async def retrieve(request: Request) -> Response | SSEResponse:
    rid = request.path_params["response_id"]
    job = background_of(request).get(rid)
    if job is not None:
        if stream_query(request):
            raw = request.query_params.get("starting_after", "-1")
            if not raw.lstrip("-").isdigit() or int(raw) < -1:
                raise BadRequest(f"'starting_after' must be a sequence number, got {raw!r}", param="starting_after")
            return job_events(job, skip=int(raw) + 1)
        return JSONResponse(_job_object(job))
    stored = store_of(request).get(rid)
    if stored is None:
        raise _not_found(rid)
    return JSONResponse(stored.response)


async def cancel(request: Request) -> Response:
    """OpenAI's ``POST /v1/responses/{id}/cancel``: a background response stops (a
    finished one is answered as it is); other responses cannot be cancelled (400)."""
    rid = request.path_params["response_id"]
    job = background_of(request).cancel(rid)
    if job is not None:
        return JSONResponse(_job_object(job))
    if store_of(request).get(rid) is not None:
        raise BadRequest("Only responses created with 'background': true can be cancelled.",
                         param="response_id")
    raise _not_found(rid)


async def delete(request: Request) -> Response:
    rid = request.path_params["response_id"]
    job = background_of(request).cancel(rid, forget=True)
    if not store_of(request).delete(rid) and job is None:
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


routes = route_table({
    "POST /v1/responses": create, "POST /v1/responses/input_tokens": input_tokens,
    "GET /v1/responses/{response_id}": retrieve, "DELETE /v1/responses/{response_id}": delete,
    "POST /v1/responses/{response_id}/cancel": cancel,
    # llama-server's un-versioned aliases (see router.dialects.openai_api.routes)
    "POST /responses": create, "POST /responses/input_tokens": input_tokens
})
