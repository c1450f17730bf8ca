"""The :class:`~.engine.Engine`'s identity and KV states: its fingerprints, the slot actions
(save, restore, erase) and prefix-cache reads of llama-server's ``/slots`` and the disk cache, and
the KV events of what enters and leaves the cache (``kv.blocks``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from protocol.kv_events import KVEvent

from .engine_load import EngineInfo
from .kv.blocks import KVBlockLog
from .kv.state import KV_LAYOUT_VERSION, KVIdentity, KVState
from .scheduler import Scheduler
from .text.tokenizer import Tokenizer

__all__ = ["EngineKVStates"]


class EngineKVStates:
    """The identity and KV-state methods of :class:`~.engine.Engine` (a base class of it: the
    attributes below are the Engine's)."""

    _gguf: Any
    _sched: Scheduler
    _lock: threading.RLock
    _kv_identity: KVIdentity | None
    _kv_blocks: KVBlockLog | None
    info: EngineInfo
    tokenizer: Tokenizer

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

    def enable_kv_events(self, block_size: int) -> None:
        """Describe the KV cache as vLLM's KV events from now on, in blocks of ``block_size``
        tokens (:meth:`take_kv_events`). Raises ValueError for ``block_size < 1``."""
        with self._lock:
            self._kv_blocks = KVBlockLog(block_size)

    def take_kv_events(self) -> list[KVEvent]:
        """The ``protocol.kv_events`` events since the last call ([] when nothing changed or events
        are off): the first call gives AllBlocksCleared, then BlockStored for what the cache holds."""
        blocks = self._kv_blocks
        if blocks is None:
            return []
        with self._lock:
            return blocks.collect(self._sched.pool.entries)

    @property
    def cached_tokens(self) -> list[int]:
        """A copy of the token ids held by the most recently used KV entry ([] when none)."""
        with self._lock:
            entries = self._sched.pool.entries
            if not entries:
                return []
            return list(max(entries, key=lambda e: e.last_use).tokens)
