"""Ollama's native API: ``POST /api/chat``, ``POST /api/generate`` (NDJSON streams),
``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``, as the
``ollama`` Python client and tools that speak Ollama natively send and read them
(Ollama's ``docs/api.md``).

Requests in:

* ``model``: a configured name or alias; ``NAME:latest`` is ``NAME`` (Ollama's default tag),
  and ``/api/tags`` lists every name with its tag (``smollm2:latest``).
* ``/api/chat`` ``messages`` (``system`` / ``user`` / ``assistant`` / ``tool``; assistant
  ``tool_calls`` with ``function.arguments`` an object; ``tool`` messages answer a call by
  ``tool_call_id`` or ``tool_name``, else the oldest unanswered call; earlier ``thinking``
  is dropped; non-empty ``images`` are a 400 naming them), ``tools`` (function tools; the
  model chooses, as Ollama has no tool choice). A last assistant message is a prefill.
* ``/api/generate`` ``prompt`` with ``system`` in the model's chat template, or as it is
  with ``raw: true``; ``suffix``, ``template``, ``context`` and ``images`` are a 400
  when non-empty (no fill-in-the-middle, Go templates, token-context memory or image input).
* ``format``: ``"json"`` (any JSON object) or a JSON Schema, enforced by the constraint.
* ``options`` (:data:`OPTIONS`): the sampling fields (Ollama's defaults under the
  model's configured ones), ``num_predict`` (> 0: the answer's limit; -1, -2, 0: none of
  its own, so the model's configured ``n_predict`` applies, else the context's end), ``num_ctx`` (honoured when the
  model's context holds it; larger is set aside, as the context is fixed at load);
  options that cannot change the answer here (threads, GPU layers, mmap, ...) are set
  aside; mirostat / typical_p / tfs_z only at their neutral values; any other option is
  a 400 naming it.
* ``keep_alive``: honoured as on every generation route (``router.serving.keep_alive``: the last
  request decides how long the model stays loaded once idle, capped by
  ``server.max_keep_alive_s``, a cap set aside visibly). With an empty ``prompt`` /
  ``messages`` the request loads the model (``done_reason: "load"``, its keep_alive applied),
  and with ``keep_alive: 0`` unloads it
  (``"unload"``; with ``server.admin_key`` set, only with that key: unloading is an
  operator's act there).
* ``think``: a 400 when asked for (these models do not think), as Ollama answers for such
  models; ``false`` is fine. ``logprobs`` / ``top_logprobs`` are honoured.
* ``truncate`` / ``shift`` (history truncation and context shift on overflow) are set aside
  when true: a prompt beyond n_ctx is a 400, a generation that reaches it ends ("length").
* A field of another dialect that would change the answer (``max_tokens``, a top-level
  ``temperature``, ``response_format``, ...) is a 400 saying where it goes (``options``,
  ``format``), never dropped silently (``router.dialects.field_policy``).

Set aside means: served without it, a warning in the log and the field named in the
``X-Modelyard-Set-Aside`` response header (``router.http.set_aside``: ``options:num_thread``,
``keep_alive:10m``, ...).

Answers out: NDJSON (``application/x-ndjson``, one object a line, ``stream`` defaults to
true) ending with ``done: true``, ``done_reason`` (``stop`` / ``length``) and the timings in
nanoseconds (``total_duration``, ``load_duration`` — the wait for the model's load, 0 when
it was loaded — ``prompt_eval_count`` = the prompt's tokens, ``prompt_eval_cached_count`` =
those reused from the KV cache (when some were), ``prompt_eval_duration``, ``eval_count``,
``eval_duration``); or one object with ``stream: false``. Tool calls are
``message.tool_calls`` ``[{"id", "function": {"index", "name", "arguments": {...}}}]``.
Errors are ``{"error": "..."}`` with their status (``router.http.errors``: 400, 404 unknown model,
503 + Retry-After queue full, ...); a failure after the first line is a last line
``{"error": "..."}``.

Admission, the worker run, cancel-on-disconnect and the error path are the shared ones of
``router.serving.generation``; tools, the constraint and the answer's parser come from
``router.dialects.shared.prepare``.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
import hashlib
import hmac
import json
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from protocol import Done, Generate, Token
from protocol.limits import MAX_N_PROBS
from router.serving import keep_alive as keepalive  # the module (handlers have a keep_alive value)
from router.dialects.constraints import schema_text
from router.dialects.shared import Prepared, choose, function_tool, objects, prepare, tool_list
from router.http.errors import ApiError, BadRequest, Forbidden, NotFound, ollama_error_payload
from router.dialects.field_policy import refuse_ignored
from router.serving.generation import begin, collect, new_id, openai_logprob, read_sampling, stream, token_probs
from router.workers.gguf_meta import chat_template, metadata, tensor_infos
from router.workers.lifecycle import LOADED
from router.metrics import label_request
from router.serving.budget import context_size
from router.http.params import INT32_MAX, get_bool, get_int, get_str, json_type, read_json
from router.workers.pool import ModelSlot, Pool
from router.http.responses import JSONResponse, dumps
from router.http.set_aside import set_aside
from router.http.sse import SSEResponse, until_disconnect
from router.dialects.tools import ChatTurn, Tool, ToolCall

#: The Ollama version ``/api/version`` reports: the API level whose fields this module serves
#: (tool-call ids and indexes, ``logprobs``, ``prompt_eval_cached_count``, ``capabilities`` in
#: ``/api/show``, ``context_length`` in ``/api/ps``).
OLLAMA_VERSION = "0.33.2"

#: Ollama's sampling defaults (``api.DefaultOptions``), under the model's configured ones.
OLLAMA_DEFAULTS: dict[str, Any] = {
    "temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.0, "repeat_penalty": 1.1,
    "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None,
}

#: ``options`` read as sampling fields (same names in Generate).
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n",
             "presence_penalty", "frequency_penalty", "stop")
#: ``options`` that the engine's sampler lacks: accepted at their neutral value only
#: (mirostat and typical_p by ``router.serving.samplers``, with llama.cpp's other samplers).
_NEUTRAL_ONLY = ("mirostat", "typical_p", "tfs_z")
#: ``options`` that cannot change an answer here: load-time and hardware settings of Ollama's
#: runner (threads, GPU layers, batch, mmap/mlock, NUMA), ``num_keep`` (tokens kept by a context
#: shift, which this server never does), ``penalize_newline`` (no effect in Ollama itself since
#: 0.4), mirostat's tau/eta (mirostat is off). Set aside, visibly.
_NO_EFFECT = ("num_keep", "num_batch", "num_gpu", "main_gpu", "low_vram", "vocab_only", "use_mmap", "use_mlock",
              "num_thread", "numa", "f16_kv", "logits_all", "embedding_only", "penalize_newline",
              "mirostat_tau", "mirostat_eta")
#: Every option name Ollama's clients send (``ollama.Options``).
OPTIONS = frozenset({*_SAMPLING, *_NEUTRAL_ONLY, *_NO_EFFECT, "num_predict", "num_ctx"})

#: ``general.file_type`` (llama.cpp's ``llama_ftype``) -> Ollama's ``quantization_level``.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
              17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
              23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
              29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}

#: What ``/api/show`` says every model can do (Ollama's capability names): plain generation and
#: tools (every template gets them, in its own syntax or the generic one).
CAPABILITIES = ["completion", "tools"]

_NS_PER_MS = 1_000_000


# ----------------------------------------------------------------------------- shared helpers


def now_iso() -> str:
    """Ollama's ``created_at``: RFC 3339 UTC with microseconds."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def tagged(name: str) -> str:
    """A model id as Ollama names it: with its tag (``latest`` when it has none)."""
    return name if ":" in name else f"{name}:latest"


