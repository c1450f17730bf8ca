"""Placement: may a model's worker start now, and which idle models must go first?

Pure decisions over a snapshot the pool takes *in the same synchronous step* as it
acts on the answer (``pool.Pool._place``), so no decision is made on a stale view.

* :func:`estimate` — what a model will take once loaded: the weights as its worker
  holds them in the model's ``weights`` mode (``protocol.weight_bytes.held_bytes`` of
  each tensor in the GGUF's tensor infos: 4 bytes per weight for ``f32``, the in-memory
  form of each tensor type for ``quantized``; without readable tensor infos, the file's
  size times :data:`FILE_FACTOR`) plus a runtime allowance — or the largest RSS its
  worker was seen with here, when that is more; plus its KV budget (``kv_budget_mib``,
  default 2048 MiB).
* :func:`decide` — given the model that wants to load, the models that hold a
  worker (:class:`Seat`), ``max_loaded`` and the available memory: ``load`` now;
  ``wait`` (possibly evicting idle models first — least recently used first, never
  a pinned one, never one with a running or waiting request: drain-then-swap); or
  ``refuse`` (503) when even evicting every unpinned model would not make room.

Memory: ``available`` is the host's available memory now (its launcher's figure, plus the RSS
of a warm spare the next load takes: ``pool.Pool.spare_bytes``); a model still
loading has not taken all of its estimate yet, so the rest of it is counted as
taken; a model draining (being unloaded) will give back its RSS.
"""

from __future__ import annotations

from protocol.limits import DEFAULT_KV_BUDGET_MIB, WEIGHT_MODES
from protocol.weight_bytes import held_bytes

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from router.gguf_meta import TensorInfo, tensor_infos

MiB = 1024 * 1024

#: Without readable tensor infos, per weights mode: the file's size times this. f32: float32
#: of ~4-8-bit weights (held/file measured 5.5x for SmolLM2 Q4_1, 4.2x for Gemma 3 Q4_K_M);
#: quantized: int8 levels + float32 scales of those (measured 1.67x and 1.14x).
FILE_FACTOR = {"f32": 4.0, "quantized": 1.7}
#: The worker's own memory besides the weights (Python, NumPy, tokenizer), measured:
#: SmolLM2's worker at 608 MiB RSS after its first request with 513 MiB of weights.
RUNTIME_BYTES = 96 * MiB
#: What a quantized worker holds on top of :data:`RUNTIME_BYTES`: numba's import (~27 MiB)
#: and its JIT with the loaded kernels (~30 MiB), LLVM's pages being dropped after the load
#: (measured: SmolLM2's quantized worker at 211 MiB RSS after its first token with 92 MiB of
#: weights, 612 MiB and 513 MiB for f32; the estimate errs high).
QUANTIZED_RUNTIME_BYTES = 40 * MiB


@dataclass(frozen=True)
class Estimate:
    """What a model will take, bytes. ``source``: "gguf" (its tensor infos), "file" (file
    size), or "measured" (the largest RSS its worker had here); ``mode``: the weights mode
    it was computed for ("f32" or "quantized")."""

    weights: int
    kv_budget: int
    source: str
    mode: str = "f32"

    @property
    def total(self) -> int:
        return self.weights + self.kv_budget

    def describe(self) -> dict[str, Any]:
        return {"total_bytes": self.total, "weights_bytes": self.weights, "kv_budget_bytes": self.kv_budget,
                "source": self.source, "weights": self.mode}


def held_weight_bytes(path: Path, weights: str) -> int | None:
    """The bytes a worker in mode ``weights`` holds for the GGUF at ``path``'s tensors (the
    sum of ``protocol.weight_bytes.held_bytes``), or None without readable tensor infos.
    Raises: ValueError for an unknown mode. Computed once per file version (size, mtime) and
    mode: placement asks on every decision, in the event loop."""
    infos = tensor_infos(path)  # cached by the file's version (router.gguf_meta)
    if not infos:
        return None
    return _held_sum(infos, weights)


@functools.lru_cache(maxsize=64)
def _held_sum(infos: tuple[TensorInfo, ...], weights: str) -> int:
    return sum(held_bytes(t.type_code, t.dims, weights) for t in infos)


