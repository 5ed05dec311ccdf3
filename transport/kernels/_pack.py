"""Packing and chunk-statistics kernels (private; see :mod:`gradlane.transport.kernels` for the
API).

The f32 packer is one fused pass per chunk: each u32 word is stored into the arena row, summed
into the fast-tag sums, and its float value squared into the norm, so the shard is read once and
the loop vectorises like a plain copy. Loops run over 1-D slices: indexing a 2-D
arena inside the loop keeps LLVM from vectorising it. 16-bit payloads copy first, then take
statistics and sums over the row while it is still in L1. Max-abs is a second pass over the
L1-hot row, only when asked for.

The sum of squares accumulates in float32 (reassociated into vector lanes under the default
fastmath): a float64 accumulator would halve the vector lanes of the fused pass. Its relative
error is about 1e-6 here; a chunk holding values above ~1.8e19 gets ``norm = inf``.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._common import (
    ABS16,
    ABS32,
    EXACT,
    KEY_PAYLOAD,
    PAYLOAD_HALF,
    PAYLOAD_WORD,
    REDUCTION,
    bf16_to_f32,
    f16_to_f32,
    fast_sums64,
    finish_packet,
    max_abs_bits,
    nh_pairs32,
    nh_words,
)
from gradlane.transport.wire.tag import NH_SHIFT, TAG_KEYED, nh
from numba import njit

_U64 = np.uint64
_U32 = np.uint32


@njit(**REDUCTION)
def pack_f32(
    src32: np.ndarray,
    arena: np.ndarray,
    lengths: np.ndarray,
    chunk_elems: int,
    tmpl: np.ndarray,
    prio: np.ndarray,
    prio_step: int,
    flags: np.ndarray,
    flags_step: int,
    first_chunk: int,
    mode: int,
    key: np.ndarray,
    norms: np.ndarray,
    maxabs: np.ndarray,
) -> int:
    """Pack a float32 shard (given as its u32 bits) into arena rows 0..n_chunks-1.

    Under a keyed ``mode`` the copy loop computes the norm only and the NH sums are a second
    pass over the L1-hot row (whole u64 words there, whatever the shard's alignment).
    """
    n = src32.shape[0]
    n_chunks = (n + chunk_elems - 1) // chunk_elems
    srcf = src32.view(np.float32)
    a32 = arena.view(np.uint32)
    a64 = arena.view(np.uint64)
    for c in range(n_chunks):
        off = c * chunk_elems
        count = min(chunk_elems, n - off)
        dst = a32[c, PAYLOAD_WORD : PAYLOAD_WORD + count]
        s32 = src32[off : off + count]
        sf = srcf[off : off + count]
        a = _U64(0)
        b = _U64(0)
        ss = np.float32(0.0)
        length = 48 + 4 * count
        if mode == TAG_KEYED:
            for j in range(count):
                dst[j] = s32[j]
                x = sf[j]
                ss += x * x
            a, b = nh_words(a64[c, PAYLOAD_WORD // 2 :], 4 * count, key[KEY_PAYLOAD:])
        else:
            for j in range(count):
                w = s32[j]
                dst[j] = w
                wu = _U64(w)
                a += wu
                b += _U64(_U32(j)) * wu
                x = sf[j]
                ss += x * x
        norm = np.sqrt(ss)
        finish_packet(
            a64[c], tmpl, flags[c * flags_step], prio[c * prio_step], first_chunk + c, count,
            norm, length, a, b, mode, key,
        )  # fmt: skip
        lengths[c] = length
        if norms.shape[0]:
            norms[c] = norm
        if maxabs.shape[0]:
            maxabs[c] = _U32(max_abs_bits(dst, ABS32)).view(np.float32)
    return n_chunks


@njit(**REDUCTION)
def sumsq_u16(h: np.ndarray, bf16: bool) -> np.float32:
    """Sum of squares (float32) of 16-bit float bit patterns (bf16 or f16)."""
    ss = np.float32(0.0)
    if bf16:
        for j in range(h.shape[0]):
            x = bf16_to_f32(h[j])
            ss += x * x
    else:
        for j in range(h.shape[0]):
            x = f16_to_f32(h[j])
            ss += x * x
    return ss


@njit(**REDUCTION)
def pack_u16(
    src16: np.ndarray,
    arena: np.ndarray,
    lengths: np.ndarray,
    chunk_elems: int,
    tmpl: np.ndarray,
    prio: np.ndarray,
    prio_step: int,
    flags: np.ndarray,
    flags_step: int,
    first_chunk: int,
    mode: int,
    key: np.ndarray,
    norms: np.ndarray,
    maxabs: np.ndarray,
    bf16: bool,
) -> int:
    """Pack an f16/bf16 shard (raw u16 bits) into arena rows 0..n_chunks-1."""
    n = src16.shape[0]
    n_chunks = (n + chunk_elems - 1) // chunk_elems
    a16 = arena.view(np.uint16)
    a64 = arena.view(np.uint64)
    for c in range(n_chunks):
        off = c * chunk_elems
        count = min(chunk_elems, n - off)
        dst = a16[c, PAYLOAD_HALF : PAYLOAD_HALF + count]
        s16 = src16[off : off + count]
        for j in range(count):
            dst[j] = s16[j]
        norm = np.sqrt(sumsq_u16(dst, bf16))
        if mode == TAG_KEYED:
            a, b = nh_words(a64[c, PAYLOAD_WORD // 2 :], 2 * count, key[KEY_PAYLOAD:])
        else:
            a, b = fast_sums64(a64[c, PAYLOAD_WORD // 2 :], 2 * count)
        length = 48 + 2 * count
        finish_packet(
            a64[c], tmpl, flags[c * flags_step], prio[c * prio_step], first_chunk + c, count,
            norm, length, a, b, mode, key,
        )  # fmt: skip
        lengths[c] = length
        if norms.shape[0]:
            norms[c] = norm
        if maxabs.shape[0]:
            maxabs[c] = _max_abs_u16(dst, bf16)
    return n_chunks


@njit(inline="always", **REDUCTION)
def _max_abs_u16(h: np.ndarray, bf16: bool) -> np.float32:
    mx = max_abs_bits(h, ABS16)
    return bf16_to_f32(np.uint16(mx)) if bf16 else f16_to_f32(np.uint16(mx))


# -- zero-copy sending: per-chunk statistics once, then headers only ------------------------------
# A sender hands the kernel a header and a view of the caller's payload (``sendmsg`` gathers
# them), so the payload is read once for its statistics instead of copied into an arena for
# every destination. The fast tag splits into header and payload sums, so the payload's part is
# computed once per shard and each destination's header is finished from it.


@njit(**REDUCTION)
def stats_chunk_f32(
    s32: np.ndarray, sf: np.ndarray, mode: int, key: np.ndarray
) -> tuple[np.float32, np.uint64, np.uint64]:
    """One float32 chunk (its u32 bits and float view): L2 norm and the tag sums (fast, or NH
    under a keyed ``mode``: ``key`` is :attr:`TagKey.words`).

    The one definition of a chunk's statistics: :func:`stats_f32` runs it over a shard and the
    reduce kernel on a chunk its last contribution just completed, so both give the same bits.
    """
    ss = np.float32(0.0)
    if mode == TAG_KEYED:
        for j in range(sf.shape[0]):
            x = sf[j]
            ss += x * x
        h1, h2 = nh_pairs32(s32, key[KEY_PAYLOAD:])
        return np.sqrt(ss), h1, h2
    a = _U64(0)
    b = _U64(0)
    for j in range(s32.shape[0]):
        wu = _U64(s32[j])
        a += wu
        b += _U64(_U32(j)) * wu
        x = sf[j]
        ss += x * x
    return np.sqrt(ss), a, b


@njit(**REDUCTION)
def stats_f32(
    src32: np.ndarray,
    chunk_elems: int,
    norms: np.ndarray,
    sum_a: np.ndarray,
    sum_b: np.ndarray,
    mode: int,
    key: np.ndarray,
) -> None:
    """Per chunk of a float32 shard (u32 bits): L2 norm and the tag sums of its payload."""
    n = src32.shape[0]
    srcf = src32.view(np.float32)
    for c in range(norms.shape[0]):
        off = c * chunk_elems
        count = min(chunk_elems, n - off)
        norms[c], sum_a[c], sum_b[c] = stats_chunk_f32(
            src32[off : off + count], srcf[off : off + count], mode, key
        )


@njit(**REDUCTION)
def stats_u16(
    src16: np.ndarray,
    chunk_elems: int,
    norms: np.ndarray,
    sum_a: np.ndarray,
    sum_b: np.ndarray,
    bf16: bool,
    mode: int,
    key: np.ndarray,
) -> None:
    """Per chunk of an f16/bf16 shard (u16 bits): L2 norm and the tag sums of its payload (fast:
    u32 words of two elements, the last one zero-padded; keyed: NH over u64 words of four)."""
    n = src16.shape[0]
    for c in range(norms.shape[0]):
        off = c * chunk_elems
        count = min(chunk_elems, n - off)
        h = src16[off : off + count]
        norms[c] = np.sqrt(sumsq_u16(h, bf16))
        if mode == TAG_KEYED:
            sum_a[c], sum_b[c] = _nh_u16(h, key[KEY_PAYLOAD:])
            continue
        a = _U64(0)
        b = _U64(0)
        for k in range(count // 2):
            w = _U64(h[2 * k]) | (_U64(h[2 * k + 1]) << _U64(16))
            a += w
            b += _U64(k) * w
        if count & 1:
            w = _U64(h[count - 1])
            a += w
            b += _U64(count // 2) * w
        sum_a[c] = a
        sum_b[c] = b


@njit(inline="always", **EXACT)
def _nh_u16(h: np.ndarray, key: np.ndarray) -> tuple[np.uint64, np.uint64]:
    """NH sums of 16-bit elements read as u64 words of four (the last zero-padded)."""
    h1 = _U64(0)
    h2 = _U64(0)
    n = h.shape[0]
    n_full = n >> 2
    for j in range(n_full):
        m = (
            _U64(h[4 * j])
            | (_U64(h[4 * j + 1]) << _U64(16))
            | (_U64(h[4 * j + 2]) << _U64(32))
            | (_U64(h[4 * j + 3]) << _U64(48))
        )
        h1 += nh(m, key[j])
        h2 += nh(m, key[j + NH_SHIFT])
    if n & 3:
        m = _U64(0)
        for k in range(n & 3):
            m |= _U64(h[4 * n_full + k]) << _U64(16 * k)
        h1 += nh(m, key[n_full])
        h2 += nh(m, key[n_full + NH_SHIFT])
    return h1, h2


@njit(**EXACT)
def headers(
    hdr64: np.ndarray,
    counts: np.ndarray,
    itemsize: int,
    tmpl: np.ndarray,
    prio: np.ndarray,
    flags: np.ndarray,
    first_chunk: int,
    norms: np.ndarray,
    sum_a: np.ndarray,
    sum_b: np.ndarray,
    mode: int,
    key: np.ndarray,
) -> None:
    """Write the 48-byte header and tag of every chunk from its precomputed statistics (the
    payload's tag sums under ``mode``/``key``, as :func:`stats_f32` computes them)."""
    for c in range(counts.shape[0]):
        count = counts[c]
        finish_packet(
            hdr64[c], tmpl, flags[c], prio[c], first_chunk + c, count, norms[c],
            48 + itemsize * count, sum_a[c], sum_b[c], mode, key,
        )  # fmt: skip
