"""The sender's checked kernel wrappers: header words, chunk statistics, DATA headers, packing.

A shard is read once for its per-chunk norms and tag sums (:func:`chunk_stats`); one 48-byte
header per chunk is written (:func:`write_headers`, :func:`fill_headers`), and header row plus a
view of the chunk is the datagram, byte for byte what :func:`pack` builds into an arena (kept for
drivers that want whole packets, and as the tested definition).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gradlane.transport.kernels import _pack as _pk
from gradlane.transport.kernels._checks import (
    _U8_MAX,
    _U16_MAX,
    _U32_MAX,
    _arena,
    _array,
    _chunked,
    _in_range,
    _key_parts,
    _optional_f32,
    _per_chunk_u8,
    _readonly,
    _shard,
    _wire_dtype,
)
from gradlane.transport.kernels._common import (
    MAGIC_VERSION_WORD,
    header_template,
)
from gradlane.transport.wire.header import (
    HEADER_SIZE,
    ITEMSIZE,
    DType,
    Header,
    chunk_counts,
)
from gradlane.transport.wire.tag import TagKey


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
    return fields_words(h.kind, h.phase, dtype, h.job, h.step, h.bucket, h.shard, h.src, h.dst)


def fields_words(
    kind: int,
    phase: int,
    dtype: int,
    job: int,
    step: int,
    bucket: int,
    shard: int,
    src: int,
    dst: int,
) -> np.ndarray:
    """:func:`header_words` from the fields themselves (a sender starting a transfer has them
    as numbers: no :class:`Header` to build), each checked against its width."""
    return np.array(
        (
            MAGIC_VERSION_WORD | (_in_range("header.kind", kind, _U8_MAX) << 24),
            (_in_range("header.dtype", dtype, _U8_MAX) << 16)
            | (_in_range("header.phase", phase, _U8_MAX) << 24),
            _in_range("header.job", job, _U32_MAX),
            _in_range("header.step", step, _U32_MAX),
            _in_range("header.bucket", bucket, _U16_MAX)
            | (_in_range("header.shard", shard, _U16_MAX) << 16),
            _in_range("header.src", src, _U16_MAX) | (_in_range("header.dst", dst, _U16_MAX) << 16),
        ),
        dtype=np.uint32,
    )


class ChunkStats(NamedTuple):
    """Per-chunk statistics of a shard, computed once for every destination it is sent to:
    L2 norms (float32; what :func:`pack` writes) and the payload's fast-tag sums (uint64)."""

    norms: np.ndarray
    sum_a: np.ndarray
    sum_b: np.ndarray


_NO_STATS = ChunkStats(
    np.empty(0, dtype=np.float32), np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64)
)


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
    mode, kw = _key_parts(key)
    if n_chunks == 0:
        return 0
    if wire == DType.F32:
        return int(
            _pk.pack_f32(
                bits, rows, lens, chunk_elems, tmpl, prio_a, prio_step, flags_a, flags_step,
                first, mode, kw, norms_a, maxabs_a,
            )
        )  # fmt: skip
    return int(
        _pk.pack_u16(
            bits, rows, lens, chunk_elems, tmpl, prio_a, prio_step, flags_a, flags_step,
            first, mode, kw, norms_a, maxabs_a, wire == DType.BF16,
        )
    )  # fmt: skip


def chunk_stats(src: np.ndarray, *, dtype: DType, chunk_elems: int, key: TagKey) -> ChunkStats:
    """The :class:`ChunkStats` of a shard (``src`` and ``chunk_elems`` as in :func:`pack`): one
    read of the shard, no copy. The tag sums are those of ``key``'s mode: headers written from
    these stats must use the same key."""
    wire, bits, chunk_elems, n_chunks = _chunked(src, dtype, chunk_elems)
    mode, kw = _key_parts(key)
    norms = np.empty(n_chunks, dtype=np.float32)
    sum_a = np.empty(n_chunks, dtype=np.uint64)
    sum_b = np.empty(n_chunks, dtype=np.uint64)
    if n_chunks:
        if wire == DType.F32:
            _pk.stats_f32(bits, chunk_elems, norms, sum_a, sum_b, mode, kw)
        else:
            _pk.stats_u16(bits, chunk_elems, norms, sum_a, sum_b, wire == DType.BF16, mode, kw)
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
    :func:`chunk_stats` under the same ``key``; ``prio`` and ``flags`` are per-chunk uint8
    arrays. Both tags split into header and payload sums, so only the precomputed sums are read.
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
    _shard("src", src, dtype)
    # Read-only, as write_headers passes them: numba compiles (and caches) one
    # specialisation per array writability, and the warm-up compiles this one.
    tmpl = header_template(words)
    tmpl.flags.writeable = False
    prio, flags = _readonly(prio), _readonly(flags)
    mode, kw = _key_parts(key)
    _pk.headers(
        hdr.view(np.uint64), counts, ITEMSIZE[dtype], tmpl, prio, flags, first_chunk,
        stats.norms, stats.sum_a, stats.sum_b, mode, kw,
    )  # fmt: skip
