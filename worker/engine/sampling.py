"""Sampling parameters and the token sampler (NumPy, vectorised over the vocabulary).

The chain follows llama.cpp (``common/sampling.cpp``, samplers in
``src/llama-sampling.cpp``; typical-p, DRY, XTC, top-n-sigma are not offered):

1. **logit bias** -- ``logit_bias[id]`` is added to the logit (``-inf`` bans;
   with ``ignore_eos`` every end-of-generation token is banned, as llama.cpp does);
2. **penalties** over the last ``repeat_last_n`` tokens of prompt + completion
   (``-1`` = the whole context, ``0`` = off; llama-server feeds the prompt to
   the sampler too): for a token seen ``c`` times, ``logit *= repeat_penalty``
   if ``logit <= 0`` else ``logit /= repeat_penalty``, then
   ``logit -= c * frequency_penalty + presence_penalty``;
   then the **constraint mask** (``json_schema`` / ``grammar``, see ``constraints.py``):
   every token it does not allow is -inf;
3. **greedy** when ``temperature <= 0``: the first index of the largest logit;
4. **top-k** (``top_k <= 0`` off): the k largest logits (``argpartition``);
5. **top-p** (``top_p >= 1`` off): softmax over the candidates, keep the
   smallest prefix (by decreasing probability) whose cumulative probability
   reaches ``top_p`` (at least one);
6. **min-p** (``min_p <= 0`` off): keep logits ``>= max + ln(min_p)``, i.e.
   ``p >= min_p * p_max`` (at least one);
7. **temperature**: logits / temperature;
8. **dist**: softmax and one draw from a ``numpy.random.Generator`` seeded by
   ``seed`` (same seed + same request = same tokens; None = fresh entropy).

Log-probabilities reported to clients are of the RAW distribution (a
log-softmax of the unmodified logits over the whole vocabulary), like the
fixtures and llama.cpp's ``n_probs`` with ``post_sampling_probs`` off.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from protocol.limits import GENERATE_LIMITS as _B
from protocol.limits import MAX_N_PROBS
from protocol.sampling import SamplingFields

from .errors import EngineError

__all__ = ["MAX_N_PROBS", "Sampler", "SamplingParams", "raw_logprobs"]


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True, kw_only=True)
class SamplingParams(SamplingFields):
    """Per-request sampling and generation parameters (see docs/ENGINE-API.md).

    Its fields and defaults are the protocol's sampling fields (it is a
    ``protocol.sampling.SamplingFields``: llama-server's names and defaults), ``logit_bias`` as a
    map; the bounds are ``protocol.limits.GENERATE_LIMITS``. Call :meth:`validated` to check and
    normalise (a changed copy: ``dataclasses.replace``).
    """

    logit_bias: dict[int, float] = field(default_factory=dict)  # type: ignore[assignment]  # the wire's [id, bias] pairs as a map
    # what the constraint could not enforce and left out (set by Engine.prepare; constraints.check)
    set_aside: tuple[str, ...] = ()
    # the vocabulary size :meth:`validated` checked this copy against (None: not checked): a
    # checked copy is trusted as it is (``Engine.prepare`` does not check it again)
    checked_for: int | None = field(default=None, compare=False, repr=False)

    def validated(self, n_vocab: int) -> SamplingParams:
        """A checked copy (``self`` when it is one already, checked for ``n_vocab``): ``logit_bias`` keys as ``int`` (decimal strings accepted,
        as JSON object keys arrive), ``stop`` as a list without empty strings
        (a single string is accepted), numbers as Python ``int``/``float``.

        Raises:
            EngineError("invalid_params"): a value of the wrong type or out of
                range (temperature < 0, top_p outside [0, 1], min_p outside
                [0, 1], repeat_penalty <= 0, repeat_last_n < -1, n_probs outside
                [0, 20], max_tokens < 0, a logit_bias id outside [0, n_vocab) or
                a NaN/+inf bias, non-finite penalties, ...).
        """

        if self.checked_for == n_vocab:
            return self

        def bad(msg: str) -> EngineError:
            return EngineError("invalid_params", msg)

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < (_B["max_tokens"].lo or 0)):
            raise bad(f"max_tokens must be a non-negative integer or null, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {v!r}")
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):  # their bounds: the protocol's table
            if not _B[name].contains(getattr(self, name)):
                raise bad(f"{name} must be {_B[name].describe()}, got {getattr(self, name)!r}")
        if not _is_int(self.top_k):
            raise bad(f"top_k must be an integer, got {self.top_k!r}")
        last_n_lo = _B["repeat_last_n"].lo  # its cap (int32) is the router's alone
        if not _is_int(self.repeat_last_n) or (last_n_lo is not None and self.repeat_last_n < last_n_lo):
            raise bad(f"repeat_last_n must be an integer >= {last_n_lo:g}, got {self.repeat_last_n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad(f"seed must be an integer or null, got {self.seed!r}")
        if not _is_int(self.n_probs) or not _B["n_probs"].contains(self.n_probs):
            raise bad(f"n_probs must be an integer {_B['n_probs'].describe()}, got {self.n_probs!r}")
        for name in ("ignore_eos", "add_special", "parse_special", "cache_prompt"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise bad(f"{name} must be a boolean, got {getattr(self, name)!r}")
        for name in ("json_schema", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise bad(f"{name} must be a string or null, got {type(getattr(self, name)).__name__}")
        if self.json_schema is not None and self.grammar is not None:
            raise EngineError("invalid_grammar", "give at most one of json_schema and grammar")
        if not isinstance(self.logit_bias, Mapping):
            raise bad("logit_bias must be a mapping of token id to bias")
        bias: dict[int, float] = {}
        for k, v in self.logit_bias.items():
            if isinstance(k, str) and k.strip().lstrip("-").isdigit():
                k = int(k)
            if not _is_int(k) or not 0 <= k < n_vocab:
                raise bad(f"logit_bias key {k!r} is not a token id in [0, {n_vocab})")
            if not _is_real(v) or math.isnan(v) or v == math.inf:
                raise bad(f"logit_bias[{k}] must be a finite number or -inf, got {v!r}")
            bias[int(k)] = float(v)
        stop = self.stop
        if isinstance(stop, str):
            stop = [stop]
        if stop is None:
            stop = []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise bad("stop must be a string or a list of strings")
        return replace(
            self,
            max_tokens=None if self.max_tokens is None else int(self.max_tokens),
            temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p),
            min_p=float(self.min_p), repeat_penalty=float(self.repeat_penalty),
            repeat_last_n=int(self.repeat_last_n), presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            seed=None if self.seed is None else int(self.seed), logit_bias=bias,
            stop=[s for s in dict.fromkeys(stop) if s], n_probs=int(self.n_probs),
            ignore_eos=bool(self.ignore_eos), add_special=bool(self.add_special),
            parse_special=bool(self.parse_special), cache_prompt=bool(self.cache_prompt),
            post_sampling_probs=bool(self.post_sampling_probs), checked_for=n_vocab,
        )


def raw_logprobs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of ``token`` and the top ``n`` (id, logprob) of ``log_softmax(logits)``.

    Args:
        logits: float32 ``[n_vocab]``, unmodified model output.
        token: the emitted token id.
        n: how many top entries (0 -> empty list); sorted by decreasing
            logprob, then increasing id.

    Returns:
        ``(logprob, [(id, logprob), ...])`` as Python floats (natural log).
    """
    x = np.asarray(logits, dtype=np.float32)
    m = float(x.max())
    lse = m + math.log(float(np.exp(x - m).sum(dtype=np.float64)))
    lp = float(x[token]) - lse
    top: list[tuple[int, float]] = []
    if n > 0:
        n = min(n, x.size)
        idx = np.argpartition(-x, n - 1)[:n] if n < x.size else np.arange(x.size)
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = [(int(i), float(x[i]) - lse) for i in idx]
    return lp, top


