"""The prefix cache: which KV a new sequence starts from, and llama-server's sliding-window rules.

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
keeps what llama-server would keep (:meth:`PrefixCache.swa_reuse`): from the newest checkpoint inside
the shared prefix, one token before it (a repeated short prompt re-evaluates its last 5 tokens as
1 + 4 rows); nothing when no checkpoint lies there; the whole shared prefix (minus the last token)
when it is longer than the window + 1 and the history never outgrew llama.cpp's sliding-window cache
(``swa_cells``). The entry keeps every position, so restoring a checkpoint is keeping fewer
positions, whose K/V are those the earlier evaluation wrote. A sliding-window model copies even a
short kept prefix (it must keep exactly that much). Entries installed from outside (KV states) have
no known checkpoints and reuse as a model without a window. Only verified tokens are reused: an entry's ``tokens``
grow only after a forward pass returned, so a cancelled or failed sequence
never leaves KV that another trusts.
"""

from __future__ import annotations

from typing import Any

from .kv.cache import Checkpoint, KVEntry, KVPool

__all__ = ["CHECKPOINT_MIN_STEP", "MIN_SHARED_PREFIX", "N_CTX_CHECKPOINTS", "PrefixCache", "SWA_TAIL", "prompt_cuts"]

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


class PrefixCache:
    """Places sequences' KV entries in ``pool``, reusing verified prefixes (the :class:`~.scheduler.Scheduler`
    owns it and calls it on its one thread). ``n_swa``: the model's sliding window (0: none);
    ``swa_cells``: the cells of llama.cpp's sliding-window cache of one sequence; ``n_ubatch``: the
    prompt's micro-batch."""

    def __init__(self, pool: KVPool, n_swa: int, swa_cells: int, n_ubatch: int) -> None:
        self.pool = pool
        self.n_swa = n_swa
        self.swa_cells = swa_cells
        self.n_ubatch = n_ubatch

    def place(self, s: Any, slot: Any, idle: list[KVEntry], clock: int) -> bool:
        """Give ``s`` a KV entry, reusing the longest verified prefix; False if it does not fit yet.

        In order of preference: take over an idle entry the prompt extends; copy
        a shared prefix (from any entry) into a new entry, leaving the donor as
        it was; take over an idle donor and truncate it; start empty. Idle
        entries are evicted least recently used first to make room. How much of
        the shared prefix is kept: all of it but the last prompt token, or, for a
        sliding-window model, what llama-server's checkpoints allow (:meth:`swa_reuse`). ``s``: the
        scheduler's sequence record (its request, reservation; ``entry``, ``n_keep``, ``n_done``,
        ``cuts``, ``ckpt_at`` are set here), ``slot``: the slot it goes to (or None), ``idle``: the
        idle entries, least recently used first, ``clock``: the scheduler's step count (LRU).
        """
        prompt = s.req.prompt
        n_prompt = len(prompt)
        swa = self.n_swa > 0
        limit = n_prompt if swa else n_prompt - 1  # at least the last prompt token is evaluated
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
                    n_keep, ckpts, high_water = self.swa_reuse(donor, n_keep, n_prompt)
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
            if not self.make_room(need, keep, idle):
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
            entry.last_use = clock
            s.entry, s.n_keep, s.n_done = entry, kept, kept
            s.cuts = prompt_cuts(kept, n_prompt, self.n_ubatch, self.n_swa)
            # llama-server checkpoints before the batch ending 4 tokens before the prompt's end and
            # before the last batch, when the memory holds something (server-context.cpp: near_prompt_end)
            s.ckpt_at = tuple(p for p in ((kept,) + s.cuts)[-2:] if p > 0) if swa else ()
            return True
        return False

    def swa_reuse(self, donor: KVEntry, n_common: int, n_prompt: int) -> tuple[int, list[Checkpoint], int]:
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

    def checkpoint(self, s: Any, at: int) -> None:
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

    def make_room(self, need: int, keep: KVEntry | None, idle: list[KVEntry]) -> bool:
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
