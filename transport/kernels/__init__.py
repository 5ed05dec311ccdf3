"""Per-packet hot paths of gradlane, compiled with numba: headers, pack, reduce, place, Hadamard,
and the sender's per-ACK pass (:func:`apply_ack`).

Theory of operation
-------------------
Packets live in *arenas*: 2-D C-contiguous uint8 arrays, one datagram slot per row, rows a
multiple of 8 bytes wide (so the 48-byte header and the payload are word aligned), with the
datagram lengths in a separate int array. The sender does not copy payloads: it reads a shard
once for its per-chunk norms and tag sums (:func:`chunk_stats`) and writes one 48-byte header
per chunk (:func:`write_headers`); header row plus a view of the chunk is the datagram, byte for
byte what :func:`pack` would build into an arena (kept for drivers that want whole packets, and
as the tested definition). The receiver hands a batch of received rows to :func:`reduce_into`
(reduce phase, adds into a float32 accumulator) or :func:`place_into` (gather phase, copies
bit-exactly).

Each public function here checks dtypes, shapes, contiguity and alignment and raises
``ValueError`` saying what to pass instead; the private kernels behind them trust their inputs.
The kernels are single-threaded and release the GIL (``nogil``), so an engine thread can run them
beside Python code. Remote bytes are never trusted: a receive kernel checks a datagram exactly like
:func:`gradlane.transport.wire.header.validate` — same
:class:`~gradlane.transport.wire.header.Reason`, same order — and writes nothing anywhere before
every check, the tag included, has passed; a bad datagram only bumps its counter.

Compilation flags come from one place, :class:`KernelConfig` (``GRADLANE_FASTMATH``), read once.
Each kernel has a plain-NumPy reference in ``tests/support/naive.py`` that the tests hold it to.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
from gradlane.transport.kernels import _ack
from gradlane.transport.kernels import _hadamard as _had
from gradlane.transport.kernels import _local_sum as _sum
from gradlane.transport.kernels import _pack as _pk
from gradlane.transport.kernels import _receive as _rx
from gradlane.transport.kernels._checks import (
    _NO_U8,
    _NO_U16,
    _OUT_DTYPES,
    _U8_MAX,
    _U16_MAX,
    _U32_MAX,
    _U64_MAX,
    _arena,
    _array,
    _chunked,
    _in_range,
    _key_parts,
    _optional_f32,
    _per_chunk_u8,
    _readonly,
    _shard,
    _typed,
    _wire_dtype,
)
from gradlane.transport.kernels._common import (
    CONFIG,
    MAGIC_VERSION_WORD,
    KernelConfig,
    header_template,
)
from gradlane.transport.wire.header import (
    HEADER_SIZE,
    ITEMSIZE,
    N_REASONS,
    DType,
    Header,
    SessionSpec,
    TransferSpec,
    chunk_counts,
)
from gradlane.transport.wire.tag import TAG_FAST, TagKey

__all__ = [
    "CONFIG",
    "AckResult",
    "ChunkStats",
    "KernelConfig",
    "ReceivePlan",
    "SentChunks",
    "apply_ack",
    "chunk_stats",
    "fill_headers",
    "hadamard_forward",
    "hadamard_inverse",
    "header_words",
    "local_sum",
    "pack",
    "place_into",
    "prepare_receive",
    "receive_rows",
    "reduce_into",
    "write_headers",
]


def _template(header: Header, dtype: DType) -> np.ndarray:
    """The kernels' header template (``header_template`` of header u32 words 0..5)."""
    return header_template(_words_of(header, dtype))


def header_words(header: Header) -> np.ndarray:
    """Header u32 words 0..5 of a packet with ``header``'s kind, phase, dtype, job, step,
    bucket, shard, src and dst (flags and prio zero; its other fields are not in these words),
    each field checked against its width: what :func:`fill_headers` takes as ``words``."""
    return _words_of(header, header.dtype)