def resolve(pool: Pool, name: Any) -> ModelSlot:
    """The slot of ``name`` (a configured name or alias; ``NAME:latest`` is ``NAME``).
    Raises BadRequest for a missing name, NotFound (404) for an unknown one."""
    if not isinstance(name, str) or not name:
        raise BadRequest("'model' is required", param="model")
    m = pool.config.resolve(name)
    if m is None and name.endswith(":latest"):
        m = pool.config.resolve(name[: -len(":latest")])
    if m is None:
        raise NotFound(f"model '{name}' not found; available models: "
                       f"{', '.join(tagged(i) for i in pool.config.ids())}", param="model")
    return pool.get(m.preset or m.name)  # a preset: the model's slot showing its defaults (router.serving.presets)


# ----------------------------------------------------------------------------- request fields


def keep_alive_s(v: Any) -> float | None:
    """``keep_alive`` in seconds (negative: forever), None when absent (``router.serving.keep_alive``
    reads it: a number of seconds or a Go duration string). Raises BadRequest naming the field."""
    got = keepalive.requested({"keep_alive": v})
    if got is None:
        return None
    return -1.0 if math.isinf(got[1]) else got[1]


def _keep_alive(request: Request, body: dict[str, Any], slot: ModelSlot, *, empty: bool) -> float | None:
    """``keep_alive`` read (seconds; None: absent) — a 400 before anything else when invalid.
    A generation's is applied by ``generation.begin`` (router.serving.keep_alive); ``empty``: the
    request is Ollama's load / unload form, where 0 unloads and any other value is applied
    by :func:`_load_or_unload`."""
    return keep_alive_s(body.get("keep_alive"))


