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

The checked wrappers live by who calls them: :mod:`.sending` (header words, chunk statistics,
DATA headers, packing), :mod:`.receiving` (validate and reduce or place a batch), :mod:`.acks`
(the sender's per-ACK pass) and :mod:`.buffers` (Hadamard transform, the daemon's local sum);
the compiled kernels are the private modules beside them. This package re-exports the API.

Each public function checks dtypes, shapes, contiguity and alignment and raises
``ValueError`` saying what to pass instead; the private kernels behind them trust their inputs.
The kernels are single-threaded and release the GIL (``nogil``), so an engine thread can run them
beside Python code. Remote bytes are never trusted: a receive kernel checks a datagram exactly like
:func:`gradlane.transport.wire.header.validate` — same
:class:`~gradlane.transport.wire.header.Reason`, same order — and writes nothing anywhere before
every check, the tag included, has passed; a bad datagram only bumps its counter.

Compilation flags come from one place, :class:`KernelConfig` (``GRADLANE_FASTMATH``), read once.
Each kernel has a plain-NumPy reference in ``tests/support/naive.py`` (the wire-precision codec's:
``tests/support/codec_ref.py``) that the tests hold it to.
"""

from __future__ import annotations

from gradlane.transport.kernels._common import CONFIG, KernelConfig, copy_bytes, memcpy, memzero
from gradlane.transport.kernels.acks import AckResult, SentChunks, apply_ack
from gradlane.transport.kernels.buffers import hadamard_forward, hadamard_inverse, local_sum
from gradlane.transport.kernels.receiving import (
    ReceivePlan,
    SumOrder,
    flush_order,
    place_into,
    prepare_receive,
    receive_batch,
    receive_rows,
    reduce_into,
    replan,
    session_checks,
    sum_order,
)
from gradlane.transport.kernels.sending import (
    ChunkStats,
    chunk_stats,
    fields_words,
    fill_headers,
    header_words,
    pack,
    write_headers,
)

__all__ = [
    "CONFIG",
    "AckResult",
    "ChunkStats",
    "KernelConfig",
    "ReceivePlan",
    "SentChunks",
    "SumOrder",
    "apply_ack",
    "chunk_stats",
    "copy_bytes",
    "fields_words",
    "fill_headers",
    "flush_order",
    "hadamard_forward",
    "hadamard_inverse",
    "header_words",
    "local_sum",
    "memcpy",
    "memzero",
    "pack",
    "place_into",
    "prepare_receive",
    "receive_batch",
    "receive_rows",
    "reduce_into",
    "replan",
    "session_checks",
    "sum_order",
    "write_headers",
]
