"""A generation's frames: the router's Generate (and Cancel); the worker's Accepted, PromptProgress
while the prompt is prefilled, a Token per generated token and the final Done (or an Error)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.frame import Message
from protocol.sampling import SamplingFields

#: finish_reason values carried by Done.
FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass(frozen=True, kw_only=True)
class Accepted(Message):
    """A Generate was taken: its prompt is tokenized, fits the context and the KV budget,
    its constraint compiled, and it is queued for a slot. Sent once, before any Token, so
    the router can open a stream (and keep it alive) while the prompt is prefilled; every
    error that can still follow is one of the generation itself.

    ``set_aside``: what the constraint could not enforce and was loosened to the nearest
    enforceable grammar (e.g. ``Unimplemented keys: ["propertyNames"]``), for the client
    to be told (``router.http.set_aside``)."""

    TYPE: ClassVar[str] = "accepted"
    prompt_tokens: int  # the prompt's tokens
    set_aside: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class PromptProgress(Message):
    """How far a prompt's prefill is, for a Generate with ``return_progress`` (llama-server's
    ``prompt_progress``): sent after Accepted and before the first Token — once as the prefill
    starts (``processed == cache``), then after each prefill chunk (forward pass) that carried
    the prompt, the last with ``processed == total``. Only choice 0 of a Generate with ``n`` > 1
    reports (the others copy its prompt).

    Units: tokens, and ms for ``time_ms`` (elapsed since the prompt's prefill was queued in the
    engine; 0 in the first report). ``0 <= cache <= processed <= total``, ``total >= 1``."""

    TYPE: ClassVar[str] = "prompt_progress"
    total: int  # the prompt's tokens
    cache: int  # of them, reused from the KV cache (prefix cache)
    processed: int  # of them, in the KV now (cache + evaluated so far)
    time_ms: float

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        if not (fields["total"] >= 1 and 0 <= fields["cache"] <= fields["processed"] <= fields["total"]):
            return (f"total={fields['total']} cache={fields['cache']} processed={fields['processed']}: "
                    "need 0 <= cache <= processed <= total and total >= 1")
        if not fields["time_ms"] >= 0:
            return f"time_ms must be >= 0, got {fields['time_ms']}"
        return None


@dataclass(frozen=True, kw_only=True)
class Token(Message):
    """One generated token. ``text`` is the safe text delta (UTF-8 complete, no
    possible stop-string prefix); it may be empty and is never retracted."""

    TYPE: ClassVar[str] = "token"
    text: str
    token_id: int
    piece: bytes  # the token's raw bytes (may end mid UTF-8 character)
    logprob: float | None = None  # of token_id under the raw distribution
    top_logprobs: list[list[Any]] = field(default_factory=list)  # [[id, logprob, piece bytes], ...]
    index: int = 0  # the choice this token belongs to (Generate.n > 1)
    # set on the first token of choice 0 only (0 elsewhere): the prompt's token count and how
    # many of them were reused from the KV cache, so a stream can report usage up front
    prompt_tokens: int = 0
    cache_n: int = 0


@dataclass(frozen=True, kw_only=True)
class Done(Message):
    """The final frame of a generation."""

    TYPE: ClassVar[str] = "done"
    finish_reason: str  # "stop" | "length" | "cancelled"
    stop_type: str  # "eos" | "word" | "limit" | "cancelled"
    stopping_word: str = ""
    text: str = ""  # text held back until the end (not yet sent in a Token)
    prompt_tokens: int  # usage
    completion_tokens: int  # usage
    prompt_n: int  # timings: prompt tokens evaluated (after KV cache reuse)
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int  # prompt tokens reused from the KV cache
    id_slot: int = -1  # the KV slot the generation ran in (-1: it never ran)
    # Generate.n > 1: one map per choice, by index: {"index", "finish_reason", "stop_type",
    # "stopping_word", "text" (its held-back tail), "completion_tokens"}; the fields above then
    # describe choice 0, except completion_tokens / predicted_n (sums over the choices).
    choices: list[dict[str, Any]] = field(default_factory=list)
    # choice 0 ended on an end-of-generation token: its id (it is not text, so no Token frame
    # carried it; -1: none) and, when n_probs > 0, its probabilities as in Token.logprob / top_logprobs
    eog_token: int = -1
    eog_logprob: float | None = None
    eog_top_logprobs: list[list[Any]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Generate(Message, SamplingFields):
    """Run one generation. Exactly one of ``prompt`` (text or token ids) and
    ``messages`` (chat, rendered with the model's template by the worker) is set.

    The sampling fields (llama.cpp's names and defaults, the constraints ``json_schema`` /
    ``grammar``) are :class:`protocol.sampling.SamplingFields`'s, declared there once.
    """

    TYPE: ClassVar[str] = "generate"
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    # with messages: the template's ``tools`` (HF's shape, [{"type": "function", "function":
    # {"name", "description", "parameters"}}]), for templates with their own tool syntax
    tools: list[dict[str, Any]] | None = None
    # with messages: more variables for the template (llama.cpp's chat_template_kwargs, e.g.
    # enable_thinking); messages, tools, add_generation_prompt, bos_token, eos_token are not among them
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # choices: n sequences from one prefilled prompt (seed + i each when seeded)
    # with messages: render them with this chat template (Jinja text or a known name such as
    # "chatml") instead of the model's own — a preset's template over the same loaded weights
    chat_template: str | None = None
    trace_id: str = ""  # the HTTP request's X-Request-Id, for the worker's log lines ("" if none)
    # a plain file name (slot_filename_error): as the generation ends, the worker saves its KV entry
    # to that file in its --slot-save-path, in the same step (nothing can take the entry over
    # first), and sends the Done once the file is written (an Error if it cannot be); "" = no save.
    # The disaggregated hand-over (router.serving.disaggregate) uses it; n must be 1.
    save_slot_to: str = ""
    # True: as the generation ends (same step), the worker streams its KV entry's state
    # (worker.engine.kv.state format) as KVChunk frames with this id, at most KV_WINDOW beyond
    # the last KVAck it got, then sends the Done. n must be 1; not with save_slot_to.
    stream_state: bool = False
    # True: the worker reports the prompt's prefill as PromptProgress frames (llama.cpp's return_progress)
    return_progress: bool = False


@dataclass(frozen=True, kw_only=True)
class Cancel(Message):
    """Cancel request ``id``: a queued one is dropped, a running one stops within
    a token (or a prefill chunk) and answers Done(finish_reason="cancelled")."""

    TYPE: ClassVar[str] = "cancel"