class Sampler:
    """The sampler chain for one sequence (see the module docstring for the order).

    Args:
        params: validated :class:`SamplingParams`.
        n_vocab: number of token ids that may be sampled (logits beyond are ignored).
        eog_ids: end-of-generation ids, banned when ``params.ignore_eos``.
        history: tokens already in the sequence (the prompt), for penalties.

    Raises:
        EngineError("invalid_params"): the biases ban every token.
    """

    def __init__(self, params: SamplingParams, n_vocab: int, eog_ids: Iterable[int] = (),
                 history: Iterable[int] = ()) -> None:
        self.p = params
        self.n_vocab = n_vocab
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % (1 << 64))
        bias = dict(params.logit_bias)
        if params.ignore_eos:
            for t in eog_ids:
                if 0 <= t < n_vocab:
                    bias[t] = -math.inf
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self._bias_vals = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        if sum(1 for v in bias.values() if v == -math.inf) >= n_vocab:
            raise EngineError("invalid_params", "logit_bias bans every token of the vocabulary")
        self._penalize = params.repeat_last_n != 0 and not (
            params.repeat_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
        )
        self.history: list[int] = list(history)
        #: with ``post_sampling_probs``: the last :meth:`sample`'s candidates after the chain,
        #: ``(ids int64 [k], probabilities float64 [k])`` by decreasing probability (ties: id), as
        #: llama.cpp's ``common_sampler_get_candidates`` after sampling; at temperature 0 the
        #: chosen token has probability 1 and the other candidates 0
        self.last_candidates: tuple[np.ndarray, np.ndarray] | None = None

    def accept(self, token: int) -> None:
        """Record a token of the sequence (for penalties)."""
        self.history.append(token)

    def _window(self) -> list[int]:
        n = self.p.repeat_last_n
        return self.history if n < 0 else self.history[-n:]

    def apply_bias_and_penalties(self, logits: np.ndarray) -> np.ndarray:
        """Steps 1-2 of the chain on a float32 copy of ``logits[:n_vocab]``."""
        x = np.array(logits[: self.n_vocab], dtype=np.float32, copy=True)
        if self._bias_ids.size:
            x[self._bias_ids] += self._bias_vals
        if self._penalize:
            counts = Counter(self._window())
            if counts:
                ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
                ids_ok = ids < self.n_vocab
                ids = ids[ids_ok]
                c = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))[ids_ok]
                v = x[ids]
                rp = np.float32(self.p.repeat_penalty)
                v = np.where(v <= 0, v * rp, v / rp)
                v -= c * np.float32(self.p.frequency_penalty) + np.float32(self.p.presence_penalty)
                x[ids] = v
        return x

    def sample(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """One token id from float32 ``logits`` ``[>= n_vocab]`` (does not call :meth:`accept`).

        ``allowed``: a constraint's boolean mask ``[n_vocab]`` (``constraints.Constraint``);
        every other token is set to -inf after bias and penalties, before the rest of the
        chain (so top-k/top-p only ever choose among allowed tokens). ``logits`` is never
        written. An ``allowed`` with no True entry is the caller's to avoid."""
        p = self.p
        if self._bias_ids.size or self._penalize:
            x = self.apply_bias_and_penalties(logits)
            if allowed is not None:
                x[~allowed[: self.n_vocab]] = -np.inf
        elif allowed is not None:
            x = np.where(allowed[: self.n_vocab], np.asarray(logits[: self.n_vocab], dtype=np.float32),
                         np.float32(-np.inf))
        else:  # nothing modifies the logits: read them in place (x is never written below)
            x = np.asarray(logits[: self.n_vocab], dtype=np.float32)
        if p.temperature <= 0 and not p.post_sampling_probs:
            return int(np.argmax(x))
        n = x.size
        if 0 < p.top_k < n:
            idx = np.argpartition(-x, p.top_k - 1)[: p.top_k]
        else:
            idx = np.arange(n)
        vals = x[idx]
        order = np.lexsort((idx, -vals))  # decreasing logit, then increasing id
        idx, vals = idx[order], vals[order].astype(np.float64)
        finite = np.isfinite(vals)
        if not finite[0]:  # cannot happen after the ban check, but never sample from NaN
            return int(np.argmax(np.nan_to_num(x, nan=-np.inf)))
        keep = int(np.count_nonzero(finite))
        idx, vals = idx[:keep], vals[:keep]
        if p.top_p < 1.0:
            e = np.exp(vals - vals[0])
            cum = np.cumsum(e / e.sum())
            last = int(np.searchsorted(cum, p.top_p, side="left")) + 1
            idx, vals = idx[:last], vals[:last]
        if p.min_p > 0.0:
            keep = max(1, int(np.count_nonzero(vals >= vals[0] + math.log(p.min_p))))
            idx, vals = idx[:keep], vals[:keep]
        if p.temperature <= 0:  # greedy (only here with post_sampling_probs): the first candidate, p = 1
            probs = np.zeros(idx.size)
            probs[0] = 1.0
            self.last_candidates = (idx, probs)
            return int(idx[0])
        vals = vals / p.temperature
        e = np.exp(vals - vals[0])
        cum = np.cumsum(e)
        if p.post_sampling_probs:
            self.last_candidates = (idx, e / cum[-1])
        r = self.rng.random() * cum[-1]
        i = min(int(np.searchsorted(cum, r, side="right")), idx.size - 1)
        return int(idx[i])

    def post_sampling(self, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
        """``token``'s log-probability and the top ``n`` ``(id, logprob)`` of the last sample's
        candidates after the chain (``last_candidates``; a token outside them: -inf), as
        :func:`raw_logprobs` gives them before the chain."""
        assert self.last_candidates is not None, "sample() with post_sampling_probs first"
        idx, probs = self.last_candidates

        def log(q: float) -> float:
            return math.log(q) if q > 0 else -math.inf

        at = np.flatnonzero(idx == token)
        lp = log(float(probs[at[0]])) if at.size else -math.inf
        return lp, [(int(i), log(float(q))) for i, q in zip(idx[:n], probs[:n])]
