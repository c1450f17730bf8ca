"""BLAS threads at run time: the share of the cores the router gives this worker
(``Ping.threads``), applied with threadpoolctl — only when ``--threads`` was not given
(then the router sends none). Called by the engine thread between two steps only
(``BatchRunner.request_threads``): never while a forward pass is inside BLAS."""

from __future__ import annotations

import logging

log = logging.getLogger("modelyard.worker")

_current: int | None = None


def apply_blas_threads(n: int) -> None:
    """Use ``n`` BLAS threads from now on (0: leave them as they are)."""
    global _current
    if n <= 0 or n == _current:
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency of the package
        log.warning("threadpoolctl is not installed: cannot use %d BLAS threads", n)
        return
    threadpool_limits(limits=n, user_api="blas")
    from worker.engine.kernels.quant import set_num_threads  # the quantized kernels' threads (numba)
    set_num_threads(n)
    _current = n
    log.info("BLAS threads: %d (the router's share of the cores)", n)