def _think(body: dict[str, Any], model: str) -> None:
    t = body.get("think")
    if t is None or t is False or t in ("", "false", "none"):
        return
    if isinstance(t, bool) or isinstance(t, str):
        raise BadRequest(f'"{model}" does not support thinking', param="think")
    raise BadRequest("'think' must be a boolean or one of 'high', 'medium', 'low'", param="think")


def _refuse_top_level(body: dict[str, Any], route: str) -> None:
    """Other dialects' answer-changing fields (``router.dialects.field_policy``), and Ollama options
    given at the top level instead of in ``options``: a 400 naming them."""
    refuse_ignored(body, route)
    for key in ("temperature", "top_p", "num_predict", "num_ctx", "repeat_last_n", "typical_p",
                "mirostat", "tfs_z"):
        if body.get(key) is not None:
            raise BadRequest(f"'{key}' is not a field of {route}: Ollama's clients give it in 'options'",
                             param=key)


def _format(body: dict[str, Any]) -> str | None:
    """``format``: ``"json"`` (any JSON object), a JSON Schema, or ``""`` / null (text)."""
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json.dumps({"type": "object"})
    if isinstance(fmt, dict):
        return schema_text(fmt, "format")
    raise BadRequest(f"'format' must be \"json\" or a JSON Schema object, got {json.dumps(fmt)[:60]}", param="format")


