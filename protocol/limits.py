"""The bounds of Generate's fields: one table both sides enforce.

The router refuses a request outside these with a 400 naming the field, so it
never forwards anything the worker would refuse; the worker checks the same
values on arrival (``worker.engine.sampling.SamplingParams.validated``).
``tests/worker/test_limits.py`` holds the two to this table, value by value at
every edge. A dialect may be stricter still (OpenAI's temperature in [0, 2],
penalties in [-2, 2]), never looser.

Imports neither the router nor the worker; both import it.
"""

from __future__ import annotations

from dataclasses import dataclass

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Bound:
    """``lo <= v <= hi`` (``lo < v`` when ``lo_open``); None: unbounded on that side."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def contains(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or v <= self.hi

    def describe(self) -> str:
        """E.g. ``in [0, 20]``, ``> 0``, ``>= -1``."""
        if self.lo is not None and self.hi is not None and not self.lo_open:
            return f"in [{self.lo:g}, {self.hi:g}]"
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        if self.hi is not None:
            parts.append(f"<= {self.hi:g}")
        return " and ".join(parts) or "any value"


#: Generate field -> its bound (``n_probs`` also bounds OpenAI's ``top_logprobs`` / ``logprobs``).
GENERATE_LIMITS: dict[str, Bound] = {
    "n_probs": Bound(0, 20),
    "max_tokens": Bound(0, INT32_MAX),
    "temperature": Bound(0.0),
    "top_p": Bound(0.0, 1.0),
    "min_p": Bound(0.0, 1.0),
    "repeat_penalty": Bound(0.0, lo_open=True),
    "repeat_last_n": Bound(-1, INT32_MAX),
    "n": Bound(1, 16),
}

#: The largest ``n_probs`` (top-N logprobs per token) either side accepts.
MAX_N_PROBS = int(GENERATE_LIMITS["n_probs"].hi or 0)

#: A worker's KV budget (MiB: running sequences + cached prefixes) when ``kv_budget_mib`` is not
#: configured; the worker applies it, the router's memory estimate counts it.
DEFAULT_KV_BUDGET_MIB = 2048.0

#: How a worker holds weight matrices (``weights`` config key, ``python -m worker --weights``):
#: the GGUF's quantized blocks, or dequantized float32 (the reference path). The engine reads
#: this one (worker.engine.arch.registry re-exports it).
WEIGHT_MODES = ("quantized", "f32")
#: The mode a worker runs when ``weights`` is not configured (``python -m worker`` without
#: ``--weights``); the engine's default too (worker.engine.arch.registry).
DEFAULT_WEIGHTS = "quantized"

#: The most choices (``n``) one request may ask for.
MAX_N = int(GENERATE_LIMITS["n"].hi or 1)

#: A worker started without ``--n-ctx`` runs ``min(<arch>.context_length, DEFAULT_MAX_CTX)`` tokens
#: (the engine reads this one: ``worker.engine.arch.registry.DEFAULT_MAX_CTX``), so the
#: router can state a model's context size before its worker is loaded (``/v1/models``).
DEFAULT_MAX_CTX = 8192
