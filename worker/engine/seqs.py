"""The scheduler's records: what it asks of the model (:class:`BatchModel`), a sequence's request
(:class:`SeqRequest`) and end (:class:`Finished`), a slot's view (:class:`SlotInfo`), and its own
bookkeeping of a live sequence, a slot and one forward pass (``_Seq``, ``_Slot``, ``_StepPlan``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .attention import AttnBatch, Segment
from .generate import GenerationResult, Sequence, TokenEvent
from .kv.cache import KVEntry, KVShape
from .sampling import SamplingParams

__all__ = ["BatchModel", "Finished", "SeqRequest", "SlotInfo"]


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


@dataclass(eq=False)
class _StepPlan:
    """One forward pass as :meth:`Scheduler._plan` laid it out: the flat batch ``tokens [N]``, one
    :class:`Segment` per part, ``parts`` (sequence, tokens fed, wants logits) in batch order, the
    batch rows whose logits are wanted (each such part's last row), the batch's sequences once
    each, and those with a ``should_stop`` to poll between layers."""

    tokens: list[int] = field(default_factory=list)
    segs: list[Segment] = field(default_factory=list)
    parts: list[tuple[_Seq, list[int], bool]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    members: list[_Seq] = field(default_factory=list)
    watched: list[_Seq] = field(default_factory=list)