def _words_of(header: Header, dtype: int) -> np.ndarray:
    """:func:`header_words` of ``header`` with its dtype replaced by ``dtype``."""
    h = header
    t = np.zeros(6, dtype=np.uint32)
    t[0] = MAGIC_VERSION_WORD | (_in_range("header.kind", h.kind, _U8_MAX) << 24)
    t[1] = (_in_range("header.dtype", dtype, _U8_MAX) << 16) | (
        _in_range("header.phase", h.phase, _U8_MAX) << 24
    )
    t[2] = _in_range("header.job", h.job, _U32_MAX)
    t[3] = _in_range("header.step", h.step, _U32_MAX)
    t[4] = _in_range("header.bucket", h.bucket, _U16_MAX) | (
        _in_range("header.shard", h.shard, _U16_MAX) << 16
    )
    t[5] = _in_range("header.src", h.src, _U16_MAX) | (
        _in_range("header.dst", h.dst, _U16_MAX) << 16
    )
    return t


@lru_cache(maxsize=256)
def _spec(session: SessionSpec, transfer: TransferSpec) -> tuple[np.ndarray, np.uint64, np.uint64]:
    """The int64 spec array the receive kernels read, and the SipHash key (cached)."""
    _wire_dtype(transfer.dtype)
    if transfer.chunk_elems < 1 or transfer.n_elems < 0:
        raise ValueError(
            f"transfer needs chunk_elems >= 1 and n_elems >= 0, got {transfer.chunk_elems} "
            f"and {transfer.n_elems}"
        )
    if not 0 <= transfer.src_lo < transfer.src_hi <= _U16_MAX + 1:
        raise ValueError(
            f"transfer ranks src_lo={transfer.src_lo}, src_hi={transfer.src_hi} must satisfy "
            "0 <= src_lo < src_hi <= 65536"
        )
    mode, k0, k1 = _key_parts(session.key)
    spec = np.zeros(_rx.SPEC_LEN, dtype=np.int64)
    spec[_rx.S_JOB] = session.job
    spec[_rx.S_ME] = session.me
    spec[_rx.S_WORLD] = session.world
    spec[_rx.S_STEP_LO] = session.step_lo
    spec[_rx.S_STEP_HI] = session.step_hi
    spec[_rx.S_N_BUCKETS] = session.n_buckets
    spec[_rx.S_MAX_DATAGRAM] = session.max_datagram
    spec[_rx.S_MODE] = mode
    spec[_rx.S_T_STEP] = transfer.step
    spec[_rx.S_T_BUCKET] = transfer.bucket
    spec[_rx.S_T_SHARD] = transfer.shard
    spec[_rx.S_T_PHASE] = transfer.phase
    spec[_rx.S_T_DTYPE] = transfer.dtype
    spec[_rx.S_T_N_ELEMS] = transfer.n_elems
    spec[_rx.S_T_CHUNK_ELEMS] = transfer.chunk_elems
    spec[_rx.S_T_SRC_LO] = transfer.src_lo
    spec[_rx.S_T_SRC_HI] = transfer.src_hi
    spec[_rx.S_T_N_CHUNKS] = transfer.n_chunks
    spec.flags.writeable = False
    return spec, k0, k1


_all_rows = np.arange(1024, dtype=np.int64)
_all_rows.flags.writeable = False


def _identity_rows(n: int) -> np.ndarray:
    """``arange(n)`` as int64, from a shared read-only cache (the batch without ``rows``)."""
    global _all_rows  # noqa: PLW0603 - a grow-only cache; replacing the array is atomic
    table = _all_rows
    if table.shape[0] < n:
        table = np.arange(max(n, 2 * table.shape[0]), dtype=np.int64)
        table.flags.writeable = False
        _all_rows = table
    return table[:n]


class ChunkStats(NamedTuple):
    """Per-chunk statistics of a shard, computed once for every destination it is sent to:
    L2 norms (float32; what :func:`pack` writes) and the payload's fast-tag sums (uint64)."""

    norms: np.ndarray
    sum_a: np.ndarray
    sum_b: np.ndarray


_NO_STATS = ChunkStats(
    np.empty(0, dtype=np.float32), np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64)
)
_NO_U32 = np.empty(0, dtype=np.uint32)
_ONE = np.float32(1.0)


