"""Batch frames of the ZeroMQ data plane: many gradlane packets in one ZeroMQ message,
laid out so the receiver processes them where they arrived.

Theory of operation
-------------------
Over TCP, a ZeroMQ message costs the plane's loop a Python call, a ``zmq.Frame`` and a wake of
ZeroMQ's I/O thread whatever its size: with one message per 64 KB packet, much of the plane's
CPU goes to the interpreter, and an all-reduce takes noticeably longer than with batch frames
(``python -m gradlane.bench.perf.allreduce --zmq-batch-compare`` times both). So the sender
packs the DATA packets of a pass for one (peer, path), however many runs (transfers, priority
classes) they come in, into frames of up to :data:`BATCH_BYTES` (:func:`frame_bounds`, then
:func:`fill`: one compiled pass per run a frame spans). Control packets (ACK, NACK,
…) still travel one per message.

A frame's packets lie one per row of a fixed width (the frame's *stride*): the receiver views
the rows as a 2-D array (:func:`rows`) and hands them to the core as they are
(:meth:`~gradlane.transport.core.endpoint.Endpoint.receive_rows`): no copy into the core's
arena, no per-packet Python. Each packet is validated exactly as if it had come alone; the
frame adds framing, not trust.

Layout, little-endian: :data:`BATCH_MAGIC`; u32 record count (at least 1); u32 stride (a
multiple of 8, at least a header); u32 zero; one u32 packet length per record; zero padding
to a multiple of 8 bytes (:func:`meta_bytes`); then the rows: packet ``i`` and zeros up to
the stride. A lone packet starts with the gradlane magic (bytes ``4C 47``), a batch frame with
``47 4C``: the receiver tells them apart by the first bytes.

A frame whose layout does not add up (wrong magic or version, no records, a bad stride, a size
other than the layout's, a length past its row) is dropped whole and counted: its rows cannot
be told apart, so none is trusted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gradlane.transport.core.events import DatagramRun
from gradlane.transport.kernels import memcpy, memzero
from gradlane.transport.wire.header import HEADER_SIZE
from numba import njit

__all__ = [
    "BATCH_BYTES",
    "BATCH_MAGIC",
    "Segment",
    "fill",
    "frame_bounds",
    "is_batch",
    "meta_bytes",
    "rows",
    "warm_up",
]

#: The first four bytes of a batch frame ("GLB" and the layout's version).
BATCH_MAGIC = b"GLB\x02"
#: Bytes of the fixed part of a frame's head: magic, count, stride and a zero word.
FIXED_HEAD = 16
#: Largest frame :func:`frame_bounds` plans (a record larger than this goes in a frame of its
#: own). The receiver processes a frame as one batch, so larger frames mean fewer, larger
#: batches (1, 2, 4 and 8 MiB measured; 4 MiB was the quickest at 2 ranks x 25 MB).
BATCH_BYTES = 4 << 20

_MAGIC_U32 = int.from_bytes(BATCH_MAGIC, "little")
_BAD = (np.empty((0, 8), dtype=np.uint8), np.empty(0, dtype=np.int64))


@njit(cache=True)
def meta_bytes(count: int) -> int:
    """Bytes before the first row of a frame of ``count`` records (compiled code calls it
    too)."""
    return FIXED_HEAD + ((4 * count + 7) & ~7)


def is_batch(buf: memoryview | bytes) -> bool:
    """Whether a received message is a batch frame (else it is one packet, or a foreign
    frame that the core rejects as one)."""
    return len(buf) >= FIXED_HEAD and buf[:3] == BATCH_MAGIC[:3]


@njit(nogil=True, cache=True)
def _close(out: np.ndarray, nf: int, first: int, end: int, stride: int) -> int:
    # Frame nf holds records first..end in rows of stride bytes.
    out[nf, 0] = first
    out[nf, 1] = end
    out[nf, 2] = stride
    out[nf, 3] = meta_bytes(end - first) + (end - first) * stride
    return nf + 1


@njit(nogil=True, cache=True)
def _bounds(rec: np.ndarray, limit: int, out: np.ndarray) -> int:
    # Greedy: a frame takes records while its size, rows as wide as its widest, fits limit.
    nf = 0
    first = 0
    stride = 0
    for i in range(rec.shape[0]):
        wider = max(stride, rec[i])
        k = i - first + 1
        if k > 1 and meta_bytes(k) + k * wider > limit:
            nf = _close(out, nf, first, i, stride)
            first, wider = i, rec[i]
        stride = wider
    if rec.shape[0] > first:
        nf = _close(out, nf, first, rec.shape[0], stride)
    return nf


#: The datagrams at positions ``sel`` of ``run``: one stretch of a frame series' records.
Segment = tuple[DatagramRun, np.ndarray]


def frame_bounds(segments: Sequence[Segment], limit: int) -> list[tuple[int, int, int, int]]:
    """How the sender cuts the records of ``segments`` (runs for one (peer, path), in order:
    their records one after the other) into frames of at most ``limit`` bytes (a record that
    alone exceeds it gets a frame of its own): per frame, ``(first, end, stride, nbytes)``
    over record positions in that concatenation."""
    rec = np.concatenate(
        [(run.header_bytes + run.sizes[sel] + 7) & ~7 for run, sel in segments]
        or [np.empty(0, dtype=np.int64)]
    ).astype(np.int64, copy=False)
    out = np.empty((rec.shape[0], 4), dtype=np.int64)
    nf = _bounds(rec, limit, out)
    return [tuple(r) for r in out[:nf].tolist()]


@njit(nogil=True, cache=True)
def _fill_rows(
    out: np.ndarray,
    row0: int,
    hdr: np.ndarray,
    hb: int,
    pay: np.ndarray,
    chunks: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    idx: np.ndarray,
    stride: int,
) -> None:
    # Rows row0, row0 + 1, ... of a frame whose head (count words) is already written.
    head = out[:FIXED_HEAD].view(np.uint32)
    k = np.int64(head[1])
    meta = meta_bytes(k)
    lens = out[FIXED_HEAD : FIXED_HEAD + 4 * k].view(np.uint32)
    pos = meta + row0 * stride
    for j in range(idx.shape[0]):
        i = idx[j]
        n = sizes[i]
        lens[row0 + j] = hb + n
        memcpy(out, pos, hdr, chunks[i] * hb, hb)
        memcpy(out, pos + hb, pay, starts[i], n)
        # The row's tail: zeros, so no stale memory goes on the wire.
        memzero(out, pos + hb + n, stride - hb - n)
        pos += stride


def fill(segments: Sequence[Segment], first: int, end: int, stride: int, out: np.ndarray) -> None:
    """Write the batch frame of records ``first .. end`` of ``segments`` (positions as in
    :func:`frame_bounds`), in rows of ``stride`` bytes, into ``out`` (uint8, exactly the
    frame's size as :func:`frame_bounds` gives it): one compiled pass per segment it spans."""
    k = end - first
    need = meta_bytes(k) + k * stride
    if out.dtype != np.uint8 or out.ndim != 1 or out.shape[0] != need or k < 1:
        raise ValueError(f"a frame of {need} bytes written into {out.dtype}{out.shape}")
    if stride % 8:
        raise ValueError(f"stride {stride} is not a multiple of 8")
    head = out[: meta_bytes(k)].view(np.uint32)
    head[:4] = (_MAGIC_U32, k, stride, 0)
    head[-1] = 0  # the padding word after an odd count of lengths (else a length, rewritten)
    base = 0  # the segment's first record position
    for run, sel in segments:
        a, b = max(first - base, 0), min(end - base, sel.shape[0])
        base += sel.shape[0]
        if a >= b:
            continue
        idx = np.ascontiguousarray(sel[a:b], dtype=np.int64)
        hb = run.header_bytes
        if stride < hb + int(run.sizes[idx].max()):
            raise ValueError(f"stride {stride} does not hold every record of the frame")
        _fill_rows(
            out,
            base - sel.shape[0] + a - first,
            np.frombuffer(run.hdr, dtype=np.uint8),
            hb,
            np.frombuffer(run.payload, dtype=np.uint8),
            run.chunks,
            run.starts,
            run.sizes,
            idx,
            stride,
        )


def rows(frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The packets of a batch ``frame`` (1-D uint8) as ``(rows, lengths)``: a 2-D view of the
    frame's rows and the packet lengths (int64). A frame whose layout does not add up gives
    no rows (the caller counts it as bad)."""
    n = frame.shape[0]
    if n < FIXED_HEAD or frame.dtype != np.uint8 or frame.ndim != 1:
        return _BAD
    magic, count, stride, zero = frame[:FIXED_HEAD].view(np.uint32).tolist()
    meta = meta_bytes(count)
    if (
        magic != _MAGIC_U32
        or count == 0
        or zero != 0
        or stride % 8
        or stride < HEADER_SIZE
        or n != meta + count * stride
    ):
        return _BAD
    lengths = frame[FIXED_HEAD : FIXED_HEAD + 4 * count].view(np.uint32).astype(np.int64)
    if int(lengths.max()) > stride:
        return _BAD
    return frame[meta:].reshape(count, stride), lengths


def warm_up() -> None:
    """Compile (or load from numba's cache) the frame planner and filler with the argument
    types the ZeroMQ plane passes, so a collective's first run does not compile them. No
    socket is touched."""
    hb = HEADER_SIZE
    hdr = np.zeros(hb, dtype=np.uint8)
    pay = np.zeros(8, dtype=np.uint8)
    one = np.zeros(1, dtype=np.int64)
    run = DatagramRun(hdr.data, hb, pay.data, one, one, one + 8, 1, one, 0)
    seg = [(run, np.zeros(1, dtype=np.int64))]
    ((a, b, stride, total),) = frame_bounds(seg, BATCH_BYTES)
    fill(seg, a, b, stride, np.empty(total, dtype=np.uint8))
