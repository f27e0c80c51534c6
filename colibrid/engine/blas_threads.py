"""numpy's BLAS on one thread for decode-sized passes, its own thread count for the rest.

Why: the OpenBLAS numpy ships keeps worker threads of its own. A product with enough
elements wakes them (a router's [1, D] x [D, E] logits are one), and after the call they
spin for a while before they sleep. During decode the native kernel pool already runs a
thread on every core, so the spinning BLAS workers and the kernels' threads take turns
on the cores and every kernel runs at a fraction of its speed (docs/performance.md,
"numpy's BLAS threads during decode"). A pass of a few rows gains nothing from BLAS
threads; a long prefill's attention products do, so such a pass gets them back.

The switch is sticky (it changes the thread count only when a pass of the other kind
comes), so a decode loop pays nothing per token. The thread count is process-wide: the
engine thread is the only one doing math, and any other caller is affected the same way.
"""

from __future__ import annotations

import threading

from threadpoolctl import ThreadpoolController

DECODE_ROWS = 64
"""Passes of at most this many rows (a decode step, a batch of them, a speculative
verification) run numpy's BLAS on one thread."""


class BlasThreads:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # engines of one process (tests) share the count
        self._controller: ThreadpoolController | None = None  # found on first use
        self._limiter = None  # set while BLAS runs on one thread: restores the counts

    def before_pass(self, rows: int) -> None:
        """A forward pass of ``rows`` rows is about to run."""
        one = rows <= DECODE_ROWS
        with self._lock:
            if one and self._limiter is None:
                if self._controller is None:
                    self._controller = ThreadpoolController()
                self._limiter = self._controller.limit(limits=1, user_api="blas")
            elif not one and self._limiter is not None:
                self._limiter.restore_original_limits()
                self._limiter = None


BLAS = BlasThreads()
"""The process's one switch (the BLAS thread count is process-wide)."""
