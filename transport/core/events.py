"""Events the sans-I/O cores emit, the datagrams they hand out, and the driver protocol.

Cores never call back into their driver: they queue small frozen events that the driver pulls
with ``next_event()`` (STYLE rule 6). Only the drivers (the data planes) turn events into
Futures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
from gradlane.transport.errors import GradlaneError

__all__ = [
    "AllReduceComplete",
    "AllReduceFailed",
    "CollectiveReport",
    "Datagram",
    "DatagramRun",
    "Event",
    "LossReport",
    "PeerTimedOut",
    "SansIOCore",
    "TransferComplete",
    "flat",
]


class Datagram(NamedTuple):
    """One packet to put on the wire: bytes, destination rank, path index toward it, IP TOS.

    A DATA packet comes in two parts, ``data`` (its header) and ``payload`` (a view of the
    sender's buffer), so it is never copied before the kernel's own copy: a socket driver sends
    them with one gathering ``sendmsg``; one that needs a single buffer uses :meth:`wire`.
    """

    data: bytes | memoryview
    peer: int
    path: int
    tos: int
    payload: memoryview | None = None

    def wire(self) -> bytes:
        """The whole packet as one ``bytes`` (a copy)."""
        if self.payload is None:
            return bytes(self.data)
        return b"".join((self.data, self.payload))


@dataclass(slots=True)
class DatagramRun:
    """DATA datagrams of one transfer, sent together, as arrays (the sender's hot-path form).

    Datagram ``i`` is header row ``chunks[i]`` of ``hdr`` (rows of ``header_bytes``) followed
    by ``payload[starts[i] : starts[i] + sizes[i]]``, for rank ``peer`` on path ``paths[i]``
    with IP TOS ``tos``. A socket driver hands the whole run to the kernel at once (Linux
    ``sendmmsg``: one system call and no Python per datagram); everything else iterates it,
    which yields the same datagrams as :class:`Datagram` tuples (views, no copies). The arrays
    and buffers are only read, and only until the driver returns.
    """

    hdr: memoryview
    header_bytes: int
    payload: memoryview
    chunks: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    peer: int
    paths: np.ndarray
    tos: int
    hdr_addr: int = -1
    """The address of ``hdr``'s memory when the sender knows it (-1: the driver finds it)."""
    payload_addr: int = -1
    """The address of ``payload``'s memory when the sender knows it (-1: the driver finds it)."""

    def __len__(self) -> int:
        return int(self.chunks.shape[0])

    def __iter__(self) -> Iterator[Datagram]:
        return iter(self.select(np.arange(len(self))))

    def select(self, idx: np.ndarray) -> list[Datagram]:
        """The datagrams at positions ``idx`` of the run (views of header rows and payload)."""
        hdr, pay, hb, peer, tos = self.hdr, self.payload, self.header_bytes, self.peer, self.tos
        return [
            Datagram(hdr[c * hb : (c + 1) * hb], peer, q, tos, pay[a : a + n])
            for c, a, n, q in zip(
                self.chunks[idx].tolist(),
                self.starts[idx].tolist(),
                self.sizes[idx].tolist(),
                self.paths[idx].tolist(),
                strict=True,
            )
        ]


def flat(out: Iterable[Datagram | DatagramRun]) -> Iterator[Datagram]:
    """Every datagram of a core's output, runs unrolled (for drivers that send one at a time)."""
    for item in out:
        if isinstance(item, DatagramRun):
            yield from item
        else:
            yield item


@dataclass(frozen=True)
class LossReport:
    """Exactly what one receiving transfer (one phase of one shard at one rank) got and lost.

    ``delivered`` maps each sender to the fraction of its expected elements that arrived;
    the per-class tuples are indexed by priority class and count chunks as *this rank's sender*
    saw them for the matching outgoing transfers (sent, dropped on purpose, retransmitted).
    """

    step: int
    bucket: int
    shard: int
    phase: int
    expected_elems: int
    missing_elems: int
    delivered: dict[int, float]
    duration: float
    degraded: bool
    bytes_received: int = 0
    duplicates: int = 0
    rejected: int = 0
    protected_missing: int = 0
    """Protected chunks missing at completion (0 unless ``degraded``)."""
    nonfinite_chunks: int = 0
    """Chunks of this shard's result holding a NaN or an infinity: as received (gather), or as
    summed here (reduce; there also a chunk whose values' squares overflow float32, beyond
    about 1.8e19). Reported, not acted on: the result is delivered as computed."""

    @property
    def delivered_fraction(self) -> float:
        """Delivered elements over expected elements, over all senders."""
        if self.expected_elems == 0:
            return 1.0
        return 1.0 - self.missing_elems / self.expected_elems


@dataclass(frozen=True)
class SenderReport:
    """What this rank's sender did for the transfers of one (step, bucket): chunks per priority
    class (sent, dropped on purpose, retransmitted) and bytes, in all and per path."""

    sent: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    retransmitted: tuple[int, ...] = ()
    bytes_sent: int = 0
    per_path_bytes: tuple[int, ...] = ()
    format_bytes: tuple[int, ...] = (0, 0, 0)
    """Payload bytes of the transfers started (each chunk once per destination) by wire
    format: uncompressed (the bucket's own type: float32 for a float32 bucket), bfloat16,
    E4M3."""
    lossy_elems: int = 0
    """Elements of those transfers sent in a lossy format (of :attr:`elems`)."""
    elems: int = 0
    err2: float = 0.0
    """The rounding's squared error, summed over this rank's shards (each counted once)."""
    norm2: float = 0.0
    """The squared values of those shards, summed: ``sqrt(err2 / norm2)`` is the relative
    error of what this rank sent."""

    @property
    def compressed_share(self) -> float:
        """Share of the elements sent in a lossy format (0 without compression)."""
        return self.lossy_elems / self.elems if self.elems else 0.0

    @property
    def rel_error(self) -> float:
        """Relative error of this rank's contribution as sent: ``sqrt(err2 / norm2)``."""
        return math.sqrt(self.err2 / self.norm2) if self.norm2 > 0 else 0.0


@dataclass(frozen=True)
class CollectiveReport:
    """Loss report of one all-reduce at one rank: both phases and this rank's sending side."""

    step: int
    bucket: int
    duration: float
    reduce: LossReport
    gather: tuple[LossReport, ...]
    sender: SenderReport = field(default_factory=SenderReport)
    reduce_s: float = 0.0
    """From the collective's start here to the start of this rank's gather phase (its reduce
    complete, by data or deadline): where the reduce phase ends and the gather begins."""
    precision_level: float = 0.0
    """The adaptive wire-precision level this collective started with (0: all float32; see
    :class:`~gradlane.scheduling.precision.AdaptiveController`)."""

    @property
    def degraded(self) -> bool:
        """True when any part completed with data missing."""
        return self.reduce.degraded or any(g.degraded for g in self.gather)

    @property
    def delivered_fraction(self) -> float:
        """Delivered elements over expected ones, over both phases at this rank."""
        exp = self.reduce.expected_elems + sum(g.expected_elems for g in self.gather)
        miss = self.reduce.missing_elems + sum(g.missing_elems for g in self.gather)
        return 1.0 if exp == 0 else 1.0 - miss / exp

    @property
    def nonfinite_chunks(self) -> int:
        """Chunks of the result holding a NaN or an infinity, over both phases at this rank
        (see :attr:`LossReport.nonfinite_chunks`): a diverging job, or, without a job secret,
        forged data."""
        return self.reduce.nonfinite_chunks + sum(g.nonfinite_chunks for g in self.gather)


@dataclass(frozen=True)
class TransferComplete:
    """A receiving transfer finished (lossless, within the bound, or degraded)."""

    report: LossReport


@dataclass(frozen=True)
class PeerTimedOut:
    """A receiving transfer hit its hard deadline with policy ``raise``."""

    error: GradlaneError
    step: int
    bucket: int


@dataclass(frozen=True)
class AllReduceComplete:
    """An all-reduce finished at this rank: ``result`` holds the reduced bucket."""

    step: int
    bucket: int
    result: np.ndarray
    report: CollectiveReport


@dataclass(frozen=True)
class AllReduceFailed:
    """An all-reduce failed at this rank; ``error`` says who and why."""

    step: int
    bucket: int
    error: GradlaneError


Event = TransferComplete | PeerTimedOut | AllReduceComplete | AllReduceFailed


class SansIOCore(Protocol):
    """The driver API of a sans-I/O protocol core (the aioquic shape): what a driver (the UDP or
    ZeroMQ data plane, the network simulator, an in-memory test wire) calls.

    The driver feeds datagrams in with the path they arrived on, takes datagrams out, re-arms
    one timer from ``get_timer()`` and pulls events. ``receive_datagram`` takes one datagram;
    drivers that read many per system call fill the core's receive arena instead (``rx_arena``,
    ``rx_free``, ``commit_datagrams`` of
    :class:`~gradlane.transport.core.endpoint.Endpoint`), of which it is the one-datagram form.
    """

    def receive_datagram(self, data: bytes | memoryview, path: int, now: float) -> None:
        """Feed one datagram that arrived on local path ``path`` at time ``now``."""

    def datagrams_to_send(self, now: float) -> list[Datagram | DatagramRun]:
        """Datagrams that may be sent now (pacing already applied)."""

    def get_timer(self) -> float | None:
        """Absolute time at which ``handle_timer`` must be called, or None."""

    def handle_timer(self, now: float) -> None:
        """Run time-driven work (retransmissions, ACKs, deadlines)."""

    def next_event(self) -> Event | None:
        """Pop the next event, or None."""
