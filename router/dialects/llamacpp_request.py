"""What a llama.cpp ``/completion`` request asks, read as llama-server reads it: its prompts (a
string, token ids, a mixed list, a prompt object, or a list of these), text-keyed ``logit_bias``,
``n_predict`` and its aliases, llama.cpp's sampling names and defaults, ``return_progress`` — and
the Generate frames that run it (:func:`read_completion`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from starlette.requests import Request

from protocol import Generate, Tokenize, TokenizeResult
from protocol.limits import GENERATE_LIMITS
from router.dialects.constraints import llamacpp_constraint
from router.dialects.field_policy import refuse_ignored
from router.http.errors import BadGateway, BadRequest
from router.http.params import (
    INT32_MAX,
    MAX_TOKEN_ID,
    N_PREDICT_MIN,
    get_bool,
    get_bounded,
    get_int,
    get_prompt,
)
from router.http.sse import until_disconnect
from router.serving.budget import RequestTooLarge, request_ceiling
from router.serving.calls import call_worker, worker_ready
from router.serving.generation import LLAMACPP_DEFAULTS, new_id, read_sampling
from router.serving.models import ServedModel

PromptPart = str | int
Prompt = str | list[int] | list[PromptPart]


@dataclass(frozen=True)
class Completion:
    """A /completion request as read: one Generate per prompt (``index`` its place), and what
    its answer needs. ``max_tokens``: the n_predict each prompt runs with (None: until the
    context is full); ``grammar_param``: the request field its constraint came from."""

    prompts: list[str | list[int]]
    msgs: list[Generate]
    max_tokens: int | None
    n_probs: int
    post_sampling: bool
    return_tokens: bool
    streaming: bool
    grammar_param: str | None


async def read_completion(request: Request, slot: ServedModel, body: dict[str, Any]) -> Completion:
    """``body`` of /completion for ``slot``'s model. Raises BadRequest naming the field at fault,
    RequestTooLarge for several prompts beyond the request's ceiling; tokenizes a mixed prompt and
    text-keyed logit_bias with the model's worker (loading it)."""
    # llama.cpp's post_sampling_probs: served here (router.serving.samplers refuses it on the other routes)
    post_sampling = get_bool(body, "post_sampling_probs", False)
    body = {k: v for k, v in body.items() if k != "post_sampling_probs"}
    refuse_ignored(body, "/completion")  # n, logprobs, response_format, tools, ...: not /completion fields
    prompts: list[str | list[int]] = []
    for parts in _prompts(body, slot.model.parallel + slot.model.max_queue):
        if isinstance(parts, list) and any(isinstance(p, str) for p in parts):
            prompts.append(await _mixed_ids(request, slot, parts))
        else:
            prompts.append(cast("str | list[int]", parts))  # a list with no string in it holds ids only
    body = await _text_logit_bias(request, slot, body)
    n_predict = get_int(body, "n_predict", None, N_PREDICT_MIN, INT32_MAX)  # -1: until n_ctx
    for alias in ("max_completion_tokens", "max_tokens"):  # llama.cpp's aliases of n_predict
        if n_predict is None:
            n_predict = get_int(body, alias, None, N_PREDICT_MIN, INT32_MAX)
    max_tokens = None if n_predict is None or n_predict < 0 else n_predict
    n_probs = get_bounded(body, "n_probs", 0, GENERATE_LIMITS["n_probs"], integer=True)
    return_tokens = get_bool(body, "return_tokens", False)
    streaming = get_bool(body, "stream", False)
    # llama-server sends prompt_progress chunks in a stream only; without one the field does nothing
    return_progress = get_bool(body, "return_progress", False) and streaming
    json_schema, grammar, param = llamacpp_constraint(body)
    # a slot that exists is accepted; which slot runs is the prefix cache's choice (the text does not
    # depend on it; the answer's id_slot says which ran), as llama.cpp does when id_slot is -1
    get_int(body, "id_slot", -1, -1, slot.model.parallel - 1)
    sampling = read_sampling(body, LLAMACPP_DEFAULTS, slot, openai=False)
    cache_prompt, ignore_eos = get_bool(body, "cache_prompt", True), get_bool(body, "ignore_eos", False)
    if len(prompts) > 1:
        max_tokens = await _shared_n_predict(request, slot, len(prompts), max_tokens)
    msgs = [Generate(id=new_id("cmpl"), prompt=prompt, max_tokens=max_tokens, n_probs=n_probs,
                     post_sampling_probs=post_sampling, cache_prompt=cache_prompt, ignore_eos=ignore_eos,
                     json_schema=json_schema, grammar=grammar, return_progress=return_progress, **sampling)
            for prompt in prompts]
    return Completion(prompts, msgs, max_tokens, n_probs, post_sampling, return_tokens, streaming, param)


def _is_id(p: Any) -> bool:
    return isinstance(p, int) and not isinstance(p, bool)


def _prompts(body: dict[str, Any], most: int) -> list[Prompt]:
    """``prompt``'s prompts, as llama-server's ``tokenize_input_prompts`` reads the field: a list
    holding no number is a list of prompts (each answered in order, ``index`` its place), anything
    else is one prompt. ``most``: how many one request may carry (a 400 naming ``prompt`` beyond)."""
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) > 1 and not any(_is_id(p) for p in raw):
        if len(raw) > most:
            raise BadRequest(f"'prompt' holds {len(raw)} prompts; one request may carry at most {most} for this "
                             "model (its parallel + max_queue: every prompt runs as a request of its own)",
                             param="prompt")
        return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(raw)]
    return [_prompt(raw, "prompt")]