def _options(request: Request, body: dict[str, Any], slot: ModelSlot) -> dict[str, Any]:
    """``options`` as the Generate's sampling fields and ``max_tokens``. Raises BadRequest
    naming ``options.<name>``."""
    opts = body.get("options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise BadRequest(f"'options' must be an object, got {json_type(opts)}", param="options")
    unknown = sorted(k for k in opts if k not in OPTIONS and opts[k] is not None)
    if unknown:
        raise BadRequest(f"'options.{unknown[0]}' is not an option this server knows (it could change the "
                         f"answer); supported: {', '.join(sorted(OPTIONS))}", param=f"options.{unknown[0]}")
    for k in opts:  # in the request's order
        if k in _NO_EFFECT and opts[k] is not None:
            set_aside(request.state, "options", k, "no effect on this server's CPU engine")
    tfs = opts.get("tfs_z")
    if tfs is not None and (isinstance(tfs, bool) or not isinstance(tfs, (int, float)) or tfs < 1.0):
        raise BadRequest("'options.tfs_z' is not supported (this server's sampler has no such stage); leave it "
                         "out or at 1.0", param="options.tfs_z")
    sampling_in = {k: opts[k] for k in (*_SAMPLING, "mirostat", "typical_p") if k in opts}
    try:
        sampling = read_sampling(sampling_in, OLLAMA_DEFAULTS, slot, openai=False)
        n_predict = get_int(opts, "num_predict", None, None, INT32_MAX)
        num_ctx = get_int(opts, "num_ctx", None, 1, INT32_MAX)
    except BadRequest as e:
        if e.param is not None and not e.param.startswith("options."):
            e.message = e.message.replace(f"'{e.param}'", f"'options.{e.param}'", 1)
            e.param = f"options.{e.param}"
        raise
    if num_ctx is not None:
        n_ctx, _ = context_size(slot)
        if n_ctx is not None and num_ctx > n_ctx:
            set_aside(request.state, "options", "num_ctx", f"the model's context is n_ctx={n_ctx} tokens, fixed "
                      "at load (config.toml); a longer prompt is a 400")
    # Ollama limits an answer only for num_predict > 0 (-1: none, -2: fill the context)
    sampling["max_tokens"] = n_predict if n_predict is not None and n_predict > 0 else None
    return sampling


def _logprobs(body: dict[str, Any]) -> int | None:
    """``logprobs`` / ``top_logprobs``: None (off), else the alternatives per token."""
    want = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", 0, 0, MAX_N_PROBS)
    if top and not want:
        raise BadRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    return top if want else None


def _overflow(request: Request, body: dict[str, Any]) -> None:
    for key in ("truncate", "shift"):
        if get_bool(body, key, False):
            set_aside(request.state, key, "true", "a prompt beyond n_ctx is a 400 and a generation that reaches "
                      "it ends with done_reason 'length'; nothing is truncated or shifted")


# ----------------------------------------------------------------------------- chat turns


def _history_calls(m: dict[str, Any], where: str, n: int) -> list[ToolCall]:
    raw = m.get("tool_calls")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest(f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls")
    calls: list[ToolCall] = []
    for k, c in enumerate(raw):
        cw = f"{where}.tool_calls[{k}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"'{cw}' must be {{\"function\": {{\"name\", \"arguments\"}}}}", param=cw)
        args = fn.get("arguments", {})
        if args is None:
            args = {}
        if isinstance(args, str):  # some clients send the JSON text
            text = args
        elif isinstance(args, dict):
            text = json.dumps(args, ensure_ascii=False)
        else:
            raise BadRequest(f"'{cw}.function.arguments' must be an object", param=f"{cw}.function.arguments")
        ident = c.get("id")
        calls.append(ToolCall(ident if isinstance(ident, str) and ident else f"call_{n}_{k}", fn["name"], text))
    return calls


class _Unanswered:
    """The history's tool calls not yet answered by a tool message, found by id, by name or
    oldest first — each in O(1) amortised (a scan per tool message was quadratic, on the event
    loop: 20,000 calls answered in reverse order, a 2.4 MB body, held every client 50 s)."""

    def __init__(self) -> None:
        self._open: dict[int, ToolCall] = {}
        self._order: deque[int] = deque()
        self._by_id: dict[str, deque[int]] = {}
        self._by_name: dict[str, deque[int]] = {}
        self._added = 0

    def add(self, call: ToolCall) -> None:
        key = self._added
        self._added += 1
        self._open[key] = call
        self._order.append(key)
        self._by_id.setdefault(call.id, deque()).append(key)
        self._by_name.setdefault(call.name, deque()).append(key)

    def _first(self, keys: deque[int] | None) -> ToolCall | None:
        while keys:
            call = self._open.pop(keys[0], None)
            keys.popleft()
            if call is not None:
                return call
        return None

    def take(self, ident: str | None, name: str | None) -> ToolCall | None:
        """The call a tool message answers (removed): the first open one with its ``tool_call_id``,
        else with its name, else — a message naming neither — the oldest open one."""
        if ident is not None:
            keys = self._by_id.get(ident)
            while keys and keys[0] not in self._open:
                keys.popleft()
            if keys:
                return self._first(keys)
        if name is not None:
            keys = self._by_name.get(name)
            while keys and keys[0] not in self._open:
                keys.popleft()
            return self._first(keys)
        while self._order and self._order[0] not in self._open:
            self._order.popleft()
        return self._first(self._order)


def chat_turns(body: dict[str, Any]) -> list[ChatTurn]:
    """``messages`` as dialect-neutral turns. Raises BadRequest naming the field."""
    turns: list[ChatTurn] = []
    unanswered = _Unanswered()  # calls of the history not yet answered by a tool message
    for i, (where, m) in enumerate(objects(body.get("messages"), "messages")):
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise BadRequest(f"'{where}.role' must be one of 'system', 'user', 'assistant', 'tool', got {role!r}",
                             param=f"{where}.role")
        if m.get("images"):
            raise BadRequest(f"'{where}.images': image input is not supported (these models read text only)",
                             param=f"{where}.images")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"'{where}.content' must be a string, got {json_type(content)}", param=f"{where}.content")
        if role == "assistant":
            calls = _history_calls(m, where, i)
            for c in calls:
                unanswered.add(c)
            turns.append(ChatTurn("assistant", content, calls))  # earlier `thinking` is dropped
        elif role == "tool":
            ident, name = m.get("tool_call_id"), m.get("tool_name") or m.get("name")
            name = name if isinstance(name, str) and name else None
            call = unanswered.take(ident if isinstance(ident, str) else None, name)
            turns.append(ChatTurn("tool", content, tool_call_id=call.id if call is not None else
                                  (ident if isinstance(ident, str) else None),
                                  name=name or (call.name if call is not None else None)))
        else:
            turns.append(ChatTurn(role, content))
    return turns


def _tool(t: dict[str, Any], where: str) -> Tool:
    if t.get("type", "function") != "function":
        raise BadRequest(f"'{where}': tools of type {t.get('type')!r} are not supported (function tools)",
                         param=f"{where}.type")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"'{where}.function' must be an object", param=f"{where}.function")
    return function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}.function",
                         "parameters")


