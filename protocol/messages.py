"""Router <-> worker message types: small typed records, one per frame.

Every frame on the wire is one msgpack map::

    {"v": PROTOCOL_VERSION, "type": "<tag>", "id": "<request id>", ...fields}

``id`` is the request id the message belongs to (a Generate and all its Token /
Done / Error frames share it; worker-level messages such as Hello, Ready, Ping
use their own id). Field names follow OpenAI's and llama.cpp's wire names
(max_tokens, n_probs, finish_reason, prompt_n, ...).

Direction:

* worker -> router: Hello, LoadProgress, Ready, Token, Done, Error, Pong, TokenizeResult,
  DetokenizeResult, ApplyTemplateResult, SlotActionResult
* router -> worker: Generate, Cancel, Ping, Shutdown, Tokenize, Detokenize,
  ApplyTemplate, SlotAction

This module only declares the records; ``protocol.codec`` encodes, decodes and
validates them. It imports neither the router nor the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

#: Bumped on any incompatible change; a frame with another version is rejected.
PROTOCOL_VERSION = 4

#: Largest frame either side accepts, in bytes (a 100 KB prompt as token ids is < 1 MiB).
MAX_FRAME_BYTES = 16 * 1024 * 1024

#: finish_reason values carried by Done.
FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every frame. ``id``: request id (str, 1..128 chars)."""

    TYPE: ClassVar[str] = ""
    id: str

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        """What is wrong with these type-checked field values (optional fields the frame
        leaves out are absent from ``fields``), or None. The codec rejects a frame for which
        this is not None, on encode and on decode."""
        return None


# --------------------------------------------------------------------- worker -> router


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """Sent once right after the worker connects, before it loads its model.

    ``auth`` is the per-spawn secret the router handed this worker privately
    (``protocol.credentials``); the router accepts no peer without it. Empty when
    the worker was started without credentials (the router then ignores it)."""

    TYPE: ClassVar[str] = "hello"
    model: str  # configured model name
    pid: int
    auth: str = ""


#: LoadProgress stages, in the order a load goes through them.
LOAD_STAGES = ("reading_gguf", "building_tokenizer", "preparing_tensors")


@dataclass(frozen=True, kw_only=True)
class LoadProgress(Message):
    """Between Hello and Ready: how far the load is (id: the worker's own id).

    ``stage`` is one of LOAD_STAGES: ``reading_gguf`` (the file's header and metadata;
    done 0 or 1 of total 1), ``building_tokenizer`` (the vocabulary, merges and chat
    template; 0 or 1 of 1), ``preparing_tensors`` (``done`` of ``total`` GGUF tensors
    dequantized into the engine's weights; absent when they come from the weight
    cache). ``0 <= done <= total``, ``total >= 1``. The worker sends a stage's first and
    last step and at most a few in between per second."""

    TYPE: ClassVar[str] = "load_progress"
    stage: str
    done: int
    total: int

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        if fields["stage"] not in LOAD_STAGES:
            return f"stage {fields['stage']!r} is not one of {list(LOAD_STAGES)}"
        if not (fields["total"] >= 1 and 0 <= fields["done"] <= fields["total"]):
            return f"done={fields['done']} total={fields['total']}: need 0 <= done <= total and total >= 1"
        return None


@dataclass(frozen=True, kw_only=True)
class Ready(Message):
    """Sent once the model is loaded: the worker's model identity. ``fingerprint`` is "" when
    the worker was still hashing a file it never saw (the first token does not wait for it);
    it then sends Ready again, identical but for the fingerprint, once the hash is done."""

    TYPE: ClassVar[str] = "ready"
    model: str  # configured model name
    architecture: str  # general.architecture, e.g. "llama", "gemma3"
    gguf_path: str
    file_size: int  # bytes
    fingerprint: str  # content fingerprint of the GGUF file (hex SHA-256), "" until computed
    n_ctx: int  # KV cache size, tokens
    n_ctx_train: int
    n_vocab: int
    has_chat_template: bool
    pid: int
    load_ms: float
    max_jobs: int = 1  # generations run at once: the worker's KV slots (config ``parallel``)
    kv_budget_tokens: int = 0  # KV positions the worker's budget holds in all (0: unknown)


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
class Error(Message):
    """A request failed (or, with the worker's own id, the worker failed to load).

    ``code`` is machine-readable: a ``protocol.errors.ErrorCode`` (a str on the wire;
    the router maps every member, and logs any other code as a 502).
    """

    TYPE: ClassVar[str] = "error"
    code: str
    message: str


