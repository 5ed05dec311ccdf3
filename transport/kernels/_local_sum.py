"""numba kernels of the daemon's local sum: the buckets of a host's ranks added into one.

Elementwise and exact IEEE (no fastmath): ``dst[i] = a[i] + b[i]`` in float32, ``a`` may be
``dst`` itself, so a host with L ranks sums in L-1 passes, the first reading two sources.
16-bit sources (f16 or bf16 words) are widened to float32 in the loop.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._common import EXACT, bf16_to_f32, f16_to_f32
from numba import njit


@njit(**EXACT)
def add_f32(dst: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """``dst = a + b`` (float32; ``a`` may alias ``dst``)."""
    for i in range(dst.shape[0]):
        dst[i] = a[i] + b[i]


@njit(**EXACT)
def add_u16(dst: np.ndarray, a: np.ndarray, b: np.ndarray, a_is_words: bool, bf16: bool) -> None:
    """``dst = a + b`` in float32 where ``b`` (and ``a`` when ``a_is_words``) are 16-bit words."""
    for i in range(dst.shape[0]):
        y = bf16_to_f32(b[i]) if bf16 else f16_to_f32(b[i])
        if a_is_words:
            x = bf16_to_f32(a[i]) if bf16 else f16_to_f32(a[i])
        else:
            x = dst[i]
        dst[i] = x + y


@njit(**EXACT)
def widen_u16(dst: np.ndarray, a: np.ndarray, bf16: bool) -> None:
    """``dst = float32(a)`` for 16-bit words ``a``."""
    for i in range(dst.shape[0]):
        dst[i] = bf16_to_f32(a[i]) if bf16 else f16_to_f32(a[i])