# ----------------------------------------------------------------------------- answers


def _stats(done: Done, t0: float, load_ns: int) -> dict[str, Any]:
    """The final object's figures, as Ollama gives them: ``prompt_eval_count`` the prompt's
    tokens in all, ``prompt_eval_cached_count`` those reused from the KV cache (only when
    some were), ``prompt_eval_duration`` the time evaluating the others; durations in ns."""
    out = {
        "done_reason": done.finish_reason,  # "stop" | "length" (cancelled never reaches here)
        "total_duration": int((time.monotonic() - t0) * 1e9),
        "load_duration": load_ns,
        "prompt_eval_count": done.prompt_tokens,
        "prompt_eval_duration": int(done.prompt_ms * _NS_PER_MS),
        "eval_count": done.completion_tokens,
        "eval_duration": int(done.predicted_ms * _NS_PER_MS),
    }
    if done.cache_n > 0:
        out["prompt_eval_cached_count"] = done.cache_n
    return out


def _call_json(c: ToolCall, index: int) -> dict[str, Any]:
    """A call as Ollama writes it: arguments an object."""
    try:
        args = json.loads(c.arguments) if c.arguments.strip() else {}
    except json.JSONDecodeError:
        args = {}
    if not isinstance(args, dict):
        args = {"value": args}
    return {"id": c.id, "function": {"index": index, "name": c.name, "arguments": args}}


def _lp(tokens: list[Token], top: int | None) -> list[dict[str, Any]]:
    return [openai_logprob(p, top or 0) for p in token_probs(tokens, top or 0)]


class NDJSONResponse(SSEResponse):
    """Ollama's stream: one JSON object a line (the SSE response's disconnect handling)."""

    content_type = b"application/x-ndjson"


def line(obj: dict[str, Any]) -> bytes:
    return dumps(obj) + b"\n"


def _error_line(err: ApiError) -> bytes:
    return line(ollama_error_payload(err))


@dataclass
class _Job:
    """A parsed generation request: what to run and how to answer."""

    model: str  # the name the client used (echoed back)
    slot: ModelSlot
    msg: Generate
    prep: Prepared | None  # chat: tools and the parser
    constraint_param: str | None
    top_lp: int | None


