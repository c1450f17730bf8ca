"""KV states that leave or enter the engine: llama.cpp's slot actions (save / restore / erase a
slot's KV to a file in ``slot_save_path``), KV states streamed in (installed in the prefix cache),
a generation's ``save_slot_to``, the KV cache directory kept across restarts, and the KV events
of what enters and leaves the cache (posted as KvBatch events for ``worker.kvevents``).

File work runs on the *kvio* thread (a restore reads and validates the whole file before the
slot is touched); slot changes run on the engine thread between two steps (:meth:`KVStates.run_slot_ops`,
deferred while the slot is busy, as llama.cpp defers them). Answers go out through ``post``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import Done, Error, Message, SlotAction, SlotActionResult, slot_filename_error
from protocol.errors import ErrorCode
from worker.engine import EngineError
from worker.events import FrameOut, JobFinished, KvBatch, Persisted, RunnerEvent
from worker.frames import INTERNAL_ERROR, error_frame, internal_error

__all__ = ["KVStates"]

log = logging.getLogger("modelyard.worker")


@dataclass(eq=False)
class _SlotOp:
    """One slot action on its way: ``state`` is the slot's copy (save, after the engine thread
    took it) or the validated file's content (restore, after the kvio thread read it)."""

    msg: SlotAction
    t0: float  # perf_counter at arrival
    state: Any = None
    n_bytes: int = 0
    final: Any = None  # a Generate's Done (save_slot_to): posted once the file is written