@dataclass(frozen=True, kw_only=True)
class Pong(Message):
    """Health answer; sent even mid-generation.

    ``slots`` has one map per KV slot (``max_jobs`` of them), llama.cpp's
    ``/slots`` names: ``{"id": int, "id_task": str | None (the request id
    running in it), "is_processing": bool, "n_past": int (tokens its KV
    holds)}``.
    """

    TYPE: ClassVar[str] = "pong"
    busy: bool
    queue_len: int  # Generate requests waiting for a slot
    running_ids: list[str] = field(default_factory=list)  # every running request id
    slots: list[dict[str, Any]] = field(default_factory=list)
    kv_tokens: int = 0  # KV positions held (running sequences and idle prefix-cache entries)
    kv_budget_tokens: int = 0  # KV positions the budget allows in all
    pid: int


@dataclass(frozen=True, kw_only=True)
class TokenizeResult(Message):
    TYPE: ClassVar[str] = "tokenize_result"
    tokens: list[int]
    pieces: list[bytes] = field(default_factory=list)  # filled when with_pieces was asked


@dataclass(frozen=True, kw_only=True)
class DetokenizeResult(Message):
    TYPE: ClassVar[str] = "detokenize_result"
    content: str


@dataclass(frozen=True, kw_only=True)
class ApplyTemplateResult(Message):
    TYPE: ClassVar[str] = "apply_template_result"
    prompt: str


# --------------------------------------------------------------------- router -> worker


