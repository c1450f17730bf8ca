"""Latency budgets from the issues, reported rather than asserted.

The machines that run the suite are shared and noisy, so no test fails on wall-clock
time. A test asserts what makes a latency *possible* (the 503 was answered while the
model was still occupied; the worker's parent check runs every 0.2 s) and hands the
measured figure here: it is printed (``pytest -s``) and, when over the issue's budget,
raised as a ``LatencyWarning`` that appears in pytest's warnings summary.
"""

from __future__ import annotations

import warnings


class LatencyWarning(UserWarning):
    """A measured latency exceeded its budget (the machine may just have been busy)."""


def report(what: str, seconds: float, budget_s: float) -> None:
    """Print ``what`` took ``seconds`` (s); warn with :class:`LatencyWarning` if over ``budget_s`` (s)."""
    print(f"\n[latency] {what}: {seconds * 1e3:.1f} ms (budget {budget_s * 1e3:.0f} ms)")
    if seconds > budget_s:
        warnings.warn(f"{what} took {seconds * 1e3:.0f} ms, over its {budget_s * 1e3:.0f} ms budget",
                      LatencyWarning, stacklevel=2)
