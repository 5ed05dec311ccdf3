"""Batch frames of the ZeroMQ data plane: a run of gradlane packets in one ZeroMQ message.

Theory of operation
-------------------
Over TCP, a ZeroMQ message costs the plane's loop a Python call, a ``zmq.Frame`` and a wake of
ZeroMQ's I/O thread whatever its size: with one message per 64 KB packet, much of the plane's
CPU goes to the interpreter, and an all-reduce takes noticeably longer than with batch frames
(``python -m gradlane.bench.perf.allreduce --zmq-batch-compare`` times both). So the sender
packs each run of DATA packets for one (peer, path) into frames of up to :data:`BATCH_BYTES`
(:func:`frame_bounds`, :func:`fill`), and the receiver splits a frame back into packets, one
per row of the core's receive arena, in one compiled pass (:func:`split`). Each packet is then
validated exactly as if it had come alone; the frame adds framing, not trust. Control packets
(ACK, NACK, …) still travel one per message.

Layout, little-endian: :data:`BATCH_MAGIC`, a u32 record count, then per record a u64 packet
length, the packet, and zero padding to a multiple of 8 bytes (so every record starts on a
word: the split copies by words). A lone packet starts with the gradlane magic (bytes
``4C 47``), a batch frame with ``47 4C``: the receiver tells them apart by the first bytes.

A frame is malformed when a record (padding included) runs past its end or a length is below
the header size: the packets before the fault are kept (each is validated on its own) and the
rest of the frame is dropped. A frame whose record count disagrees with its records keeps them
all. Either is counted as a bad frame.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.core.events import DatagramRun
from gradlane.transport.kernels import copy_bytes
from gradlane.transport.wire.header import HEADER_SIZE
from numba import njit

__all__ = [
    "BATCH_BYTES",
    "BATCH_MAGIC",
    "FRAME_HEADER",
    "fill",
    "frame_bounds",
    "is_batch",
    "record_count",
    "split",
    "warm_up",
]

#: The first four bytes of a batch frame ("GLB" and the layout's version).
BATCH_MAGIC = b"GLB\x01"
#: Bytes before the first record: the magic and the record count.
FRAME_HEADER = 8
#: Bytes before each packet: its length.
RECORD_HEADER = 8
#: Largest frame :func:`frame_bounds` plans (a record larger than this goes in a frame of its own).
#: 1 MiB amortises the per-message cost ~16-fold at 64 KB packets and keeps a frame within
#: the caches the split copies through.
BATCH_BYTES = 1 << 20

#: What :func:`split` says of the frame after its call.
SPLIT_DONE = 0
SPLIT_ARENA_FULL = 1
SPLIT_MALFORMED = 2

_MAGIC_U32 = int.from_bytes(BATCH_MAGIC, "little")


def is_batch(buf: memoryview | bytes) -> bool:
    """Whether a received message is a batch frame (else it is one packet)."""
    return len(buf) >= FRAME_HEADER and buf[:4] == BATCH_MAGIC


def frame_bounds(run: DatagramRun, sel: np.ndarray, limit: int) -> list[tuple[int, int, int]]:
    """How the sender cuts the datagrams at positions ``sel`` of ``run`` into frames of at
    most ``limit`` bytes (a datagram that alone exceeds it gets a frame of its own): per frame,
    ``(first, end, nbytes)`` over positions in ``sel``."""
    rec = RECORD_HEADER + ((run.header_bytes + run.sizes[sel] + 7) & ~7)
    bounds: list[tuple[int, int, int]] = []
    start, total = 0, FRAME_HEADER
    for i, r in enumerate(rec.tolist()):
        if i > start and total + r > limit:
            bounds.append((start, i, total))
            start, total = i, FRAME_HEADER
        total += r
    if len(rec):
        bounds.append((start, len(rec), total))
    return bounds


def fill(run: DatagramRun, sel: np.ndarray, first: int, end: int, out: np.ndarray) -> None:
    """Write the batch frame of the datagrams at positions ``sel[first:end]`` of ``run`` into
    ``out`` (uint8, exactly the frame's size as :func:`frame_bounds` gives it).

    The copies are NumPy slice assignments (``memcpy``): a compiled byte loop with run-time
    bounds copied at a sixth of the speed, and a shard's payload need not be word-aligned for
    a word loop.
    """
    hb = run.header_bytes
    hdr = np.frombuffer(run.hdr, dtype=np.uint8)
    pay = np.frombuffer(run.payload, dtype=np.uint8)
    head = out[:FRAME_HEADER].view(np.uint32)
    head[0] = _MAGIC_U32
    head[1] = end - first
    pos = FRAME_HEADER
    idx = sel[first:end]
    for c, a, n in zip(
        run.chunks[idx].tolist(), run.starts[idx].tolist(), run.sizes[idx].tolist(), strict=True
    ):
        out[pos : pos + RECORD_HEADER].view(np.uint64)[0] = hb + n
        p = pos + RECORD_HEADER
        out[p : p + hb] = hdr[c * hb : (c + 1) * hb]
        out[p + hb : p + hb + n] = pay[a : a + n]
        pos = p + ((hb + n + 7) & ~7)
        out[p + hb + n : pos] = 0  # the padding: no stale memory on the wire
    if pos != out.shape[0]:
        raise ValueError(f"a frame of {pos} bytes written into {out.shape[0]}")


@njit(nogil=True, cache=True)
def _split(
    frame: np.ndarray, pos: int, arena: np.ndarray, first: int, lengths: np.ndarray
) -> tuple[int, int, int]:
    end = frame.shape[0]
    width = arena.shape[1]
    w = 0
    while pos < end:
        if first + w >= arena.shape[0] or w >= lengths.shape[0]:
            return w, pos, SPLIT_ARENA_FULL
        if pos + RECORD_HEADER > end:
            return w, pos, SPLIT_MALFORMED
        n = np.int64(0)
        for b in range(RECORD_HEADER):
            n |= np.int64(frame[pos + b]) << (8 * b)
        body = pos + RECORD_HEADER
        # The padded record must fit (n first: padding a huge n would overflow).
        if n < HEADER_SIZE or n > end - body or ((n + 7) & ~7) > end - body:
            return w, pos, SPLIT_MALFORMED
        # Longer than a row: the row keeps its start, the length says it did not fit (the
        # endpoint counts it as oversized), as for a truncated datagram off a socket.
        copy_bytes(arena[first + w], frame, body, min(n, width))
        lengths[w] = n if n <= width else width + 1
        w += 1
        pos = body + ((n + 7) & ~7)
    return w, pos, SPLIT_DONE


def split(
    frame: np.ndarray, pos: int, arena: np.ndarray, first: int, lengths: np.ndarray
) -> tuple[int, int, int]:
    """Copy the records of a batch ``frame`` (uint8) from byte ``pos`` into rows ``first,
    first + 1, ...`` of ``arena`` (uint8 rows), their packet lengths into ``lengths``.

    Returns ``(rows, next_pos, state)``: ``state`` is ``SPLIT_DONE`` (the frame is used up),
    ``SPLIT_ARENA_FULL`` (out of rows or ``lengths``: commit them, call again from
    ``next_pos``) or ``SPLIT_MALFORMED`` (a record at ``next_pos`` is broken; the rows before
    it are good). A packet longer than a row keeps its start and reads as ``width + 1``.
    """
    if frame.dtype != np.uint8 or frame.ndim != 1:
        raise ValueError(f"frame must be 1-D uint8, got {frame.dtype}{frame.shape}")
    if arena.dtype != np.uint8 or arena.ndim != 2 or arena.shape[1] % 8:
        raise ValueError(f"arena must be uint8 rows of a multiple of 8 bytes, got {arena.shape}")
    if lengths.dtype != np.int64 or lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D int64, got {lengths.dtype}{lengths.shape}")
    if not 0 <= first <= arena.shape[0] or pos < 0:
        raise ValueError(f"first {first} / pos {pos} outside the arena or frame")
    w, nxt, state = _split(frame, pos, arena, first, lengths)
    return int(w), int(nxt), int(state)


def record_count(frame: np.ndarray) -> int:
    """The record count a batch frame declares."""
    return int(frame[4:8].view(np.uint32)[0])


def warm_up() -> None:
    """Compile (or load from numba's cache) the split with the argument types the ZeroMQ plane
    passes (a received frame's writable bytes, the endpoint's arena and int64 lengths), so a
    collective's first batch frame does not compile it. No socket is touched."""
    frame = np.zeros(FRAME_HEADER + RECORD_HEADER + HEADER_SIZE, dtype=np.uint8)
    frame[:FRAME_HEADER].view(np.uint32)[:] = (_MAGIC_U32, 1)
    frame[FRAME_HEADER : FRAME_HEADER + RECORD_HEADER].view(np.uint64)[0] = HEADER_SIZE
    arena = np.zeros((1, HEADER_SIZE), dtype=np.uint8)
    split(frame, FRAME_HEADER, arena, 0, np.zeros(1, dtype=np.int64))
