"""The native kernels' own speed on a weight layout, cache-hot: arithmetic alone.

Why apart from calibration (backends.calibrate, which times layouts from DRAM to pick an
ISA): a kernel floor or ceiling must not count the memory bus, which is a limit of its
own. Timing a matrix small enough to stay in a core's cache leaves the kernel's
arithmetic. `colibri bench decode` times the token's real matrices this way (its kernel
floor); the daemon's live roofline times one random matrix of each layout the model
uses (serve.kernel_ceiling), cheap enough to run beside its other probes.
"""

from __future__ import annotations

import time

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.backends.calibrate import sample_weight
from colibrid.formats.weights import QuantWeight, WeightLayout

HOT_SET_BYTES = 1 << 20  # copies of a matrix timed together: stays in a core's L2
HOT_ROUNDS = 7
SAMPLE_BYTES = 256 << 10  # a layout's timed matrix: hot in a core's L2, above call overhead

Layout = WeightLayout  # what a kernel's speed depends on beyond the row count


def hot_seconds_per_byte(w: QuantWeight, family: KernelFamily) -> float:
    """Seconds per weight byte of an S = 1 product with ``w``'s layout and shape, its
    weights hot in cache: copies of it (about ``HOT_SET_BYTES`` in all) in one
    ``matmul_many`` call, so a small matrix is timed without a call's fixed cost; the
    best of ``HOT_ROUNDS`` after a warm-up. The kernels' own dispatch runs it, so at the
    ISA calibration chose for the layout."""
    from colibrid.backends import native

    copies = [w] * max(1, HOT_SET_BYTES // max(1, w.nbytes))
    x = np.random.default_rng(1).standard_normal((1, w.shape[1]), dtype=np.float32)
    native.matmul_many(copies, x, family)
    best = float("inf")
    for _ in range(HOT_ROUNDS):
        t0 = time.perf_counter()
        native.matmul_many(copies, x, family)
        best = min(best, time.perf_counter() - t0)
    return best / (len(copies) * w.nbytes)


def layout_seconds_per_byte(layout: WeightLayout, rows: int, family: KernelFamily) -> float:
    """``layout``'s cache-hot time per weight byte in ``family``, on a random matrix of at
    most ``rows`` rows (the largest the model has) and about ``SAMPLE_BYTES``."""
    rng = np.random.default_rng(0)
    one = sample_weight(layout, 1, rng).nbytes
    w = sample_weight(layout, max(1, min(rows, SAMPLE_BYTES // max(1, one))), rng)
    return hot_seconds_per_byte(w, family)
