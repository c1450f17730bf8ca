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

Prefix cache and sliding-window checkpoints: :mod:`.prefix` (which KV a new request starts from).

KV reservation of a request: ``n_prompt + n_max`` positions, where ``n_max``
is ``max_tokens``, or (``max_tokens`` None) what is left of ``n_ctx`` and of
the budget. Memory is touched only as positions are written (lazy pages), and
a finished sequence's entry is shrunk to what it holds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .attention import AttnBatch, Segment, StepInterrupted
from .errors import EngineError
from .generate import GenerationResult, Sequence, check_context
from .kv.cache import KVPool
from .prefix import PrefixCache
from .seqs import BatchModel, Finished, SeqRequest, _Seq, _Slot, _StepPlan
from .slot_states import SlotStates
from .text.tokenizer import Tokenizer

__all__ = ["DEFAULT_N_BATCH", "DEFAULT_N_UBATCH", "Scheduler", "run_one", "ubatch_bounds"]

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

def ubatch_bounds(n_keep: int, n_prompt: int, at: int, n_ubatch: int,
                  cuts: tuple[int, ...] = ()) -> tuple[int, int]:
    """``(first, rows)``: the micro-batch of a prompt that holds its token ``at``.

    A prompt of ``n_prompt`` tokens whose first ``n_keep`` come from the KV cache is
    evaluated as llama.cpp evaluates it alone (``llama_decode`` over ``n_ubatch`` tokens at a
    time from its ``n_past``): micro-batches ``[n_keep + k * n_ubatch, ...)`` of ``n_ubatch``
    tokens, the last one shorter. ``cuts`` (from :func:`~.prefix.prompt_cuts`, ascending, each in
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


class Scheduler(SlotStates):
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
        #: which KV entry a new sequence starts from (the prefix cache over ``pool``)
        self.prefix = PrefixCache(self.pool, self.n_swa, self.swa_cells, n_ubatch)
        self.slots = [_Slot(i) for i in range(n_parallel)]
        self.waiting: deque[_Seq] = deque()
        self._by_id: dict[str, _Seq] = {}
        self._clock = 0  # steps run (the LRU clock)
        #: counters: passes run / abandoned by a cancel, layers started (``AttnBatch.layers_run``) in all /
        #: the last pass, busy slots summed per pass (llama.cpp's ``n_busy_slots_total``)
        self.stats = {"passes": 0, "interrupted": 0, "layers": 0, "last_layers": 0, "busy_slots": 0}

    # ------------------------------------------------------------------ facts

    @property
    def n_parallel(self) -> int:
        return len(self.slots)

    @property
    def has_work(self) -> bool:
        return bool(self._by_id)

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

        Three phases: :meth:`_plan` (which sequences' tokens this pass carries, and whose logits
        it wants), :meth:`_execute` (the forward pass; nothing is changed if it fails or is
        interrupted), :meth:`_commit` (append the fed tokens to the KV entries, sample, end the
        finished).

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
        plan = self._plan()
        if plan is None:
            return done
        logits = self._execute(plan, done)
        if logits is not None:
            self._commit(plan, logits, done)
        return done

    def _plan(self) -> _StepPlan | None:
        """The next pass's flat batch: every decoding sequence's next token, then prompt slices
        of the prefilling ones (first come first served, within ``n_batch`` — at most
        ``DECODE_PREFILL_CHUNK`` beside decodes — never crossing a micro-batch's end); None when
        there is nothing to run. Records a sliding-window model's checkpoints due before a slice."""
        decode = [sl.seq for sl in self.slots if sl.seq is not None and not sl.seq.prefilling
                  and sl.seq.next_token is not None]
        prefill = sorted((sl.seq for sl in self.slots if sl.seq is not None and sl.seq.prefilling),
                         key=lambda s: s.t_admit)
        plan = _StepPlan()
        tokens, segs, parts = plan.tokens, plan.segs, plan.parts
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
                    self.prefix.checkpoint(s, at)
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
            return None
        plan.rows = [seg.start + seg.n - 1 for seg, (_, _, want) in zip(segs, parts) if want]
        plan.members = list(dict.fromkeys(s for s, _, _ in parts))  # the batch's sequences, once each
        plan.watched = [s for s in plan.members if s.req.should_stop is not None]
        return plan

    def _execute(self, plan: _StepPlan, done: list[Finished]) -> np.ndarray | None:
        """Run the planned pass: logits ``[len(plan.rows), n_vocab]``, or None when it was
        interrupted (the stopped sequences end cancelled) or failed (its sequences end with the
        error); either way nothing was appended: the K/V written past each entry's ``n_past`` are
        never read before being written again (attention module docstring)."""
        watched = plan.watched
        batch = AttnBatch(plan.segs, self.model.dtype,
                          (lambda: any(self._stopped(s) for s in watched)) if watched else None)
        self.stats["passes"] += 1
        self.stats["busy_slots"] += sum(1 for sl in self.slots if sl.seq is not None)
        try:
            return self.model.forward_batch(np.asarray(plan.tokens, dtype=np.int64), batch, plan.rows)
        except StepInterrupted:
            self.stats["interrupted"] += 1
            for s in watched:
                if self._stopped(s):
                    if not s.seq.done:
                        s.seq.finish("cancelled", "cancelled")
                    done.append(self._finish(s))
            return None
        except Exception as e:  # noqa: BLE001 - a model failure ends this batch's sequences, not the worker
            for s in plan.members:
                done.append(self._finish(s, e))
            return None
        finally:
            self.stats["layers"] += batch.layers_run
            self.stats["last_layers"] = batch.layers_run

    def _commit(self, plan: _StepPlan, logits: np.ndarray, done: list[Finished]) -> None:
        """The pass ran: append each part's fed tokens to its entry, advance the prefills, sample
        the next token of every part that wanted logits (``logits`` rows in ``plan.rows`` order)
        and end the sequences that finished (or whose ``on_token`` raised)."""
        now = time.perf_counter()
        r = 0
        for s, fed, want in plan.parts:
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
            if not self.prefix.place(s, free, self.idle_entries(), self._clock):
                return  # head of line waits for KV (running sequences will free some)
            self.waiting.popleft()
            free.seq = s
            free.last_entry = s.entry
            s.slot = free.id
            s.t_admit = time.perf_counter()

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