async def _run(request: Request, job: _Job, t0: float, *, chat: bool) -> Response | SSEResponse:
    was_loaded = job.slot.state in LOADED
    streaming = get_bool(await _body(request), "stream", True)
    run, first = await begin(request, job.slot, job.msg, grammar_param=job.constraint_param, early=streaming)
    load_ns = 0 if was_loaded else max(0, int((run.record.started_at - run.record.admitted_at) * 1e9))
    head = {"model": job.model}
    parser = job.prep.parser() if job.prep is not None else None

    if not streaming:
        tokens, done = await collect(request, run, first)
        pieces = [*(t.text for t in tokens), done.text]
        out: dict[str, Any] = {**head, "created_at": now_iso()}
        if chat:
            assert parser is not None
            parsed = parser.read(pieces)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content or ""}
            if parsed.calls:
                message["tool_calls"] = [_call_json(c, k) for k, c in enumerate(parsed.calls)]
            out["message"] = message
        else:
            out["response"] = "".join(pieces)
        out["done"] = True
        out.update(_stats(done, t0, load_ns))
        if job.top_lp is not None:
            out["logprobs"] = _lp(tokens, job.top_lp)
        return JSONResponse(out)

    pending: list[Token] = []
    n_calls = 0

    def chunk(text: str, calls: list[ToolCall] | None = None) -> bytes:
        nonlocal n_calls
        obj: dict[str, Any] = {**head, "created_at": now_iso()}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [_call_json(c, n_calls + k) for k, c in enumerate(calls)]
                n_calls += len(calls)
            obj["message"] = message
        else:
            obj["response"] = text
        obj["done"] = False
        if job.top_lp is not None:
            obj["logprobs"] = _lp(pending, job.top_lp)
            pending.clear()
        return line(obj)

    def emit(text: str, calls: list[ToolCall], out: list[bytes]) -> None:
        if text:
            out.append(chunk(text))
        if calls:
            out.append(chunk("", calls))

    async def on_frame(item: Token | Done) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(item, Token):
            pending.append(item)
            if item.text:
                emit(*(parser.feed(item.text) if parser is not None else (item.text, [])), out)
            return out
        if parser is not None:
            emit(*parser.feed(item.text), out)
            emit(*parser.finish(), out)
        elif item.text:
            emit(item.text, [], out)
        final: dict[str, Any] = {**head, "created_at": now_iso()}
        if chat:
            final["message"] = {"role": "assistant", "content": ""}
        else:
            final["response"] = ""
        final["done"] = True
        final.update(_stats(item, t0, load_ns))
        if job.top_lp is not None and pending:
            final["logprobs"] = _lp(pending, job.top_lp)
        out.append(line(final))
        return out

    # the stream opens as soon as the worker has accepted the prompt, and a line that adds nothing
    # keeps it alive while a long prompt is prefilled (Ollama's clients read every line as a chunk)
    empty: dict[str, Any] = {**head, "created_at": now_iso()}
    empty.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    nothing = line({**empty, "done": False})
    return NDJSONResponse(stream(run, first, on_frame, on_error=_error_line, on_open=lambda _: [nothing],
                                 keepalive=nothing), run.close)


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON body (read once; kept on the request's state)."""
    body: dict[str, Any] | None = getattr(request.state, "ollama_body", None)
    if body is None:
        body = await read_json(request)
        request.state.ollama_body = body
    return body


def _is_operator(request: Request) -> bool:
    """The request may unload a model: no ``admin_key`` is configured, or it bears that key."""
    admin_key = request.app.state.config.server.admin_key
    if admin_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
    return hmac.compare_digest(given.encode(), admin_key.encode())


async def _load_or_unload(request: Request, slot: ModelSlot, model: str, keep_alive: float | None,
                          *, chat: bool) -> Response:
    """Ollama's empty request: load the model (``done_reason: "load"``), or with
    ``keep_alive: 0`` unload it (``"unload"``)."""
    if keep_alive == 0:
        if not _is_operator(request):
            raise Forbidden("unloading a model (keep_alive 0 with an empty request) needs the admin key "
                            "(server.admin_key)", code="admin_key_required")
        await slot.unload(reason="unloaded by an Ollama request (keep_alive 0)")
        reason = "unload"
    else:
        slot.set_keep_alive(keepalive.apply(request.state, getattr(request.state, "json_body", None),
                                             request.app.state.pool.config.server.max_keep_alive_s))
        await until_disconnect(request.receive, slot.ready_worker())
        reason = "load"
    out: dict[str, Any] = {"model": model, "created_at": now_iso()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    out.update(done=True, done_reason=reason)
    return JSONResponse(out)


# ----------------------------------------------------------------------------- routes: generation


async def chat(request: Request) -> Response | SSEResponse:
    t0 = time.monotonic()
    body = await _body(request)
    pool: Pool = request.app.state.pool
    model = get_str(body, "model")
    slot = resolve(pool, model)
    label_request(request, slot.model.name)
    _refuse_top_level(body, "/api/chat")
    _think(body, model)
    keep_alive = _keep_alive(request, body, slot, empty=body.get("messages") in (None, []))
    if body.get("messages") in (None, []):
        return await _load_or_unload(request, slot, model, keep_alive, chat=True)
    turns = chat_turns(body)
    tools = tool_list(body, _tool)
    choice = choose(tools, "auto", None, True, "tools")
    prep = prepare(slot, turns, tools, choice, _format(body), "format")
    sampling = _options(request, body, slot)
    _overflow(request, body)
    top = _logprobs(body)
    msg = Generate(id=new_id("ollama"), n_probs=max(top, 1) if top is not None else 0,
                   **prep.generate_fields(), **sampling)
    return await _run(request, _Job(model, slot, msg, prep, prep.constraint_param, top), t0, chat=True)


async def generate(request: Request) -> Response | SSEResponse:
    t0 = time.monotonic()
    body = await _body(request)
    pool: Pool = request.app.state.pool
    model = get_str(body, "model")
    slot = resolve(pool, model)
    label_request(request, slot.model.name)
    _refuse_top_level(body, "/api/generate")
    _think(body, model)
    prompt = get_str(body, "prompt", "")
    keep_alive = _keep_alive(request, body, slot, empty=not prompt)
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
    text_schema = _format(body)
    sampling = _options(request, body, slot)
    _overflow(request, body)
    top = _logprobs(body)
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
    msg = Generate(id=new_id("ollama"), n_probs=max(top, 1) if top is not None else 0, **fields, **sampling)
    return await _run(request, _Job(model, slot, msg, None, cparam, top), t0, chat=False)


# ----------------------------------------------------------------------------- routes: models


def parameter_size(n: int) -> str:
    """A parameter count as Ollama writes it (``format.HumanNumber``): 134.52M, 8.0B, 7B."""
    if n >= 1_000_000_000:
        x = n / 1e9
        return f"{x:.0f}B" if x == math.floor(x) else f"{x:.1f}B"
    if n >= 1_000_000:
        x = n / 1e6
        return f"{x:.0f}M" if x == math.floor(x) else f"{x:.2f}M"
    if n >= 1000:
        return f"{n / 1e3:.0f}K"
    return str(n)


def _parameter_count(path: Path, meta: dict[str, Any]) -> int | None:
    count = meta.get("general.parameter_count")
    if isinstance(count, int) and count > 0:
        return count
    infos = tensor_infos(path)
    return sum(math.prod(t.dims) for t in infos) if infos else None


def model_facts(path: Path, *, arrays: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(details, model_info)`` of a GGUF file, as Ollama's ``/api/show`` gives them:
    ``details`` {parent_model, format, family, families, parameter_size, quantization_level};
    ``model_info`` every key/value of its header (arrays as ``[]`` unless ``arrays``) and
    ``general.parameter_count`` (summed over its tensors when the header lacks it)."""
    meta = metadata(path, arrays=arrays) or {}
    arch = meta.get("general.architecture")
    count = _parameter_count(path, meta)
    ftype = meta.get("general.file_type")
    if count is not None:
        meta["general.parameter_count"] = count
    details = {
        "parent_model": "", "format": "gguf",
        "family": arch if isinstance(arch, str) else "",
        "families": [arch] if isinstance(arch, str) else None,
        "parameter_size": parameter_size(count) if count else "",
        "quantization_level": FILE_TYPES.get(ftype, "") if isinstance(ftype, int) else "",
    }
    return details, meta


@functools.lru_cache(maxsize=32)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


async def digest(slot: ModelSlot) -> str:
    """The GGUF file's SHA-256 (what Ollama's digests are): its worker's fingerprint when it
    has one, else hashed here once per file version (in a thread; cached)."""
    ready = slot.worker.ready if slot.worker is not None else None
    if ready is not None and ready.fingerprint:
        return ready.fingerprint
    try:
        st = slot.model.path.stat()
        return await asyncio.to_thread(_file_sha256, str(slot.model.path), st.st_size, st.st_mtime_ns)
    except OSError:
        return ""


async def tags(request: Request) -> Response:
    """Every configured name and alias, with its tag. Never loads a model."""
    pool: Pool = request.app.state.pool
    out = []
    for ident in pool.config.ids():
        slot = resolve(pool, ident)
        path = slot.model.path
        try:
            st = path.stat()
        except OSError:
            continue  # a configured file that is missing is not "available locally"
        details, _ = model_facts(path)
        out.append({"name": tagged(ident), "model": tagged(ident), "modified_at": _iso(st.st_mtime),
                    "size": st.st_size, "digest": await digest(slot), "details": details})
    return JSONResponse({"models": out})


def _parameters(slot: ModelSlot) -> str:
    """The model's configured generation parameters, one ``name value`` a line (Ollama's
    ``parameters``): its sampling defaults, num_ctx and num_predict (config's ``n_predict``)."""
    params: list[tuple[str, Any]] = sorted(slot.model.sampling.items())
    if slot.model.n_ctx is not None:
        params.append(("num_ctx", slot.model.n_ctx))
    if slot.model.n_predict > 0:
        params.append(("num_predict", slot.model.n_predict))
    return "\n".join(f"{k:<30} {v}" for k, v in params)


async def show(request: Request) -> Response:
    body = await read_json(request)
    pool: Pool = request.app.state.pool
    name = body.get("model") if body.get("model") is not None else body.get("name")  # "name": older clients
    slot = resolve(pool, name)
    label_request(request, slot.model.name)
    verbose = get_bool(body, "verbose", False)
    path = slot.model.path
    try:
        st = path.stat()
    except OSError:
        raise NotFound(f"model '{name}' not found: its GGUF file is missing", param="model") from None
    details, info = await asyncio.to_thread(model_facts, path, arrays=verbose)
    template = chat_template(slot.model.chat_template, path)
    params = _parameters(slot)
    modelfile = (f"# Modelfile of {tagged(slot.model.name)}, served by modelyard\nFROM ./{path.name}\n"
                 + (f'TEMPLATE """{template}"""\n' if template else "")
                 + "".join(f"PARAMETER {ln.split(None, 1)[0]} {ln.split(None, 1)[1]}\n" for ln in params.splitlines()))
    license_ = info.get("general.license")
    return JSONResponse({
        "license": license_ if isinstance(license_, str) else "",
        "modelfile": modelfile,
        "parameters": params,
        "template": template,
        "details": details,
        "model_info": info,
        "capabilities": CAPABILITIES,
        "modified_at": _iso(st.st_mtime),
    })


async def ps(request: Request) -> Response:
    """The loaded models: size (the worker's resident memory, else placement's estimate),
    ``expires_at`` (when the idle unload is due: ``idle_ttl_s`` or the last request's
    ``keep_alive`` after the last activity; about 292 years away for a model never unloaded), ``context_length`` (n_ctx). ``size_vram`` is 0: everything is on the CPU."""
    pool: Pool = request.app.state.pool
    out = []
    for slot in pool.slots.values():
        if slot.state not in LOADED or slot.worker is None or slot.worker.ready is None:
            continue
        info = slot.describe()
        ready = slot.worker.ready
        since = slot.last_used or slot.loaded_at or time.time()
        due, ttl = slot.expires_at(), slot.idle_ttl()  # idle_ttl_s, or the last request's keep_alive
        expires = (_iso(due) if due is not None else _iso_forever(since) if ttl is None
                   else _iso(time.time() + ttl))  # busy: the TTL starts when it is idle
        details, _ = model_facts(slot.model.path)
        out.append({"name": tagged(slot.model.name), "model": tagged(slot.model.name),
                    "size": info.get("rss_bytes") or slot.estimate().total,
                    "digest": await digest(slot), "details": details,
                    "expires_at": expires,
                    "size_vram": 0, "context_length": ready.n_ctx})
    return JSONResponse({"models": out})


def _iso_forever(since: float) -> str:
    """``expires_at`` of a model never unloaded for idleness: ~292 years on, as Ollama's for
    keep_alive < 0 (the longest Go duration)."""
    d = datetime.fromtimestamp(since, UTC)
    return d.replace(year=d.year + 292).isoformat(timespec="microseconds").replace("+00:00", "Z")


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


routes = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/version", version, methods=["GET"]),
]