@dataclass(frozen=True, kw_only=True)
class Generate(Message):
    """Run one generation. Exactly one of ``prompt`` (text or token ids) and
    ``messages`` (chat, rendered with the model's template by the worker) is set.

    Sampling fields use llama.cpp's names and defaults; temperature <= 0 is greedy.
    ``max_tokens`` None means until the context (n_ctx) is full.
    ``logit_bias`` is a list of [token_id, bias] pairs.

    Constraints (at most one; the worker masks every sampled token with it, and an
    invalid one is an Error "invalid_grammar" before any token):
    ``json_schema`` — the text of a JSON Schema the output must match;
    ``grammar`` — a Lark grammar (llguidance's dialect: ``%json {...}``, regexes,
    ``start``) the output must match. The generation ends ("stop") when the
    constraint allows nothing more.
    """

    TYPE: ClassVar[str] = "generate"
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    # with messages: the template's ``tools`` (HF's shape, [{"type": "function", "function":
    # {"name", "description", "parameters"}}]), for templates with their own tool syntax
    tools: list[dict[str, Any]] | None = None
    add_special: bool = True
    parse_special: bool = True
    max_tokens: int | None = None
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: list[list[Any]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    n_probs: int = 0  # top-N logprobs per token, 0 = none
    ignore_eos: bool = False
    cache_prompt: bool = True
    n: int = 1  # choices: n sequences from one prefilled prompt (seed + i each when seeded)
    json_schema: str | None = None
    grammar: str | None = None
    trace_id: str = ""  # the HTTP request's X-Request-Id, for the worker's log lines ("" if none)
    # a plain file name (slot_filename_error): as the generation ends, the worker saves its KV entry
    # to that file in its --slot-save-path, in the same step (nothing can take the entry over
    # first), and sends the Done once the file is written (an Error if it cannot be); "" = no save.
    # The disaggregated hand-over (router.disaggregate) uses it; n must be 1.
    save_slot_to: str = ""


@dataclass(frozen=True, kw_only=True)
class Cancel(Message):
    """Cancel request ``id``: a queued one is dropped, a running one stops within
    a token (or a prefill chunk) and answers Done(finish_reason="cancelled")."""

    TYPE: ClassVar[str] = "cancel"


@dataclass(frozen=True, kw_only=True)
class Ping(Message):
    """Liveness (answered by a Pong). ``threads`` > 0: use that many BLAS threads from now
    on (the router's share of the cores, sent only to workers without ``--threads``)."""

    TYPE: ClassVar[str] = "ping"
    threads: int = 0


@dataclass(frozen=True, kw_only=True)
class Shutdown(Message):
    """Ask the worker to cancel its work and exit."""

    TYPE: ClassVar[str] = "shutdown"


@dataclass(frozen=True, kw_only=True)
class Tokenize(Message):
    TYPE: ClassVar[str] = "tokenize"
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


@dataclass(frozen=True, kw_only=True)
class Detokenize(Message):
    TYPE: ClassVar[str] = "detokenize"
    tokens: list[int]


@dataclass(frozen=True, kw_only=True)
class ApplyTemplate(Message):
    TYPE: ClassVar[str] = "apply_template"
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True


#: SlotAction.action values (llama.cpp's ``POST /slots/{id}?action=``).
SLOT_ACTIONS = ("save", "restore", "erase")


def slot_filename_error(name: str) -> str | None:
    """Why ``name`` is not a plain file name for a slot save directory (llama.cpp's
    fs_validate_filename in spirit), or None: non-empty, at most 255 bytes, no path
    separator, no ``..``, no control character or BOM, no leading/trailing whitespace,
    no trailing dot."""
    if not isinstance(name, str) or not name:
        return "the filename is empty"
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return "the filename is longer than 255 bytes"
    if "/" in name or "\\" in name or ".." in name:
        return "the filename must not contain a path separator or '..'"
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or "\ufeff" in name:
        return "the filename contains a control character"
    if name != name.strip() or name.endswith("."):
        return "the filename must not start or end with whitespace or end with '.'"
    return None


@dataclass(frozen=True, kw_only=True)
class SlotAction(Message):
    """Save, restore or erase KV slot ``id_slot`` (llama.cpp's slot actions).

    ``filename`` (save / restore): a plain file name inside the worker's
    ``--slot-save-path`` directory (no path separator, no ``..``; checked on both
    sides). The state never crosses the wire: the worker reads / writes the file
    (``worker.engine.kv_state`` format). A busy slot's action waits until the slot
    is idle (llama.cpp defers it too). Answered by a SlotActionResult or an Error
    ("kv_state_mismatch" naming the field, "kv_state_invalid", "invalid_params",
    "kv_budget_exceeded", "invalid_request" when the worker has no save path).
    """

    TYPE: ClassVar[str] = "slot_action"
    action: str  # one of SLOT_ACTIONS
    id_slot: int  # -1 with "restore": into the prefix cache, no slot (the disaggregated hand-over)
    filename: str = ""


@dataclass(frozen=True, kw_only=True)
class SlotActionResult(Message):
    """A SlotAction done: ``n_tokens`` saved / restored / erased, ``n_bytes`` written / read,
    ``ms`` its wall time (milliseconds)."""

    TYPE: ClassVar[str] = "slot_action_result"
    action: str
    id_slot: int
    filename: str = ""
    n_tokens: int
    n_bytes: int = 0
    ms: float = 0.0


#: Every message type by its wire tag.
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, LoadProgress, Ready, Token, Done, Error, Pong, TokenizeResult, DetokenizeResult,
        ApplyTemplateResult, Generate, Cancel, Ping, Shutdown, Tokenize, Detokenize,
        ApplyTemplate, SlotAction, SlotActionResult,
    )
}
