"""Router <-> worker message types: small typed records, one per frame.

Every frame on the wire is one msgpack map::

    {"v": PROTOCOL_VERSION, "type": "<tag>", "id": "<request id>", ...fields}

``id`` is the request id the message belongs to (a Generate and all its Token /
Done / Error frames share it; worker-level messages such as Hello, Ready, Ping
use their own id). Field names follow OpenAI's and llama.cpp's wire names
(max_tokens, n_probs, finish_reason, prompt_n, ...).

Direction:

* worker -> router: Hello, LoadProgress, Ready, Accepted, Token, Done, Error, Pong, TokenizeResult,
  DetokenizeResult, ApplyTemplateResult, SlotActionResult, KVChunk (a prefill worker's
  state), KVAck (a decode worker took a chunk)
* router -> worker: Assign (a warm spare's model), Generate, Cancel, Ping, Shutdown, Tokenize,
  Detokenize, ApplyTemplate, SlotAction, KVChunk (to a decode worker), KVAck (credit to a prefill worker)

This module only declares the records; ``protocol.codec`` encodes, decodes and
validates them. It imports neither the router nor the worker.
"""

from __future__ import annotations

import sys
from array import array
from itertools import accumulate
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.limits import WEIGHT_MODES

#: Bumped on any incompatible change; a frame with another version is rejected.
#: 5: KV-state streams (KVChunk / KVAck, Generate.stream_state).
#: 6: token ids of TokenizeResult / Detokenize travel as TokenIds (int32 bytes), pieces as one blob.
#: 7: LoadProgress stage ``loading_kernels``.
#: 8: Accepted (a Generate's prompt fits and is queued; what its constraint set aside); ApplyTemplate.tools.
#: 9: Error.n_prompt_tokens / n_ctx (a context overflow's figures); Generate / ApplyTemplate template_kwargs;
#:    Generate.post_sampling_probs.
#: 10: Pong.n_decode_total / n_busy_slots_total (llama.cpp's decode-call metrics).
#: 11: Assign (a warm spare, started without a model, is given one; Hello.model "" until then).
PROTOCOL_VERSION = 11

#: Largest frame either side accepts, in bytes (a 100 KB prompt as token ids is < 1 MiB).
MAX_FRAME_BYTES = 16 * 1024 * 1024

#: KV-state streams (KVChunk): what a sender puts in one chunk (bytes) ...
KV_CHUNK_BYTES = 1024 * 1024
#: ... and the most a KVChunk may carry (validated on both sides; far within MAX_FRAME_BYTES).
KV_CHUNK_MAX_BYTES = 4 * 1024 * 1024
#: Chunks a sender may have sent beyond the last one acknowledged (KVAck): with the router
#: relaying, at most this many chunks of one stream are in flight, so memory stays bounded.
KV_WINDOW = 4
#: A KV stream with no chunk (receiver) or no acknowledgement (sender) for this long is dropped (s).
KV_STREAM_IDLE_S = 60.0

