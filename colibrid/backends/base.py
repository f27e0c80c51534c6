"""Types shared by every backend: kernel families. The weight formats and the quantised
weight type they compute on live in :mod:`colibrid.formats.weights`.

Shape legend used across kernels and models: S rows (tokens), I input features,
O output features, D hidden size, F expert FFN width.
"""

from __future__ import annotations

import enum


class KernelFamily(enum.Enum):
    """The arithmetic a kernel uses; always chosen explicitly by the caller (DESIGN §4).

    F32: activations stay f32; quantised weights are expanded to f32 in registers and
         accumulated in f32. Matches a reference that uses the dequantised weights.
    I8:  activations are quantised per row to int8 (absmax/127, round half to even),
         dot products are integer, then scaled. Bit-exact across ISAs; lossy, so opt-in.

    In both families row s of a batch of S rows is computed with exactly the arithmetic
    of a single-row call on row s: the batch size never changes a result.
    """

    F32 = "f32"
    I8 = "i8"
