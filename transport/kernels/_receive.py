"""Receive kernels: validate a batch of datagrams (:mod:`._verdict`), then reduce or place the
good ones (private).

Theory of operation
-------------------
Each row is first judged by :mod:`._verdict`'s fast paths (the float32 one, the lossy formats'
one) or its full ordered check. A fast row of at least :data:`FUSE_MIN_ITEMS` floats' worth of
payload, for a slot not yet filled, goes through one of :mod:`._tagged`'s fused loops, which read
each payload word once for the tag sums and the add or copy, keeping the slot's old values, and
put them back if the tag does not match: the slot, contributor count and received bitmap end as
if the packet had never come. Checking first and writing second read the row twice and ran at
about half the speed of ``dst += src``. A bfloat16 row that the reduce kernel adds (unordered,
fast tag, long enough) takes such a loop too (:func:`._tagged.add_bf16`: the tag's u32 words are
the items' pairs). A shorter row, a duplicate (its slot already filled), an ordered reduction
and any other lossy row check the tag first (:func:`._verdict.row_tag`); only a packet that
passed every check is then written (a lossy one decoded to float32), from L1. E4M3's four codes a
word do not vectorise in one loop with the tag's sums.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._codec import add_bf16, add_e4m3, decode_bf16, decode_e4m3
from gradlane.transport.kernels._common import (
    EXACT,
    KEY_PAYLOAD,
    PAYLOAD_HALF,
    PAYLOAD_WORD,
    bf16_to_f32,
    f16_to_f32,
)
from gradlane.transport.kernels._pack import stats_chunk_f32
from gradlane.transport.kernels._tagged import add_bf16 as add_bf16_tagged
from gradlane.transport.kernels._tagged import add_f32, copy_words, tag_of, undo
from gradlane.transport.kernels._verdict import (
    _BAD_TAG,
    _BF16,
    _DUPLICATE,
    _F16,
    _F32,
    _HDR,
    _ITEM_16,
    _ITEM_F32,
    _OK,
    S_MODE,
    S_T_CHUNK_ELEMS,
    S_T_DTYPE,
    S_T_SRC_LO,
    _check_rows,
    expected_words,
    fast_header,
    itemsize,
    load_spec,
    lossy_header,
    row_tag,
    slow_verdict,
)
from gradlane.transport.wire.tag import TAG_KEYED
from numba import njit

_U64 = np.uint64

#: Payload floats (bytes / 4) from which a row goes through a fused check-and-write loop: below,
#: checking first and writing from L1 after is faster (the fused loop's set-up, its alias
#: checks and the undo buffer cost more than the second read of a short row).
FUSE_MIN_ITEMS = 1024


@njit(**EXACT)
def decode_row(row: np.ndarray, count: int, tmp: np.ndarray) -> np.ndarray:
    """The float32 values of a checked lossy-format DATA row (uint8, header first): its
    ``count`` bfloat16 or E4M3 elements (the latter times the scale in ``aux``), decoded into
    ``tmp[:count]``, which is returned. Out of line: only lossy rows come here."""
    out = tmp[:count]
    pay = row[_HDR : _HDR + count * itemsize(int(row[6]))]
    if row[6] == _BF16:
        decode_bf16(out, pay.view(np.uint16))
    else:
        scale = row[36:40].view(np.float32)[0]
        decode_e4m3(out, pay, scale)
    return out


@njit(**EXACT)
def add_row(acc: np.ndarray, row: np.ndarray, count: int) -> None:
    """``acc += `` the float32 values of a checked lossy-format DATA row (as
    :func:`decode_row`, in one pass)."""
    pay = row[_HDR : _HDR + count * itemsize(int(row[6]))]
    if row[6] == _BF16:
        add_bf16(acc, pay.view(np.uint16))
    else:
        add_e4m3(acc, pay, row[36:40].view(np.float32)[0])


@njit(**EXACT)
def ordered_add(
    acc: np.ndarray,
    pay: np.ndarray,
    sr: int,
    chunk: int,
    off: int,
    order: np.ndarray,
    pos: np.ndarray,
    stage: np.ndarray,
    staged: np.ndarray,
) -> None:
    """Add sender row ``sr``'s contribution ``pay`` (float32 values of ``chunk``, at element
    ``off``) into ``acc`` in the canonical order ``order`` (sender rows, ascending), so the
    float32 sum does not depend on arrival order.

    ``pos[chunk]`` indexes the next row due. A contribution that is not due is copied into its
    ``stage`` row and flagged in ``staged``; one that is due is added, then every staged one
    that it unblocks, in order. Out of line: only ordered receives come here."""
    count = pay.shape[0]
    p = pos[chunk]
    if p >= order.shape[0] or order[p] != sr:
        st = stage[sr, off : off + count]
        for j in range(count):
            st[j] = pay[j]
        staged[sr, chunk] = 1
        return
    for j in range(count):
        acc[j] += pay[j]
    p += 1
    while p < order.shape[0] and staged[order[p], chunk]:
        r = order[p]
        st = stage[r, off : off + count]
        for j in range(count):
            acc[j] += st[j]
        staged[r, chunk] = 0
        p += 1
    pos[chunk] = p


@njit(**EXACT)
def flush_ordered(
    accum: np.ndarray,
    chunk_elems: int,
    order: np.ndarray,
    pos: np.ndarray,
    stage: np.ndarray,
    staged: np.ndarray,
) -> int:
    """Add every contribution still staged (a chunk completed without some sender, within the
    loss bound) in the canonical order, skipping the missing ones; returns how many."""
    n = accum.shape[0]
    added = 0
    for chunk in range(pos.shape[0]):
        off = chunk * chunk_elems
        count = min(chunk_elems, n - off)
        acc = accum[off : off + count]
        for p in range(pos[chunk], order.shape[0]):
            r = order[p]
            if staged[r, chunk]:
                st = stage[r, off : off + count]
                for j in range(count):
                    acc[j] += st[j]
                staged[r, chunk] = 0
                added += 1
        pos[chunk] = order.shape[0]
    return added


# The batch loops keep the per-packet body written out in the loop: an inlined helper taking the
# arrays as arguments compiles to a slower loop (the aliasing of the module docstring again).
# Each loop: fast header check, tag, duplicate check, then the add/copy from the L1-hot row.


@njit(**EXACT)
def reduce_f32(
    arena: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    spec: np.ndarray,
    key: np.ndarray,
    accum: np.ndarray,
    contrib: np.ndarray,
    received: np.ndarray,
    counters: np.ndarray,
    verdicts: np.ndarray,
    acc_bits: np.ndarray,
    norms: np.ndarray,
    sum_a: np.ndarray,
    sum_b: np.ndarray,
    final: int,
    scale: np.float32,
    order: np.ndarray,
    pos: np.ndarray,
    stage: np.ndarray,
    staged: np.ndarray,
) -> int:
    """Validate each batch row and add the valid F32 payloads into ``accum``.

    With ``order`` (empty: off) the payloads are added in that order of sender rows, whatever
    the arrival order (:func:`ordered_add`).

    With ``norms`` (one per chunk; empty: off), a chunk whose contributor count reaches
    ``final`` is finished right after that last add, while it is still in cache: multiplied by
    ``scale`` (unless 1), then its statistics (:func:`stats_chunk_f32` of the result,
    ``acc_bits`` being ``accum``'s u32 view) go to ``norms``/``sum_a``/``sum_b``. The gather
    phase then sends it without reading the shard again.
    """
    sp = load_spec(spec)
    ex = expected_words(sp, arena.shape[1])
    ce = sp[S_T_CHUNK_ELEMS]
    src_lo = sp[S_T_SRC_LO]
    mode = sp[S_MODE]
    a32 = arena.view(np.uint32)
    a64 = arena.view(np.uint64)
    af = arena.view(np.float32)
    want_verdicts = verdicts.shape[0] > 0
    want_stats = norms.shape[0] > 0
    ordered = order.shape[0] > 0
    one = np.float32(1.0)
    kp = key[KEY_PAYLOAD:]
    keyed = mode == TAG_KEYED
    save = np.empty(ce, dtype=np.float32)
    # A lossy-format row's decoded values, allocated by the first row that needs them.
    lossy = np.empty(0, dtype=np.float32)
    _check_rows(rows, arena.shape[0])
    accepted = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        row64 = a64[r]
        length = lengths[r]
        fast, src, chunk, count = fast_header(
            row64[0], row64[1], row64[2], row64[3], length, _ITEM_F32, ce, ex
        )
        lossy_row = False
        if not fast:
            lossy_row, src, chunk, count = lossy_header(
                row64[0], row64[1], row64[2], row64[3], row64[4], length, ce, ex
            )
        sr = src - src_lo
        off = chunk * ce
        acc = accum[off : off + count]
        pay = af[r, PAYLOAD_WORD : PAYLOAD_WORD + count]
        added = decoded = False
        if fast and not ordered and count >= FUSE_MIN_ITEMS and not received[sr, chunk]:
            # The common case: add while checking the tag, undo on a mismatch (_tagged).
            p1, p2 = add_f32(a64[r, PAYLOAD_WORD // 2 :], pay, acc, save, count, mode, kp)
            if tag_of(row64, length, mode, key, p1, p2) == row64[5]:
                reason = _OK
                added = True
            else:
                undo(acc, save, count)
                reason = _BAD_TAG
        elif (
            lossy_row
            and not ordered
            and not keyed
            and 2 * count >= 4 * FUSE_MIN_ITEMS
            and (row64[0] >> _U64(48)) & _U64(0xFF) == _U64(_BF16)
            and not received[sr, chunk]
        ):
            # bfloat16 chunks, the same way: the tag's words are the items' pairs.
            p1, p2 = add_bf16_tagged(a32[r, PAYLOAD_WORD:], acc, save, count)
            if tag_of(row64, length, mode, key, p1, p2) == row64[5]:
                reason = _OK
                added = decoded = True
            else:
                undo(acc, save, count)
                reason = _BAD_TAG
        elif fast or lossy_row:
            reason = _OK if row_tag(row64, length, mode, key) == row64[5] else _BAD_TAG
        else:
            reason, src, chunk, count = slow_verdict(a32[r], row64, length, spec, key)
            sr = src - src_lo
            lossy_row = reason == _OK  # only a lossy-format chunk passes the full check
        if lossy_row and reason == _OK and not added and not received[sr, chunk]:
            # A lossy-format chunk: added here from its float32 values (kept apart from
            # ``pay`` so the float32 loops below keep their array types).
            off = chunk * ce
            acc = accum[off : off + count]
            if ordered:
                if lossy.shape[0] < ce:
                    lossy = np.empty(ce, dtype=np.float32)
                vals = decode_row(arena[r], count, lossy)
                ordered_add(acc, vals, sr, chunk, off, order, pos, stage, staged)
            else:
                add_row(acc, arena[r], count)
            added = decoded = True
        if reason == _OK and not added and received[sr, chunk]:
            reason = _DUPLICATE
        if reason == _OK:
            if decoded:
                pass
            elif ordered:
                # Complete (contrib == final) only once every sender came: the one that came
                # last was then the one due, so the ordered sum is finished too.
                ordered_add(acc, pay, sr, chunk, off, order, pos, stage, staged)
            elif not added:  # a short row: checked first, added now from L1
                for j in range(count):
                    acc[j] += pay[j]
            contrib[chunk] += np.uint16(1)
            if want_stats and contrib[chunk] == final:
                if scale != one:
                    for j in range(count):
                        acc[j] *= scale
                norms[chunk], sum_a[chunk], sum_b[chunk] = stats_chunk_f32(
                    acc_bits[off : off + count], acc, mode, key
                )
            received[sr, chunk] = 1
            accepted += 1
        else:
            counters[reason] += 1
        if want_verdicts:
            verdicts[i] = reason
    counters[_OK] += accepted
    return accepted


@njit(**EXACT)
def reduce_u16(
    arena: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    spec: np.ndarray,
    key: np.ndarray,
    accum: np.ndarray,
    contrib: np.ndarray,
    received: np.ndarray,
    counters: np.ndarray,
    verdicts: np.ndarray,
    bf16: bool,
    order: np.ndarray,
    pos: np.ndarray,
    stage: np.ndarray,
    staged: np.ndarray,
) -> int:
    """Validate each batch row and add the valid F16/BF16 payloads (as float32) into ``accum``,
    in ``order`` if given (as :func:`reduce_f32`)."""
    sp = load_spec(spec)
    ex = expected_words(sp, arena.shape[1])
    ce = sp[S_T_CHUNK_ELEMS]
    src_lo = sp[S_T_SRC_LO]
    mode = sp[S_MODE]
    a32 = arena.view(np.uint32)
    a64 = arena.view(np.uint64)
    a16 = arena.view(np.uint16)
    want_verdicts = verdicts.shape[0] > 0
    ordered = order.shape[0] > 0
    _check_rows(rows, arena.shape[0])
    accepted = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        row64 = a64[r]
        length = lengths[r]
        fast, src, chunk, count = fast_header(
            row64[0], row64[1], row64[2], row64[3], length, _ITEM_16, ce, ex
        )
        if fast:
            reason = _OK if row_tag(row64, length, mode, key) == row64[5] else _BAD_TAG
        else:
            reason, src, chunk, count = slow_verdict(a32[r], row64, length, spec, key)
        sr = src - src_lo
        if reason == _OK and received[sr, chunk]:
            reason = _DUPLICATE
        if reason == _OK:
            off = chunk * ce
            acc = accum[off : off + count]
            half = a16[r, PAYLOAD_HALF : PAYLOAD_HALF + count]
            if ordered:
                vals = np.empty(count, dtype=np.float32)
                for j in range(count):
                    vals[j] = bf16_to_f32(half[j]) if bf16 else f16_to_f32(half[j])
                ordered_add(acc, vals, sr, chunk, off, order, pos, stage, staged)
            elif bf16:
                for j in range(count):
                    acc[j] += bf16_to_f32(half[j])
            else:
                for j in range(count):
                    acc[j] += f16_to_f32(half[j])
            contrib[chunk] += np.uint16(1)
            received[sr, chunk] = 1
            accepted += 1
        else:
            counters[reason] += 1
        if want_verdicts:
            verdicts[i] = reason
    counters[_OK] += accepted
    return accepted


@njit(**EXACT)
def place_rows(
    arena: np.ndarray,
    words: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    spec: np.ndarray,
    key: np.ndarray,
    out: np.ndarray,
    contrib: np.ndarray,
    nonfinite: np.ndarray,
    received: np.ndarray,
    counters: np.ndarray,
    verdicts: np.ndarray,
) -> int:
    """Validate each batch row and copy the valid DATA payloads bit-exactly into ``out``.

    ``out`` is u32 (F32) or u16 (F16/BF16) and ``words`` the arena viewed as the same type.
    ``nonfinite`` (one uint8 per chunk; empty: off) is set for a chunk whose payload holds a
    NaN or an infinity (every exponent bit set), found in the copy loop itself: a running
    minimum of the inverted exponent bits, which vectorises beside the copy.
    """
    sp = load_spec(spec)
    ex = expected_words(sp, arena.shape[1])
    ce = sp[S_T_CHUNK_ELEMS]
    src_lo = sp[S_T_SRC_LO]
    mode = sp[S_MODE]
    first = _HDR // out.itemsize
    a32 = arena.view(np.uint32)
    a64 = arena.view(np.uint64)
    want_contrib = contrib.shape[0] > 0
    want_nonfinite = nonfinite.shape[0] > 0
    dt = sp[S_T_DTYPE]
    # u32 lanes: a running minimum in int64 lanes would halve the copy loop's vectors.
    emask = np.uint32(0x7F800000 if dt == _F32 else (0x7C00 if dt == _F16 else 0x7F80))
    want_verdicts = verdicts.shape[0] > 0
    kp = key[KEY_PAYLOAD:]
    save = np.empty(ce, dtype=out.dtype)
    # A lossy-format row's decoded values, allocated by the first row that needs them.
    lossy = np.empty(0, dtype=np.float32)
    _check_rows(rows, arena.shape[0])
    accepted = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        row64 = a64[r]
        length = lengths[r]
        fast, src, chunk, count = fast_header(
            row64[0], row64[1], row64[2], row64[3], length, out.itemsize, ce, ex
        )
        lossy_row = False
        if not fast:
            lossy_row, src, chunk, count = lossy_header(
                row64[0], row64[1], row64[2], row64[3], row64[4], length, ce, ex
            )
        sr = src - src_lo
        reason = _DUPLICATE
        if fast and not received[sr, chunk]:
            off = chunk * ce
            dst = out[off : off + count]
            pay = words[r, first : first + count]
            if count * out.itemsize >= FUSE_MIN_ITEMS * 4:
                # Copy while checking the tag, undo on a mismatch (_tagged).
                p1, p2, bad = copy_words(
                    a64[r, PAYLOAD_WORD // 2 :], pay, dst, save, count, mode, kp, emask
                )
                good = tag_of(row64, length, mode, key, p1, p2) == row64[5]
                if not good:
                    undo(dst, save, count)
            else:  # a short row: check, then copy from L1
                good = row_tag(row64, length, mode, key) == row64[5]
                bad = False
                if good:
                    least = emask
                    for j in range(count):
                        v = pay[j]
                        dst[j] = v
                        least = min(least, ~np.uint32(v) & emask)
                    bad = least == 0
            reason = _OK if good else _BAD_TAG
            if good and want_nonfinite and bad:
                nonfinite[chunk] = 1
        elif fast:
            # A duplicate, unless forged: the tag decides which it is counted as.
            if row_tag(row64, length, mode, key) != row64[5]:
                reason = _BAD_TAG
        else:
            if lossy_row:
                reason = _OK if row_tag(row64, length, mode, key) == row64[5] else _BAD_TAG
            else:
                reason, src, chunk, count = slow_verdict(a32[r], row64, length, spec, key)
                sr = src - src_lo
            if reason == _OK and received[sr, chunk]:
                reason = _DUPLICATE
            elif reason == _OK:  # a lossy-format chunk of a float32 result: decoded in place
                off = chunk * ce
                dst = out[off : off + count]
                if lossy.shape[0] < ce:
                    lossy = np.empty(ce, dtype=np.float32)
                bits = decode_row(arena[r], count, lossy).view(np.uint32)
                least = emask
                for j in range(count):
                    v = bits[j]
                    dst[j] = v
                    least = min(least, ~np.uint32(v) & emask)
                if want_nonfinite and least == 0:
                    nonfinite[chunk] = 1
        if reason == _OK:
            if want_contrib:
                contrib[chunk] += np.uint16(1)
            received[sr, chunk] = 1
            accepted += 1
        else:
            counters[reason] += 1
        if want_verdicts:
            verdicts[i] = reason
    counters[_OK] += accepted
    return accepted
