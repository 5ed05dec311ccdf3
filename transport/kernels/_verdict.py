"""The receive kernels' checks: which rows of a batch are valid DATA packets of a transfer,
without writing anything (private; the kernels that write are :mod:`._receive`).

Theory of operation
-------------------
:func:`check_packet` is :func:`gradlane.transport.wire.header.validate` on an arena row, check for
check and in the same order, so both give the same :class:`~gradlane.transport.wire.header.Reason`
for any bytes.

A batch loop decides a row in two steps. The fast path (:func:`fast_header`) compares the
header with what every valid DATA packet of this transfer must carry — three masked u64 words and
the src/chunk/count/length ranges, branch-free — and, if it matches, only the tag is left to check.
A lossy-format chunk of a float32 transfer (bfloat16 or E4M3,
:data:`~gradlane.transport.wire.header.LOSSY`) has a fast path of its own (:func:`lossy_header`:
the same fields with its own dtype, its length at that dtype's itemsize, a valid E4M3 scale). A
row that misses both goes to the out-of-line :func:`slow_verdict`, which runs the full ordered
check, the tag included, and names the reason.

The session and transfer travel as one int64 ``spec`` array (``S_*`` indices below) so the kernel
signature stays stable; the tag key travels as its words (``TagKey.words``). Each kernel copies
``spec`` into a tuple of scalars (:func:`load_spec`): LLVM cannot keep array loads out of the
per-packet loop (the loop stores into other arrays that might alias it), but it keeps a tuple in
registers.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._common import EXACT, fast_tag_row, keyed_row
from gradlane.transport.wire.header import (
    BITMAP_KINDS,
    HEADER_SIZE,
    ITEMSIZE,
    LOSSY,
    MAGIC,
    MAX_SCALE_BITS,
    VERSION,
    DType,
    Kind,
    Phase,
    Reason,
)
from gradlane.transport.wire.tag import TAG_KEYED
from numba import njit

_U64 = np.uint64

# spec layout: session fields, then transfer fields.
S_JOB = 0
S_ME = 1
S_WORLD = 2
S_STEP_LO = 3
S_STEP_HI = 4
S_N_BUCKETS = 5
S_MAX_DATAGRAM = 6
S_MODE = 7
S_T_STEP = 8
S_T_BUCKET = 9
S_T_SHARD = 10
S_T_PHASE = 11
S_T_DTYPE = 12
S_T_N_ELEMS = 13
S_T_CHUNK_ELEMS = 14
S_T_SRC_LO = 15
S_T_SRC_HI = 16
S_T_N_CHUNKS = 17
SPEC_LEN = 18

# Plain ints (numba freezes module globals into constants).
_OK = int(Reason.OK)
_TRUNCATED = int(Reason.TRUNCATED)
_OVERSIZED = int(Reason.OVERSIZED)
_BAD_MAGIC = int(Reason.BAD_MAGIC)
_BAD_VERSION = int(Reason.BAD_VERSION)
_BAD_KIND = int(Reason.BAD_KIND)
_FOREIGN_JOB = int(Reason.FOREIGN_JOB)
_BAD_TAG = int(Reason.BAD_TAG)
_STALE_STEP = int(Reason.STALE_STEP)
_BAD_BUCKET = int(Reason.BAD_BUCKET)
_BAD_PHASE = int(Reason.BAD_PHASE)
_BAD_RANK = int(Reason.BAD_RANK)
_BAD_SHARD = int(Reason.BAD_SHARD)
_CHUNK_RANGE = int(Reason.CHUNK_RANGE)
_COUNT_MISMATCH = int(Reason.COUNT_MISMATCH)
_BAD_DTYPE = int(Reason.BAD_DTYPE)
_DUPLICATE = int(Reason.DUPLICATE)
_UNKNOWN_TRANSFER = int(Reason.UNKNOWN_TRANSFER)

_KIND_MIN = min(int(k) for k in Kind)
_KIND_MAX = max(int(k) for k in Kind)
assert {int(k) for k in Kind} == set(range(_KIND_MIN, _KIND_MAX + 1)), "kinds must be contiguous"
_DATA = int(Kind.DATA)
#: Bit k set when kind k carries a bitmap (one source of truth: wire.header.BITMAP_KINDS).
_BITMAP_MASK = sum(1 << int(k) for k in BITMAP_KINDS)
_PHASE_MAX = int(Phase.PULL)
_DTYPE_MAX = int(DType.E4M3)
_F32 = int(DType.F32)
_F16 = int(DType.F16)
_BF16 = int(DType.BF16)
_E4M3 = int(DType.E4M3)
_ITEM_F32 = ITEMSIZE[DType.F32]
_ITEM_16 = ITEMSIZE[DType.F16]
_ITEM_8 = ITEMSIZE[DType.E4M3]
assert ITEMSIZE[DType.F16] == ITEMSIZE[DType.BF16] == 2
assert {DType.BF16, DType.E4M3} == LOSSY, "the kernels below decode exactly these"
_LOSSY_MASK = sum(1 << int(d) for d in LOSSY)  # bit k: dtype k is a lossy wire format
_HDR = HEADER_SIZE


@njit(inline="always", **EXACT)
def load_spec(spec: np.ndarray) -> tuple[int, ...]:
    """The spec array as a tuple of scalars (kept in registers by the batch loops)."""
    return (
        spec[0], spec[1], spec[2], spec[3], spec[4], spec[5], spec[6], spec[7], spec[8],
        spec[9], spec[10], spec[11], spec[12], spec[13], spec[14], spec[15], spec[16], spec[17],
    )  # fmt: skip


@njit(inline="always", **EXACT)
def itemsize(dtype: int) -> int:
    """Bytes per payload element of a valid ``dtype`` (:data:`ITEMSIZE`)."""
    if dtype == _F32:
        return _ITEM_F32
    return _ITEM_8 if dtype == _E4M3 else _ITEM_16


@njit(**EXACT)
def check_packet(
    row32: np.ndarray,
    row64: np.ndarray,
    length: int,
    sp: tuple[int, ...],
    key: np.ndarray,
) -> tuple[int, int, int, int, int]:
    """``validate(row[:length], session, transfer)`` → (reason, kind, src, chunk, count).

    ``row32``/``row64`` are one arena row as u32/u64 words, ``sp`` is :func:`load_spec`. A
    ``length`` beyond the row (the datagram did not fit its slot) is OVERSIZED.
    """
    n = length
    if n < _HDR:
        return _TRUNCATED, 0, 0, 0, 0
    if n > sp[S_MAX_DATAGRAM] or n > 8 * row64.shape[0]:
        return _OVERSIZED, 0, 0, 0, 0
    w0 = np.int64(row32[0])
    if (w0 & 0xFFFF) != MAGIC:
        return _BAD_MAGIC, 0, 0, 0, 0
    if ((w0 >> 16) & 0xFF) != VERSION:
        return _BAD_VERSION, 0, 0, 0, 0
    kind = (w0 >> 24) & 0xFF
    if kind < _KIND_MIN or kind > _KIND_MAX:
        return _BAD_KIND, kind, 0, 0, 0
    if np.int64(row32[2]) != sp[S_JOB]:
        return _FOREIGN_JOB, kind, 0, 0, 0
    if sp[S_MODE] == TAG_KEYED:
        tag = keyed_row(row64, n, key)
    else:
        tag = fast_tag_row(row64, n)
    if tag != row64[5]:
        return _BAD_TAG, kind, 0, 0, 0
    step = np.int64(row32[3])
    if step < sp[S_STEP_LO] or step > sp[S_STEP_HI]:
        return _STALE_STEP, kind, 0, 0, 0
    w4 = np.int64(row32[4])
    bucket = w4 & 0xFFFF
    shard = w4 >> 16
    if bucket >= sp[S_N_BUCKETS]:
        return _BAD_BUCKET, kind, 0, 0, 0
    w1 = np.int64(row32[1])
    dtype = (w1 >> 16) & 0xFF
    phase = w1 >> 24
    if phase > _PHASE_MAX:
        return _BAD_PHASE, kind, 0, 0, 0
    w5 = np.int64(row32[5])
    src = w5 & 0xFFFF
    if src >= sp[S_WORLD] or (w5 >> 16) != sp[S_ME]:
        return _BAD_RANK, kind, src, 0, 0
    if kind == _DATA and shard >= max(sp[S_WORLD], 1):
        return _BAD_SHARD, kind, src, 0, 0
    payload = n - _HDR
    count = np.int64(row32[7])
    if kind == _DATA:
        if dtype > _DTYPE_MAX or (dtype == _E4M3 and not 0 < row32[9] <= MAX_SCALE_BITS):
            return _BAD_DTYPE, kind, src, 0, count
        if count * itemsize(dtype) != payload:
            return _COUNT_MISMATCH, kind, src, 0, count
    elif (_BITMAP_MASK >> kind) & 1 and payload != (count + 7) // 8:
        return _COUNT_MISMATCH, kind, src, 0, count
    if (
        step != sp[S_T_STEP]
        or bucket != sp[S_T_BUCKET]
        or shard != sp[S_T_SHARD]
        or phase != sp[S_T_PHASE]
    ):
        return _UNKNOWN_TRANSFER, kind, src, 0, count
    if src < sp[S_T_SRC_LO] or src >= sp[S_T_SRC_HI]:
        return _BAD_RANK, kind, src, 0, count
    chunk = np.int64(row32[6])
    if kind == _DATA:
        t_dtype = sp[S_T_DTYPE]
        if dtype != t_dtype and not (t_dtype == _F32 and (_LOSSY_MASK >> dtype) & 1):
            return _BAD_DTYPE, kind, src, chunk, count
        if chunk >= sp[S_T_N_CHUNKS]:
            return _CHUNK_RANGE, kind, src, chunk, count
        ce = sp[S_T_CHUNK_ELEMS]
        if count != min(ce, sp[S_T_N_ELEMS] - chunk * ce):
            return _COUNT_MISMATCH, kind, src, chunk, count
    return _OK, kind, src, chunk, count


@njit(**EXACT)
def session_verdicts(
    arena: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    spec: np.ndarray,
    key: np.ndarray,
    out: np.ndarray,
) -> None:
    """:func:`check_packet` of each listed row up to the session's checks (the tag included),
    into ``out``: a packet that passes them all gets OK, whatever transfer it names (``spec``'s
    transfer step is -1, which no packet names)."""
    sp = load_spec(spec)
    a32 = arena.view(np.uint32)
    a64 = arena.view(np.uint64)
    _check_rows(rows, arena.shape[0])
    for i in range(rows.shape[0]):
        r = rows[i]
        reason = check_packet(a32[r], a64[r], lengths[r], sp, key)[0]
        out[i] = _OK if reason == _UNKNOWN_TRANSFER else reason


#: What :func:`expected_words` returns: (usable, w0, w1, w2, src_lo, src_hi, last_chunk,
#: last_count, max_len).
Expected = tuple[bool, np.uint64, np.uint64, np.uint64, int, int, int, int, int]


@njit(inline="always", **EXACT)
def expected_words(sp: tuple[int, ...], row_bytes: int) -> Expected:
    """What every valid DATA packet of the transfer carries, for :func:`verdict`'s fast path.

    u64 header words 0..2 with the flags/prio and src bits cleared, the allowed src range
    (within the world), the last chunk and its count, and the longest acceptable datagram.
    ``usable`` is False when no packet can pass the checks these stand for; then every packet
    takes the full path, which names the reason.
    """
    job = sp[S_JOB]
    me = sp[S_ME]
    world = sp[S_WORLD]
    step = sp[S_T_STEP]
    bucket = sp[S_T_BUCKET]
    shard = sp[S_T_SHARD]
    phase = sp[S_T_PHASE]
    dtype = sp[S_T_DTYPE]
    n_chunks = sp[S_T_N_CHUNKS]
    usable = (
        0 <= job <= 0xFFFFFFFF
        and 0 <= me <= 0xFFFF
        and sp[S_STEP_LO] <= step <= sp[S_STEP_HI]
        and 0 <= step <= 0xFFFFFFFF
        and 0 <= bucket < min(sp[S_N_BUCKETS], 0x10000)
        and 0 <= shard < min(max(world, 1), 0x10000)
        and 0 <= phase <= _PHASE_MAX
        and 0 <= dtype <= _DTYPE_MAX
        and n_chunks > 0
    )
    if not usable:
        return False, _U64(0), _U64(0), _U64(0), 0, 0, 0, 0, 0
    w0 = _U64(MAGIC | (VERSION << 16) | (_DATA << 24)) | (
        _U64((dtype << 16) | (phase << 24)) << _U64(32)
    )
    w1 = _U64(job) | (_U64(step) << _U64(32))
    w2 = _U64(bucket | (shard << 16)) | (_U64(me) << _U64(48))
    last = n_chunks - 1
    last_count = sp[S_T_N_ELEMS] - last * sp[S_T_CHUNK_ELEMS]
    max_len = min(sp[S_MAX_DATAGRAM], row_bytes)
    return True, w0, w1, w2, sp[S_T_SRC_LO], min(sp[S_T_SRC_HI], world), last, last_count, max_len


_CLEAR_16_32 = ~np.uint64(0xFFFF << 32)  # u64 header words 0 and 2: flags/prio, src


@njit(inline="always", **EXACT)
def fast_header(
    h0: np.uint64,
    h1: np.uint64,
    h2: np.uint64,
    h3: np.uint64,
    length: int,
    item: int,
    chunk_elems: int,
    ex: Expected,
) -> tuple[bool, int, int, int]:
    """Fast path of the receive decision, from header u64 words 0..3 → (fast, src, chunk, count).

    ``fast``: the header equals ``ex`` (:func:`expected_words`) in every field the checks look
    at, so it passes every check but the tag; conversely no packet with ``fast`` False can be
    accepted but a lossy-format chunk of a float32 transfer, and the full, ordered
    :func:`check_packet` runs to name the reason or accept such a chunk. ``item``
    is the payload itemsize (a constant in each kernel). Scalars only: inlined into the batch
    loops, a helper that takes arrays keeps their loads from staying in registers (see the
    module docstring on aliasing).
    """
    src = np.int64((h2 >> _U64(32)) & _U64(0xFFFF))
    chunk = np.int64(h3 & _U64(0xFFFFFFFF))
    count = np.int64(h3 >> _U64(32))
    diff = ((h0 & _CLEAR_16_32) ^ ex[1]) | (h1 ^ ex[2]) | ((h2 & _CLEAR_16_32) ^ ex[3])
    # Non-short-circuit ``&``: one branch instead of ten, in the per-packet loop.
    fast = (
        ex[0]
        & (diff == _U64(0))
        & (src >= ex[4])
        & (src < ex[5])
        & (chunk <= ex[6])
        & (count == (chunk_elems if chunk < ex[6] else ex[7]))
        & (length == _HDR + count * item)
        & (length <= ex[8])
    )
    return fast, src, chunk, count


_DTYPE_BITS = np.uint64(0xFF << 48)  # u64 header word 0: the dtype field
_F32_BITS = np.uint64(_F32 << 48)


@njit(inline="always", **EXACT)
def lossy_header(
    h0: np.uint64,
    h1: np.uint64,
    h2: np.uint64,
    h3: np.uint64,
    h4: np.uint64,
    length: int,
    chunk_elems: int,
    ex: Expected,
) -> tuple[bool, int, int, int]:
    """:func:`fast_header` for a lossy-format chunk (bfloat16 or E4M3) of a float32 transfer
    (``ex`` a float32 transfer's): the same header fields with the row's own dtype in place of
    float32, the payload's length at that dtype's itemsize and, for E4M3, a valid scale (``aux``,
    the high half of header word 4). ``fast`` False for any other row."""
    dt = np.int64((h0 >> _U64(48)) & _U64(0xFF))
    item = _ITEM_8 if dt == _E4M3 else _ITEM_16
    scale = h4 >> _U64(32)
    lossy = (
        ((ex[1] & _DTYPE_BITS) == _F32_BITS)
        & ((dt == _BF16) | (dt == _E4M3))
        & ((dt != _E4M3) | ((scale > _U64(0)) & (scale <= _U64(MAX_SCALE_BITS))))
    )
    fast, src, chunk, count = fast_header(
        (h0 & ~_DTYPE_BITS) | _F32_BITS, h1, h2, h3, length, item, chunk_elems, ex
    )
    return lossy & fast, src, chunk, count


@njit(**EXACT)
def slow_verdict(
    row32: np.ndarray,
    row64: np.ndarray,
    length: int,
    spec: np.ndarray,
    key: np.ndarray,
) -> tuple[int, int, int, int]:
    """:func:`check_packet` for a packet that missed the fast path → (reason, src, chunk, count).

    A valid non-DATA packet gets BAD_KIND. Out of line on purpose: only rejected packets come
    here (see :func:`fast_header`), and keeping it out of the batch loop keeps that loop small.
    """
    reason, kind, src, chunk, count = check_packet(row32, row64, length, load_spec(spec), key)
    if reason == _OK and kind != _DATA:
        reason = _BAD_KIND
    return reason, src, chunk, count


@njit(inline="always", **EXACT)
def row_tag(row64: np.ndarray, length: int, mode: int, key: np.ndarray) -> np.uint64:
    """The tag a row must carry (fast or keyed per ``mode``)."""
    if mode == TAG_KEYED:
        return keyed_row(row64, length, key)
    return fast_tag_row(row64, length)


@njit(**EXACT)
def _check_rows(rows: np.ndarray, n_rows: int) -> None:
    """Every batch row is an arena row (checked before anything is written): the loops below
    read rows unchecked, and callers with a prepared plan do not check rows in Python."""
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= n_rows:
            raise ValueError("rows must index arena rows")
