"""Outgoing transfers: the per-chunk state of one shard toward one peer, and its packet arenas.

Theory of operation
-------------------
An *outgoing transfer* is one shard (step, bucket, shard, phase) for one peer. At start the shard
is classified (priority policy on per-chunk norms and the bucket's layer position); it is packed
into an arena of ready packets lazily, a block of chunks at a time, right before the block's
first chunk is sent: the first packet leaves without waiting for the whole shard to be copied,
packing overlaps the peer's work, and each block is still in cache when the kernel copies it
out. Retransmissions reuse the arena. The caller's buffer is therefore read until every block
is packed; :meth:`OutTransfer.pack_all` packs the rest at once when the buffer must be released
(a collective that completed or failed). Per-chunk state lives in numpy arrays (STYLE rule 3):

=========  ================================================================================
state      meaning
=========  ================================================================================
PENDING    never sent
INFLIGHT   sent, not acknowledged
LOST       declared lost (RACK on the same path and class, RTO, or a NACK) and queued to resend
ACKED      the receiver has it
ABANDONED  skipped on purpose (droppable and late) or a tolerated loss, within the budget
=========  ================================================================================

Chunks are sent in ``order`` (class, then chunk index) from a ``cursor``; retransmissions are
the LOST ones. What to send when, and the loss detection, are :mod:`transport.sender`'s.

Arenas come from an :class:`ArenaPool`: fresh memory costs a page fault per 4 KiB on first
touch, as much as packing itself for a small bucket, and training repeats its bucket sizes
every step.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np

from scheduling.loss import LossPolicy
from scheduling.priority import PriorityPolicy, send_order_key
from transport import kernels
from transport.config import TransportConfig
from transport.packet import HEADER_SIZE, ITEMSIZE, DType, Flags, Header, Kind, Phase, chunk_counts

__all__ = [
    "ABANDONED",
    "ACKED",
    "INFLIGHT",
    "LOST",
    "PENDING",
    "ArenaPool",
    "OutKey",
    "OutTransfer",
]

#: Lazy packing granularity: a block this large is packed when its first chunk is sent.
PACK_BLOCK_BYTES = 1 << 20
#: Most bytes of free packet arenas kept for reuse by one sender.
ARENA_POOL_BYTES = 256 << 20
#: References a free pooled arena has while it is examined: the pool, the loop's name and
#: ``sys.getrefcount``'s argument; any more is a live view (a datagram still being sent).
_FREE_REFS = 3

PENDING, INFLIGHT, LOST, ACKED, ABANDONED = 0, 1, 2, 3, 4


class ArenaPool:
    """Free packet arenas for reuse, up to ``ARENA_POOL_BYTES``.

    An arena is only handed out again once nothing references it: a datagram handed to a driver
    is a view into its arena (queued by an event loop, or sent zero-copy by ZeroMQ), and the view
    keeps a reference, so a buffer still being sent is never rewritten.
    """

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._bytes = 0

    def take(self, rows: int, row_bytes: int) -> np.ndarray:
        """An arena of at least ``rows`` rows of ``row_bytes``: a free one that fits, or new."""
        free = self._free
        for i in range(len(free)):
            a = free[i]
            if (
                rows <= a.shape[0] <= 2 * rows
                and a.shape[1] == row_bytes
                and sys.getrefcount(a) <= _FREE_REFS
            ):
                del free[i]
                self._bytes -= a.nbytes
                return a
        return np.empty((rows, row_bytes), dtype=np.uint8)

    def give(self, arena: np.ndarray) -> None:
        """Return an arena (it is reused only once no view of it is alive)."""
        if arena.nbytes > ARENA_POOL_BYTES // 4:
            return  # a rare giant: let it go
        self._free.append(arena)
        self._bytes += arena.nbytes
        while self._bytes > ARENA_POOL_BYTES:
            self._bytes -= self._free.pop(0).nbytes


class OutKey(NamedTuple):
    """Identity of an outgoing transfer."""

    step: int
    bucket: int
    shard: int
    phase: int
    dst: int


class OutTransfer:
    """State of one outgoing shard (arrays per chunk). Created by :meth:`SenderCore.start`.

    ``me`` is the sending rank; ``priority`` classifies the chunks; ``loss`` gives the budget of
    chunks the sender may give up on; ``arenas`` lends the packet arena (returned by the sender
    when the transfer retires).
    """

    def __init__(
        self,
        key: OutKey,
        seq: int,
        data: np.ndarray,
        dtype: int,
        layer_position: float,
        now: float,
        pinned: bool,
        *,
        me: int,
        config: TransportConfig,
        priority: PriorityPolicy,
        loss: LossPolicy,
        arenas: ArenaPool,
    ) -> None:
        cfg = config
        self.key = key
        self.seq = seq
        self.layer_position = float(layer_position)
        self.started = now
        self.hard_deadline = now + cfg.loss.hard_deadline_s
        gather = key.phase == Phase.GATHER
        self.chunk_elems = cfg.chunk_elems(dtype)
        self.n_elems = int(data.shape[0])
        self.counts = chunk_counts(self.n_elems, self.chunk_elems)
        n = self.n_chunks = int(self.counts.shape[0])
        norms, _ = kernels.chunk_norms(data, dtype=DType(dtype), chunk_elems=self.chunk_elems)
        classes = priority.classify(norms=norms, layer_position=layer_position, pinned=pinned)
        self.prio = np.ascontiguousarray(classes.prio, dtype=np.uint8)
        self.protected = np.asarray(classes.protected, dtype=bool)
        self.droppable = np.asarray(classes.droppable, dtype=bool) & ~self.protected
        flags = np.where(self.protected, np.uint8(Flags.PROTECTED), np.uint8(0)).astype(np.uint8)
        flags |= np.where(self.droppable, np.uint8(Flags.DROPPABLE), np.uint8(0)).astype(np.uint8)
        if n:
            flags[-1] |= np.uint8(Flags.LAST)
        self.arena = arenas.take(max(n, 1), cfg.slot_bytes)
        self.lengths = np.zeros(max(n, 1), dtype=np.int32)
        self.lengths[:n] = HEADER_SIZE + self.counts * ITEMSIZE[dtype]  # what pack will write
        self._header = Header(
            kind=Kind.DATA,
            job=cfg.job,
            step=key.step,
            bucket=key.bucket,
            shard=key.shard,
            src=me,
            dst=key.dst,
            phase=key.phase,
            dtype=dtype,
        )
        self._src: np.ndarray | None = data if n else None
        self._dtype = DType(dtype)
        self._tag_key = cfg.tag_key
        self._flags = flags
        self._block = max(1, PACK_BLOCK_BYTES // max(cfg.chunk_bytes, 1))
        self._packed = np.zeros(-(-n // self._block), dtype=bool)
        self.state = np.zeros(n, dtype=np.uint8)
        self.sent_at = np.zeros(n, dtype=np.float64)
        self.path = np.zeros(n, dtype=np.int16)
        self.tx = np.zeros(n, dtype=np.uint8)
        # Send order: by class, then chunk index; the layer position is per transfer (heap key).
        self.order = np.argsort(
            send_order_key(self.prio, self.layer_position, np.arange(n)), kind="stable"
        ).astype(np.int64)
        self.cursor = 0
        self.n_lost = 0
        self.n_inflight = 0
        bounded = cfg.loss.bound(gather) > 0
        self.budget_elems = 0
        if bounded:
            self.budget_elems = loss.budget_elems(gather=gather, expected_elems=self.n_elems)
        self.abandoned_elems = 0
        self.manifest_acked = not bounded
        self.manifest_sent_at = -np.inf
        self.fin_sent_at = -np.inf
        self.rto_backoff = 1.0
        self.done = False
        self.gather = gather

    # -- packing ---------------------------------------------------------------------------
    def ensure_packed(self, chunks: np.ndarray) -> None:
        """Pack the blocks holding ``chunks`` that are not packed yet."""
        blocks = chunks // self._block
        todo = blocks[~self._packed[blocks]]
        if todo.size:
            for b in np.unique(todo).tolist():
                self._pack_block(b)

    def pack_all(self) -> None:
        """Pack every block not packed yet; the source buffer is not read after this."""
        for b in np.flatnonzero(~self._packed).tolist():
            self._pack_block(b)

    def _pack_block(self, b: int) -> None:
        assert self._src is not None
        c0 = b * self._block
        c1 = min(c0 + self._block, self.n_chunks)
        ce = self.chunk_elems
        kernels.pack(
            self._src[c0 * ce : min(c1 * ce, self.n_elems)],
            self.arena[c0:c1],
            self.lengths[c0:c1],
            dtype=self._dtype,
            header=self._header,
            chunk_elems=ce,
            key=self._tag_key,
            prio=self.prio[c0:c1],
            flags=self._flags[c0:c1],
            first_chunk=c0,
        )
        self._packed[b] = True
        if self._packed.all():
            self._src = None  # everything is in the arena: drop the caller's buffer

    # -- queries ---------------------------------------------------------------------------
    def next_class(self) -> int | None:
        """Class of the next chunk this transfer would send, or None when it has nothing."""
        best: int | None = None
        if self.n_lost:
            best = int(self.prio[self.state == LOST].min())
        if self.cursor < self.n_chunks:
            nxt = int(self.prio[self.order[self.cursor]])
            best = nxt if best is None else min(best, nxt)
        return best

    def outstanding(self) -> bool:
        """True while some chunk is neither acknowledged nor abandoned."""
        return bool(np.any(self.state < ACKED))

    def advance_cursor(self) -> None:
        """Move the cursor past chunks that are no longer PENDING (sent or skipped)."""
        while self.cursor < self.n_chunks:
            window = self.state[self.order[self.cursor : self.cursor + 256]]
            pending = np.flatnonzero(window == PENDING)
            if pending.size:
                self.cursor += int(pending[0])
                return
            self.cursor += int(window.size)