class ReceivePlan(NamedTuple):
    """A receiving transfer's checked kernel arguments, everything but the batch
    (:func:`prepare_receive`); :func:`receive_rows` runs a batch with it."""

    session: SessionSpec
    transfer: TransferSpec
    spec: np.ndarray
    k0: np.uint64
    k1: np.uint64
    place: bool
    target: np.ndarray  # float32 accumulator (reduce) or the output's raw bits (place)
    contrib: np.ndarray
    received: np.ndarray
    counters: np.ndarray
    stats: ChunkStats = _NO_STATS  # per-chunk statistics of completed sums (F32 reduce; empty: off)
    final: int = 0  # the contributor count that completes a chunk
    target_bits: np.ndarray = _NO_U32  # the accumulator's u32 view (F32 reduce with stats)
    scale: np.float32 = _ONE  # what a completed sum is multiplied by (F32 reduce with stats)


def prepare_receive(
    session: SessionSpec,
    transfer: TransferSpec,
    target: np.ndarray,
    contrib: np.ndarray | None,
    received: np.ndarray,
    counters: np.ndarray,
    *,
    place: bool,
    stats: ChunkStats | None = None,
    final: int = 0,
    scale: float = 1.0,
) -> ReceivePlan:
    """Check once what :func:`reduce_into` (``place=False``: ``target`` is ``accum``) or
    :func:`place_into` (``target`` is ``out``) would check on every call, except the batch.

    A receiver makes one per transfer (again when its session's step window moves): a batch
    then costs a few attribute checks instead of some twenty NumPy operations.

    ``stats`` (F32 reduce only: arrays of one entry per chunk) asks the kernel for the
    :func:`chunk_stats` of every chunk whose ``contrib`` reaches ``final`` (>= 1), computed from
    the finished sum as the last contribution lands: a sender of the reduced shard then needs
    no pass over it. Entries of chunks that never reach ``final`` are left as they were. Such a
    finished chunk is first multiplied by ``scale`` (float32; e.g. ``1 / world`` for a mean),
    in the same pass; the other chunks are not.
    """
    spec, k0, k1 = _spec(session, transfer)
    recv = _array("received", received, 2, writeable=True)
    if recv.dtype == np.bool_:
        recv = recv.view(np.uint8)
    want = (transfer.src_hi - transfer.src_lo, transfer.n_chunks)
    if recv.dtype != np.uint8 or recv.shape != want:
        raise ValueError(
            f"received must be uint8 of shape (src_hi - src_lo, n_chunks) = {want}, got "
            f"{recv.dtype.name}{recv.shape}"
        )
    _typed("counters", counters, np.int64, (N_REASONS,))
    wire = DType(transfer.dtype)
    if stats is not None and (place or wire != DType.F32):
        raise ValueError("stats are computed by the F32 reduce only")
    if scale != 1.0 and stats is None:
        raise ValueError("scale applies to finished chunks: it needs stats")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if place:
        out_a = _array("out", target, 1, writeable=True)
        if out_a.dtype not in _OUT_DTYPES[wire] or out_a.shape != (transfer.n_elems,):
            names = ", ".join(d.name for d in _OUT_DTYPES[wire])
            raise ValueError(
                f"out for {wire.name} must be one of ({names}) with shape ({transfer.n_elems},), "
                f"got {out_a.dtype.name}{out_a.shape}"
            )
        tgt = out_a.view(np.uint32 if wire == DType.F32 else np.uint16)
        con = _NO_U16  # optional in the gather phase
        if contrib is not None:
            con = _typed("contrib", contrib, np.uint16, (transfer.n_chunks,))
    else:
        tgt = _typed("accum", target, np.float32, (transfer.n_elems,))
        assert contrib is not None
        con = _typed("contrib", contrib, np.uint16, (transfer.n_chunks,))
    plan = ReceivePlan(
        session=session,
        transfer=transfer,
        spec=spec,
        k0=k0,
        k1=k1,
        place=bool(place),
        target=tgt,
        contrib=con,
        received=recv,
        counters=counters,
    )
    if stats is None:
        return plan
    shape = (transfer.n_chunks,)
    if not 1 <= final <= _U16_MAX:
        raise ValueError(f"final must be a contributor count in [1, {_U16_MAX}], got {final}")
    if not tgt.flags.c_contiguous:
        raise ValueError("accum must be C-contiguous to compute chunk statistics")
    st = ChunkStats(
        _typed("stats.norms", stats.norms, np.float32, shape, writeable=True),
        _typed("stats.sum_a", stats.sum_a, np.uint64, shape, writeable=True),
        _typed("stats.sum_b", stats.sum_b, np.uint64, shape, writeable=True),
    )
    return plan._replace(
        stats=st, final=final, target_bits=tgt.view(np.uint32), scale=np.float32(scale)
    )