def estimate(path: Path, kv_budget_mib: float | None, measured_rss: int | None, *, weights: str) -> Estimate:
    """The estimate for the GGUF at ``path`` served in mode ``weights`` ("f32" or
    "quantized"; see the module docstring). Raises: ValueError for an unknown mode."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    kv = int((kv_budget_mib if kv_budget_mib is not None else DEFAULT_KV_BUDGET_MIB) * MiB)
    runtime = RUNTIME_BYTES + (QUANTIZED_RUNTIME_BYTES if weights == "quantized" else 0)
    held = held_weight_bytes(path, weights)
    if held:
        total, source = held + runtime, "gguf"
    else:
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        total, source = int(size * FILE_FACTOR[weights]) + runtime, "file"
    # the worker maps its weights lazily (RSS right after Ready is far below them), so a
    # measurement only ever raises the estimate
    if measured_rss and measured_rss > total:
        total, source = int(measured_rss), "measured"
    return Estimate(total, kv, source, weights)


class MemoryProbe(Protocol):
    """Where placement reads memory figures: the pool's launcher, which knows its host
    (``router.workers.launchers``; tests inject made-up ones)."""

    def available(self) -> int:
        """Memory available for a new process now, bytes."""
        ...

    def rss(self, pid: int | None, model: str) -> int | None:
        """Resident memory of ``model``'s worker process ``pid``, bytes (None: gone)."""
        ...


@dataclass(frozen=True)
class Seat:
    """A model that holds a worker now, as placement sees it."""

    name: str
    state: str  # "loading", "ready" or "draining"
    idle: bool  # ready with nothing running or waiting
    pinned: bool
    last_active: float  # monotonic; least recently used first
    rss: int  # bytes now (0: unknown)
    estimate: int  # bytes it will take (its Estimate.total)


@dataclass(frozen=True)
class Decision:
    """``action``: "load" (start now), "wait" (after ``evict`` have stopped, or others
    have become idle), "refuse" (503 ``code``). ``why``: for operators and clients."""

    action: str
    evict: tuple[str, ...] = ()
    why: str = ""
    code: str = ""


def _mib(n: float) -> str:
    return f"{n / MiB:.0f} MiB"


def decide(want: str, need: Estimate, seats: list[Seat], *, max_loaded: int,
           available: int | None) -> Decision:
    """May ``want`` (needing ``need``) load now? ``seats``: every other model holding a
    worker; ``max_loaded`` 0: no limit; ``available`` None: memory is not checked."""
    staying = [s for s in seats if s.state != "draining"]
    leaving = [s for s in seats if s.state == "draining"]
    reserved = sum(max(0, s.estimate - s.rss) for s in staying if s.state == "loading")
    free_now = None if available is None else available - reserved
    count_ok = max_loaded <= 0 or len(seats) < max_loaded
    if count_ok and (free_now is None or free_now >= need.total):
        return Decision("load")

    # what must go: places beyond max_loaded (draining ones are already going), and memory
    places = 0 if max_loaded <= 0 else max(0, len(staying) + 1 - max_loaded)
    short = 0 if free_now is None else need.total - (free_now + sum(s.rss for s in leaving))
    candidates = sorted((s for s in staying if not s.pinned),
                        key=lambda s: (not s.idle, s.state != "ready", s.last_active))
    chosen: list[Seat] = []
    for s in candidates:
        if places <= 0 and short <= 0:
            break
        chosen.append(s)
        places -= 1
        short -= max(s.rss, s.estimate if s.state == "loading" else s.rss)
    if short > 0:
        unpinned = sum(s.rss for s in staying if not s.pinned)
        return Decision("refuse", code="insufficient_memory", why=(
            f"model '{want}' needs about {_mib(need.total)} (weights {_mib(need.weights)} [{need.source}] + "
            f"KV budget {_mib(need.kv_budget)}) but {_mib(max(0, free_now or 0))} is available"
            + (f" ({_mib(reserved)} more is promised to models still loading)" if reserved else "")
            + f" and unloading every unpinned model would free about {_mib(unpinned)}"
            + (f" (pinned: {', '.join(s.name for s in staying if s.pinned)})" if any(s.pinned for s in staying) else "")))
    if places > 0:
        return Decision("refuse", code="max_loaded_reached", why=(
            f"model '{want}' cannot load: max_loaded={max_loaded} models are loaded and "
            f"{len(staying) - len(candidates)} of them are pinned ({', '.join(s.name for s in staying if s.pinned)})"))
    evict = tuple(s.name for s in chosen if s.idle and s.state == "ready")
    busy = [s.name for s in chosen if s.name not in evict]
    parts = []
    if evict:
        parts.append(f"evicting {', '.join(evict)} (idle, least recently used)")
    if leaving:
        parts.append(f"{', '.join(s.name for s in leaving)} unloading")
    if busy:
        parts.append(f"waiting for {', '.join(busy)} to become idle")
    limit = f"max_loaded={max_loaded}" if max_loaded > 0 and not count_ok else "memory"
    return Decision("wait", evict=evict, why=f"waiting for room ({limit}): " + "; ".join(parts))
