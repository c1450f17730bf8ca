"""llama.cpp server/router introspection: ``GET /props``, ``GET /slots``, ``GET /models``,
``POST /models/load``, ``POST /models/unload``, ``GET /health?model=``.

Shapes follow llama-server (``tools/server``): in router mode the model is the
``model`` query parameter for GET and the ``"model"`` body field for POST; when
only one model is configured it may be left out. As llama.cpp's router does, a
GET for a model that is not loaded loads it first unless ``?autoload=false``
(then 400 ``model_not_loaded``). Errors keep modelyard's OpenAI shape; an
unknown model is a 404.

* ``/props`` — ``total_slots`` is the worker's real KV slot count
  (``Ready.max_jobs``); ``default_generation_settings`` has ``n_ctx`` and the
  sampling defaults ``/completion`` applies (llama.cpp's, overlaid with the
  model's config); ``chat_template`` is the configured one (template text, or a
  built-in name such as ``"gemma"``), else the GGUF's ``tokenizer.chat_template``
  read from its header, else ``""``.
* ``/slots`` — one entry per KV slot, from a fresh Pong (the worker's own slot
  list, or, when it sends none, made from the router's running requests).
  ``id_task`` is the request id running in the slot (``null`` when idle);
  ``n_past`` the tokens its KV holds; ``reader_stalled_s`` (modelyard's) the seconds
  the client of the request in the slot has taken nothing of its stream (its send
  queue is full: ``router.http.http_server``), ``null`` while it reads. ``?fail_on_no_slot=1``:
  503 when every slot is busy.
* ``POST /slots/{id_slot}?action=save|restore|erase`` — llama.cpp's slot actions (off,
  a 501, unless the model's ``slot_save_path`` is set). ``{"filename": NAME}`` (save /
  restore; the model in the query or the body): a plain name inside ``slot_save_path``
  (a path separator or ``..`` is a 400). The worker writes / reads the file itself
  (``worker.engine.kv.state``: identity, checksums); a restore of another model,
  quantization or n_ctx is a 400 ``kv_state_mismatch`` naming the field, a truncated or
  corrupt file a 400 ``kv_state_invalid``, and neither touches the slot. Answers, as
  llama.cpp: save ``{id_slot, filename, n_saved, n_written, timings: {save_ms}}``,
  restore ``{id_slot, filename, n_restored, n_read, timings: {restore_ms}}``, erase
  ``{id_slot, n_erased}``. A busy slot's action waits until the slot is idle.
* ``/models`` — ``status.value`` ``unloaded`` / ``loading`` / ``loaded``
  (``draining`` is still ``loaded``: it runs until its requests finish); a model
  whose worker failed or crashed is ``unloaded`` with ``failed: true`` and
  ``exit_code``. ``status.state`` carries modelyard's own state.
* ``/models/load`` starts a load and answers ``{"success": true}`` at once (400
  if the model is already loading or loaded); ``/models/unload`` starts a
  drain-then-stop and answers at once (400 if nothing is running).
* ``/health?model=`` — 200 ``{"status": "ok"}`` once the model is ready; 503
  while it loads (a load is started unless ``autoload=false``) or after a failure.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from protocol import SLOT_ACTIONS, SlotAction, SlotActionResult, slot_filename_error
from router.http.errors import ApiError, BadGateway, BadRequest, NotSupported, Unavailable, error_response, redact_paths
from router.dialects.shared import RANDOM_SEED, build_info
from router.serving.calls import call_worker, model_ready
from router.serving.generation import LLAMACPP_DEFAULTS
from router.http.http_server import STALLED_READERS
from router import gguf_meta
from router.metrics import label_request
from router.http.params import get_str, read_json
from router.serving.models import (
    ModelPool,
    ServedModel,
    WorkerState,
    begin_load,
    begin_unload,
    model_state,
    replica_rows,
    serves_now,
)
from router.http.responses import JSONResponse
from router.http.security import may_load_on_get
from router.http.sse import until_disconnect
from router.http.routes import route_table

#: How long /slots waits for the worker's Pong before using the router's own view, s.
PROBE_TIMEOUT_S = 2.0
#: How long a slot action may take (a busy slot's action waits for the slot), s.
SLOT_ACTION_TIMEOUT_S = 120.0


class ModelNotLoaded(BadRequest, code="model_not_loaded"):
    """400: ``autoload=false`` and the model is not loaded (llama.cpp's router says the same)."""


def _pool(request: Request) -> ModelPool:
    pool: ModelPool = request.app.state.pool
    return pool


def _named_slot(request: Request, name: str | None) -> ServedModel | None:
    """The slot of ``name``; without a name, the only model (None when there are several)."""
    pool = _pool(request)
    if name is None:
        if len(pool.slots) != 1:
            return None
        name = next(iter(pool.slots))
    slot = pool.get(name)
    label_request(request, slot.model.name)
    return slot


def _query_slot(request: Request) -> ServedModel:
    slot = _named_slot(request, request.query_params.get("model"))
    if slot is None:
        raise BadRequest(f"the 'model' query parameter is required; available models: "
                         f"{', '.join(_pool(request).config.ids())}", param="model")
    return slot


def _autoload(request: Request) -> bool:
    """``?autoload`` (default true), and never for a cross-site browser request
    (``router.http.security.may_load_on_get``: a GET must not have that side effect)."""
    v = request.query_params.get("autoload", "true").strip().lower()
    return v in ("1", "true", "yes", "") and may_load_on_get(request.headers)


async def _ready(request: Request, slot: ServedModel) -> None:
    """Wait until ``slot``'s model is ready (with replicas: one of them), loading it unless
    ``?autoload=false``."""
    if serves_now(slot):
        return
    if not _autoload(request):
        raise ModelNotLoaded(f"model '{slot.model.name}' is not loaded ({slot.state.value})", param="model")
    await until_disconnect(request.receive, model_ready(slot))


def chat_template(slot: ServedModel) -> str:
    """The configured template (text or built-in name), else the GGUF's own, else ""."""
    return gguf_meta.chat_template(slot.model.chat_template, slot.model.path)


def generation_params(slot: ServedModel) -> dict[str, Any]:
    """``/completion``'s defaults for this model, in llama.cpp's ``params`` names."""
    d = {**LLAMACPP_DEFAULTS, **slot.model.sampling}
    seed = d["seed"]
    return {
        "n_predict": -1, "max_tokens": -1,
        "seed": RANDOM_SEED if seed is None or seed < 0 else seed,
        "temperature": d["temperature"], "top_k": d["top_k"], "top_p": d["top_p"], "min_p": d["min_p"],
        "repeat_last_n": d["repeat_last_n"], "repeat_penalty": d["repeat_penalty"],
        "presence_penalty": d["presence_penalty"], "frequency_penalty": d["frequency_penalty"],
        "stop": [], "n_keep": 0, "ignore_eos": False, "n_probs": 0, "cache_prompt": True,
    }


def _n_ctx(slot: ServedModel) -> int:
    ready = slot.ready_info or (slot.last_ready if slot.sleeping else None)
    return ready.n_ctx if ready is not None else (slot.model.n_ctx or 0)


# ----------------------------------------------------------------------------- /props


async def props(request: Request) -> Response:
    slot = _named_slot(request, request.query_params.get("model"))
    if slot is None:  # several models, none named: the router's own props, as llama.cpp's router
        return JSONResponse({
            "role": "router", "model_alias": "modelyard", "model_path": "none",
            "models": _pool(request).config.ids(),
            "default_generation_settings": {"params": {}, "n_ctx": 0},
            "build_info": build_info(),
        })
    sleeping = slot.sleeping  # as llama-server: a sleeping model answers from what it knew, and stays asleep
    if not sleeping:
        await _ready(request, slot)
    last = slot.last_ready
    return JSONResponse({
        "default_generation_settings": {
            "id": 0, "id_task": None, "n_ctx": _n_ctx(slot), "speculative": False, "is_processing": False,
            "params": generation_params(slot),
        },
        "total_slots": last.max_jobs if sleeping and last is not None else slot.total_slots,
        "model_alias": slot.model.name,
        "model_path": redact_paths(str(slot.model.path)),
        "chat_template": chat_template(slot),
        "modalities": {"vision": False, "audio": False},
        "build_info": build_info(),
        "is_sleeping": sleeping,
    })


# ----------------------------------------------------------------------------- /slots


async def slots(request: Request) -> Response:
    slot = _query_slot(request)
    await _ready(request, slot)
    await slot.probe(PROBE_TIMEOUT_S)
    n_ctx = _n_ctx(slot)
    params = generation_params(slot)
    now = time.monotonic()
    out = [{"id": s["id"], "id_task": s["id_task"], "n_ctx": n_ctx, "speculative": False,
            "is_processing": s["is_processing"], "n_past": s["n_past"], "params": params,
            "reader_stalled_s": STALLED_READERS.stalled_s(s["id_task"], now),
            **({"replica": s["replica"], "node": s["node"]} if "replica" in s else {})}
           for s in slot.kv_slots()]
    if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(s["is_processing"] for s in out):
        raise Unavailable(f"model '{slot.model.name}' has no free slot", code="no_slot_available")
    return JSONResponse(out)


async def slot_action(request: Request) -> Response:
    """``POST /slots/{id_slot}?action=save|restore|erase`` (llama.cpp's answer fields)."""
    action = request.query_params.get("action", "")
    raw_id = request.path_params["id_slot"]
    empty = request.headers.get("content-length") in (None, "0") and "transfer-encoding" not in request.headers
    body = {} if empty else await read_json(request)
    name = request.query_params.get("model") or get_str(body, "model", None)
    slot = _named_slot(request, name)
    if slot is None:
        raise BadRequest(f"'model' is required; available models: {', '.join(_pool(request).config.ids())}",
                         param="model")
    if slot.model.slot_save_path is None:
        raise NotSupported("This server does not support slots action: set slot_save_path for model "
                           f"'{slot.model.name}' in the config")
    if action not in SLOT_ACTIONS:
        raise BadRequest(f"Invalid action {action!r}: expected one of {', '.join(SLOT_ACTIONS)}", param="action")
    try:
        id_slot = int(raw_id)
    except ValueError:
        raise BadRequest(f"Invalid slot ID {raw_id!r}", param="id_slot") from None
    filename = ""
    if action != "erase":
        filename = get_str(body, "filename")
        why = slot_filename_error(filename)
        if why is not None:
            raise BadRequest(f"Invalid filename: {why}", param="filename")
    await _ready(request, slot)
    if not 0 <= id_slot < slot.total_slots:
        raise BadRequest(f"Invalid slot ID {id_slot} (slots 0..{slot.total_slots - 1})", param="id_slot")
    ans = await call_worker(request, slot, lambda i: SlotAction(id=i, action=action, id_slot=id_slot, filename=filename),
                      SLOT_ACTION_TIMEOUT_S)
    if not isinstance(ans, SlotActionResult):
        raise BadGateway(f"unexpected {ans.TYPE} answer to a slot action")
    if action == "erase":
        return JSONResponse({"id_slot": ans.id_slot, "n_erased": ans.n_tokens})
    if action == "save":
        return JSONResponse({"id_slot": ans.id_slot, "filename": ans.filename, "n_saved": ans.n_tokens,
                             "n_written": ans.n_bytes, "timings": {"save_ms": ans.ms}})
    return JSONResponse({"id_slot": ans.id_slot, "filename": ans.filename, "n_restored": ans.n_tokens,
                         "n_read": ans.n_bytes, "timings": {"restore_ms": ans.ms}})


# ----------------------------------------------------------------------------- /models


def _status(slot: ServedModel) -> dict[str, Any]:
    state = model_state(slot)  # replicas: the model as a whole
    value = {WorkerState.UNLOADED: "unloaded", WorkerState.LOADING: "loading", WorkerState.READY: "loaded",
             WorkerState.UNRESPONSIVE: "loaded", WorkerState.DRAINING: "loaded",
             WorkerState.FAILED: "unloaded"}[state]
    status: dict[str, Any] = {"value": value, "state": state.value}
    rows = replica_rows(slot)
    if rows is not None:  # each replica: its node, state, slots, load
        status["replicas"] = rows
    if slot.worker_command:
        status["args"] = [redact_paths(a) for a in slot.worker_command]  # a client's view: no paths, no endpoints
    if slot.state is WorkerState.FAILED:
        status["failed"] = True
        status["exit_code"] = slot.last_exit_code
        status["error"] = redact_paths(slot.last_error) if slot.last_error else slot.last_error
    if slot.sleeping:
        status["is_sleeping"] = True  # unloaded for idleness: the next generation loads it again
    return status


def model_entry(slot: ServedModel) -> dict[str, Any]:
    """One ``/models`` entry in llama.cpp router shape."""
    m = slot.model
    return {
        "id": m.name, "aliases": list(m.aliases), "tags": [], "object": "model", "owned_by": "modelyard",
        "created": int(m.path.stat().st_mtime) if m.path.exists() else 0,
        "path": redact_paths(str(m.path)), "status": _status(slot),
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "source": "models_dir" if m.discovered else "config",
        "weights": m.weights_mode,
        "meta": gguf_meta.meta(m.path),
    }


async def list_models(request: Request) -> Response:
    """Every configured model with its status (never loads one)."""
    await gguf_meta.warm([s.model.path for s in _pool(request).slots.values()])
    return JSONResponse({"object": "list", "data": [model_entry(s) for s in _pool(request).slots.values()]})


async def _body_slot(request: Request) -> ServedModel:
    body = await read_json(request)
    slot = _named_slot(request, get_str(body, "model", None))
    if slot is None:
        raise BadRequest(f"'model' is required; available models: {', '.join(_pool(request).config.ids())}",
                         param="model")
    return slot


async def load(request: Request) -> Response:
    slot = await _body_slot(request)
    if not begin_load(slot):  # replicas = N: each one loads
        raise BadRequest(f"model '{slot.model.name}' is already running ({slot.state.value})",
                         code="model_already_loaded", param="model")
    return JSONResponse({"success": True})


async def unload(request: Request) -> Response:
    slot = await _body_slot(request)
    if slot.state not in (WorkerState.LOADING, WorkerState.READY, WorkerState.UNRESPONSIVE,
                          WorkerState.DRAINING):
        raise BadRequest(f"model '{slot.model.name}' is not running ({slot.state.value})",
                         code="model_not_running", param="model")
    begin_unload(slot)  # replicas = N: each one unloads
    return JSONResponse({"success": True})


# ----------------------------------------------------------------------------- /health?model=


async def model_health(request: Request, name: str) -> Response:
    """``/health?model=NAME``: 200 once ready (with replicas: once any is), else 503 (starting a
    load unless autoload=false)."""
    slot = _pool(request).get(name)
    label_request(request, slot.model.name)
    state = model_state(slot)  # replicas: the model as a whole
    if state is WorkerState.READY:
        return JSONResponse({"status": "ok", "model": slot.model.name})
    if slot.sleeping:  # llama-server's sleeping server is healthy; its next generation wakes it
        return JSONResponse({"status": "ok", "model": slot.model.name, "is_sleeping": True})
    err: ApiError
    if state in (WorkerState.UNLOADED, WorkerState.FAILED) and _autoload(request):
        failed = state is WorkerState.FAILED
        try:  # a client's autoload waits out a crash backoff
            begin_load(slot, operator=False)
        except ApiError as e:
            return error_response(e)
        err = Unavailable("Loading model" + (f" (the last load failed: {slot.last_error})" if failed else ""),
                          code="model_loading")
    elif state is WorkerState.LOADING:
        err = Unavailable("Loading model", code="model_loading")
    elif state is WorkerState.FAILED:
        err = Unavailable(f"model '{slot.model.name}' failed: {slot.last_error}", code="model_load_failed")
    elif state is WorkerState.DRAINING:
        err = Unavailable(f"model '{slot.model.name}' is being unloaded", code="model_unloading")
    elif state is WorkerState.UNRESPONSIVE:
        err = Unavailable(f"model '{slot.model.name}' worker is unresponsive", code="model_unresponsive")
    else:
        err = Unavailable(f"model '{slot.model.name}' is not loaded", code="model_not_loaded")
    return error_response(err)


routes = route_table({
    "GET /props": props, "GET /slots": slots, "POST /slots/{id_slot}": slot_action, "GET /models": list_models,
    "POST /models/load": load, "POST /models/unload": unload
})