def receive_rows(
    plan: ReceivePlan,
    arena: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray | None = None,
    verdicts: np.ndarray | None = None,
) -> int:
    """Run one batch (``arena`` rows, or those listed in ``rows``) with a prepared plan: the
    reduce or place of :func:`reduce_into` / :func:`place_into`. Returns the accepted count."""
    rows_a = _readonly(_arena(arena, writeable=False))
    n_rows = rows_a.shape[0]
    lens = _array("lengths", lengths, 1)
    if lens.dtype.kind not in "ui" or lens.shape[0] != n_rows:
        raise ValueError(
            f"lengths must be an integer array with one entry per arena row ({n_rows}), got "
            f"{lens.dtype.name}{lens.shape}"
        )
    lens = _readonly(lens.astype(np.int64, copy=False))
    if rows is None:
        idx = _identity_rows(n_rows)
    else:
        idx = _array("rows", rows, 1)
        if idx.dtype.kind not in "ui":
            raise ValueError(f"rows must be an integer array, got {idx.dtype.name}")
        idx = _readonly(idx.astype(np.int64, copy=False))  # each row's range: the kernel's check
    verd = _NO_U8 if verdicts is None else _typed("verdicts", verdicts, np.uint8, (idx.shape[0],))
    p = plan
    args = (p.spec, p.k0, p.k1)
    if p.place:
        words = rows_a.view(np.uint32 if p.target.dtype == np.uint32 else np.uint16)
        return int(_rx.place_rows(rows_a, words, lens, idx, *args, p.target, p.contrib,
                                  p.received, p.counters, verd))  # fmt: skip
    if p.transfer.dtype == DType.F32:
        return int(_rx.reduce_f32(rows_a, lens, idx, *args, p.target, p.contrib, p.received,
                                  p.counters, verd, p.target_bits, *p.stats, p.final,
                                  p.scale))  # fmt: skip
    return int(_rx.reduce_u16(rows_a, lens, idx, *args, p.target, p.contrib, p.received,
                              p.counters, verd, p.transfer.dtype == DType.BF16))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# public API


