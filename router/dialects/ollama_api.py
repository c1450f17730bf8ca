"""Ollama's native API: ``POST /api/chat``, ``POST /api/generate`` (NDJSON streams),
``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``, as the
``ollama`` Python client and tools that speak Ollama natively send and read them
(Ollama's ``docs/api.md``).

The requests are read in ``router.dialects.ollama_request`` (its docstring: every field and how
it is honoured), the answers written in ``router.dialects.ollama_answer`` (NDJSON or one object,
the timings in nanoseconds) and the model routes (tags, show, ps, version) are
``router.dialects.ollama_models``. Here: the generation routes, and Ollama's empty request that
loads (``done_reason: "load"``) or, with ``keep_alive: 0``, unloads the model (``"unload"``; with
``server.admin_key`` set, only with that key: unloading is an operator's act there).

Admission, the worker run, cancel-on-disconnect and the error path are the shared ones of
``router.serving.generation``; tools, the constraint and the answer's parser come from
``router.dialects.shared.prepare``.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from protocol import Generate
from router.dialects.ollama_answer import Job, now_iso, run
from router.dialects.ollama_models import ps, show, tags, version
from router.dialects.ollama_request import (
    chat_turns, keep_alive_s, read_body, read_format, read_logprobs, read_options, read_overflow, read_think,
    read_tool, refuse_top_level, resolve,
)
from router.dialects.shared import choose, prepare, tool_list
from router.dialects.tools import ChatTurn
from router.http.errors import BadRequest, Forbidden
from router.http.params import get_bool, get_str
from router.http.responses import JSONResponse
from router.http.sse import SSEResponse, until_disconnect
from router.http.routes import route_table
from router.metrics import label_request
from router.serving import keep_alive as keepalive  # the module (handlers have a keep_alive value)
from router.serving.calls import model_ready
from router.serving.generation import new_id
from router.serving import models
from router.serving.models import ModelPool, ServedModel

def _is_operator(request: Request) -> bool:
    """The request may unload a model: no ``admin_key`` is configured, or it bears that key."""
    admin_key = request.app.state.config.server.admin_key
    if admin_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
    return hmac.compare_digest(given.encode(), admin_key.encode())


async def _load_or_unload(request: Request, slot: ServedModel, model: str, keep_alive: float | None,
                          *, chat: bool) -> Response:
    """Ollama's empty request: load the model (``done_reason: "load"``), or with
    ``keep_alive: 0`` unload it (``"unload"``)."""
    if keep_alive == 0:
        if not _is_operator(request):
            raise Forbidden("unloading a model (keep_alive 0 with an empty request) needs the admin key "
                            "(server.admin_key)", code="admin_key_required")
        # the model as a whole: with replicas, every one (as /admin/models/unload)
        await models.unload(slot, reason="unloaded by an Ollama request (keep_alive 0)")
        reason = "unload"
    else:
        models.set_keep_alive(slot, keepalive.apply(request.state, getattr(request.state, "json_body", None),
                                             request.app.state.pool.config.server.max_keep_alive_s))
        await until_disconnect(request.receive, model_ready(slot))
        reason = "load"
    out: dict[str, Any] = {"model": model, "created_at": now_iso()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    out.update(done=True, done_reason=reason)
    return JSONResponse(out)


# ----------------------------------------------------------------------------- routes: generation


# ----------------------------------------------------------------------------- routes: generation


async def _open(request: Request, route: str) -> tuple[dict[str, Any], str, ServedModel]:
    """The request's body, the model's name as the client gave it and its slot, after the checks
    every generation route makes first (other dialects' fields, ``think``)."""
    body = await read_body(request)
    pool: ModelPool = request.app.state.pool
    model = get_str(body, "model")
    slot = resolve(pool, model)
    label_request(request, slot.model.name)
    refuse_top_level(body, route)
    read_think(body, model)
    return body, model, slot


def _generate(fields: dict[str, Any], sampling: dict[str, Any], top: int | None) -> Generate:
    return Generate(id=new_id("ollama"), n_probs=max(top, 1) if top is not None else 0, **fields, **sampling)


async def chat(request: Request) -> Response | SSEResponse:
    t0 = time.monotonic()
    body, model, slot = await _open(request, "/api/chat")
    # keep_alive is read first (a 400 before anything else when invalid); a generation's is applied
    # by generation.begin (router.serving.keep_alive), an empty request's by _load_or_unload
    keep_alive = keep_alive_s(body.get("keep_alive"))
    if body.get("messages") in (None, []):
        return await _load_or_unload(request, slot, model, keep_alive, chat=True)
    turns = chat_turns(body)
    tools = tool_list(body, read_tool)
    choice = choose(tools, "auto", None, True, "tools")
    prep = prepare(slot, turns, tools, choice, read_format(body), "format")
    sampling = read_options(request, body, slot)
    read_overflow(request, body)
    top = read_logprobs(body)
    msg = _generate(prep.generate_fields(), sampling, top)
    return await run(request, Job(model, slot, msg, prep, prep.constraint_param, top, chat=True), t0)


async def generate(request: Request) -> Response | SSEResponse:
    t0 = time.monotonic()
    body, model, slot = await _open(request, "/api/generate")
    prompt = get_str(body, "prompt", "")
    keep_alive = keep_alive_s(body.get("keep_alive"))  # read first, as in chat
    for key, why in (("suffix", "fill-in-the-middle is not supported"),
                     ("template", "Go prompt templates are not supported; the model's own chat template is used "
                                  "(configure chat_template in config.toml), or send 'raw': true"),
                     ("context", "the token context of an earlier answer is not supported; use /api/chat "
                                 "with the conversation's messages"),
                     ("images", "image input is not supported (these models read text only)")):
        if body.get(key):
            raise BadRequest(f"'{key}': {why}", param=key)
    system = get_str(body, "system", "")
    raw = get_bool(body, "raw", False)
    if not prompt:
        return await _load_or_unload(request, slot, model, keep_alive, chat=False)
    text_schema = read_format(body)
    sampling = read_options(request, body, slot)
    read_overflow(request, body)
    top = read_logprobs(body)
    if raw:
        if system:
            raise BadRequest("'system' cannot be applied with 'raw': true (no template renders it); put it in "
                             "the prompt", param="system")
        fields: dict[str, Any] = {"prompt": prompt, "json_schema": text_schema}
        cparam = "format" if text_schema is not None else None
    else:
        turns = ([ChatTurn("system", system)] if system else []) + [ChatTurn("user", prompt)]
        prep = prepare(slot, turns, [], choose([], "auto", None, True, "tools"), text_schema, "format",
                       messages_param="prompt")
        fields, cparam = prep.generate_fields(), prep.constraint_param
    msg = _generate(fields, sampling, top)
    return await run(request, Job(model, slot, msg, None, cparam, top, chat=False), t0)


routes = route_table({
    "POST /api/chat": chat, "POST /api/generate": generate, "GET /api/tags": tags, "POST /api/show": show,
    "GET /api/ps": ps, "GET /api/version": version
})