class TokenIds(bytes):
    """A list of token ids as one compact value: little-endian int32, 4 bytes per id.

    Fields that may hold millions of ids (a 7 MB text's TokenizeResult: ~2.5M) carry this
    instead of a msgpack list, so neither side packs, unpacks or type-checks millions of
    Python ints in one hold of the GIL (2.5M ids as a list: ~0.4 s of the router's event
    loop to decode). On the wire it is a msgpack ``bin``; the codec's one rule for it is
    its shape (a whole number of 4-byte ids, checked on encode and decode). What an id
    means ([0, n_vocab)) is checked where it is used (the engine).

    Build with :meth:`of`; read with :meth:`view` (no copy on little-endian hosts) or
    :meth:`tolist`. ``len()`` is the byte length; :attr:`count` the number of ids.
    """

    #: Bytes per id.
    ITEM_BYTES: ClassVar[int] = 4
    #: Ids packed per C-level step by :meth:`of` (~1 ms each).
    PACK_SLICE: ClassVar[int] = 1 << 16

    @classmethod
    def of(cls, ids: Iterable[int]) -> TokenIds:
        """Pack ``ids`` (ints in [-2**31, 2**31-1]; OverflowError outside, TypeError for a
        non-int), a list in slices of ``PACK_SLICE`` (other threads may run in between)."""
        if isinstance(ids, list) and len(ids) > cls.PACK_SLICE:
            a = array("i")
            for i in range(0, len(ids), cls.PACK_SLICE):
                a.extend(ids[i:i + cls.PACK_SLICE])
        else:
            a = array("i", ids)
        if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
            a.byteswap()
        return cls(a.tobytes())

    # deliberately replaces bytes.count (a substring count, meaningless over packed int32 ids)
    @property
    def count(self) -> int:  # type: ignore[override]
        """Number of ids."""
        return len(self) // self.ITEM_BYTES

    def view(self) -> memoryview | array[int]:
        """The ids as a read-only sequence of int (indexing, slicing, iterating; ``len`` is
        the id count): a memoryview over these bytes, or a byte-swapped copy on big-endian hosts."""
        if sys.byteorder == "little":
            return memoryview(self).cast("i")
        a = array("i")  # pragma: no cover
        a.frombytes(self)  # pragma: no cover
        a.byteswap()  # pragma: no cover
        return a  # pragma: no cover

    def tolist(self) -> list[int]:
        """The ids as a list of int (builds one Python int per id)."""
        return self.view().tolist()


assert array("i").itemsize == TokenIds.ITEM_BYTES, "TokenIds needs a 4-byte C int"

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
    model: str  # configured model name; "" for a warm spare (it gets one with Assign)
    pid: int
    auth: str = ""


#: LoadProgress stages, in the order a load goes through them.
LOAD_STAGES = ("reading_gguf", "building_tokenizer", "preparing_tensors", "loading_kernels")


@dataclass(frozen=True, kw_only=True)
class LoadProgress(Message):
    """Between Hello and Ready: how far the load is (id: the worker's own id).

    ``stage`` is one of LOAD_STAGES: ``reading_gguf`` (the file's header and metadata;
    done 0 or 1 of total 1), ``building_tokenizer`` (the vocabulary, merges and chat
    template; 0 or 1 of 1), ``preparing_tensors`` (``done`` of ``total`` GGUF tensors
    dequantized into the engine's weights; absent when they come from the weight
    cache), ``loading_kernels`` (a quantized worker waiting for its numba kernels: loaded
    from the disk cache, or compiled when that is empty; 0 or 1 of 1). ``0 <= done <=
    total``, ``total >= 1``. The worker sends a stage's first and last step and at most a
    few in between per second."""

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
    # context_length_exceeded: the prompt's tokens and the context size, as llama-server's
    # exceed_context_size_error carries them (None: not known, or another code)
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None


@dataclass(frozen=True, kw_only=True)
class Pong(Message):
    """Health answer; sent even mid-generation.

    ``slots`` has one map per KV slot (``max_jobs`` of them), llama.cpp's
    ``/slots`` names: ``{"id": int, "id_task": str | None (the request id
    running in it), "is_processing": bool, "n_past": int (tokens its KV
    holds)}``.

    ``n_decode_total`` / ``n_busy_slots_total``: since the worker started, its batched forward
    passes (llama.cpp's ``llama_decode`` calls) and the sum over them of the slots busy at each
    (``server_metrics::on_decoded`` in llama.cpp's tools/server: a slot running a request,
    prefilling or decoding, counts whether or not that pass carried it).
    """

    TYPE: ClassVar[str] = "pong"
    busy: bool
    queue_len: int  # Generate requests waiting for a slot
    running_ids: list[str] = field(default_factory=list)  # every running request id
    slots: list[dict[str, Any]] = field(default_factory=list)
    kv_tokens: int = 0  # KV positions held (running sequences and idle prefix-cache entries)
    kv_budget_tokens: int = 0  # KV positions the budget allows in all
    n_decode_total: int = 0  # batched forward passes run since the worker started
    n_busy_slots_total: int = 0  # over those passes, the slots busy at each
    pid: int


