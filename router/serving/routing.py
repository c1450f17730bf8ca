"""Which replica of a model a generation request goes to (``replicas = N``, ``routing``).

The policy (:func:`choose`, pure), over the ready replicas (``router.workers.replicas``), each
with its load (requests running + waiting) and how many of the prompt's leading KV blocks its
prefix index holds (``router.workers.prefix_index``):

* ``"cache_aware"`` (default; SGLang's router and LocalAI's shape): when the load is imbalanced
  (max − min > :func:`imbalance_threshold`: the model's ``parallel``, at least 2) the least
  loaded replica; else the replica holding the longest cached prefix of this prompt, when that
  is at least :data:`CACHE_FRACTION` of the prompt's blocks; else the least loaded. A
  conversation's next turn so lands where its KV is;
* ``"least_loaded"``: the least loaded (ties: the lowest replica number);
* ``"round_robin"``: each ready replica in turn (the benchmark's baseline).

The prompt's token ids (to hash its blocks, ``protocol.kv_events.block_hashes``) come from the
request (a prompt given as ids) or are rendered (``ApplyTemplate``) and tokenized (``Tokenize``)
once on a ready replica's text thread — never its engine — and only when the policy is
``cache_aware`` and at least two replicas are ready. A failure there (worker gone, timeout)
routes by load alone. The replica chosen records the prompt's blocks in its index at once.

No replica ready (the model loads, or its replicas were lost): the request goes to the replica
that will be ready soonest (one loading, else the least loaded) and the others start too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from protocol import Generate, Message
from protocol.kv_events import block_hashes
from router.serving.calls import prompt_ids
from router.workers.lifecycle import WorkerState
from router.workers.replicas import ReplicaSet, load_of
from router.workers.slot import ModelSlot

log = logging.getLogger("modelyard.routing")

#: The least share of a prompt's blocks a replica must hold for its cache to decide (SGLang's
#: ``cache_threshold``).
CACHE_FRACTION = 0.3

#: How long rendering and tokenizing a prompt for routing may take before it routes by load, s.
TOKENIZE_TIMEOUT_S = 10.0


def imbalance_threshold(parallel: int) -> int:
    """The load difference (max − min, requests) above which the cache does not decide."""
    return max(2, parallel)


def choose(loads: Sequence[int], matched: Sequence[int], n_blocks: int, *, policy: str, threshold: int,
           turn: int = 0) -> list[int]:
    """The ready replicas' indices in order of preference (the first gets the request).

    Args:
        loads: each replica's running + waiting requests.
        matched: each replica's leading blocks of the prompt held (0..n_blocks).
        n_blocks: the prompt's full blocks (0: too short to match; load decides).
        policy: ``cache_aware``, ``least_loaded`` or ``round_robin``.
        threshold: :func:`imbalance_threshold`.
        turn: the round-robin counter (``round_robin`` starts at ``turn % len(loads)``).
    """
    n = len(loads)
    by_load = sorted(range(n), key=lambda i: (loads[i], i))
    if policy == "round_robin":
        first = turn % n
        return [(first + k) % n for k in range(n)]
    if policy != "cache_aware" or n_blocks <= 0 or max(loads) - min(loads) > threshold:
        return by_load
    best = max(range(n), key=lambda i: (matched[i], -loads[i], -i))
    if matched[best] < CACHE_FRACTION * n_blocks:
        return by_load
    return [best, *(i for i in by_load if i != best)]


async def prompt_tokens(slot: ModelSlot, msg: Generate) -> list[int] | None:
    """``msg``'s prompt as token ids (``router.serving.calls.prompt_ids``) on ``slot``'s ready worker's
    text thread, each call within :data:`TOKENIZE_TIMEOUT_S`. None when that fails (routing then goes by load)."""
    if isinstance(msg.prompt, list):
        return list(msg.prompt)
    worker = slot.worker
    if worker is None:
        return None

    async def call(make: Callable[[str], Message]) -> Message:
        return await worker.call(make(worker.new_call_id("route")), TOKENIZE_TIMEOUT_S)

    try:
        with slot.holding():
            ids = await prompt_ids(msg, call)
    except Exception as e:  # noqa: BLE001 - routing by load is always a correct answer
        log.info("model %s: the prompt could not be tokenized for routing (%s: %s); routing by load",
                 slot.model.name, type(e).__name__, e)
        return None
    return ids.tolist()


@dataclass
class Router:
    """One model's routing state: the round-robin counter and the last decision (for operators)."""

    turn: int = 0
    routed: int = 0  # requests routed among >= 2 ready replicas
    by_cache: int = 0  # ... of which the cache decided

    async def order(self, replicas: ReplicaSet, msg: Generate | None) -> list[ModelSlot]:
        """The replicas to try for ``msg`` (None: before its Generate is known: by load), best first;
        the ready ones first (see the module doc), then the others (loading first, then by load)."""
        ready = replicas.ready()
        rest = sorted((s for s in replicas.open() if s not in ready),
                      key=lambda s: (s.state is not WorkerState.LOADING, load_of(s), s.replica))
        if len(ready) < 2:
            return [*ready, *rest]
        model = replicas.slots[0].model
        tokens = await prompt_tokens(min(ready, key=load_of), msg) \
            if msg is not None and model.routing == "cache_aware" else None
        ready = replicas.ready() or ready  # the await may have changed them
        hashes: dict[int, list[int]] = {}
        matched = []
        for s in ready:
            size = s.prefix.block_size
            if tokens is not None and size not in hashes:
                hashes[size] = block_hashes(tokens, size)
            matched.append(s.prefix.match(hashes.get(size, [])))
        loads = [load_of(s) for s in ready]
        n_blocks = len(hashes.get(ready[0].prefix.block_size, []))
        idx = choose(loads, matched, n_blocks, policy=model.routing,
                     threshold=imbalance_threshold(model.parallel), turn=self.turn)
        self.turn += 1
        self.routed += 1
        first = ready[idx[0]]
        if n_blocks and idx[0] != min(range(len(ready)), key=lambda i: (loads[i], i)):
            self.by_cache += 1
        if tokens is not None:
            first.prefix.insert(hashes.get(first.prefix.block_size) or block_hashes(tokens, first.prefix.block_size))
        log.debug("model %s: routed to replica %d (loads %s, cached blocks %s of %d)", model.name,
                  first.replica, loads, matched, n_blocks)
        return [*(ready[i] for i in idx), *rest]


__all__ = ["CACHE_FRACTION", "Router", "choose", "imbalance_threshold", "prompt_tokens"]
