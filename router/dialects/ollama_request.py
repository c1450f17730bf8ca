"""Ollama's requests read (``POST /api/chat``, ``POST /api/generate``; router.dialects.ollama_api
serves them), as Ollama's ``docs/api.md`` gives them:

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
"""

from __future__ import annotations

import json
import math
from collections import deque
from typing import Any

from starlette.requests import Request

from protocol.limits import MAX_N_PROBS
from router.dialects.chat_request import chat_tool, tool_calls
from router.dialects.constraints import schema_text
from router.dialects.field_policy import refuse_ignored
from router.dialects.shared import objects
from router.dialects.tools import ChatTurn, Tool, ToolCall
from router.http.errors import BadRequest, NotFound
from router.http.params import INT32_MAX, get_bool, get_int, json_type, read_json
from router.http.set_aside import set_aside
from router.serving import keep_alive as keepalive  # the module (handlers have a keep_alive value)
from router.serving.budget import context_size
from router.serving.generation import read_sampling
from router.serving.models import ModelPool, ServedModel

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

def tagged(name: str) -> str:
    """A model id as Ollama names it: with its tag (``latest`` when it has none)."""
    return name if ":" in name else f"{name}:latest"


def resolve(pool: ModelPool, name: Any) -> ServedModel:
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


def read_think(body: dict[str, Any], model: str) -> None:
    """``think``: a 400 when asked for (these models do not think), as Ollama answers; false is fine."""
    t = body.get("think")
    if t is None or t is False or t in ("", "false", "none"):
        return
    if isinstance(t, bool) or isinstance(t, str):
        raise BadRequest(f'"{model}" does not support thinking', param="think")
    raise BadRequest("'think' must be a boolean or one of 'high', 'medium', 'low'", param="think")


def refuse_top_level(body: dict[str, Any], route: str) -> None:
    """Other dialects' answer-changing fields (``router.dialects.field_policy``), and Ollama options
    given at the top level instead of in ``options``: a 400 naming them."""
    refuse_ignored(body, route)
    for key in ("temperature", "top_p", "num_predict", "num_ctx", "repeat_last_n", "typical_p",
                "mirostat", "tfs_z"):
        if body.get(key) is not None:
            raise BadRequest(f"'{key}' is not a field of {route}: Ollama's clients give it in 'options'",
                             param=key)


def read_format(body: dict[str, Any]) -> str | None:
    """``format``: ``"json"`` (any JSON object), a JSON Schema, or ``""`` / null (text)."""
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json.dumps({"type": "object"})
    if isinstance(fmt, dict):
        return schema_text(fmt, "format")
    raise BadRequest(f"'format' must be \"json\" or a JSON Schema object, got {json.dumps(fmt)[:60]}", param="format")


def read_options(request: Request, body: dict[str, Any], slot: ServedModel) -> dict[str, Any]:
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


def read_logprobs(body: dict[str, Any]) -> int | None:
    """``logprobs`` / ``top_logprobs``: None (off), else the alternatives per token."""
    want = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", 0, 0, MAX_N_PROBS)
    if top and not want:
        raise BadRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    return top if want else None


def read_overflow(request: Request, body: dict[str, Any]) -> None:
    """``truncate`` / ``shift``: set aside when true (a prompt beyond n_ctx is a 400 here)."""
    for key in ("truncate", "shift"):
        if get_bool(body, key, False):
            set_aside(request.state, key, "true", "a prompt beyond n_ctx is a 400 and a generation that reaches "
                      "it ends with done_reason 'length'; nothing is truncated or shifted")


# ----------------------------------------------------------------------------- chat turns


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
            calls = tool_calls(m, where, id_prefix=f"call_{i}_", ollama=True)
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


def read_tool(t: dict[str, Any], where: str) -> Tool:
    """One of ``tools``: a function tool (Ollama has no custom tools)."""
    return chat_tool(t, where, custom=False)


async def read_body(request: Request) -> dict[str, Any]:
    """The request's JSON body (read once; kept on the request's state)."""
    body: dict[str, Any] | None = getattr(request.state, "ollama_body", None)
    if body is None:
        body = await read_json(request)
        request.state.ollama_body = body
    return body