def pack(
    src: np.ndarray,
    arena: np.ndarray,
    lengths: np.ndarray,
    *,
    dtype: DType,
    header: Header,
    chunk_elems: int,
    key: TagKey,
    prio: np.ndarray | int = 0,
    flags: np.ndarray | int = 0,
    first_chunk: int = 0,
    norms: np.ndarray | None = None,
    maxabs: np.ndarray | None = None,
) -> int:
    """Pack a 1-D shard into DATA packets, one per arena row; returns the number of packets.

    Chunk ``c`` is ``src[c*chunk_elems:(c+1)*chunk_elems]`` (the last may be short) and goes to
    row ``c`` with ``chunk = first_chunk + c``, ``count``, ``dtype``, ``prio[c]``, ``flags[c]``
    (or the scalars), ``norm`` = its L2 norm (computed in the same pass as the copy), ``aux = 0``,
    and the tag under ``key``. The other header fields come from ``header`` (kind, job, step,
    bucket, shard, src, dst, phase); its chunk/count/dtype/prio/flags/norm/aux/tag are ignored.
    ``lengths[c]`` gets the datagram length; ``norms``/``maxabs`` (float32, optional) get the
    chunk's L2 norm and max |x|.

    ``src``: float32 for F32; float16/uint16/int16 bits for F16; uint16/int16 bits for BF16
    (e.g. a bf16 torch tensor viewed as int16). ``arena``: 2-D uint8, C-contiguous, rows a
    multiple of 8 bytes and at least ``48 + chunk_elems * itemsize``.
    """
    wire = _wire_dtype(dtype)
    bits = _shard("src", src, wire)
    item = ITEMSIZE[wire]
    chunk_elems = int(chunk_elems)
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems={chunk_elems} must be >= 1")
    rows = _arena(arena, writeable=True)
    n_chunks = -(-bits.shape[0] // chunk_elems)
    need = HEADER_SIZE + chunk_elems * item
    if rows.shape[1] < need or rows.shape[0] < n_chunks:
        raise ValueError(
            f"arena of shape {rows.shape} cannot hold {n_chunks} packets of up to {need} bytes; "
            f"allocate at least ({n_chunks}, {need + (-need) % 8})"
        )
    lens = _array("lengths", lengths, 1, writeable=True)
    if lens.dtype not in (np.int64, np.int32) or lens.shape[0] < n_chunks:
        raise ValueError(
            f"lengths must be int64 or int32 with at least {n_chunks} entries, got "
            f"{lens.dtype.name}{lens.shape}"
        )
    first = int(first_chunk)
    if first < 0 or first + n_chunks - 1 > _U32_MAX or chunk_elems > _U32_MAX:
        raise ValueError(f"chunk indices {first}..{first + n_chunks - 1} do not fit a u32")
    prio_a, prio_step = _per_chunk_u8("prio", prio, n_chunks)
    flags_a, flags_step = _per_chunk_u8("flags", flags, n_chunks)
    norms_a = _optional_f32("norms", norms, n_chunks)
    maxabs_a = _optional_f32("maxabs", maxabs, n_chunks)
    tmpl = _template(header, wire)
    mode, k0, k1 = _key_parts(key)
    if n_chunks == 0:
        return 0
    if wire == DType.F32:
        return int(
            _pk.pack_f32(
                bits, rows, lens, chunk_elems, tmpl, prio_a, prio_step, flags_a, flags_step,
                first, mode, k0, k1, norms_a, maxabs_a,
            )
        )  # fmt: skip
    return int(
        _pk.pack_u16(
            bits, rows, lens, chunk_elems, tmpl, prio_a, prio_step, flags_a, flags_step,
            first, mode, k0, k1, norms_a, maxabs_a, wire == DType.BF16,
        )
    )  # fmt: skip


def reduce_into(
    arena: np.ndarray,
    lengths: np.ndarray,
    accum: np.ndarray,
    contrib: np.ndarray,
    received: np.ndarray,
    *,
    session: SessionSpec,
    transfer: TransferSpec,
    counters: np.ndarray,
    rows: np.ndarray | None = None,
    verdicts: np.ndarray | None = None,
) -> int:
    """Validate a batch of received datagrams and add the good DATA payloads; returns accepted.

    The batch is every arena row, or the rows listed in ``rows``; ``lengths`` has one datagram
    length per arena row. Each is checked exactly like
    :func:`~gradlane.transport.wire.header.validate` ``(data, session, transfer)`` (same Reason,
    same order); a packet it accepts that is not DATA gets BAD_KIND (route control packets
    elsewhere), and one whose ``received[src - transfer.src_lo, chunk]`` is set
    gets DUPLICATE. A good packet is added into ``accum`` (float32, ``transfer.n_elems``; f16/bf16
    converted) at ``chunk * chunk_elems``, ``contrib[chunk] += 1`` (uint16, one per chunk) and its
    ``received`` entry (uint8 or bool, ``(src_hi - src_lo, n_chunks)``) is set. ``counters``
    (int64, one per Reason) gets +1 at each item's Reason (OK counts accepted); ``verdicts``
    (uint8, one per item, optional) gets it too. A datagram longer than its row is OVERSIZED.
    """
    plan = prepare_receive(session, transfer, accum, contrib, received, counters, place=False)
    return receive_rows(plan, arena, lengths, rows, verdicts)


def place_into(
    arena: np.ndarray,
    lengths: np.ndarray,
    out: np.ndarray,
    received: np.ndarray,
    *,
    session: SessionSpec,
    transfer: TransferSpec,
    counters: np.ndarray,
    contrib: np.ndarray | None = None,
    rows: np.ndarray | None = None,
    verdicts: np.ndarray | None = None,
) -> int:
    """Gather phase of :func:`reduce_into`: copy each good payload bit-exactly into ``out``.

    ``out`` has ``transfer.n_elems`` elements of the wire type: float32 (or uint32 bits) for F32;
    uint16/int16/float16 for F16; uint16/int16 for BF16. Validation, ``received``, ``counters``,
    ``verdicts`` and ``rows`` are as in :func:`reduce_into`; ``contrib`` is optional.
    """
    plan = prepare_receive(session, transfer, out, contrib, received, counters, place=True)
    return receive_rows(plan, arena, lengths, rows, verdicts)


def chunk_stats(src: np.ndarray, *, dtype: DType, chunk_elems: int) -> ChunkStats:
    """The :class:`ChunkStats` of a shard (``src`` and ``chunk_elems`` as in :func:`pack`): one
    read of the shard, no copy."""
    wire, bits, chunk_elems, n_chunks = _chunked(src, dtype, chunk_elems)
    norms = np.empty(n_chunks, dtype=np.float32)
    sum_a = np.empty(n_chunks, dtype=np.uint64)
    sum_b = np.empty(n_chunks, dtype=np.uint64)
    if n_chunks:
        if wire == DType.F32:
            _pk.stats_f32(bits, chunk_elems, norms, sum_a, sum_b)
        else:
            _pk.stats_u16(bits, chunk_elems, norms, sum_a, sum_b, wire == DType.BF16)
    return ChunkStats(norms, sum_a, sum_b)


def write_headers(
    hdr: np.ndarray,
    src: np.ndarray,
    stats: ChunkStats,
    *,
    dtype: DType,
    header: Header,
    chunk_elems: int,
    key: TagKey,
    prio: np.ndarray,
    flags: np.ndarray,
    first_chunk: int = 0,
) -> int:
    """Write the DATA header of every chunk of ``src`` into the rows of ``hdr`` (uint8,
    ``(n_chunks, 48)``, C-contiguous); returns the number of chunks.

    Row ``c`` followed by chunk ``c``'s payload bytes is byte for byte the datagram
    :func:`pack` builds (same fields, norm and tag), so a driver sends the pair with one
    gathering ``sendmsg`` and the payload is never copied. ``stats`` are the shard's
    :func:`chunk_stats`; ``prio`` and ``flags`` are per-chunk uint8 arrays. A SipHash key reads
    each payload (its tag covers header and payload in one stream); the fast tag only combines
    the precomputed sums.
    """
    wire, bits, chunk_elems, n_chunks = _chunked(src, dtype, chunk_elems)
    rows = _array("hdr", hdr, 2, writeable=True)
    if rows.dtype != np.uint8 or rows.shape[0] < n_chunks or rows.shape[1] != HEADER_SIZE:
        raise ValueError(
            f"hdr must be uint8 of shape (>= {n_chunks}, {HEADER_SIZE}), got "
            f"{rows.dtype.name}{rows.shape}"
        )
    for name, arr in zip(ChunkStats._fields, stats, strict=True):
        if np.asarray(arr).shape[0] != n_chunks:
            raise ValueError(f"stats.{name} has {np.asarray(arr).shape[0]} entries, not {n_chunks}")
    first = int(first_chunk)
    if first < 0 or first + n_chunks - 1 > _U32_MAX or chunk_elems > _U32_MAX:
        raise ValueError(f"chunk indices {first}..{first + n_chunks - 1} do not fit a u32")
    prio_a, _ = _per_chunk_u8("prio", prio, n_chunks)
    flags_a, _ = _per_chunk_u8("flags", flags, n_chunks)
    if n_chunks == 0:
        return 0
    counts = chunk_counts(bits.shape[0], chunk_elems)
    fill_headers(
        rows[:n_chunks],
        src,
        counts,
        stats,
        dtype=wire,
        words=_words_of(header, wire),
        chunk_elems=chunk_elems,
        key=key,
        prio=prio_a,
        flags=flags_a,
        first_chunk=first,
    )
    return n_chunks


def fill_headers(
    hdr: np.ndarray,
    src: np.ndarray,
    counts: np.ndarray,
    stats: ChunkStats,
    *,
    dtype: DType,
    words: np.ndarray,
    chunk_elems: int,
    key: TagKey,
    prio: np.ndarray,
    flags: np.ndarray,
    first_chunk: int = 0,
) -> None:
    """:func:`write_headers` without its argument checks, for a caller that built every array
    itself (the sender, once per transfer: the checks cost more than the kernel at a few
    chunks). ``hdr`` is uint8 ``(n, 48)`` C-contiguous; ``src`` the shard (its dtype is still
    checked: it is the caller's buffer); ``counts``
    (:func:`~gradlane.transport.wire.header.chunk_counts`), ``stats``' arrays, ``prio`` and
    ``flags`` (uint8) have ``n`` entries; ``words`` is :func:`header_words`. Wrong shapes here are
    memory errors, which is why only the sender's own arrays come this way."""
    bits = _shard("src", src, dtype)
    itemsize = ITEMSIZE[dtype]
    # Read-only, as write_headers passes them: numba compiles (and caches) one
    # specialisation per array writability, and the warm-up compiles this one.
    tmpl = header_template(words)
    tmpl.flags.writeable = False
    prio, flags = _readonly(prio), _readonly(flags)
    mode, k0, k1 = _key_parts(key)
    hdr64 = hdr.view(np.uint64)
    if mode == TAG_FAST:
        _pk.headers_fast(
            hdr64, counts, itemsize, tmpl, prio, flags, first_chunk,
            stats.norms, stats.sum_a, stats.sum_b,
        )  # fmt: skip
    else:
        scratch = np.zeros((HEADER_SIZE + chunk_elems * itemsize + 7) // 8, dtype=np.uint64)
        src8 = bits.view(np.uint8)
        src32 = src8[: src8.shape[0] // 4 * 4].view(np.uint32)
        _pk.headers_siphash(
            hdr64, scratch, src32, src8, chunk_elems * itemsize, counts, itemsize, tmpl, prio,
            flags, first_chunk, stats.norms, k0, k1,
        )  # fmt: skip


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


class AckResult(NamedTuple):
    """What :func:`apply_ack` found, in the order the sender passes it on.

    ``idx`` are the newly acknowledged chunks (ascending); ``sizes``, ``rtt`` (first
    transmissions only, NaN otherwise), ``paths`` and ``counted`` (bytes that leave the
    outstanding bytes: INFLIGHT chunks only) are per acknowledged chunk, the arguments of
    ``PathSet.on_acked``. ``n_lost``, ``n_inflight`` and ``abandoned_elems`` are what left those
    states. ``trigger_first``: the trigger chunk is among them, as a first transmission.
    ``path_bytes``/``path_hit``: acknowledged bytes per path, and the paths that had any.
    ``lost``: the chunks RACK declares lost (ascending).
    """

    idx: np.ndarray
    sizes: np.ndarray
    rtt: np.ndarray
    paths: np.ndarray
    counted: np.ndarray
    n_lost: int
    n_inflight: int
    abandoned_elems: int
    trigger_first: bool
    path_bytes: np.ndarray
    path_hit: np.ndarray
    lost: np.ndarray


class SentChunks(NamedTuple):
    """The per-chunk arrays of one outgoing transfer that :func:`apply_ack` reads (an
    :class:`~gradlane.transport.core.outgoing.OutTransfer`'s): 1-D, one entry per chunk, any
    strides; ``lengths`` may be longer than the others. ``state`` is written: chunks an ACK
    newly acknowledges become ACKED."""

    state: np.ndarray  # uint8 chunk states (outgoing.INFLIGHT, LOST, ACKED, ABANDONED)
    tx: np.ndarray  # uint8 transmissions so far (1: the RTT sample is clean, Karn)
    sent_at: np.ndarray  # float64 time of the last transmission
    path: np.ndarray  # int16 path of the last transmission
    prio: np.ndarray  # uint8 priority class
    counts: np.ndarray  # int64 elements per chunk
    lengths: np.ndarray  # int32 datagram length per chunk


#: The dtype of each :class:`SentChunks` array, in field order, then the bitmap's.
_ACK_DTYPES: tuple[np.dtype[Any], ...] = (
    np.dtype(np.uint8),
    np.dtype(np.uint8),
    np.dtype(np.float64),
    np.dtype(np.int16),
    np.dtype(np.uint8),
    np.dtype(np.int64),
    np.dtype(np.int32),
    np.dtype(np.bool_),
)


def _ack_arguments(
    chunks: tuple[object, ...], bits: object, base: int, n_paths: int, n_classes: int
) -> None:
    """Raise the ValueError that says what is wrong with :func:`apply_ack`'s arguments."""
    state = chunks[0]
    n = state.shape[0] if isinstance(state, np.ndarray) and state.ndim == 1 else -1
    for name, dt, a in zip(SentChunks._fields, _ACK_DTYPES, chunks, strict=False):
        if (
            not isinstance(a, np.ndarray)
            or a.dtype != dt
            or a.ndim != 1
            or (a.shape[0] != n and not (name == "lengths" and a.shape[0] >= n))
        ):
            got = f"{a.dtype.name} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"{name} must be a 1-D {dt.name} array of state's length; got {got}")
    if isinstance(state, np.ndarray) and not state.flags.writeable:
        raise ValueError("state is read-only; apply_ack marks acknowledged chunks in it")
    if not isinstance(bits, np.ndarray) or bits.dtype != np.bool_ or bits.ndim != 1:
        raise ValueError("bits must be a 1-D bool array (the ACK bitmap)")
    raise ValueError(
        f"base={base}, n_paths={n_paths}, n_classes={n_classes}: base >= 0, "
        "at least one path and one class"
    )


def apply_ack(
    chunks: SentChunks,
    bits: np.ndarray,
    *,
    base: int,
    trigger: int,
    now: float,
    n_paths: int,
    n_classes: int,
    reorder_window_s: float,
) -> AckResult:
    """Apply an ACK bitmap ``bits`` (bool, chunks ``base ..``) to one outgoing transfer.

    ``chunks`` are the transfer's per-chunk arrays (:class:`SentChunks`; ``state`` is written).
    Returns an :class:`AckResult`; ``trigger`` is the chunk whose arrival sent the ACK, and the
    RACK scan uses lanes of ``n_paths`` × ``n_classes`` and ``reorder_window_s``. Raises
    ValueError on wrong dtypes, shapes, a negative ``base``, or a chunk's path or class out of
    range.
    """
    state, tx, sent_at, path, prio, counts, lengths = chunks
    try:  # one cheap test per ACK; _ack_arguments says what is wrong when it fails
        dtypes = (state.dtype, tx.dtype, sent_at.dtype, path.dtype, prio.dtype, counts.dtype)
        ok = (*dtypes, lengths.dtype, bits.dtype) == _ACK_DTYPES and (
            state.ndim == lengths.ndim == bits.ndim == 1
            and state.shape == tx.shape == sent_at.shape == path.shape == prio.shape
            and state.shape == counts.shape
            and lengths.shape[0] >= state.shape[0]
            and state.flags.writeable
            and base >= 0
            and n_paths >= 1
            and n_classes >= 1
        )
    except AttributeError:
        ok = False
    if not ok:
        _ack_arguments(chunks, bits, base, n_paths, n_classes)
    idx, sizes, rtt, paths, counted, n_lost, n_inflight, abandoned, first, pbytes, hit, lost = (
        _ack.ack_scan(
            state,
            tx,
            sent_at,
            path,
            prio,
            counts,
            lengths,
            bits,
            base,
            trigger,
            float(now),
            n_paths,
            n_classes,
            float(reorder_window_s),
        )
    )
    # int()/bool(): already Python scalars when compiled; numpy ones under NUMBA_DISABLE_JIT.
    return AckResult(
        idx=idx,
        sizes=sizes,
        rtt=rtt,
        paths=paths,
        counted=counted,
        n_lost=int(n_lost),
        n_inflight=int(n_inflight),
        abandoned_elems=int(abandoned),
        trigger_first=bool(first),
        path_bytes=pbytes,
        path_hit=hit,
        lost=lost,
    )