def _prompt(raw: Any, param: str) -> Prompt:
    """One prompt as llama-server takes one: a string, token ids, a list mixing strings and
    token ids (``[12, 34, "text", 56]``: returned as is, :func:`_mixed_ids` tokenizes it), or an
    object ``{"prompt_string": ...}`` (with no ``multimodal_data``: this server has no vision).
    ``param``: the field's name in errors (``prompt``, ``prompt[2]``)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (dict, list)):
        raw = raw[0]  # one prompt in a list of prompts
    if isinstance(raw, dict):
        if raw.get("multimodal_data"):
            raise BadRequest(f"'{param}.multimodal_data' is not supported: this server's models take text only",
                             param=f"{param}.multimodal_data")
        text = raw.get("prompt_string")
        if not isinstance(text, str):
            raise BadRequest("a prompt object needs a string 'prompt_string'", param=f"{param}.prompt_string")
        return text
    prompt = get_prompt(raw, param)
    if prompt is not None:
        return prompt
    if (isinstance(raw, list) and raw and all(isinstance(p, str) or _is_id(p) for p in raw)
            and any(_is_id(p) for p in raw)):
        for t in raw:
            if _is_id(t) and not 0 <= t <= MAX_TOKEN_ID:
                raise BadRequest(f"'{param}': token ids must be integers in [0, {MAX_TOKEN_ID}], got {t}",
                                 param=param)
        return list(raw)
    raise BadRequest(f"'{param}' must be a string, a non-empty list of token ids (strings may be mixed in), "
                     "{\"prompt_string\": ...} or a list of these (several prompts)", param=param)


async def _tokenize(request: Request, slot: ServedModel, text: str, add_special: bool, parse_special: bool,
                    param: str) -> list[int]:
    ans = await call_worker(request, slot, lambda i: Tokenize(id=i, content=text, add_special=add_special,
                                                         parse_special=parse_special), param=param)
    if not isinstance(ans, TokenizeResult):
        raise BadGateway(f"unexpected {ans.TYPE} answer to tokenize")
    return list(ans.tokens.view())


async def _mixed_ids(request: Request, slot: ServedModel, parts: Sequence[PromptPart]) -> list[int]:
    """A mixed prompt's token ids, as llama-server's ``tokenize_mixed``: each string tokenized
    with special tokens parsed, the first element (only) with the model's BOS when it is a string;
    ids kept as they are."""
    out: list[int] = []
    for k, p in enumerate(parts):
        if isinstance(p, str):
            out += await _tokenize(request, slot, p, k == 0, True, "prompt")
        else:
            out.append(p)
    return out


async def _text_logit_bias(request: Request, slot: ServedModel, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with llama-server's text-keyed ``logit_bias`` entries (``{"Hello": -1}``,
    ``[["Hello", false]]``) turned into one entry per token of the text (tokenized without
    special tokens, as llama-server does); entries keyed by token id are left as they are."""
    lb = body.get("logit_bias")
    if isinstance(lb, dict):
        pairs = list(lb.items())
    elif isinstance(lb, list) and all(isinstance(p, list) and len(p) == 2 for p in lb):
        pairs = [(p[0], p[1]) for p in lb]
    else:
        return body
    if not any(isinstance(k, str) and not k.strip().isdigit() for k, _ in pairs):
        return body
    out: list[list[Any]] = []
    for key, bias in pairs:
        if isinstance(key, str) and not key.strip().isdigit():
            out += [[t, bias] for t in await _tokenize(request, slot, key, False, False, "logit_bias")]
        else:
            out.append([key, bias])
    return {**body, "logit_bias": out}


async def _shared_n_predict(request: Request, slot: ServedModel, k: int, max_tokens: int | None) -> int | None:
    """The ``n_predict`` each of ``k`` prompts of one request gets: its total work is bounded
    as ``n`` choices' is (``router.serving.budget``): without ``n_predict`` each takes an equal share
    of the model's request ceiling; with one, ``k`` x ``n_predict`` beyond it is a 400 naming
    ``prompt``. The ceiling needs the worker's n_ctx when none is configured: the model is loaded
    first then (as a tokenize call would load it)."""
    ceiling, why = request_ceiling(slot)
    if ceiling is None:
        await until_disconnect(request.receive, worker_ready(slot))
        ceiling, why = request_ceiling(slot)
        if ceiling is None:
            return max_tokens
    if max_tokens is None:
        if ceiling // k < 1:
            raise RequestTooLarge(f"{k} prompts cannot share this request's ceiling of {ceiling} tokens ({why}) "
                                  f"for model '{slot.model.name}'", param="prompt")
        return ceiling // k
    if k * max_tokens > ceiling:
        raise RequestTooLarge(
            f"{k} prompts x n_predict {max_tokens} = {k * max_tokens} tokens is beyond what one request may ask "
            f"of model '{slot.model.name}': {ceiling} tokens ({why}; set max_request_tokens to allow more). "
            "Send fewer prompts or fewer tokens", param="prompt")
    return max_tokens