@dataclass(frozen=True, kw_only=True)
class TokenizeResult(Message):
    TYPE: ClassVar[str] = "tokenize_result"
    tokens: TokenIds
    # with_pieces: every token's bytes, concatenated; piece_ends[i] is where token i's ends
    # (so token i is pieces[piece_ends[i-1]:piece_ends[i]]). Empty without with_pieces.
    pieces: bytes = b""
    piece_ends: TokenIds = TokenIds()

    @classmethod
    def of(cls, id: str, ids: Sequence[int], pieces: Sequence[bytes] | None = None) -> TokenizeResult:
        """The answer for ``ids`` (and, when given, each id's bytes, ``len(pieces) == len(ids)``)."""
        if pieces is None:
            return cls(id=id, tokens=TokenIds.of(ids))
        return cls(id=id, tokens=TokenIds.of(ids), pieces=b"".join(pieces),
                   piece_ends=TokenIds.of(accumulate(map(len, pieces))))

    def piece_slice(self, lo: int, hi: int) -> list[bytes]:
        """The bytes of tokens ``lo..hi-1`` (with_pieces answers)."""
        ends = self.piece_ends.view()[lo:hi]
        start = self.piece_ends.view()[lo - 1] if lo > 0 else 0
        blob, out = self.pieces, []
        for e in ends:
            out.append(blob[start:e])
            start = e
        return out

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        ends = fields.get("piece_ends", TokenIds())
        if not ends:
            return "pieces without piece_ends" if fields.get("pieces") else None
        if ends.count != fields["tokens"].count:
            return f"piece_ends has {ends.count} entries for {fields['tokens'].count} tokens"
        v = ends.view()
        if v[-1] != len(fields.get("pieces", b"")):
            return f"piece_ends ends at {v[-1]}, pieces has {len(fields.get('pieces', b''))} bytes"
        return None


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
class Assign(Message):
    """Give a warm spare its model (id: the router's call id; the worker's frames keep their own).

    A spare is a worker started without a model (``python -m worker --spare``): it has
    done its interpreter start, imports and kernel loading, sent Hello with ``model`` "",
    and waits. On Assign it loads the model exactly as a worker started for it would
    (the fields are the ``python -m worker`` options of the same names), then sends
    LoadProgress and Ready, or Error "load_failed" and exits 1. Sent at most once; a
    worker that has a model answers another Assign with Error "protocol_error".

    ``threads`` > 0: the worker's BLAS threads (its NumPy is already loaded, so they are
    set as a Ping's ``threads`` are, not through the environment); 0: as the spare started.
    Units: n_ctx, n_ubatch tokens; kv_budget_mib, kv_cache_mib MiB.
    """

    TYPE: ClassVar[str] = "assign"
    model: str  # configured model name (echoed in Ready)
    gguf: str  # path of the GGUF file on the worker's host
    n_ctx: int | None = None
    chat_template: str | None = None
    max_queue: int = 8
    parallel: int = 1
    kv_budget_mib: float | None = None
    weights: str | None = None  # one of protocol.limits.WEIGHT_MODES; None: the worker's default
    n_ubatch: int | None = None
    threads: int = 0
    slot_save_path: str | None = None
    kv_cache_dir: str | None = None
    kv_cache_mib: float = 1024.0

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        if not fields["model"] or not fields["gguf"]:
            return "model and gguf must be non-empty"
        for key in ("n_ctx", "n_ubatch"):
            if fields.get(key) is not None and fields[key] <= 0:
                return f"{key} must be a positive number of tokens, got {fields[key]}"
        if fields.get("max_queue", 0) < 0:
            return f"max_queue must be >= 0, got {fields['max_queue']}"
        if fields.get("parallel", 1) < 1:
            return f"parallel must be >= 1, got {fields['parallel']}"
        if fields.get("threads", 0) < 0:
            return f"threads must be >= 0, got {fields['threads']}"
        if fields.get("kv_budget_mib") is not None and not fields["kv_budget_mib"] > 0:
            return f"kv_budget_mib must be > 0, got {fields['kv_budget_mib']}"
        if not fields.get("kv_cache_mib", 1.0) > 0:
            return f"kv_cache_mib must be > 0, got {fields['kv_cache_mib']}"
        if fields.get("weights") is not None and fields["weights"] not in WEIGHT_MODES:
            return f"weights {fields['weights']!r} is not one of {list(WEIGHT_MODES)}"
        return None


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
    # with messages: more variables for the template (llama.cpp's chat_template_kwargs, e.g.
    # enable_thinking); messages, tools, add_generation_prompt, bos_token, eos_token are not among them
    template_kwargs: dict[str, Any] = field(default_factory=dict)
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
    # llama.cpp's post_sampling_probs: the logprobs (the token's and the top n_probs) are of the
    # sampler chain's distribution (after top-k, top-p, min-p, temperature), not the model's
    post_sampling_probs: bool = False
    ignore_eos: bool = False
    cache_prompt: bool = True
    n: int = 1  # choices: n sequences from one prefilled prompt (seed + i each when seeded)
    json_schema: str | None = None
    grammar: str | None = None
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
    tokens: TokenIds


