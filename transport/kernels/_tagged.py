"""Fused check-and-write loops of the receive kernels: one pass over a payload (private).

Theory of operation
-------------------
A receive kernel must not let a packet change anything before its tag is checked, and the tag
covers every payload byte. Checking first and then writing reads the row twice; the second read
hits L1, but the first is a lone stream from memory while the accumulator's stream waits its
turn, so the pair runs at about half the speed of ``dst += src``. These loops read each payload
word once: the tag sums, the write into the slot, and a copy of what the slot held before go in
the same iteration. The caller then compares the tag and, on a mismatch, copies the saved values
back (:func:`undo`): the slot ends bit-for-bit as it was, as if the packet had never been seen.
The save is an L1 store of values the loop has just loaded (a write already reads the line it
writes), so a single pass with two streams from memory costs little more than ``dst += src``.

Only the kernel's own thread touches a slot while it runs (the accumulator and output of a
transfer in progress are private to the core until it completes), so the transient write is
never observed.

Each function returns the payload's share of the tag sums, in :func:`tag_of`'s terms:
``(Σ w, Σ j·w)`` over its u32 words for the fast tag, the two NH sums for the keyed one (``kp``
is the key stream from the payload's first word, ``key[KEY_PAYLOAD:]``). The payload is
``count`` items from row u64 word ``PAYLOAD_WORD // 2``; a last partial u64 word is masked to
the payload as the tag's zero padding says.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._common import (
    _LO32,
    EXACT,
    fast_row_finish,
    fast_word,
    keyed_row_finish,
)
from gradlane.transport.wire.tag import NH_SHIFT, TAG_KEYED, nh
from numba import njit

_U64 = np.uint64
_U32 = np.uint32


@njit(inline="always", **EXACT)
def _tail_word(w64: np.ndarray, k: int, n_bytes: int) -> np.uint64:
    """u64 word ``k`` of the payload masked to its first ``n_bytes`` (1..7) bytes."""
    return w64[k] & ((_U64(1) << _U64(8 * n_bytes)) - _U64(1))


@njit(inline="always", **EXACT)
def _add2(pay: np.ndarray, acc: np.ndarray, save: np.ndarray, k: int) -> None:
    """Add (and save) items ``2k`` and ``2k + 1``."""
    x0 = acc[2 * k]
    x1 = acc[2 * k + 1]
    save[2 * k] = x0
    save[2 * k + 1] = x1
    acc[2 * k] = x0 + pay[2 * k]
    acc[2 * k + 1] = x1 + pay[2 * k + 1]


@njit(inline="always", **EXACT)
def add_f32(
    w64: np.ndarray,
    pay: np.ndarray,
    acc: np.ndarray,
    save: np.ndarray,
    count: int,
    mode: int,
    kp: np.ndarray,
) -> tuple[np.uint64, np.uint64]:
    """``acc[:count] += pay[:count]`` (float32), old values to ``save``, and the tag sums.

    ``w64`` is the row's payload as u64 words and ``pay`` the same bytes as float32.
    """
    half = count >> 1
    s1 = _U64(0)
    s2 = _U64(0)
    a_hi = _U64(0)
    keyed = mode == TAG_KEYED
    if keyed:
        for k in range(half):
            m = w64[k]
            s1 += nh(m, kp[k])
            s2 += nh(m, kp[k + NH_SHIFT])
            _add2(pay, acc, save, k)
    else:
        for k in range(half):
            s1, a_hi, s2 = fast_word(s1, a_hi, s2, k, w64[k])
            _add2(pay, acc, save, k)
    if count & 1:
        m = _tail_word(w64, half, 4)
        if keyed:
            s1 += nh(m, kp[half])
            s2 += nh(m, kp[half + NH_SHIFT])
        else:
            s1, a_hi, s2 = fast_word(s1, a_hi, s2, half, m)
        j = count - 1
        save[j] = acc[j]
        acc[j] += pay[j]
    if not keyed:
        s2 = _U64(2) * s2 + a_hi
    return s1, s2


@njit(inline="always", **EXACT)
def add_bf16(
    w32: np.ndarray, acc: np.ndarray, save: np.ndarray, count: int
) -> tuple[np.uint64, np.uint64]:
    """``acc[:count] +=`` the float32 values of ``count`` bfloat16 items (``w32``: the payload
    as u32 words, two items each, low half first), old values to ``save``, and the fast tag's
    payload sums: the tag's u32 words are the items' own pairs, so the sums take each word as
    it is loaded (``Σ w``, ``Σ j·w``; a last lone item's word is masked to it, the tag's zero
    padding). The index is masked to 32 bits so the product is a 32 x 32-bit multiply."""
    a = _U64(0)
    b = _U64(0)
    for i in range(count >> 1):
        w = w32[i]
        wu = _U64(w)
        a += wu
        b += (_U64(i) & _LO32) * wu
        x0 = acc[2 * i]
        x1 = acc[2 * i + 1]
        save[2 * i] = x0
        save[2 * i + 1] = x1
        acc[2 * i] = x0 + _U32(w << _U32(16)).view(np.float32)
        acc[2 * i + 1] = x1 + _U32(w & _U32(0xFFFF0000)).view(np.float32)
    if count & 1:
        half = count >> 1
        w = w32[half] & _U32(0xFFFF)
        a += _U64(w)
        b += _U64(half) * _U64(w)
        j = count - 1
        save[j] = acc[j]
        acc[j] += _U32(w << _U32(16)).view(np.float32)
    return a, b


@njit(inline="always", **EXACT)
def _copy2(
    pay: np.ndarray, dst: np.ndarray, save: np.ndarray, k: int, least: np.uint32, emask: np.uint32
) -> int:
    """Copy (and save) items ``2k`` and ``2k + 1``; the running minimum of inverted exponents."""
    x0 = pay[2 * k]
    x1 = pay[2 * k + 1]
    save[2 * k] = dst[2 * k]
    save[2 * k + 1] = dst[2 * k + 1]
    dst[2 * k] = x0
    dst[2 * k + 1] = x1
    return min(least, ~_U32(x0) & emask, ~_U32(x1) & emask)


@njit(inline="always", **EXACT)
def copy_words(
    w64: np.ndarray,
    pay: np.ndarray,
    dst: np.ndarray,
    save: np.ndarray,
    count: int,
    mode: int,
    kp: np.ndarray,
    emask: np.uint32,
) -> tuple[np.uint64, np.uint64, bool]:
    """``dst[:count] = pay[:count]`` bit-exactly (u32 or u16 items), old values to ``save``, the
    tag sums, and whether an item has every exponent bit of ``emask`` set (NaN or infinity: a
    running minimum of the inverted exponent bits, which vectorises beside the copy).

    u32 items (two per u64 word) are copied in the tag loop; u16 items in a second loop over the
    same, L1-hot bytes, which vectorises on the item type where a copy of four per word does not.
    """
    per = 8 // pay.itemsize
    full = (count * pay.itemsize) >> 3
    s1 = _U64(0)
    s2 = _U64(0)
    a_hi = _U64(0)
    least = emask
    keyed = mode == TAG_KEYED
    # Four loops, not one with branches inside: ``itemsize`` is a run-time field of a numba
    # array, so a test inside the loop would stay there and keep it from vectorising.
    if keyed and per == 2:
        for k in range(full):
            m = w64[k]
            s1 += nh(m, kp[k])
            s2 += nh(m, kp[k + NH_SHIFT])
            least = _copy2(pay, dst, save, k, least, emask)
    elif keyed:
        for k in range(full):
            m = w64[k]
            s1 += nh(m, kp[k])
            s2 += nh(m, kp[k + NH_SHIFT])
    elif per == 2:
        for k in range(full):
            s1, a_hi, s2 = fast_word(s1, a_hi, s2, k, w64[k])
            least = _copy2(pay, dst, save, k, least, emask)
    else:
        for k in range(full):
            s1, a_hi, s2 = fast_word(s1, a_hi, s2, k, w64[k])
    for j in range(2 * full if per == 2 else 0, count):
        v = pay[j]
        save[j] = dst[j]
        dst[j] = v
        least = min(least, ~_U32(v) & emask)
    rest = count * pay.itemsize - 8 * full
    if rest:
        m = _tail_word(w64, full, rest)
        if keyed:
            s1 += nh(m, kp[full])
            s2 += nh(m, kp[full + NH_SHIFT])
        else:
            s1, a_hi, s2 = fast_word(s1, a_hi, s2, full, m)
    if not keyed:
        s2 = _U64(2) * s2 + a_hi
    return s1, s2, least == 0


@njit(inline="always", **EXACT)
def tag_of(
    row64: np.ndarray, length: int, mode: int, key: np.ndarray, p1: np.uint64, p2: np.uint64
) -> np.uint64:
    """The tag of a row whose payload sums are ``p1``/``p2`` (as :func:`row_tag` gives it)."""
    if mode == TAG_KEYED:
        return keyed_row_finish(row64, length, key, p1, p2)
    return fast_row_finish(row64, length, p1, p2)


@njit(inline="always", **EXACT)
def undo(dst: np.ndarray, save: np.ndarray, count: int) -> None:
    """Put back what a fused loop overwrote (the tag did not match)."""
    for j in range(count):
        dst[j] = save[j]