class KVStates:
    """The slot files and the KV cache directory of one worker.

    Args:
        post: the runner's event sink (thread-safe, never blocks).
        wake: wakes the engine thread (its loop runs :meth:`run_slot_ops` and, when
            :meth:`persist_due`, :meth:`persist_now`).
        publish: refreshes the runner's snapshot (before slot-action answers are posted, so that
            a /slots read after the answer shows what it did).
        slot_save_path: the directory of slot files (None: slot actions are refused).
        kv_cache_dir, kv_cache_mib: the KV cache kept across restarts (None: none).
        kv_events_block_size: > 0: the engine's KV events are on, in blocks of that many tokens
            (:meth:`post_events`); 0: off.
    """

    def __init__(self, post: Callable[[RunnerEvent], None], wake: threading.Event, publish: Callable[[], None], *,
                 slot_save_path: str | None, kv_cache_dir: str | None, kv_cache_mib: float,
                 kv_events_block_size: int = 0) -> None:
        self._post = post
        self._wake = wake
        self._publish = publish
        self.slot_save_path = Path(slot_save_path) if slot_save_path else None
        self._kv_cache_dir = kv_cache_dir
        self._kv_cache_bytes = int(max(0.0, kv_cache_mib) * 2**20)
        self.disk: Any = None  # worker.engine.kv.disk.DiskCache once loaded (kv_cache_dir set)
        self._engine: Any = None
        self._io_inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # file work of slot actions
        self._io = threading.Thread(target=self._io_main, name="kvio", daemon=True)
        self._slot_ops: queue.SimpleQueue[_SlotOp] = queue.SimpleQueue()  # for the engine thread
        self._deferred: list[_SlotOp] = []  # slot ops waiting for their slot to be idle
        self._persist_wanted = threading.Event()
        self._kv_block_size = kv_events_block_size

    def start(self, engine: Any) -> None:
        """The engine is loaded (engine thread): turn its KV events on (when asked), open the KV
        cache directory, start the kvio thread."""
        self._engine = engine
        if self._kv_block_size:
            engine.enable_kv_events(self._kv_block_size)
        if self._kv_cache_dir:
            self._open_disk(engine)
        self._io.start()

    def stop(self) -> None:
        self._io_inbox.put(None)

    def post_events(self) -> None:
        """Post what entered and left the engine's KV cache since the last call as one KvBatch
        (engine thread, after a step or slot action; nothing when nothing changed or events are off;
        the first batch is AllBlocksCleared)."""
        if self._kv_block_size and (events := self._engine.take_kv_events()):
            self._post(KvBatch(time.time(), events))

    def persist_due(self, engine: Any) -> bool:
        """A persist was asked for and nothing runs (engine thread): run :meth:`persist_now`."""
        if self._persist_wanted.is_set() and not engine.has_work:
            self._persist_wanted.clear()
            return True
        return False

    def save_then_finish(self, job_id: str, id_slot: int, filename: str, state: Any, final: Done) -> None:
        """A generation's ``save_slot_to``: write ``state`` (its slot's copy, taken in the step it
        ended) to ``filename`` on the kvio thread, then post its JobFinished (``final``, or the Error
        of the write)."""
        op = _SlotOp(SlotAction(id=job_id, action="save", id_slot=id_slot, filename=filename), time.perf_counter(),
                     state)
        op.final = final
        self._io_inbox.put(op)

    def submit_slot_action(self, msg: SlotAction) -> None:
        """Run a slot action (after Loaded); its SlotActionResult or Error comes as a FrameOut.
        File work runs on the ``kvio`` thread, slot changes on the engine thread between steps
        (deferred while the slot is busy)."""
        t0 = time.perf_counter()
        if self.slot_save_path is None:
            self._post(FrameOut(Error(id=msg.id, code=ErrorCode.INVALID_REQUEST, message=(
                "This server does not support slots action: no slot_save_path is configured"))))
            return
        if msg.action not in ("save", "restore", "erase"):
            self._post(FrameOut(Error(id=msg.id, code=ErrorCode.INVALID_REQUEST,
                                      message=f"Invalid action {msg.action!r} (save, restore or erase)")))
            return
        if msg.action != "erase":
            why = slot_filename_error(msg.filename)
            if why is not None:
                self._post(FrameOut(Error(id=msg.id, code=ErrorCode.INVALID_REQUEST, message=f"Invalid filename: {why}")))
                return
        op = _SlotOp(msg, t0)
        if msg.action == "restore":
            self._io_inbox.put(op)  # read and validate the whole file first; the slot is touched after
        else:
            self._slot_ops.put(op)
            self._wake.set()

    def install_state(self, stream_id: str, state: Any, n_bytes: int, t0: float) -> None:
        """Put a fully validated KV state (a KVChunk stream's) into the prefix cache, on the
        engine thread between steps; answered (FrameOut) by a SlotActionResult (action "restore",
        id_slot -1, id ``stream_id``) or an Error ("kv_budget_exceeded", ...). After Loaded."""
        op = _SlotOp(SlotAction(id=stream_id, action="restore", id_slot=-1), t0, state, n_bytes)
        self._slot_ops.put(op)
        self._wake.set()

    def request_persist(self) -> bool:
        """Save the idle KV entries to the KV cache directory once nothing runs (the engine thread
        posts :class:`Persisted`). False when there is no cache directory or no engine."""
        if self.disk is None or self._engine is None:
            return False
        self._persist_wanted.set()
        self._wake.set()
        return True

    def disk_state(self, ids: list[int], params: Any) -> Any:
        """A saved KV state holding a longer prefix of ``ids`` than the KV does (read and
        validated here, on the prep thread), or None."""
        disk = self.disk
        if disk is None or not disk.files or not getattr(params, "cache_prompt", True):
            return None
        path = disk.lookup(ids, self._engine.best_prefix(ids))
        if path is None:
            return None
        from worker.engine.kv.state import KVStateError

        try:
            state, n = disk.load(path)
        except KVStateError:
            return None
        log.info("KV cache: %s holds %d tokens of a %d-token prompt (%d bytes read)", path.name,
                 state.n_tokens, len(ids), n)
        return state

    def _io_main(self) -> None:
        from worker.engine.kv.state import encode_state, read_state_file, write_state_file

        while True:
            op = self._io_inbox.get()
            if op is None:
                return
            msg = op.msg
            assert self.slot_save_path is not None
            path = self.slot_save_path / msg.filename
            try:
                if op.state is None:  # restore: read and validate, then the engine thread installs it
                    op.state, op.n_bytes = read_state_file(path, self._engine.kv_identity)
                    self._slot_ops.put(op)
                    self._wake.set()
                    continue
                st = op.state  # save: the engine thread's copy of the slot
                self.slot_save_path.mkdir(parents=True, exist_ok=True)
                n = write_state_file(path, encode_state(st.identity, st.tokens, st.k, st.v))
                if op.final is not None:  # a generation's save_slot_to: its Done comes now
                    self._post(JobFinished(msg.id, op.final))
                    continue
                self._post(FrameOut(SlotActionResult(id=msg.id, action="save", id_slot=msg.id_slot,
                                                     filename=msg.filename, n_tokens=st.n_tokens, n_bytes=n,
                                                     ms=(time.perf_counter() - op.t0) * 1e3)))
            except Exception as e:  # noqa: BLE001 - a request never kills the worker
                if isinstance(e, EngineError):
                    err = error_frame(msg.id, e)
                elif isinstance(e, OSError):
                    err = Error(id=msg.id, code=INTERNAL_ERROR,
                                message=f"cannot write {msg.filename!r}: {e.strerror or e}"[:1000])
                else:
                    log.error("slot action %s failed:\n%s", msg.id, traceback.format_exc())
                    err = internal_error(msg.id, e)
                self._post(JobFinished(msg.id, err) if op.final is not None else FrameOut(err))

    def _open_disk(self, engine: Any) -> None:
        from worker.engine.kv.disk import DiskCache

        assert self._kv_cache_dir
        try:
            disk = DiskCache(self._kv_cache_dir, self._kv_cache_bytes, engine.kv_identity)
            n = disk.scan()
        except Exception as e:  # noqa: BLE001 - a bad cache directory disables the cache, not the worker
            log.error("KV cache %s disabled: %s: %s", self._kv_cache_dir, type(e).__name__, e)
            return
        self.disk = disk
        log.info("KV cache %s: %d saved states of this model", self._kv_cache_dir, n)

    def run_slot_ops(self) -> None:
        while True:
            try:
                self._deferred.append(self._slot_ops.get_nowait())
            except queue.Empty:
                break
        if not self._deferred:
            return
        engine = self._engine
        waiting: list[_SlotOp] = []
        answers: list[Message] = []  # posted once the snapshot shows what they did
        for op in self._deferred:
            msg = op.msg
            try:
                to_cache = msg.action == "restore" and msg.id_slot == -1  # the prefix cache, no slot
                if not to_cache and engine.slot_busy(msg.id_slot):
                    waiting.append(op)  # llama.cpp defers a busy slot's action too
                    continue
                if msg.action == "save":
                    op.state = engine.save_slot(msg.id_slot)
                    self._io_inbox.put(op)
                    continue
                if msg.action == "restore":
                    n = engine.restore_slot(op.state, None if to_cache else msg.id_slot)
                    op.state = None
                    res = SlotActionResult(id=msg.id, action="restore", id_slot=msg.id_slot, filename=msg.filename,
                                           n_tokens=n, n_bytes=op.n_bytes, ms=(time.perf_counter() - op.t0) * 1e3)
                else:
                    n = engine.erase_slot(msg.id_slot)
                    res = SlotActionResult(id=msg.id, action="erase", id_slot=msg.id_slot, n_tokens=n,
                                           ms=(time.perf_counter() - op.t0) * 1e3)
                answers.append(res)
            except EngineError as e:
                answers.append(error_frame(msg.id, e))
            except Exception as e:  # noqa: BLE001 - a request never kills the worker
                log.error("slot action %s failed:\n%s", msg.id, traceback.format_exc())
                answers.append(internal_error(msg.id, e))
        self._deferred = waiting
        self._publish()
        for a in answers:
            self._post(FrameOut(a))

    def persist_now(self, engine: Any) -> None:
        t0 = time.perf_counter()
        files = n_bytes = 0
        try:
            files, n_bytes = self.disk.save(engine.idle_states(copy=False))  # nothing runs meanwhile
        except Exception:  # noqa: BLE001 - saving is best effort; the worker still exits cleanly
            log.error("KV cache save failed:\n%s", traceback.format_exc())
        ms = (time.perf_counter() - t0) * 1e3
        log.info("KV cache %s: saved %d states (%d bytes) in %.0f ms", self._kv_cache_dir, files, n_bytes, ms)
        self._post(Persisted(files, n_bytes, ms))
