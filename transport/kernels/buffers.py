"""Whole-buffer passes: the randomized Hadamard transform and the daemon's local sum."""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels import _hadamard as _had
from gradlane.transport.kernels import _local_sum as _sum
from gradlane.transport.kernels._checks import (
    _U64_MAX,
    _array,
    _in_range,
    _shard,
    _typed,
    _wire_dtype,
)
from gradlane.transport.wire.header import (
    DType,
)


def _hadamard_args(x: np.ndarray, seed: int, block: int) -> tuple[np.ndarray, np.uint64, int]:
    arr = _array("x", x, 1, writeable=True)
    if arr.dtype != np.float32:
        raise ValueError(f"x must be float32, got {arr.dtype.name}")
    block = int(block)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 1")
    return arr, np.uint64(_in_range("seed", seed, _U64_MAX)), block


def hadamard_forward(x: np.ndarray, *, seed: int, block: int = 1024) -> None:
    """Randomized Hadamard rotation ``y = H·D·x`` of a float32 vector, in place.

    Blockwise over contiguous blocks of ``block`` (a power of two) elements; a tail shorter than
    ``block`` uses the largest power-of-two blocks that fit, down to 1. ``D`` holds ±1 signs
    derived from ``(seed, element index within x)`` by a counter hash, identical on every rank;
    ``H`` is orthonormal. Linear, so rotating each rank's bucket and summing equals rotating
    the sum; :func:`hadamard_inverse` with the same seed and block undoes it.
    """
    arr, s, b = _hadamard_args(x, seed, block)
    if arr.shape[0]:
        _had.hadamard(arr, s, b, False)


def hadamard_inverse(x: np.ndarray, *, seed: int, block: int = 1024) -> None:
    """Inverse of :func:`hadamard_forward` (``x = D·H·y``), in place."""
    arr, s, b = _hadamard_args(x, seed, block)
    if arr.shape[0]:
        _had.hadamard(arr, s, b, True)


def local_sum(out: np.ndarray, srcs: list[np.ndarray], dtype: int) -> None:
    """Sum the wire-word buckets ``srcs`` (the ranks of one host) into float32 ``out``.

    ``srcs``: 1-D arrays of ``out``'s length, float32 (F32) or 16-bit words (F16/BF16), summed
    in list order (exact IEEE float32, so the order fixes the result); at least one.
    """
    wire = _wire_dtype(dtype)
    dst = _typed("out", out, np.float32, (np.asarray(out).shape[0],))
    if not srcs:
        raise ValueError("local_sum needs at least one source")
    views = [_shard(f"srcs[{i}]", s, wire) for i, s in enumerate(srcs)]
    for i, v in enumerate(views):
        if v.shape[0] != dst.shape[0]:
            raise ValueError(f"srcs[{i}] has {v.shape[0]} elements, out has {dst.shape[0]}")
    if wire == DType.F32:
        f32 = [v.view(np.float32) for v in views]
        if len(f32) == 1:
            np.copyto(dst, f32[0])
            return
        _sum.add_f32(dst, f32[0], f32[1])
        for v in f32[2:]:
            _sum.add_f32(dst, dst, v)
        return
    bf16 = wire == DType.BF16
    if len(views) == 1:
        _sum.widen_u16(dst, views[0], bf16)
        return
    _sum.add_u16(dst, views[0], views[1], True, bf16)
    for v in views[2:]:
        _sum.add_u16(dst, dst, v, False, bf16)
