"""The batch scheduler: KV slots, continuous batching, chunked prefill, prefix cache.

It decides; the model executes. One :class:`Scheduler` owns, for one loaded
model, the slot table (``n_parallel`` slots: which sequence runs in which),
the :class:`~worker.engine.kv.cache.KVPool` (every sequence's KV entry, and
the idle entries kept as a prefix cache) and the waiting line. Each
:meth:`Scheduler.step` builds one flat batch and runs one
``model.forward_batch`` over it:

* every decoding sequence contributes its next token (one row each);
* prefilling sequences contribute prompt tokens, first come first served,
  up to ``n_batch`` prompt tokens per step (``DECODE_PREFILL_CHUNK`` while
  others decode), so a long prompt arriving never freezes running streams for
  more than one such slice;
* the prompt is cut into micro-batches as llama.cpp cuts a sequence's prompt alone
  (``n_ubatch`` tokens each, counted from the end of its reused prefix), whatever the
  budget and the other sequences: a step carries slices of one or more of them (a slice
  never crosses a micro-batch's end; ``Segment.ubatch``), and the kernels choose for the
  whole micro-batch, so a sequence's logits are the same bits alone and beside any others
  (with ``weights="quantized"``; the float32 path agrees to float32 rounding);
* a new request joins at the next step when a slot is free and its KV
  reservation fits the budget (idle entries are evicted, least recently used
  first, to make room); one that can never fit is refused at :meth:`add`.

Prefix cache (llama.cpp ``--slot-prompt-similarity`` / ``--cache-ram`` in
spirit): a new request starts from the entry (idle or running) sharing the
longest common token prefix with its prompt. An idle entry it extends is taken
over; otherwise the shared prefix is copied into a fresh entry and the donor
stays as it was (a shared prefix under ``MIN_SHARED_PREFIX`` tokens and under
half the prompt is not reused that way). At least the last prompt token is always evaluated (its
logits are needed).

Sliding-window models (``model.n_swa > 0``, e.g. Gemma 3) follow llama-server's context-checkpoint
rule (``tools/server/server-context.cpp``, ``update_slots``; llama.cpp PR 20288), so a reused
prefix gives llama-server's bits: a prompt evaluated from ``n_keep`` ends a batch at ``n_prompt -
4 - n_ubatch`` and at ``n_prompt - 4`` when past ``n_keep`` (:func:`prompt_cuts`; micro-batches count
from each cut), and llama-server's checkpoint before each of the last two batches (when the KV holds
something) is recorded on the entry (:class:`~worker.engine.kv.cache.Checkpoint`). A later prompt
keeps what llama-server would keep (:meth:`Scheduler._swa_reuse`): from the newest checkpoint inside
the shared prefix, one token before it (a repeated short prompt re-evaluates its last 5 tokens as
1 + 4 rows); nothing when no checkpoint lies there; the whole shared prefix (minus the last token)
when it is longer than the window + 1 and the history never outgrew llama.cpp's sliding-window cache
(``swa_cells``). The entry keeps every position, so restoring a checkpoint is keeping fewer
positions, whose K/V are those the earlier evaluation wrote. A sliding-window model copies even a
short kept prefix (it must keep exactly that much). Entries installed from outside (KV states) have
no known checkpoints and reuse as a model without a window. Only verified tokens are reused: an entry's ``tokens``
grow only after a forward pass returned, so a cancelled or failed sequence
never leaves KV that another trusts.

KV reservation of a request: ``n_prompt + n_max`` positions, where ``n_max``
is ``max_tokens``, or (``max_tokens`` None) what is left of ``n_ctx`` and of
the budget. Memory is touched only as positions are written (lazy pages), and
a finished sequence's entry is shrunk to what it holds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .attention import AttnBatch, Segment, StepInterrupted
from .errors import EngineError
from .generate import GenerationResult, Sequence, TokenEvent, check_context
from .kv.cache import Checkpoint, KVEntry, KVPool, KVShape
from .sampling import SamplingParams
from .text.tokenizer import Tokenizer

__all__ = ["DEFAULT_N_BATCH", "DEFAULT_N_UBATCH", "SWA_TAIL", "BatchModel", "Finished", "Scheduler", "SeqRequest",
           "SlotInfo", "prompt_cuts", "ubatch_bounds"]

#: Prompt tokens per step while no sequence decodes (the prefill budget of one forward pass).
DEFAULT_N_BATCH = 256

#: Tokens of a prompt's micro-batch (llama.cpp's ``n_ubatch``, 512 by default): the unit its
#: kernels are chosen for, so the unit that decides a prompt's numerics (``ubatch_bounds``).
DEFAULT_N_UBATCH = 512

#: While other sequences are decoding, a step carries at most this many prompt tokens, so a
#: running stream waits at most one such slice for its next token (a 256-token slice of
#: SmolLM2 costs ~0.5 s on 2 cores; 128 roughly halves the worst gap for a few % more steps).
#: A slice is a part of a micro-batch: it does not change what the prompt computes.
DECODE_PREFILL_CHUNK = 128

#: A shared prefix shorter than this (and than half the prompt, llama.cpp's slot-similarity
#: idea) is not worth copying or cutting another conversation's entry for (extending an entry
#: the prompt fully contains has no minimum).
MIN_SHARED_PREFIX = 16


#: llama-server on a sliding-window model evaluates a prompt's last ``SWA_TAIL`` tokens, and the
#: ``n_ubatch`` before them, as batches of their own (``checkpoint_offsets = {4 + n_ubatch, 4}``
#: in ``tools/server/server-context.cpp``, llama.cpp PR 20288) and keeps a context checkpoint
#: before each of those batches.
SWA_TAIL = 4

#: llama-server's defaults ``--ctx-checkpoints 32`` (``n_ctx_checkpoints``: checkpoints kept per
#: slot) and ``checkpoint_min_step`` 8192 (tokens; closer ones may be evicted when full).
N_CTX_CHECKPOINTS = 32
CHECKPOINT_MIN_STEP = 8192


def prompt_cuts(n_keep: int, n_prompt: int, n_ubatch: int, n_swa: int) -> tuple[int, ...]:
    """Positions (ascending) where llama-server ends a batch of a prompt besides its
    ``n_ubatch`` micro-batches: for a sliding-window model (``n_swa > 0``) ``n_prompt - 4 -
    n_ubatch`` and ``n_prompt - 4``, each only when past ``n_keep`` (the first token of a
    batch is always added before the check); none for other models.

    Source: ``tools/server/server-context.cpp``, the prompt loop's ``checkpoint_offsets``
    (``n_last = min(n_batch, offset)``; this assumes llama.cpp's ``n_batch >= n_ubatch + 4``,
    as the defaults 2048 / 512 are). Requires ``0 <= n_keep < n_prompt``.
    """
    if n_swa <= 0:
        return ()
    return tuple(c for c in (n_prompt - SWA_TAIL - n_ubatch, n_prompt - SWA_TAIL) if c > n_keep)


def ubatch_bounds(n_keep: int, n_prompt: int, at: int, n_ubatch: int,
                  cuts: tuple[int, ...] = ()) -> tuple[int, int]:
    """``(first, rows)``: the micro-batch of a prompt that holds its token ``at``.

    A prompt of ``n_prompt`` tokens whose first ``n_keep`` come from the KV cache is
    evaluated as llama.cpp evaluates it alone (``llama_decode`` over ``n_ubatch`` tokens at a
    time from its ``n_past``): micro-batches ``[n_keep + k * n_ubatch, ...)`` of ``n_ubatch``
    tokens, the last one shorter. ``cuts`` (from :func:`prompt_cuts`, ascending, each in
    ``(n_keep, n_prompt)``) end a batch there, and the micro-batches after a cut count from it.
    Requires ``n_keep <= at < n_prompt``, ``n_ubatch >= 1``.
    """
    start, end = n_keep, n_prompt
    for c in cuts:
        if c <= at:
            start = c
        else:
            end = c
            break
    first = start + (at - start) // n_ubatch * n_ubatch
    return first, min(n_ubatch, end - first)


class BatchModel(Protocol):
    """What the scheduler needs from ``worker.engine.arch.model.Model``."""

    n_ctx: int
    n_vocab: int
    dtype: Any

    @property
    def kv_shape(self) -> KVShape: ...
    # optional: ``n_swa`` (int, sliding-window size; 0 or absent: none)
    def forward_batch(self, tokens: np.ndarray, batch: AttnBatch, rows: Any) -> np.ndarray: ...


@dataclass
class SeqRequest:
    """One sequence to run.

    ``prompt``: token ids, validated and non-empty; ``params``: validated;
    ``on_token`` gets every generated token (returning ``False`` cancels).
    ``should_stop``: polled before every step *and between the layers of a forward pass*
    (it may be called from the engine thread only, but may read state other threads set,
    e.g. ``threading.Event.is_set``); True cancels the sequence at once: a step it is part
    of is abandoned mid-pass and the others of that batch run again at the next step.
    """

    id: str
    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[TokenEvent], Any] | None = None
    should_stop: Callable[[], Any] | None = None


@dataclass
class Finished:
    """A sequence that ended in this step: its result, or the exception that ended it."""

    id: str
    result: GenerationResult | None
    error: BaseException | None = None
    id_slot: int = -1


@dataclass(frozen=True)
class SlotInfo:
    """One slot as ``/slots`` reports it (llama.cpp names)."""

    id: int
    id_task: str | None  # request id running in it
    is_processing: bool
    n_past: int  # tokens its KV holds (running, or the entry it last ran)


@dataclass(eq=False)
class _Seq:
    req: SeqRequest
    reserve: int  # KV positions reserved
    n_max: int
    seq: Sequence
    entry: KVEntry | None = None
    slot: int = -1
    n_keep: int = 0  # prompt tokens reused from the cache
    n_done: int = 0  # prompt tokens in the KV (reused + evaluated)
    cuts: tuple[int, ...] = ()  # prompt_cuts of this evaluation
    ckpt_at: tuple[int, ...] = ()  # prompt positions where a context checkpoint is recorded
    next_token: int | None = None  # sampled, to feed at the next step
    cancelled: bool = False
    t_admit: float = 0.0
    t_first: float = 0.0  # prefill finished
    evaluated: int = 0

    @property
    def prefilling(self) -> bool:
        return self.n_done < len(self.req.prompt)


@dataclass
class _Slot:
    id: int
    seq: _Seq | None = None
    last_entry: KVEntry | None = None


class Scheduler:
    """Slots, KV pool and waiting line of one model; :meth:`step` runs one batched forward.

    Args:
        model: a :class:`BatchModel`.
        tokenizer: for pieces and the end-of-generation set.
        n_parallel: slots (sequences decoded at once), >= 1.
        kv_budget_tokens: KV positions all entries may reserve together (>= 1).
        n_batch: prompt tokens per step while none decodes (>= 1; ``DECODE_PREFILL_CHUNK`` at
            most while others decode).
        n_ubatch: tokens of a prompt's micro-batch (>= 1), llama.cpp's ``n_ubatch``: the unit
            the kernels are chosen for (:func:`ubatch_bounds`); how many of them a step
            carries does not change the numbers.
    Raises:
        EngineError("invalid_params"): a bad size.

    Not thread-safe: one thread calls add/abort/step (the engine's lock or the
    worker's engine thread).
    """

    def __init__(self, model: BatchModel, tokenizer: Tokenizer, *, n_parallel: int = 1,
                 kv_budget_tokens: int | None = None, n_batch: int = DEFAULT_N_BATCH,
                 n_ubatch: int = DEFAULT_N_UBATCH) -> None:
        for name, v in (("n_parallel", n_parallel), ("n_batch", n_batch), ("n_ubatch", n_ubatch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngineError("invalid_params", f"{name} must be an integer >= 1, got {v!r}")
        self.model = model
        self.tok = tokenizer
        self.n_ctx = int(model.n_ctx)
        self.n_vocab = min(int(model.n_vocab), tokenizer.n_vocab)
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch
        #: sliding-window size (0: none); llama-server's prompt rule for such models applies
        self.n_swa = max(0, int(getattr(model, "n_swa", 0) or 0))
        #: cells of llama.cpp's sliding-window cache of one sequence (``llama_kv_cache_iswa``:
        #: ``GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256)``); an entry's oldest position that cache
        #: still holds is modelled as ``max(0, swa_high_water - swa_cells)`` (one sequence's cache:
        #: llama-server ``-np 1`` or a non-unified cache; its default ``-np auto`` shares one unified
        #: cache of ``4 * n_swa + n_ubatch`` cells among 4 slots, which wraps elsewhere)
        self.swa_cells = -(-min(self.n_ctx, self.n_swa + n_ubatch) // 256) * 256 if self.n_swa else 0
        budget = kv_budget_tokens if kv_budget_tokens is not None else n_parallel * self.n_ctx
        self.pool = KVPool(model.kv_shape, int(budget), self.n_ctx)
        self.slots = [_Slot(i) for i in range(n_parallel)]
        self.waiting: deque[_Seq] = deque()
        self._by_id: dict[str, _Seq] = {}
        self._clock = 0  # steps run (the LRU clock)
        #: counters: forward passes run / abandoned mid-pass by a cancel, layers started over all
        #: passes (``AttnBatch.layers_run``), layers of the last pass, and over all passes the slots
        #: busy at each (llama.cpp's ``n_busy_slots_total``: a slot holding a sequence, whether or
        #: not the pass carried it)
        self.stats = {"passes": 0, "interrupted": 0, "layers": 0, "last_layers": 0, "busy_slots": 0}

    # ------------------------------------------------------------------ facts

    @property
    def n_parallel(self) -> int:
        return len(self.slots)

    @property
    def has_work(self) -> bool:
        return bool(self._by_id)

    def slot_info(self) -> list[SlotInfo]:
        out = []
        for s in self.slots:
            if s.seq is not None:
                n = s.seq.entry.n_past if s.seq.entry is not None else 0
                out.append(SlotInfo(s.id, s.seq.req.id, True, n))
            else:
                e = s.last_entry
                out.append(SlotInfo(s.id, None, False, e.n_past if e is not None and e in self.pool.entries else 0))
        return out

    def idle_entries(self) -> list[KVEntry]:
        """KV entries no running sequence owns (the prefix cache), least recently used first."""
        owned = {id(s.seq.entry) for s in self.slots if s.seq is not None and s.seq.entry is not None}
        return sorted((e for e in self.pool.entries if id(e) not in owned), key=lambda e: e.last_use)

    # ------------------------------------------------------------------ slot states

    def _slot(self, id_slot: int) -> _Slot:
        if isinstance(id_slot, bool) or not isinstance(id_slot, int) or not 0 <= id_slot < len(self.slots):
            raise EngineError("invalid_params", f"Invalid slot ID {id_slot!r} (slots 0..{len(self.slots) - 1})")
        return self.slots[id_slot]

    def slot_busy(self, id_slot: int) -> bool:
        """True while a sequence runs in slot ``id_slot`` (its state cannot be saved, restored or
        erased until it ends). Raises EngineError("invalid_params") for a bad id."""
        return self._slot(id_slot).seq is not None

    def slot_entry(self, id_slot: int) -> KVEntry | None:
        """The idle entry slot ``id_slot`` last ran (None: none, or another sequence took it over).

        Raises: EngineError("invalid_params") for a bad id or a busy slot.
        """
        sl = self._slot(id_slot)
        if sl.seq is not None:
            raise EngineError("invalid_params", f"slot {id_slot} is processing a request")
        e = sl.last_entry
        if e is None or e not in self.pool.entries or e not in self.idle_entries():
            return None
        return e

    def install(self, tokens: list[int], k: np.ndarray, v: np.ndarray, id_slot: int | None = None) -> KVEntry:
        """A new idle entry holding ``tokens`` with keys ``k`` / values ``v``
        (``[n_layer, n_kv_head, n, head_dim]``), the prefix cache's most recent; with
        ``id_slot`` it becomes that slot's entry and the entry the slot held is dropped.
        Idle entries are evicted (LRU) to make room. The caller has validated the state.

        Raises (nothing changed): EngineError("invalid_params") bad / busy slot, shapes;
            EngineError("kv_budget_exceeded") it does not fit even with every idle entry evicted.
        """
        sl = self._slot(id_slot) if id_slot is not None else None
        if sl is not None and sl.seq is not None:
            raise EngineError("invalid_params", f"slot {id_slot} is processing a request")
        n = len(tokens)
        s = self.pool.shape
        if k.shape != (s.n_layer, s.n_kv_head, n, s.head_dim_k) or v.shape != (s.n_layer, s.n_kv_head, n, s.head_dim_v):
            raise EngineError("invalid_params", f"KV arrays {k.shape}/{v.shape} do not fit this model's KV layout")
        if n > self.n_ctx:
            raise EngineError("context_length_exceeded", f"a KV state of {n} tokens exceeds n_ctx={self.n_ctx}")
        old = self.slot_entry(id_slot) if id_slot is not None else None
        cap = max(1, -(-n // 16) * 16)
        idle = [e for e in self.idle_entries() if e is not old]
        free_after = self.pool.free_tokens() + (old.capacity if old is not None else 0)
        if free_after + sum(e.capacity for e in idle) < cap:
            raise EngineError("kv_budget_exceeded", f"a KV state of {n} tokens does not fit this model's KV "
                              f"budget of {self.pool.budget_tokens} tokens")
        if old is not None:
            self.pool.drop(old)
        self._make_room(cap, None, idle)
        entry = self.pool.new(cap)
        if n:
            entry.k[:, :, :n] = k
            entry.v[:, :, :n] = v
            entry._written = n
        entry.tokens.extend(int(t) for t in tokens)
        entry.checkpoints = None  # how it was evaluated is not known: its prefix is reused as is
        entry.swa_high_water = n
        self._clock += 1
        entry.last_use = self._clock
        if sl is not None:
            sl.last_entry = entry
        return entry

    def erase(self, id_slot: int) -> int:
        """Drop slot ``id_slot``'s idle entry; the tokens it held (0: none).

        Raises: EngineError("invalid_params") for a bad id or a busy slot.
        """
        e = self.slot_entry(id_slot)
        if e is None:
            return 0
        n = e.n_past
        self.pool.drop(e)
        self.slots[id_slot].last_entry = None
        return n

    def best_prefix(self, ids: list[int]) -> int:
        """The longest prefix of ``ids`` (at most ``len(ids) - 1``) any entry holds."""
        limit = len(ids) - 1
        return max((e.common_prefix(ids, limit) for e in self.pool.entries), default=0)

    # ------------------------------------------------------------------ requests

    def reservation(self, n_prompt: int, max_tokens: int | None) -> tuple[int, int]:
        """``(positions to reserve, n_max)`` for a request, or raise.

        Raises:
            EngineError("context_length_exceeded"): prompt + max_tokens > n_ctx.
            EngineError("kv_budget_exceeded"): it can never fit the KV budget.
        """
        budget = self.pool.budget_tokens
        if max_tokens is None:
            check_context(self.n_ctx, n_prompt, None)
            n_max = min(self.n_ctx, budget) - n_prompt
            if n_max < 1:
                raise EngineError("kv_budget_exceeded", f"the prompt ({n_prompt} tokens) does not fit this model's "
                                  f"KV budget of {budget} tokens")
        else:
            n_max = max_tokens
            check_context(self.n_ctx, n_prompt, n_max)
            if n_prompt + n_max > budget:
                raise EngineError("kv_budget_exceeded", f"this request needs {n_prompt + n_max} tokens of KV "
                                  f"({n_prompt} in the prompt, {n_max} for the completion) but this model's KV "
                                  f"budget holds {budget} tokens")
        return n_prompt + n_max, n_max

    def add(self, req: SeqRequest) -> None:
        """Queue ``req``; it joins the batch at a coming step.

        Raises (nothing is queued):
            EngineError("invalid_params"): an id already running or waiting.
            EngineError("context_length_exceeded" | "kv_budget_exceeded"): see :meth:`reservation`.
        """
        if req.id in self._by_id:
            raise EngineError("invalid_params", f"sequence id {req.id!r} is already in use")
        reserve, n_max = self.reservation(len(req.prompt), req.params.max_tokens)
        seq = Sequence(self.tok, req.params, req.prompt, n_max, req.on_token, self.n_vocab)
        s = _Seq(req, reserve, n_max, seq)
        self.waiting.append(s)
        self._by_id[req.id] = s

    def abort(self, seq_id: str) -> bool:
        """Cancel ``seq_id``: it leaves at the next step with finish_reason "cancelled".
        False when unknown (or already finished). (A cancel that must not wait for the step
        running now goes through ``SeqRequest.should_stop``.)"""
        s = self._by_id.get(seq_id)
        if s is None:
            return False
        s.cancelled = True
        return True

    def cache_n(self, seq_id: str) -> int:
        """Prompt tokens ``seq_id`` reused from the KV cache (0 when unknown or not admitted yet)."""
        s = self._by_id.get(seq_id)
        return s.n_keep if s is not None else 0

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Finished]:
        """Admit, build one batch, run one forward pass, sample; return the sequences that ended.

        Never raises for a sequence's fault: a model error ends every sequence
        of that batch with ``Finished.error``; a callback error ends its own.
        A sequence whose ``should_stop()`` turns true while the pass runs ends it between two
        layers: the step returns at once with that sequence (and any other stopped one)
        cancelled; the rest of the batch appended nothing and runs again at the next step.
        """
        self._clock += 1
        done: list[Finished] = []
        for s in [s for s in self._by_id.values() if s.cancelled or self._stopped(s)]:
            if not s.seq.done:
                s.seq.finish("cancelled", "cancelled")
            done.append(self._finish(s))
        self._admit()
        decode = [sl.seq for sl in self.slots if sl.seq is not None and not sl.seq.prefilling
                  and sl.seq.next_token is not None]
        prefill = sorted((sl.seq for sl in self.slots if sl.seq is not None and sl.seq.prefilling),
                         key=lambda s: s.t_admit)
        tokens: list[int] = []
        segs: list[Segment] = []
        parts: list[tuple[_Seq, list[int], bool]] = []  # (seq, tokens fed, wants logits)
        for s in decode:
            assert s.entry is not None and s.next_token is not None
            segs.append(Segment(s.entry, len(tokens), 1, s.entry.n_past))
            parts.append((s, [s.next_token], True))
            tokens.append(s.next_token)
        budget = min(self.n_batch, DECODE_PREFILL_CHUNK) if decode else self.n_batch
        for s in prefill:  # first come first served; a slice never crosses a micro-batch's end
            assert s.entry is not None
            prompt = s.req.prompt
            at = s.n_done
            while budget > 0 and at < len(prompt):
                first, ub_rows = ubatch_bounds(s.n_keep, len(prompt), at, self.n_ubatch, s.cuts)
                if at in s.ckpt_at:
                    self._checkpoint(s, at)
                chunk = prompt[at:min(first + ub_rows, at + budget)]
                segs.append(Segment(s.entry, len(tokens), len(chunk), s.entry.n_past + at - s.n_done,
                                    ub_rows, at - first))
                at += len(chunk)
                budget -= len(chunk)
                parts.append((s, chunk, at == len(prompt)))
                tokens.extend(chunk)
            if budget <= 0:
                break
        if not tokens:
            return done
        rows: list[int] = []
        for seg, (_, _, want) in zip(segs, parts):
            if want:
                rows.append(seg.start + seg.n - 1)
        members = list(dict.fromkeys(s for s, _, _ in parts))  # the batch's sequences, once each
        watched = [s for s in members if s.req.should_stop is not None]
        batch = AttnBatch(segs, self.model.dtype,
                          (lambda: any(self._stopped(s) for s in watched)) if watched else None)
        self.stats["passes"] += 1
        self.stats["busy_slots"] += sum(1 for sl in self.slots if sl.seq is not None)
        try:
            logits = self.model.forward_batch(np.asarray(tokens, dtype=np.int64), batch, rows)  # [R, n_vocab]
        except StepInterrupted:
            # nothing was appended: the K/V written past each entry's n_past are never read
            # before being written again (attention module docstring)
            self.stats["interrupted"] += 1
            for s in watched:
                if self._stopped(s):
                    if not s.seq.done:
                        s.seq.finish("cancelled", "cancelled")
                    done.append(self._finish(s))
            return done
        except Exception as e:  # noqa: BLE001 - a model failure ends this batch's sequences, not the worker
            for s in members:
                done.append(self._finish(s, e))
            return done
        finally:
            self.stats["layers"] += batch.layers_run
            self.stats["last_layers"] = batch.layers_run
        now = time.perf_counter()
        r = 0
        for s, fed, want in parts:
            assert s.entry is not None
            s.entry.tokens.extend(fed)
            s.entry.last_use = self._clock
            if s.entry.n_past > s.entry.swa_high_water:
                s.entry.swa_high_water = s.entry.n_past
            if s.prefilling:
                s.n_done += len(fed)
                s.evaluated += len(fed)
                if not s.prefilling:
                    s.t_first = now
            if not want:
                continue
            row = logits[r]
            r += 1
            try:
                s.next_token = s.seq.step(row)
            except Exception as e:  # noqa: BLE001 - on_token raised: this sequence ends
                done.append(self._finish(s, e))
                continue
            if s.next_token is None:
                done.append(self._finish(s))
        return done

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _stopped(s: _Seq) -> bool:
        stop = s.req.should_stop
        if stop is None or s.cancelled:
            return s.cancelled
        if stop():
            s.cancelled = True  # sticky: a flag read once as set stays set
        return s.cancelled

    def _admit(self) -> None:
        """Move waiting sequences into free slots, first come first served, while their KV fits."""
        while self.waiting:
            free = next((sl for sl in self.slots if sl.seq is None), None)
            if free is None:
                return
            s = self.waiting[0]
            if not self._place(s, free):
                return  # head of line waits for KV (running sequences will free some)
            self.waiting.popleft()
            free.seq = s
            free.last_entry = s.entry
            s.slot = free.id
            s.t_admit = time.perf_counter()

    def _place(self, s: _Seq, slot: _Slot | None = None) -> bool:
        """Give ``s`` a KV entry, reusing the longest verified prefix; False if it does not fit yet.

        In order of preference: take over an idle entry the prompt extends; copy
        a shared prefix (from any entry) into a new entry, leaving the donor as
        it was; take over an idle donor and truncate it; start empty. Idle
        entries are evicted least recently used first to make room. How much of
        the shared prefix is kept: all of it but the last prompt token, or, for a
        sliding-window model, what llama-server's checkpoints allow (:meth:`_swa_reuse`).
        """
        prompt = s.req.prompt
        n_prompt = len(prompt)
        swa = self.n_swa > 0
        limit = n_prompt if swa else n_prompt - 1  # at least the last prompt token is evaluated
        idle = self.idle_entries()
        donor, n_keep = None, 0
        ckpts: list[Checkpoint] = []
        high_water = 0
        inherited: list[Checkpoint] | None = None
        if s.req.params.cache_prompt and n_prompt > 1:
            order = idle + [e for e in self.pool.entries if e not in idle]  # idle first on ties
            if swa:  # ... and then the most recent, as llama-server's slot holds its latest state
                idle_ids = {id(e) for e in idle}
                order.sort(key=lambda e: (id(e) not in idle_ids, -e.last_use))
            for e in order:
                n = e.common_prefix(prompt, limit)
                if n > n_keep:
                    donor, n_keep = e, n
            if donor is not None:
                if swa and donor.checkpoints is not None:  # what llama-server keeps of it
                    n_keep, ckpts, high_water = self._swa_reuse(donor, n_keep, n_prompt)
                    if n_keep == 0:  # re-evaluated whole, on the state the slot held
                        inherited, donor = ckpts, None
                else:  # no sliding window, or a state installed from outside (checkpoints unknown)
                    n_keep, high_water = min(n_keep, n_prompt - 1), donor.swa_high_water
        donor_idle = donor is not None and donor in idle
        plans: list[tuple[str, KVEntry | None]] = []
        if donor is not None:
            if donor_idle and n_keep == donor.n_past:
                plans.append(("take", donor))
            elif n_keep >= MIN_SHARED_PREFIX or 2 * n_keep >= n_prompt or swa:
                # (a sliding-window model keeps exactly what llama-server keeps, however short)
                plans.append(("copy", donor))
                if donor_idle:
                    plans.append(("take", donor))
        plans.append(("new", None))
        # llama-server's slot keeps, through a prompt evaluated from 0, the checkpoints with
        # pos_max <= 0 of what it held (the state after the first token): here, the slot's last entry
        if inherited is None:
            prev = slot.last_entry if slot is not None else None
            inherited = [c for c in (prev.checkpoints or []) if c.pos_max <= 0] \
                if swa and prev is not None and prev in self.pool.entries else []
        for how, d in plans:
            keep = d if how == "copy" or how == "take" else None
            need = s.reserve - (d.capacity if how == "take" and d is not None else 0)
            if not self._make_room(need, keep, idle):
                continue
            if how == "take" and d is not None:
                d.truncate(n_keep)
                self.pool.resize(d, s.reserve)
                entry = d
            else:
                entry = self.pool.new(s.reserve)
                if how == "copy" and d is not None:
                    entry.k[:, :, :n_keep] = d.k[:, :, :n_keep]
                    entry.v[:, :, :n_keep] = d.v[:, :, :n_keep]
                    entry.tokens.extend(d.tokens[:n_keep])
            kept = n_keep if how != "new" else 0
            entry.checkpoints = list(ckpts) if kept else inherited
            entry.swa_high_water = high_water if kept else 0
            entry.last_use = self._clock
            s.entry, s.n_keep, s.n_done = entry, kept, kept
            s.cuts = prompt_cuts(kept, n_prompt, self.n_ubatch, self.n_swa)
            # llama-server checkpoints before the batch ending 4 tokens before the prompt's end and
            # before the last batch, when the memory holds something (server-context.cpp: near_prompt_end)
            s.ckpt_at = tuple(p for p in ((kept,) + s.cuts)[-2:] if p > 0) if swa else ()
            return True
        return False

    def _swa_reuse(self, donor: KVEntry, n_common: int, n_prompt: int) -> tuple[int, list[Checkpoint], int]:
        """``(n_keep, checkpoints, high_water)``: what llama-server keeps of ``donor`` for a prompt of
        ``n_prompt`` tokens sharing its first ``n_common`` with it, on a sliding-window model.

        llama-server (``tools/server/server-context.cpp``, the ``SLOT_STATE_STARTED`` branch of
        ``update_slots``): ``pos_min_thold = max(0, n_common - n_swa - (0 if new tokens else 1))``;
        when the sliding-window cache's lowest position ``pos_min >= pos_min_thold`` (always so
        for a short history: ``pos_min`` is 0 until that cache wraps), it restores the newest
        checkpoint with ``pos_max <= n_common`` and (``pos_min < pos_min_thold`` or ``pos_min ==
        0``) and re-evaluates from ``min(n_common, max(ck.pos_min + 1, ck.pos_max))`` (so from
        ``ck.n_tokens - 1``: the [TAG_CHECKPOINTS_FIX_POS_MIN] workaround), or, with none,
        re-evaluates the whole prompt; otherwise it keeps all ``n_common``. Checkpoints with
        ``pos_max`` past the new position are dropped; a prompt kept whole re-evaluates its
        last token ([TAG_PROMPT_LOGITS]). The entry keeps every K/V, so "restoring" is keeping
        its first ``n_keep`` positions: the K/V a fresh evaluation with the same batches wrote.
        """
        ckpts = list(donor.checkpoints or [])
        high_water = donor.swa_high_water
        pos_next = n_keep = n_common
        if n_common > 0:
            thold = max(0, n_common - self.n_swa - (0 if n_common < n_prompt else 1))
            if max(0, high_water - self.swa_cells) >= thold:
                ck = next((c for c in reversed(ckpts)
                           if c.pos_max <= n_common and (c.pos_min < thold or c.pos_min == 0)), None)
                if ck is not None:
                    pos_next = min(n_common, max(ck.pos_min + 1, ck.pos_max))
                    n_keep = min(pos_next, ck.n_tokens)
                    high_water = ck.high_water
                else:
                    pos_next = n_keep = high_water = 0
        ckpts = [c for c in ckpts if c.pos_max <= pos_next]
        if n_keep == n_prompt:
            n_keep -= 1
        return n_keep, ckpts, high_water

    def _checkpoint(self, s: _Seq, at: int) -> None:
        """Record llama-server's context checkpoint of ``s``'s entry at ``at`` tokens (before the
        batch starting there is evaluated): ``create_checkpoint`` in server-context.cpp, with its
        eviction (``N_CTX_CHECKPOINTS``, ``CHECKPOINT_MIN_STEP``) and superseding rules."""
        e = s.entry
        assert e is not None
        if e.checkpoints is None:
            e.checkpoints = []
        cks, task = e.checkpoints, s.req.id
        i, last = 0, -1
        while len(cks) + 1 >= N_CTX_CHECKPOINTS and i < len(cks):
            c = cks[i]
            if c.task != task and last >= 0 and c.n_tokens <= last + CHECKPOINT_MIN_STEP:
                del cks[i]
                continue
            last = c.n_tokens
            i += 1
        while len(cks) >= N_CTX_CHECKPOINTS:
            del cks[0]
        cks[:] = [c for c in cks if c.n_tokens != at]
        hw = max(e.swa_high_water, at)
        cks.append(Checkpoint(at, max(0, hw - self.swa_cells), at - 1, hw, task))

    def _make_room(self, need: int, keep: KVEntry | None, idle: list[KVEntry]) -> bool:
        """Evict idle entries (LRU first, never ``keep``) until ``need`` positions are free;
        False (nothing evicted) when even evicting all of them would not do."""
        free = self.pool.free_tokens()
        if free >= need:
            return True
        victims = [e for e in idle if e is not keep and e in self.pool.entries]
        if free + sum(e.capacity for e in victims) < need:
            return False
        for e in victims:
            if self.pool.free_tokens() >= need:
                break
            self.pool.drop(e)
        return True

    def _finish(self, s: _Seq, error: BaseException | None = None) -> Finished:
        self._by_id.pop(s.req.id, None)
        slot = s.slot
        if slot >= 0:
            self.slots[slot].seq = None
        else:
            try:
                self.waiting.remove(s)
            except ValueError:
                pass
        if s.entry is not None:
            s.entry.last_use = self._clock
            try:
                self.pool.shrink(s.entry)
            except Exception:  # noqa: BLE001 - never trust an entry we could not shrink
                self.pool.drop(s.entry)
        if error is not None:
            return Finished(s.req.id, None, error, slot)
        now = time.perf_counter()
        t_admit = s.t_admit or now
        t_first = s.t_first or now
        text, tail = s.seq.final_text()
        res = GenerationResult(
            text=text, tail=tail, tokens=s.seq.tokens, finish_reason=s.seq.finish_reason,
            stop_type=s.seq.stop_type, stopping_word=s.seq.stopping_word, prompt_n=s.evaluated,
            prompt_ms=(t_first - t_admit) * 1e3, predicted_n=len(s.seq.tokens),
            predicted_ms=(now - t_first) * 1e3, cache_n=s.n_keep, prompt_tokens=len(s.req.prompt), eog=s.seq.eog)
        return Finished(s.req.id, res, None, slot)


def run_one(sched: Scheduler, req: SeqRequest, should_stop: Callable[[], Any] | None = None) -> GenerationResult:
    """Run one sequence to its end on ``sched`` (alone or beside others already queued).

    ``should_stop()`` is polled before every step; True cancels. Returns its
    result; raises what ended it (a model or callback exception) and
    :meth:`Scheduler.add`'s errors. Other sequences' results of those steps
    are dropped: use :meth:`Scheduler.step` directly to run several.
    """
    sched.add(req)
    while True:
        if should_stop is not None and should_stop():
            sched.abort(req.id)
        for f in sched.step():
            if f.id == req.id:
                if f.error is not None:
                    raise f.error
                assert f.result is not None
                return f.result
