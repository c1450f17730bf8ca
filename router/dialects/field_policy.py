"""Request fields that change the answer, and which generation route honours which.

Each dialect ignores fields it does not know (harnesses send metadata, caching hints,
service tiers, ... that change nothing). But a field that *would* change the answer
— on this route in another dialect's spelling, or on another route, or in
llama.cpp's server — must never be dropped silently: the client would get an answer
to a question it did not ask. :data:`FIELDS` is the one table of such fields, each
with its neutral value (the value at which it changes nothing, so a client that
sends a default is not refused); :data:`HONOURED` says which of them each route
implements. :func:`refuse_ignored` turns a field of the table that the route does
not implement, sent at a non-neutral value, into a 400 naming it — with the route's
own field for the same thing when it has one (``'stop' ... use 'stop_sequences'``).

``null`` counts as absent everywhere, as in the readers of ``router.http.params``.
Sources of the table: OpenAI's chat / completions / Responses request bodies,
Anthropic's Messages request body, and llama.cpp's ``tools/server/server-schema.cpp``
(the fields its server reads, with their defaults).

llama.cpp's sampler fields (``mirostat``, ``typical_p``, DRY, XTC, ...) are
``router.serving.samplers``' table (the same on every route: every route runs the same
sampler); :func:`refuse_ignored` applies it too, so a route that reads only some
sampling fields (Responses, Messages) still refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.http.errors import BadRequest
from router.serving.samplers import refuse_unimplemented


def _never(v: Any) -> bool:
    return False


def _empty(v: Any) -> bool:
    return v in ("", [], {})


def _false(v: Any) -> bool:
    return v is False


def _true(v: Any) -> bool:
    return v is True


def _one(v: Any) -> bool:
    return not isinstance(v, bool) and v == 1


def _not_positive(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v <= 0


def _negative(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v < 0


def _no_stop(v: Any) -> bool:
    return v == "" or (isinstance(v, list) and all(s == "" for s in v))


def _text_format(v: Any) -> bool:
    return isinstance(v, dict) and v.get("type") == "text"


def _no_tool_choice(v: Any) -> bool:
    return v in ("none", "auto") or (isinstance(v, dict) and v.get("type") in ("none", "auto"))


def _no_logprobs(v: Any) -> bool:
    return v is False or (not isinstance(v, bool) and v == 0)


@dataclass(frozen=True)
class Field:
    """A request field that changes the answer. ``neutral(value)``: True when the value
    changes nothing (``neutral_text`` says which value that is, for the message)."""

    neutral: Callable[[Any], bool]
    neutral_text: str | None = None
    instead: str | None = None  # what to do instead, on every route (a route's own advice wins)


#: Every field that changes a generation's answer somewhere, with its neutral value.
FIELDS: dict[str, Field] = {
    # how long, how many
    "max_tokens": Field(_never),
    "max_completion_tokens": Field(_never),
    "max_output_tokens": Field(_never),
    "n_predict": Field(_never),
    "n": Field(_one, "1"),
    "n_cmpl": Field(_one, "1"),  # llama.cpp: number of completions (alias of n there)
    "t_max_predict_ms": Field(_not_positive, "0"),  # llama.cpp: a time limit on generation
    "n_indent": Field(_not_positive, "0"),  # llama.cpp: stop at a line indented less than this
    # where to stop
    "stop": Field(_no_stop, "empty"),
    "stop_sequences": Field(_no_stop, "empty"),
    # how to sample (beyond temperature / top_p, which every route reads)
    "seed": Field(_negative, "-1 (random)"),
    "top_k": Field(_not_positive, "0"),
    "min_p": Field(_not_positive, "0.0"),
    "repeat_penalty": Field(lambda v: v == 1, "1.0"),
    "presence_penalty": Field(lambda v: v == 0, "0.0"),
    "frequency_penalty": Field(lambda v: v == 0, "0.0"),
    "logit_bias": Field(_empty, "empty"),
    "ignore_eos": Field(_false, "false"),
    # what comes back
    "logprobs": Field(_no_logprobs, "false"),
    "top_logprobs": Field(lambda v: not isinstance(v, bool) and v == 0, "0"),
    "n_probs": Field(lambda v: not isinstance(v, bool) and v == 0, "0"),
    # constraints
    "response_format": Field(_text_format, '{"type": "text"}'),
    "json_schema": Field(_empty, "empty"),
    "grammar": Field(_empty, "empty"),
    "grammar_lazy": Field(_false, "false"),  # llama.cpp: the grammar applies only after a trigger
    "grammar_triggers": Field(_empty, "empty"),
    "tools": Field(_empty, "empty"),
    "tool_choice": Field(_no_tool_choice, "'none' or 'auto'"),
    "functions": Field(_never, instead="use 'tools'"),  # OpenAI's legacy function calling
    "function_call": Field(_never, instead="use 'tool_choice'"),
    # the prompt
    "system": Field(_empty, "empty"),  # Anthropic's system prompt
    "instructions": Field(_empty, "empty"),  # Responses' system prompt
    "chat_template_kwargs": Field(_empty, "empty"),  # llama.cpp / vLLM: variables for the chat template
    "add_generation_prompt": Field(_true, "true"),  # llama.cpp: false renders no assistant header
    # inputs and outputs these text models do not have
    "image_data": Field(_empty, "empty", "these models read text only"),  # llama.cpp's multimodal inputs
    "multimodal_data": Field(_empty, "empty", "these models read text only"),
    "audio": Field(_never, instead="these models produce text only"),  # OpenAI's audio output
    "web_search_options": Field(_never, instead="there is no web search"),  # OpenAI's built-in web search
    "lora": Field(_empty, "empty"),  # llama.cpp: adapters applied to this request
}

_SAMPLING = frozenset({"stop", "seed", "top_k", "min_p", "repeat_penalty", "presence_penalty",
                       "frequency_penalty", "logit_bias", "ignore_eos"})

#: route -> the fields of FIELDS it implements.
HONOURED: dict[str, frozenset[str]] = {
    "/v1/chat/completions": _SAMPLING | {
        "max_tokens", "max_completion_tokens", "n_predict", "n", "logprobs", "top_logprobs",
        "response_format", "json_schema", "grammar", "tools", "tool_choice", "chat_template_kwargs"},
    "/v1/completions": _SAMPLING | {
        "max_tokens", "max_completion_tokens", "n_predict", "n", "logprobs", "json_schema", "grammar"},
    "/v1/responses": frozenset({"max_output_tokens", "top_logprobs", "tools", "tool_choice", "instructions"}),
    "/v1/messages": frozenset({"max_tokens", "stop_sequences", "top_k", "tools", "tool_choice", "system"}),
    "/completion": _SAMPLING | {"n_predict", "max_tokens", "max_completion_tokens", "n_probs", "json_schema",
                                "grammar"},
    # Ollama's native routes (router.dialects.ollama_api): sampling fields live in its "options"
    "/api/chat": frozenset({"tools", "logprobs", "top_logprobs"}),
    "/api/generate": frozenset({"system", "logprobs", "top_logprobs"}),
}

#: (route, field) -> the route's own way of saying the same thing.
_INSTEAD: dict[tuple[str, str], str] = {
    **{(r, "stop_sequences"): "use 'stop'" for r in ("/v1/chat/completions", "/v1/completions", "/completion")},
    **{(r, "system"): "put a system message first in 'messages'"
       for r in ("/v1/chat/completions",)},
    **{(r, "instructions"): "put a system message first in 'messages'"
       for r in ("/v1/chat/completions",)},
    ("/v1/chat/completions", "max_output_tokens"): "use 'max_tokens'",
    ("/v1/chat/completions", "n_cmpl"): "use 'n'",
    ("/v1/chat/completions", "n_probs"): "it is llama.cpp's /completion field; use 'logprobs' "
                                         "(and 'top_logprobs')",
    ("/v1/completions", "max_output_tokens"): "use 'max_tokens'",
    ("/v1/completions", "n_cmpl"): "use 'n'",
    ("/v1/completions", "top_logprobs"): "use 'logprobs': N",
    ("/v1/completions", "n_probs"): "it is llama.cpp's /completion field; use 'logprobs'",
    ("/v1/completions", "response_format"): "use 'json_schema' or 'grammar'",
    ("/v1/completions", "tools"): "tools are offered on /v1/chat/completions",
    ("/v1/completions", "tool_choice"): "tools are offered on /v1/chat/completions",
    ("/v1/completions", "system"): "a completion has no system prompt; put it in 'prompt'",
    ("/v1/completions", "instructions"): "a completion has no system prompt; put it in 'prompt'",
    **{("/v1/responses", f): "use 'max_output_tokens'"
       for f in ("max_tokens", "max_completion_tokens", "n_predict")},
    ("/v1/responses", "response_format"): "use 'text.format'",
    ("/v1/responses", "json_schema"): "use 'text.format'",
    ("/v1/responses", "logprobs"): "use 'include': [\"message.output_text.logprobs\"] and 'top_logprobs'",
    ("/v1/responses", "n_probs"): "use 'include': [\"message.output_text.logprobs\"] and 'top_logprobs'",
    ("/v1/responses", "system"): "use 'instructions'",
    **{("/v1/messages", f): "use 'max_tokens'" for f in ("max_completion_tokens", "max_output_tokens", "n_predict")},
    ("/v1/messages", "stop"): "use 'stop_sequences'",
    ("/v1/messages", "response_format"): "use 'output_config.format'",
    ("/v1/messages", "json_schema"): "use 'output_config.format'",
    ("/v1/messages", "instructions"): "use 'system'",
    ("/completion", "n"): "one completion per request here",
    ("/completion", "n_cmpl"): "one completion per request here",
    ("/completion", "max_output_tokens"): "use 'n_predict'",
    ("/completion", "logprobs"): "use 'n_probs'",
    ("/completion", "top_logprobs"): "use 'n_probs'",
    ("/completion", "response_format"): "use 'json_schema' or 'grammar'",
    ("/completion", "tools"): "tools are offered on /v1/chat/completions",
    ("/completion", "tool_choice"): "tools are offered on /v1/chat/completions",
    ("/completion", "system"): "a completion has no system prompt; put it in 'prompt'",
    ("/completion", "instructions"): "a completion has no system prompt; put it in 'prompt'",
    **{(r, f): "Ollama's clients give it in 'options'" for r in ("/api/chat", "/api/generate")
       for f in ("seed", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "stop")},
    **{(r, f): "use 'options.num_predict'" for r in ("/api/chat", "/api/generate")
       for f in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")},
    **{(r, f): "use 'format' (\"json\" or a JSON Schema)" for r in ("/api/chat", "/api/generate")
       for f in ("response_format", "json_schema")},
    ("/api/chat", "tool_choice"): "Ollama's API has no tool choice: with 'tools' the model chooses",
    ("/api/chat", "system"): "put a system message first in 'messages'",
    ("/api/chat", "instructions"): "put a system message first in 'messages'",
    ("/api/generate", "instructions"): "use 'system'",
    ("/api/generate", "tools"): "tools are offered on /api/chat",
    ("/api/generate", "tool_choice"): "tools are offered on /api/chat",
}


def refuse_ignored(body: dict[str, Any], route: str) -> None:
    """A 400 naming the first field of :data:`FIELDS` in ``body`` that ``route`` (a key of
    :data:`HONOURED`) does not implement and that is not at its neutral value.

    llama.cpp's sampler fields are checked first, on every route alike
    (``router.serving.samplers.refuse_unimplemented``).

    Raises BadRequest (``param`` = the field); KeyError for an unknown ``route`` (a bug)."""
    honoured = HONOURED[route]
    refuse_unimplemented(body)
    for key, spec in FIELDS.items():
        if key in honoured or body.get(key) is None or spec.neutral(body[key]):
            continue
        instead = _INSTEAD.get((route, key), spec.instead)
        if instead is None:
            instead = (f"leave it out or at {spec.neutral_text}" if spec.neutral_text is not None
                       else "leave it out")
        raise BadRequest(f"'{key}' is not supported on {route} (it would change the answer and this "
                         f"server does not implement it there): {instead}", param=key)
