"""The batch scheduler: KV slots, continuous batching, chunked prefill, prefix cache.

It decides; the model executes. One :class:`Scheduler` owns, for one loaded
model, the slot table (``n_parallel`` slots: which sequence runs in which),
the :class:`~worker.engine.kv_cache.KVPool` (every sequence's KV entry, and
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
logits are needed). Only verified tokens are reused: an entry's ``tokens``
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
from .kv_cache import KVEntry, KVPool, KVShape
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = ["DEFAULT_N_BATCH", "DEFAULT_N_UBATCH", "BatchModel", "Finished", "Scheduler", "SeqRequest", "SlotInfo",
           "ubatch_bounds"]

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


def ubatch_bounds(n_keep: int, n_prompt: int, at: int, n_ubatch: int) -> tuple[int, int]:
    """``(first, rows)``: the micro-batch of a prompt that holds its token ``at``.

    A prompt of ``n_prompt`` tokens whose first ``n_keep`` come from the KV cache is
    evaluated as llama.cpp evaluates it alone (``llama_decode`` over ``n_ubatch`` tokens at a
    time from its ``n_past``): micro-batches ``[n_keep + k * n_ubatch, ...)`` of ``n_ubatch``
    tokens, the last one shorter. Requires ``n_keep <= at < n_prompt``, ``n_ubatch >= 1``.
    """
    first = n_keep + (at - n_keep) // n_ubatch * n_ubatch
    return first, min(n_ubatch, n_prompt - first)


class BatchModel(Protocol):
    """What the scheduler needs from ``worker.engine.model.Model``."""

    n_ctx: int
    n_vocab: int
    dtype: Any

    @property
    def kv_shape(self) -> KVShape: ...
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
        budget = kv_budget_tokens if kv_budget_tokens is not None else n_parallel * self.n_ctx
        self.pool = KVPool(model.kv_shape, int(budget), self.n_ctx)
        self.slots = [_Slot(i) for i in range(n_parallel)]
        self.waiting: deque[_Seq] = deque()
        self._by_id: dict[str, _Seq] = {}
        self._clock = 0  # steps run (the LRU clock)
        #: counters: forward passes run / abandoned mid-pass by a cancel, layers started over all
        #: passes (``AttnBatch.layers_run``), layers of the last pass
        self.stats = {"passes": 0, "interrupted": 0, "layers": 0, "last_layers": 0}

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
                first, ub_rows = ubatch_bounds(s.n_keep, len(prompt), at, self.n_ubatch)
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
            if not self._place(s):
                return  # head of line waits for KV (running sequences will free some)
            self.waiting.popleft()
            free.seq = s
            free.last_entry = s.entry
            s.slot = free.id
            s.t_admit = time.perf_counter()

    def _place(self, s: _Seq) -> bool:
        """Give ``s`` a KV entry, reusing the longest verified prefix; False if it does not fit yet.

        In order of preference: take over an idle entry the prompt extends; copy
        a shared prefix (from any entry) into a new entry, leaving the donor as
        it was; take over an idle donor and truncate it; start empty. Idle
        entries are evicted least recently used first to make room.
        """
        prompt = s.req.prompt
        limit = len(prompt) - 1  # the last prompt token is always evaluated
        idle = self.idle_entries()
        donor, n_keep = None, 0
        if s.req.params.cache_prompt and limit > 0:
            for e in idle + [e for e in self.pool.entries if e not in idle]:  # idle first on ties
                n = e.common_prefix(prompt, limit)
                if n > n_keep:
                    donor, n_keep = e, n
        donor_idle = donor is not None and donor in idle
        plans: list[tuple[str, KVEntry | None]] = []
        if donor is not None:
            if donor_idle and n_keep == donor.n_past:
                plans.append(("take", donor))
            elif n_keep >= MIN_SHARED_PREFIX or 2 * n_keep >= len(prompt):
                plans.append(("copy", donor))
                if donor_idle:
                    plans.append(("take", donor))
        plans.append(("new", None))
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
            entry.last_use = self._clock
            s.entry, s.n_keep, s.n_done = entry, kept, kept
            return True
        return False

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
