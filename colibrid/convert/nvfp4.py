"""NVFP4 (NVIDIA modelopt) weights decoded to float32.

Layout of one quantised matrix ``X.weight`` [O, I]:

* ``X.weight``          U8 [O, I/2]: packed e2m1, the even element in the low nibble;
* ``X.weight_scale``    F8_E4M3 [O, I/16]: one scale per 16 consecutive inputs;
* ``X.weight_scale_2``  F32 scalar ([] or [1]): the per-tensor global scale;
* ``X.input_scale``     F32 (activation scale, unused for weights).

Dequantised value = ``(e2m1 * e4m3(block scale)) * global`` in float32 (two roundings,
left to right, as upstream's converter computes it). modelopt stores the global as a
multiplier < 1; compressed-tensors checkpoints store its reciprocal (a divisor >= 1) in
the same tensor name, so a global >= 1 is refused rather than silently mis-scaled.
"""

from __future__ import annotations

import numpy as np

from colibrid.errors import ConvertError
from colibrid.formats.quant import E4M3FN

BLOCK = 16
SCALE_SUFFIX = "_scale"
GLOBAL_SUFFIX = "_scale_2"
INPUT_SUFFIX = "input_scale"

E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
E2M1.flags.writeable = False


def check_global(name: str, value: float) -> np.float32:
    g = np.float32(value)
    if not np.isfinite(g) or g <= 0:
        raise ConvertError(f"tensor {name!r}: NVFP4 global scale {value} is not a positive number")
    if g >= 1:
        raise ConvertError(
            f"tensor {name!r}: NVFP4 global scale {float(g):g} >= 1 looks like a "
            "compressed-tensors checkpoint (it stores the reciprocal, a divisor); colibri "
            "reads modelopt NVFP4, whose global is a multiplier < 1"
        )
    return g


def decode_rows(packed: np.ndarray, scales: np.ndarray, global_scale: np.float32) -> np.ndarray:
    """Rows of packed e2m1 [R, I/2] with their e4m3 scale bytes [R, I/16] -> f32 [R, I]."""
    rows, half = packed.shape
    cols = 2 * half
    vals = np.empty((rows, cols), dtype=np.float32)
    vals[:, 0::2] = E2M1[packed & 0x0F]
    vals[:, 1::2] = E2M1[packed >> 4]
    block = np.repeat(E4M3FN[scales], BLOCK, axis=1)[:, :cols]
    out = vals * block
    out *= global_scale
    return out
