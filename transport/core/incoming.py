"""Incoming transfers: the per-chunk state of one shard from its senders, and held early data.

The receiver's counterpart of :mod:`gradlane.transport.core.outgoing`: what one incoming shard
holds (arrays per sender and chunk: received, protected, abandoned, FIN, pass ends, ACK state)
and what a transfer not started here yet has had held for it. What arrives when, and what is
decided about it, is :mod:`gradlane.transport.core.receiver`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from gradlane.transport import kernels
from gradlane.transport.wire.header import Phase, TransferSpec, chunk_counts

__all__ = ["HeldRows", "InKey", "InTransfer"]


class InKey(NamedTuple):
    """Identity of an incoming transfer."""

    step: int
    bucket: int
    shard: int
    phase: int


@dataclass(slots=True)
class HeldRows:
    """Early DATA rows of one transfer: ``rows`` of ``arena`` with their datagram ``lengths``
    and ``paths`` (indexed by arena row), ``nbytes`` counted against ``early_buffer_bytes``.
    ``arena`` is the endpoint's own receive batch, held in place (the endpoint writes no new
    datagram into it until this is released), or a compact copy of the rows."""

    arena: np.ndarray
    lengths: np.ndarray
    paths: np.ndarray
    rows: np.ndarray
    nbytes: int


class InTransfer:
    """State of one incoming shard. ``target`` is the accumulator (reduce) or output (gather);
    ``stats``/``final``/``order`` as in
    :meth:`~gradlane.transport.core.receiver.ReceiverCore.expect`."""

    def __init__(
        self,
        key: InKey,
        spec: TransferSpec,
        senders: tuple[int, ...],
        target: np.ndarray,
        contrib: np.ndarray,
        received: np.ndarray,
        started: float,
        stats: kernels.ChunkStats | None = None,
        final: int = 0,
        scale: float = 1.0,
        order: kernels.SumOrder | None = None,
    ) -> None:
        self.key = key
        self.stats = stats  # filled by the reduce kernel as chunks complete (see expect)
        self.final = final
        self.scale = scale
        self.spec = spec
        self.senders = senders
        self.target = target
        self.contrib = contrib
        self.received = received
        self.started = started
        # A gather (or pull) waits for its senders' reduce phases: its soft deadline (NACKs,
        # lossy completion) runs from its first datagram; until then only the hard deadline
        # applies (see ``ReceiverCore.restart_clock``).
        self.running = key.phase not in (Phase.GATHER, Phase.PULL)
        self.counts = chunk_counts(spec.n_elems, spec.chunk_elems)
        # Gather: chunks whose placed data holds a NaN or an infinity (the place kernel's flag).
        self.nonfinite = np.zeros(spec.n_chunks if self.gather else 0, dtype=np.uint8)
        n_src = received.shape[0]
        n = spec.n_chunks
        rows = np.array([s - spec.src_lo for s in senders], dtype=np.int64)
        self.rows = rows
        self.expected = n * len(senders)
        self.elems = spec.n_elems * len(senders)  # elements expected over all senders
        self.got = int(received[rows].sum()) if n else 0
        self.protected = np.zeros((n_src, n), dtype=bool)
        self.manifest_known = np.zeros(n_src, dtype=bool)
        self.abandoned = np.zeros((n_src, n), dtype=bool)
        self.fin = np.zeros(n_src, dtype=bool)
        self.pass_end = np.full(n_src, np.inf)  # when each sender's PASS_END chunk came
        self.new_since_ack = np.zeros(n_src, dtype=np.int64)
        self.ack_due = np.full(n_src, np.inf)
        self.trigger = np.zeros(n_src, dtype=np.int64)
        self.trigger_at = np.zeros(n_src, dtype=np.float64)
        self.path = np.zeros(n_src, dtype=np.int64)
        self.nack_at = -np.inf
        self.nack_backoff = 1.0
        self.got_at_nack = -1
        self.check_at = np.inf
        self.bytes_received = 0
        self.last_data_at = started
        self.duplicates = 0
        self.rejected = 0
        self.done = False
        self.plan: kernels.ReceivePlan | None = None  # the receive kernels' checked arguments
        self.order = order  # a reduce's fixed order of senders (None: arrival order)
        self.sent_stopped = False  # gather: our reduce transfer to its owner was stopped

    @property
    def gather(self) -> bool:
        """True for the gather phase (place, do not add)."""
        return self.key.phase in (Phase.GATHER, Phase.PULL)

    def missing_elems(self) -> dict[int, int]:
        """Elements not received, per sender."""
        if self.got >= self.expected:  # every chunk of every sender came
            return dict.fromkeys(self.senders, 0)
        return {
            s: int(self.counts[self.received[s - self.spec.src_lo] == 0].sum())
            for s in self.senders
        }

    def protected_missing(self) -> int:
        """Protected chunks not received, over every sender."""
        if self.got >= self.expected:
            return 0
        return int(((self.received[self.rows] == 0) & self.protected[self.rows]).sum())
