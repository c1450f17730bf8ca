"""The engine facade the worker uses (contract: docs/ENGINE-API.md).

An :class:`Engine` owns one loaded GGUF model, its tokenizer, its chat template
and its batch :class:`~worker.engine.scheduler.Scheduler` (KV slots, prefix
cache). Several sequences run at once through ``add`` / ``step`` / ``abort``;
``generate`` is the single-sequence wrapper. A lock serialises the calls that
touch the scheduler; ``prepare``, ``tokenize`` and the template calls never
touch the KV and may run on any thread. The load itself is in ``engine_load.py``, the text
methods in ``engine_text.py``, the identity and KV-state methods in ``engine_kv.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from . import constraints
from .engine_kv import EngineKVStates
from .engine_load import EngineInfo, load_parts
from .engine_text import EngineText
from .errors import EngineError
from .generate import GenerationResult, TokenEvent
from .kv.blocks import KVBlockLog
from .kv.state import KVIdentity
from .sampling import SamplingParams
from .scheduler import Scheduler, run_one
from .seqs import Finished, SeqRequest, SlotInfo
from .text.chat_template import ChatTemplate
from .text.tokenizer import Tokenizer

__all__ = ["Engine", "EngineInfo"]


class Engine(EngineText, EngineKVStates):
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
        self._kv_blocks: KVBlockLog | None = None  # KV events (enable_kv_events); None: off

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
                compiling, see :func:`~.warmup.compile_kernels`). Called on the loading thread;
                must not raise.

        Raises:
            EngineError: ``file_not_found``, ``invalid_gguf``,
                ``unsupported_architecture``, ``unsupported_tensor_type``,
                ``unsupported_tokenizer``, ``template_error`` (the given or
                embedded template does not compile), ``invalid_params``
                (n_ctx not a positive integer, parallel, n_batch or n_ubatch < 1, budget <= 0,
                unknown weights mode).
        """
        return cls(*load_parts(gguf_path, n_ctx, chat_template, parallel=parallel, kv_budget_mib=kv_budget_mib,
                               n_batch=n_batch, weights=weights, n_ubatch=n_ubatch, progress=progress))

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
        p = params.validated(self.sampling_vocab)
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
    def sampling_vocab(self) -> int:
        """The token ids sampling parameters may name (``logit_bias`` keys): ``[0, sampling_vocab)``,
        the smaller of the model's and the tokenizer's vocabulary."""
        return int(min(self.info.n_vocab, self.tokenizer.n_vocab))

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
