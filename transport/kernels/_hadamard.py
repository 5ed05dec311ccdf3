"""Randomized Hadamard transform kernels (private; see :mod:`gradlane.transport.kernels`).

Theory of operation
-------------------
``y = H·D·x`` blockwise: ``D`` flips the sign of element ``i`` when bit ``i mod 64`` of
``splitmix64(key + (i // 64 + 1)·γ)`` is set, with ``key = splitmix64(seed)`` and γ the 64-bit
golden ratio — a counter hash, so no sign array is stored and every rank derives the same ``D``
from the same seed. ``H`` is the orthonormal Walsh–Hadamard matrix of the block (scaled by
``1/sqrt(block)``), symmetric and its own inverse, so the inverse is ``D·H``.

The butterflies run in place, two stages per pass (:func:`fwht`). No reassociation is allowed
(``EXACT``): the transform is bit-reproducible on a given machine and build.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._common import EXACT, splitmix64
from numba import njit

_U64 = np.uint64
_U32 = np.uint32
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_SIGN = np.uint32(0x80000000)


@njit(**EXACT)
def flip_signs(x32: np.ndarray, start: int, stop: int, key: np.uint64) -> None:
    """Apply ``D`` to ``x[start:stop]`` (given as the u32 bits of the whole array)."""
    for g in range(start >> 6, ((stop - 1) >> 6) + 1):
        h = splitmix64(key + _U64(g + 1) * _GAMMA)
        lo = max(start, g << 6)
        hi = min(stop, (g << 6) + 64)
        seg = x32[lo:hi]
        shift = lo - (g << 6)
        for j in range(hi - lo):
            bit = (h >> _U64(shift + j)) & _U64(1)
            seg[j] ^= _U32(bit) << _U32(31)


@njit(**EXACT)
def fwht(blk: np.ndarray) -> None:
    """Orthonormal Walsh–Hadamard transform of a power-of-two block, in place.

    Stages go two at a time (radix 4: half the passes over the block): stages 1+2 on groups of
    four neighbours, stages 4+8 on groups of sixteen at stride four, then the wide stages over
    1-D slices that LLVM vectorises; a radix-2 stage finishes when log2(n) is odd. Each
    pass loads and stores the whole block, so halving the passes nearly halves the time.
    """
    n = blk.shape[0]
    h = 1
    if n >= 4:
        for i in range(0, n, 4):
            x0 = blk[i]
            x1 = blk[i + 1]
            x2 = blk[i + 2]
            x3 = blk[i + 3]
            a0 = x0 + x1
            a1 = x0 - x1
            a2 = x2 + x3
            a3 = x2 - x3
            blk[i] = a0 + a2
            blk[i + 1] = a1 + a3
            blk[i + 2] = a0 - a2
            blk[i + 3] = a1 - a3
        h = 4
    if n >= 16:
        for i in range(0, n, 16):
            g = blk[i : i + 16]
            for j in range(4):
                x0 = g[j]
                x1 = g[j + 4]
                x2 = g[j + 8]
                x3 = g[j + 12]
                a0 = x0 + x1
                a1 = x0 - x1
                a2 = x2 + x3
                a3 = x2 - x3
                g[j] = a0 + a2
                g[j + 4] = a1 + a3
                g[j + 8] = a0 - a2
                g[j + 12] = a1 - a3
        h = 16
    while 4 * h <= n:
        for i in range(0, n, 4 * h):
            a = blk[i : i + h]
            b = blk[i + h : i + 2 * h]
            c = blk[i + 2 * h : i + 3 * h]
            d = blk[i + 3 * h : i + 4 * h]
            for j in range(h):
                a0 = a[j] + b[j]
                b0 = a[j] - b[j]
                c0 = c[j] + d[j]
                d0 = c[j] - d[j]
                a[j] = a0 + c0
                b[j] = b0 + d0
                c[j] = a0 - c0
                d[j] = b0 - d0
        h *= 4
    while h < n:
        for i in range(0, n, 2 * h):
            lo = blk[i : i + h]
            hi = blk[i + h : i + 2 * h]
            for j in range(h):
                u = lo[j]
                v = hi[j]
                lo[j] = u + v
                hi[j] = u - v
        h *= 2
    if n > 1:
        scale = np.float32(1.0 / np.sqrt(np.float64(n)))
        for j in range(n):
            blk[j] *= scale


@njit(**EXACT)
def hadamard(x: np.ndarray, seed: np.uint64, block: int, inverse: bool) -> None:
    """Forward ``H·D`` (or inverse ``D·H``) over full blocks, then power-of-two tail blocks."""
    n = x.shape[0]
    x32 = x.view(np.uint32)
    key = splitmix64(seed)
    pos = 0
    bs = block
    while pos < n:
        while bs > n - pos:
            bs >>= 1
        blk = x[pos : pos + bs]
        if inverse:
            fwht(blk)
            flip_signs(x32, pos, pos + bs, key)
        else:
            flip_signs(x32, pos, pos + bs, key)
            fwht(blk)
        pos += bs