@dataclass(frozen=True, kw_only=True)
class ApplyTemplate(Message):
    TYPE: ClassVar[str] = "apply_template"
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    # the template's ``tools`` (as Generate.tools), for templates with their own tool syntax
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # as Generate.template_kwargs
    chat_template: str | None = None  # as Generate.chat_template (a preset's own template)


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
    sides). A slot action's state never crosses the wire: the worker reads / writes the file
    (``worker.engine.kv.state`` format). A busy slot's action waits until the slot
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


@dataclass(frozen=True, kw_only=True)
class KVChunk(Message):
    """One piece of a KV state stream (``worker.engine.kv.state`` format, opaque here).

    ``seq``: 0, 1, 2, ... within the stream ``id``; ``data``: 1..KV_CHUNK_MAX_BYTES bytes;
    ``last``: the stream's final chunk. A prefill worker sends them for a Generate with
    ``stream_state`` (id = the Generate's); the router relays the bytes to the decode worker
    under its own transfer id, without looking into them. The decode worker validates the
    stream as it arrives (identity before any payload byte, checksums at the end), answers a
    KVAck per chunk, and after the last one a SlotActionResult (``action`` "restore",
    ``id_slot`` -1: the state is in its prefix cache) or an Error ("kv_state_mismatch",
    "kv_state_invalid", "kv_budget_exceeded", "protocol_error" for a chunk out of order, "busy").
    A Cancel with the transfer id drops a partial stream (nothing is installed)."""

    TYPE: ClassVar[str] = "kv_chunk"
    seq: int
    data: bytes
    last: bool = False

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        if fields["seq"] < 0:
            return f"seq must be >= 0, got {fields['seq']}"
        if not 1 <= len(fields["data"]) <= KV_CHUNK_MAX_BYTES:
            return f"data of {len(fields['data'])} bytes: a chunk carries 1..{KV_CHUNK_MAX_BYTES} bytes"
        return None


@dataclass(frozen=True, kw_only=True)
class KVAck(Message):
    """Chunk ``seq`` of KV stream ``id`` was taken: from a decode worker to the router, and
    relayed by the router to the prefill worker as its credit (it may send up to chunk
    ``seq + KV_WINDOW``)."""

    TYPE: ClassVar[str] = "kv_ack"
    seq: int

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        return None if fields["seq"] >= 0 else f"seq must be >= 0, got {fields['seq']}"


#: Every message type by its wire tag.
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, LoadProgress, Ready, Accepted, Token, Done, Error, Pong, TokenizeResult, DetokenizeResult,
        ApplyTemplateResult, Assign, Generate, Cancel, Ping, Shutdown, Tokenize, Detokenize,
        ApplyTemplate, SlotAction, SlotActionResult, KVChunk, KVAck,
    )
}
