"""The engine facade the worker uses (contract: docs/ENGINE-API.md).

An :class:`Engine` owns one loaded GGUF model, its tokenizer, its chat template
and its batch :class:`~worker.engine.scheduler.Scheduler` (KV slots, prefix
cache). Several sequences run at once through ``add`` / ``step`` / ``abort``;
``generate`` is the single-sequence wrapper. A lock serialises the calls that
touch the scheduler; ``prepare``, ``tokenize`` and the template calls never
touch the KV and may run on any thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import constraints
from .loading import resident
from .text.chat_template import ChatTemplate, resolve_template
from .errors import EngineError
from .generate import GenerationResult, TokenEvent
from .kv.state import KV_LAYOUT_VERSION, KVIdentity, KVState
from .sampling import SamplingParams
from .scheduler import Finished, Scheduler, SeqRequest, SlotInfo, run_one
from .text.tokenizer import Tokenizer

__all__ = ["Engine", "EngineInfo", "preload_kernels"]


@dataclass(frozen=True)
class EngineInfo:
    """Identity and sizes of a loaded model."""

    architecture: str  # general.architecture, e.g. "llama", "gemma3"
    name: str  # general.name or the file stem
    n_ctx: int  # KV cache size in tokens
    n_ctx_train: int
    n_vocab: int
    file_size: int  # bytes
    fingerprint: str  # hex SHA-256 of the file (gguf_loader's identity rule); "" until computed (Engine.fingerprint)
    has_chat_template: bool
    bos_token: str | None
    eos_token: str | None
    n_parallel: int = 1  # KV slots: sequences decoded at once
    kv_budget_tokens: int = 0  # KV positions the budget holds in all
    kv_token_bytes: int = 0  # bytes of K and V per position
    weights: str = "quantized"  # how weight matrices are held: "quantized" | "f32"
    weight_bytes: int = 0  # bytes of the prepared weights in memory


class Engine:
    """One loaded model: tokenizer, chat template, forward pass, KV cache.

    Build with :meth:`load`. Methods raise :class:`EngineError` with a
    ``code`` for every bad input; they never leave the KV cache in a state a
    later request would trust without checking.
    """

    def __init__(self, gguf: Any, model: Any, tokenizer: Tokenizer, template: ChatTemplate | None,
                 info: EngineInfo, scheduler: Scheduler) -> None:
        self._gguf = gguf
        self._model = model
        self.tokenizer = tokenizer
        self._template = template
        self.info = info
        self._sched = scheduler
        self._lock = threading.RLock()
        self._max_piece_chars: int | None = None  # longest token text in characters (lazy)
        self._kv_identity: KVIdentity | None = None

    # ------------------------------------------------------------------ load

    @classmethod
    def load(cls, gguf_path: str, n_ctx: int | None = None, chat_template: str | None = None, *,
             parallel: int = 1, kv_budget_mib: float | None = None, n_batch: int | None = None,
             weights: str | None = None, n_ubatch: int | None = None,
             progress: Callable[[str, int, int], None] | None = None) -> Engine:
        """Load a GGUF file.

        Args:
            gguf_path: path of the ``.gguf`` file.
            n_ctx: context size of each sequence in tokens; None -> ``min(n_ctx_train, 8192)``.
            chat_template: a Jinja template text or a known name (``"chatml"``,
                ``"gemma"``) replacing / supplying ``tokenizer.chat_template``.
            parallel: KV slots (sequences decoded at once), >= 1.
            kv_budget_mib: KV memory of all sequences and cached prefixes together,
                MiB; None -> room for ``parallel`` full contexts (``parallel * n_ctx`` positions).
            n_batch: prompt tokens per step while none decodes (a step's prefill budget);
                None -> 256.
            n_ubatch: tokens of a prompt's micro-batch, llama.cpp's ``n_ubatch`` (the unit
                its kernels are chosen for: a prompt is cut into micro-batches of this size
                from the end of its reused prefix, whatever the other sequences);
                None -> 512, llama.cpp's default.
            weights: ``"quantized"`` (the GGUF's blocks, ggml's vec_dot numerics) or ``"f32"``
                (dequantized float32 reference); None -> ``model.DEFAULT_WEIGHTS`` ("quantized").
            progress: ``progress(stage, done, total)`` hears the load's steps, in order:
                ``("reading_gguf", 0, 1)`` before the file's header and metadata are
                read, ``("reading_gguf", 1, 1)`` after; ``("building_tokenizer", 0, 1)`` /
                ``(…, 1, 1)`` around the tokenizer and chat template; ``("preparing_tensors", n, N)``
                once per tensor dequantized into the weights (N: the file's tensors;
                none when the prepared weights come from the weight cache); with
                ``weights="quantized"``, ``("loading_kernels", 0, 1)`` / ``(…, 1, 1)`` around
                the wait for the kernel warm-up (numba's cache; on an empty cache its
                compiling, see :func:`compile_kernels`). Called on the loading thread;
                must not raise.

        Raises:
            EngineError: ``file_not_found``, ``invalid_gguf``,
                ``unsupported_architecture``, ``unsupported_tensor_type``,
                ``unsupported_tokenizer``, ``template_error`` (the given or
                embedded template does not compile), ``invalid_params``
                (n_ctx not a positive integer, parallel, n_batch or n_ubatch < 1, budget <= 0,
                unknown weights mode).
        """
        from .loading.gguf_loader import read_gguf
        from .scheduler import DEFAULT_N_BATCH, DEFAULT_N_UBATCH
        from .arch.model import DEFAULT_WEIGHTS, WEIGHT_MODES, load_model  # n_ctx None -> min(n_ctx_train, 8192) there

        path = Path(gguf_path)
        if not path.is_file():
            raise EngineError("file_not_found", f"GGUF file not found: {gguf_path}")
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0):
            raise EngineError("invalid_params", f"n_ctx must be a positive integer, got {n_ctx!r}")
        if chat_template is not None and not isinstance(chat_template, str):
            raise EngineError("invalid_params", "chat_template must be a string")
        for name, v in (("parallel", parallel), ("n_batch", n_batch), ("n_ubatch", n_ubatch)):
            if (v is not None or name == "parallel") and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise EngineError("invalid_params", f"{name} must be an integer >= 1, got {v!r}")
        if kv_budget_mib is not None and (isinstance(kv_budget_mib, bool) or not isinstance(kv_budget_mib, (int, float))
                                          or not kv_budget_mib > 0):
            raise EngineError("invalid_params", f"kv_budget_mib must be a positive number, got {kv_budget_mib!r}")
        weights = DEFAULT_WEIGHTS if weights is None else weights
        if weights not in WEIGHT_MODES:
            raise EngineError("invalid_params", f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
        if progress is not None:
            progress("reading_gguf", 0, 1)
        gguf = _wrap(read_gguf, str(path))
        gguf.start_fingerprint()  # hashed on a background thread while the model is built
        warm = None
        if weights == "quantized":  # numba's import and cached kernels load while the model is built
            types = {t.type.name for t in gguf.tensors.values()}
            from .arch.model import ARCHITECTURES, _register_builtin

            _register_builtin()
            arch_cls = ARCHITECTURES.get(gguf.architecture)
            warm = threading.Thread(target=_warm_up_kernels, daemon=True, name="modelyard-warm-up",
                                    args=(types, _take_preload(), getattr(arch_cls, "ffn_act", None)))
            warm.start()
        if progress is not None:
            progress("reading_gguf", 1, 1)
        md = gguf.metadata
        arch = gguf.architecture
        n_ctx_train = md.get(f"{arch}.context_length")
        if isinstance(n_ctx_train, bool) or not isinstance(n_ctx_train, int) or n_ctx_train <= 0:
            raise EngineError("invalid_gguf", f"GGUF has no valid {arch}.context_length")
        if progress is not None:
            progress("building_tokenizer", 0, 1)
        tokenizer = _wrap(Tokenizer.from_metadata, md)
        source = resolve_template(chat_template) if chat_template is not None else md.get("tokenizer.chat_template")
        template = None
        if isinstance(source, str) and source.strip():
            template = ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token,
                                    strip_bos=tokenizer.add_bos, strip_eos=tokenizer.add_eos)
        if progress is not None:
            progress("building_tokenizer", 1, 1)
        model = _wrap(load_model, gguf, n_ctx, weights=weights, progress=progress)
        if warm is not None:  # kernels from numba's cache (~0.3 s), or compiled into an empty one (tens of s)
            if progress is not None:
                progress("loading_kernels", 0, 1)
            warm.join()  # before any kernel runs on this thread (one numba parallel launch at a time)
            _warm_up_slices(_column_slice_types(model.w.values()))
            if progress is not None:
                progress("loading_kernels", 1, 1)
        resident.trim_heap()  # the load's freed temporaries (dequantization, metadata parsing) back to the OS
        token_bytes = model.kv_shape.token_bytes
        budget_tokens = (parallel * int(model.n_ctx) if kv_budget_mib is None
                         else max(1, int(kv_budget_mib * 2**20) // token_bytes))
        sched = Scheduler(model, tokenizer, n_parallel=parallel, kv_budget_tokens=budget_tokens,
                          n_batch=DEFAULT_N_BATCH if n_batch is None else n_batch,
                          n_ubatch=DEFAULT_N_UBATCH if n_ubatch is None else n_ubatch)
        name = md.get("general.name")
        info = EngineInfo(
            architecture=arch,
            name=name if isinstance(name, str) and name else path.stem,
            n_ctx=int(model.n_ctx),
            n_ctx_train=n_ctx_train,
            n_vocab=int(model.n_vocab),
            file_size=int(gguf.file_size),
            fingerprint=gguf.fingerprint_nowait() or "",
            has_chat_template=template is not None,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            n_parallel=parallel,
            kv_budget_tokens=budget_tokens,
            kv_token_bytes=token_bytes,
            weights=model.weights,
            weight_bytes=int(model.weight_bytes),
        )
        return cls(gguf, model, tokenizer, template, info, sched)

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (llama.cpp semantics, see ``Tokenizer.tokenize``).

        Raises:
            EngineError("invalid_params"): ``text`` is not a string.
        """
        return self.tokenizer.tokenize(text, add_special=bool(add_special), parse_special=bool(parse_special))

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (control tokens rendered as their text; invalid UTF-8 -> U+FFFD).

        Raises:
            EngineError("invalid_token"): an id outside ``[0, n_vocab)``.
        """
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise EngineError("invalid_params", "ids must be a list of token ids")
        return self.tokenizer.detokenize(ids)

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """Raw bytes of one token's piece; ``special=False`` gives b"" for control
        tokens, as generated text does.

        Raises:
            EngineError("invalid_token"): id outside ``[0, n_vocab)``.
        """
        return self.tokenizer.token_bytes(token_id, special=special)

    def _require_template(self) -> ChatTemplate:
        if self._template is None:
            raise EngineError("no_chat_template", f"model {self.info.name!r} has no chat template; "
                              "configure one (a template text or a name such as 'chatml' or 'gemma')")
        return self._template

    #: Request templates (``chat_template`` of a request: a preset's) kept compiled, most recent last.
    TEMPLATE_CACHE = 8

    def _template_for(self, chat_template: str | None) -> ChatTemplate:
        """The model's template (``chat_template`` None), else that template text or known name,
        compiled once (the last :attr:`TEMPLATE_CACHE` kept).

        Raises:
            EngineError("no_chat_template" | "template_error" | "invalid_params")."""
        if chat_template is None:
            return self._require_template()
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise EngineError("invalid_params", "chat_template must be a non-empty string")
        cache: dict[str, ChatTemplate] = self.__dict__.setdefault("_request_templates", {})
        t = cache.pop(chat_template, None)
        if t is None:
            tok = self.tokenizer
            t = ChatTemplate(resolve_template(chat_template), tok.bos_token, tok.eos_token,
                             strip_bos=tok.add_bos, strip_eos=tok.add_eos)
            while len(cache) >= self.TEMPLATE_CACHE:
                cache.pop(next(iter(cache)))
        cache[chat_template] = t
        return t

    def apply_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                       tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None,
                       chat_template: str | None = None) -> str:
        """The chat prompt text for ``messages`` (OpenAI-style; content a string
        or a list of text parts; ``template_kwargs``: more template variables, llama.cpp's
        ``chat_template_kwargs``). A leading BOS text is removed when the
        tokenizer adds BOS itself, like llama.cpp's ``/apply-template``. ``chat_template``
        (text or a known name) renders with that template instead of the model's.

        Raises:
            EngineError("no_chat_template" | "template_error" | "invalid_params").
        """
        return self._template_for(chat_template).render(messages, add_generation_prompt, tools, template_kwargs)

    def tokenize_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                      tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None,
                      chat_template: str | None = None) -> list[int]:
        """Prompt ids for ``messages``: template markup is tokenized with special
        parsing, message contents without it (a user typing ``<|im_end|>``
        cannot close a turn); BOS added per the GGUF, exactly once. ``chat_template`` (text
        or a known name) renders them with that template instead of the model's;
        ``template_kwargs`` are extra template variables (``chat_template_kwargs``).

        Raises:
            EngineError("no_chat_template" | "template_error" | "invalid_params").
        """
        segments = self._template_for(chat_template).render_segments(messages, add_generation_prompt, tools,
                                                                     template_kwargs)
        self._check_fits(sum(len(text) for text, _ in segments))
        return self.tokenizer.tokenize_pieces(segments, add_special=True)

    def _check_fits(self, n_chars: int) -> None:
        """Refuse, before tokenizing, a text that cannot fit the context whatever its tokens:
        a token covers at most ``max_piece`` characters, so more than ``n_ctx * max_piece``
        characters make more than n_ctx tokens.

        Raises: EngineError("context_length_exceeded").
        """
        n_ctx = self.info.n_ctx
        if n_chars <= n_ctx:
            return
        if self._max_piece_chars is None:
            # the longest token text in UTF-8 bytes bounds every piece's characters (a piece's
            # bytes are at most its text's: SentencePiece's "\u2581" and "<0xNN>", GPT-2's byte
            # alphabet all shrink when decoded): one numpy pass over the vocabulary's compact
            # storage, where decoding 262k pieces took seconds on the first long prompt
            self._max_piece_chars = max(1, int(self.tokenizer.tokens.byte_lengths().max()))
        if n_chars > n_ctx * self._max_piece_chars:
            raise EngineError("context_length_exceeded", (
                f"This model's maximum context length is {n_ctx} tokens. However, the prompt has {n_chars} "
                f"characters, more than {n_ctx} tokens of at most {self._max_piece_chars} characters can hold."))
            # no n_prompt_tokens: not tokenized, the count is unknown (a count_tokens answer takes
            # the figure as exact: router.dialects.counting)

    # ------------------------------------------------------------------ generate

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """Validated ``(prompt ids, params)`` for a request; touches no KV (any thread).

        Text prompts are tokenized with ``params.add_special`` / ``parse_special``.

        Raises:
            EngineError("invalid_params"): bad ``params`` or prompt type.
            EngineError("invalid_token"): a prompt id outside the vocabulary.
            EngineError("empty_prompt"): no prompt tokens.
            EngineError("context_length_exceeded"): the prompt alone fills n_ctx (a
                ``max_tokens`` beyond the room the prompt leaves is clamped to that room,
                so the generation ends with "length" when the context is full).
            EngineError("kv_budget_exceeded"): it can never fit the KV budget.
            EngineError("invalid_grammar"): ``json_schema`` / ``grammar`` does not
                compile (an unsupported schema keyword is named in the message).
        """
        if not isinstance(params, SamplingParams):
            raise EngineError("invalid_params", "params must be a SamplingParams")
        p = params.validated(min(self.info.n_vocab, self.tokenizer.n_vocab))
        if isinstance(prompt, str):
            self._check_fits(len(prompt))
            ids = self.tokenizer.tokenize(prompt, add_special=p.add_special, parse_special=p.parse_special)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            ids = self.tokenizer.check_ids(prompt)
            limit = self.info.n_vocab
            bad = next((t for t in ids if t >= limit), None)
            if bad is not None:
                raise EngineError("invalid_token", f"token id {bad} is out of the vocabulary [0, {limit})")
        else:
            raise EngineError("invalid_params", "prompt must be a string or a list of token ids")
        if not ids:
            raise EngineError("empty_prompt", "the prompt is empty (it tokenizes to no tokens)")
        set_aside = constraints.check(self.tokenizer, self.info.n_vocab, p.json_schema, p.grammar)
        if set_aside:
            p = replace(p, set_aside=tuple(set_aside))
        room = self.info.n_ctx - len(ids)
        if p.max_tokens is not None and 0 < room < p.max_tokens:
            p = replace(p, max_tokens=room)  # llama.cpp's behaviour: generate until the context is full
        self._sched.reservation(len(ids), p.max_tokens)  # raises when it can never run
        return ids, p

    def add(self, seq_id: str, prompt: list[int], params: SamplingParams,
            on_token: Callable[[TokenEvent], Any] | None = None,
            should_stop: Callable[[], Any] | None = None) -> None:
        """Queue a sequence (``prompt``/``params`` from :meth:`prepare`); it joins the
        batch at the next :meth:`step`. ``on_token`` gets each token (returning
        ``False`` cancels it). ``should_stop()`` (e.g. ``threading.Event.is_set`` of a flag
        another thread sets) is polled before each step and between the layers of each
        forward pass: True cancels it without waiting for the pass running now (the step
        is abandoned mid-pass; the other sequences of that batch run again next step).

        Raises: EngineError("invalid_params") for an id in use; :meth:`prepare`'s
        "context_length_exceeded" / "kv_budget_exceeded".
        """
        with self._lock:
            self._sched.add(SeqRequest(seq_id, list(prompt), params, on_token, should_stop))

    def step(self) -> list[Finished]:
        """One batched forward pass over every live sequence; the ones that ended
        (``Finished.result`` a :class:`GenerationResult`, or ``Finished.error``)."""
        with self._lock:
            return self._sched.step()

    def abort(self, seq_id: str) -> bool:
        """Cancel a queued or running sequence; it ends at the next step ("cancelled")."""
        with self._lock:
            return self._sched.abort(seq_id)

    def cache_n(self, seq_id: str) -> int:
        """Prompt tokens a running sequence reused from the KV cache (known once its
        prefill began, e.g. inside its first ``on_token``; 0 when unknown)."""
        with self._lock:
            return self._sched.cache_n(seq_id)

    @property
    def has_work(self) -> bool:
        """True while a sequence is waiting or running."""
        return self._sched.has_work

    def slots(self) -> list[SlotInfo]:
        """Every KV slot: id, the request running in it, tokens held."""
        with self._lock:
            return self._sched.slot_info()

    @property
    def step_stats(self) -> dict[str, int]:
        """Counters of the batch scheduler (a copy): ``passes`` forward passes started,
        ``interrupted`` of them abandoned mid-pass by a ``should_stop``, ``layers`` layers
        started over all passes, ``last_layers`` layers the last pass started, ``busy_slots``
        the slots busy at each pass, summed over all passes."""
        return dict(self._sched.stats)

    @property
    def kv_tokens(self) -> int:
        """KV positions holding valid tokens (running sequences and the prefix cache)."""
        with self._lock:
            return self._sched.pool.held_tokens

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 on_token: Callable[[TokenEvent], bool] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        """Generate a completion of ``prompt`` alone (text or token ids): :meth:`prepare`,
        then steps until it ends.

        ``should_stop()`` is polled before each step and between the layers of a forward
        pass; ``on_token`` returning ``False`` also stops; either gives finish_reason "cancelled".

        Raises (before any token): :meth:`prepare`'s errors. Exceptions raised
        by the model or by on_token propagate (the KV holds only verified tokens).
        """
        ids, p = self.prepare(prompt, params)
        with self._lock:
            if self._sched.has_work:
                raise EngineError("invalid_params", "generate() while add()/step() sequences are live")
            return run_one(self._sched, SeqRequest("generate", ids, p, on_token, should_stop), should_stop)

    # ------------------------------------------------------------------ identity, KV states

    @property
    def fingerprint(self) -> str:
        """The GGUF's content fingerprint (hex SHA-256 of the file, ``GGUFFile.fingerprint``),
        waiting for the background hash ``load`` started if it is still running (a file seen
        before is known at once). ``info.fingerprint`` is "" until then, the digest after."""
        fp = self._gguf.fingerprint
        if self.info.fingerprint != fp:
            self.info = replace(self.info, fingerprint=fp)
        return fp

    def on_fingerprint(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(fingerprint)`` once it is known: at once if it is, else on the hashing
        thread when it finishes (``info.fingerprint`` is updated first). Not called if the file
        was closed before."""
        def done(fut: Any) -> None:
            if fut.exception() is None:
                callback(self.fingerprint)

        self._gguf.start_fingerprint().add_done_callback(done)

    @property
    def kv_identity(self) -> KVIdentity:
        """What a KV state of this engine depends on (``worker.engine.kv.state``), with the full
        content fingerprint (waited for if still being computed: a state from another file is
        always refused, naming ``model_fingerprint``); the tokenizer fingerprint is computed
        on first use."""
        if self._kv_identity is None:
            s = self._sched.pool.shape
            self._kv_identity = KVIdentity(
                architecture=self.info.architecture, model_fingerprint=self.fingerprint,
                tokenizer_fingerprint=self.tokenizer.fingerprint, n_layer=s.n_layer, n_kv_head=s.n_kv_head,
                head_dim_k=s.head_dim_k, head_dim_v=s.head_dim_v, kv_dtype=s.dtype.name,
                kv_layout=KV_LAYOUT_VERSION, n_ctx=self.info.n_ctx)
        return self._kv_identity

    def slot_busy(self, id_slot: int) -> bool:
        """True while a request runs in slot ``id_slot``. Raises EngineError("invalid_params")."""
        with self._lock:
            return self._sched.slot_busy(id_slot)

    def save_slot(self, id_slot: int) -> KVState:
        """A copy of what idle slot ``id_slot`` holds (0 tokens when it holds nothing).

        Raises: EngineError("invalid_params"): a bad slot id, or the slot is processing.
        """
        with self._lock:
            e = self._sched.slot_entry(id_slot)
            return self._snapshot(e)

    def _snapshot(self, e: Any, copy: bool = True) -> KVState:
        ident = self.kv_identity
        if e is None:
            s = self._sched.pool.shape
            return KVState(ident, [], np.zeros((s.n_layer, s.n_kv_head, 0, s.head_dim_k), s.dtype),
                           np.zeros((s.n_layer, s.n_kv_head, 0, s.head_dim_v), s.dtype))
        n = e.n_past
        k, v = e.k[:, :, :n], e.v[:, :, :n]
        return KVState(ident, list(e.tokens), k.copy() if copy else k, v.copy() if copy else v)

    def restore_slot(self, state: KVState, id_slot: int | None = None) -> int:
        """Load ``state`` into idle slot ``id_slot`` (replacing what it held), or with None into
        the prefix cache only; the tokens restored. The next request whose prompt extends
        those tokens reuses them.

        Raises (the KV is unchanged): KVStateError("kv_state_mismatch") naming the field
        when ``state`` is of another model / quantization / tokenizer / n_ctx / layout;
        EngineError("invalid_params") a bad or busy slot; ("kv_budget_exceeded") no room.
        """
        self.kv_identity.check(state.identity)
        with self._lock:
            self._sched.install(state.tokens, state.k, state.v, id_slot)
        return state.n_tokens

    def erase_slot(self, id_slot: int) -> int:
        """Forget idle slot ``id_slot``'s KV; the tokens it held.

        Raises: EngineError("invalid_params"): a bad slot id, or the slot is processing.
        """
        with self._lock:
            return self._sched.erase(id_slot)

    def idle_states(self, copy: bool = True) -> list[KVState]:
        """Every idle KV entry (the prefix cache), most recently used first: copies, or with
        ``copy=False`` views valid only until the next add / step / restore (for a caller
        that writes them out before touching the engine again)."""
        with self._lock:
            return [self._snapshot(e, copy) for e in reversed(self._sched.idle_entries()) if e.n_past]

    def best_prefix(self, ids: Sequence[int]) -> int:
        """Tokens of ``ids`` (at most all but the last) the KV already holds as a prefix."""
        with self._lock:
            return self._sched.best_prefix(list(ids))

    def reset_cache(self) -> None:
        """Forget every idle KV entry (the next request evaluates its whole prompt)."""
        with self._lock:
            for e in self._sched.idle_entries():
                self._sched.pool.drop(e)

    @property
    def cached_tokens(self) -> list[int]:
        """A copy of the token ids held by the most recently used KV entry ([] when none)."""
        with self._lock:
            entries = self._sched.pool.entries
            if not entries:
                return []
            return list(max(entries, key=lambda e: e.last_use).tokens)


def _wrap(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a loader; any failure that is not an EngineError becomes ``invalid_gguf``."""
    try:
        return fn(*args, **kwargs)
    except EngineError:
        raise
    except MemoryError:
        raise
    except Exception as e:
        raise EngineError("invalid_gguf", f"cannot load GGUF: {type(e).__name__}: {e}") from e


_preload_lock = threading.Lock()
_preload_thread: threading.Thread | None = None


def preload_kernels() -> None:
    """Start loading, on a daemon thread, the part of the quantized path's kernels that does not
    depend on the file: numba's import (~0.2 s), the kernel modules, the activation quantization
    and both flash-attention kernels (from numba's on-disk cache). For a process that knows it
    will call ``Engine.load(..., weights="quantized")`` (the worker, from its arguments) and has
    other start-up work to overlap with it; the next such load waits for it instead of doing it
    again. Returns at once; a second call while one is pending does nothing. Failures are
    logged and otherwise ignored (the load then does the work itself)."""
    global _preload_thread
    with _preload_lock:
        if _preload_thread is None:
            _preload_thread = threading.Thread(target=_warm_up_common, daemon=True, name="modelyard-preload")
            _preload_thread.start()


def _take_preload() -> threading.Thread | None:
    """The pending :func:`preload_kernels` thread, once (the next load starts from scratch)."""
    global _preload_thread
    with _preload_lock:
        th, _preload_thread = _preload_thread, None
    return th


def compile_kernels(type_names: Iterable[str] | None = None) -> None:
    """Compile every kernel signature the quantized path runs, or load it from numba's on-disk
    cache where that is current (``__pycache__`` beside ``worker/engine/kernels/*_kernels.py``, or
    ``NUMBA_CACHE_DIR``): the file-independent ones (activation quantization, both flash-attention
    kernels, SiLU, GELU's table, RoPE's cos/sin) and the matmuls of each GGUF type name in
    ``type_names`` (None: every type with a kernel, ``quant.ACT_TYPE``). The same set as
    ``Engine.load(weights="quantized")``'s warm-up; for a set-up step (``scripts/compile_kernels.py``)
    that fills the cache once per checkout, so that no load compiles (a fresh cache costs tens of
    seconds of compiling, a current one ~0.5 s of loading). Raises whatever numba raises."""
    from .kernels import quant

    from .arch.model import FFN_ACTS

    _load_common_kernels()
    for act in FFN_ACTS:
        _load_ffn_kernels(act)
    _load_matmul_kernels(set(quant.ACT_TYPE) if type_names is None else set(type_names))


def _load_common_kernels() -> None:
    """numba's import and the kernels every model's quantized path runs (32-block activation
    quantization, both flash-attention kernels, RMSNorm, RoPE); raises on failure. The K-quants'
    activation quantization loads with their matmuls (:func:`_load_matmul_kernels`), the FFN's
    activation with :func:`_load_ffn_kernels`: a model loads only what it runs (each signature
    costs ~0.5-2 MiB of LLVM's resident code and tables, and load time)."""
    from . import attention
    from .kernels import quant

    x = np.zeros((2, 256), np.float32)
    for act in ("q8_0", "q8_1"):
        for with_s in (False, True):
            quant.quantize_activations(x, act, with_s)
    for rows, end in ((1, 1), (64, 64)):
        kv = np.zeros((1, end, 8), np.float32)
        attention.ggml_attention(np.zeros((rows, 1, 8), np.float32), kv, kv, end - rows, 0, None, 1.0)
    from .arch.model import RopeTable, rms_norm

    rms_norm(np.zeros((1, 16), np.float32), np.ones(16, np.float32), 1e-6, kernel=True)  # RMSNorm's kernel
    rope = RopeTable(2, 4, 10000.0, libm=True)                # RoPE's kernel: heads contiguous or strided
    qkv = np.zeros((2, 16), np.float32)
    for heads in (qkv[:, :8].reshape(2, 2, 4), np.zeros((1, 2, 4), np.float32)):
        rope.apply_neox(heads, np.zeros(heads.shape[0], np.int64))
    quant.cos_sin_libm(np.zeros((1, 2), np.float32))         # RoPE's cosf / sinf


def _load_ffn_kernels(act: str) -> None:
    """The fused ``act(gate) * up`` kernel of a gated FFN activation (a key of
    ``model.FFN_ACTS``; GELU also builds ggml's table); raises KeyError for another name, or what
    numba raises."""
    from .arch.model import FFN_ACTS, glu_ggml

    glu_ggml(np.zeros((1, 32), np.float32), 16, FFN_ACTS[act])


def _load_matmul_kernels(type_names: set[str], whole: bool = True, column_slice: bool = True) -> None:
    """Per weight type in ``type_names`` (those with a kernel), the matmul into a whole output
    (``QWeight.matmul``; when ``whole``) and into a column slice of one (a ``QConcat`` part of a
    prompt's rows, another numba signature for the VNNI kernels; when ``column_slice``); raises on failure."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from .kernels import quant

    for name in sorted(type_names):
        if not quant.supports(name):
            continue
        block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        w = quant.QWeight.from_raw(name, np.zeros((8, 256 // block * tsize), np.uint8), 8, 256)
        x = np.zeros((2, 256), np.float32)
        if whole:
            w.matmul(x)                                                  # [2, 8] C-contiguous out
            if w.act == "q8_K":                                          # the float-level q8_K of a fused part
                for with_s in (False, True):
                    quant.quantize_activations(x, "q8_K", with_s)
        if column_slice:
            out = np.empty((2, 16), np.float32)
            w.matmul_quantized(*quant.quantize_activations(x, w.act, True), out[:, 4:12])


def _warm_up_common() -> None:
    """numba's import and the file-independent kernels (see :func:`preload_kernels`)."""
    try:
        _load_common_kernels()
    except Exception:  # noqa: BLE001 - only a warm-up
        logging.getLogger(__name__).warning("kernel preload failed (kernels load at first use)", exc_info=True)


def _warm_up_kernels(type_names: set[str], preload: threading.Thread | None = None, ffn_act: str | None = None) -> None:
    """Import numba and load (from its on-disk cache) the kernel signatures the quantized path
    calls, on tiny inputs of the production types: first the file-independent ones (activation
    quantization, both flash-attention kernels: :func:`_warm_up_common`, or ``preload``, a
    :func:`preload_kernels` thread, joined instead when given); then per weight type in
    ``type_names`` the matmul into a whole output (``QWeight.matmul``), and the kernel of the
    architecture's FFN activation ``ffn_act`` (``Model.ffn_act``; None: every one). Run on a thread during
    ``Engine.load`` (joined before it returns), so that numba's import (~0.4 s) and the kernels'
    loading (~25 ms each) overlap the GGUF reading, the tokenizer build and the weight unpacking
    instead of delaying the first token. A failure is logged and otherwise ignored: the kernels
    are then loaded at first use. The load then runs :func:`_warm_up_slices` (the column-slice
    matmuls its ``QConcat`` parts need, none for most files, and the drop of LLVM's pages from
    the resident set)."""
    if preload is not None:
        preload.join()  # one numba parallel launch at a time
    else:
        _warm_up_common()
    from .arch.model import FFN_ACTS

    try:
        for act in FFN_ACTS if ffn_act is None else (ffn_act,):
            _load_ffn_kernels(act)
        _load_matmul_kernels(type_names, column_slice=False)
    except Exception:  # noqa: BLE001 - only a warm-up
        logging.getLogger(__name__).warning("kernel warm-up failed (kernels load at first use)", exc_info=True)


def _column_slice_types(weights: Iterable[Any]) -> set[str]:
    """The GGUF type names of the quantized parts of the :class:`~.quant.QConcat` matrices among
    ``weights`` (the model's): the only weights multiplied into a column slice of an output."""
    from .kernels.quant import QConcat, QWeight

    return {t for w in weights if isinstance(w, QConcat) for p in w.parts if isinstance(p, QWeight) for t in p.types}


def _warm_up_slices(type_names: set[str]) -> None:
    """The second part of the warm-up, once the model is built (after :func:`_warm_up_kernels`):
    the column-slice matmuls of ``type_names`` (:func:`_column_slice_types`; a model with no
    ``QConcat`` needs none), then LLVM's pages off the resident set. Failures are logged."""
    try:
        _load_matmul_kernels(type_names, whole=False)
        # LLVM's code and tables are not run by the loaded kernels: off the resident set (~90 MiB)
        resident.drop_clean_file_pages("libllvmlite")
    except Exception:  # noqa: BLE001 - only a warm-up
        logging.getLogger(__name__).warning("kernel warm-up failed (kernels load at first use)", exc_info=True)
