"""When a sending pass may send toward a peer, and which of a collective's phases goes first.

Theory of operation
-------------------
:class:`~gradlane.transport.core.sender.SenderCore` sends in passes: each pass serves the
transfers in priority order until the tokens or the burst budget run out, then sets its timer
for the next. This module holds the two rules that pass follows besides the priority order.

**Tokens** (:class:`PaceGate`). Bytes leave through a pacer per (peer, path) and, with
``nic_rate_Bps``, one NIC pacer that every peer shares. A pass sends toward a peer only once
one of its paths has a whole batch of tokens: ``tx_quantum_packets`` datagrams (fewer, larger
batches at the same rate), or one datagram for class 0 and for a transfer with fewer chunks
than that left. A wake-up for an ACK or a read therefore sends nothing rather than a lone
datagram: a pass costs far more than a datagram does. The test that lets a batch go
(:meth:`PaceGate.ready`) is the wake time's (:meth:`PaceGate.wake_time`), so a timer never
fires without something to send. With ``tx_quantum_min_packets`` the quantum follows loss
(:class:`~gradlane.scheduling.pacing.BurstControl`, :meth:`PaceGate.adapt` at each pass) and
the pacers' depths scale with it, so a queue that drops the tail of long bursts gets short ones.

**Phase order** (:class:`PhaseOrder`). A peer completes its reduce, and only then sends its
gathered shard to everyone, when every rank's reduce data for it has come; our gather data it
needs only at the end. So a collective's gather (pull) data waits while its reduce (push) data
still has chunks to send, whatever the chunks' classes: to the same peer, or to any peer when
a NIC cap makes them all share one rate. Under a NIC cap the same holds across a step's
collectives for every chunk but class 0: a step's reduce data goes before its gather data. A
peer completes a bucket's reduce only when the last of it has crossed the network; gathers of
the buckets already complete, held back meanwhile, fill the links while the last reduce data is
under way, where sending them first would leave every rank with nothing to send then (its reduce
data out, its own shards not yet complete). Class 0 (protected, pinned) gather chunks still go
first: the front layers they carry are needed first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from gradlane.scheduling.pacing import BurstControl, Pacer
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.outgoing import OutKey, OutTransfer
from gradlane.transport.wire.header import Phase

__all__ = ["PaceGate", "PhaseOrder", "nic_pacer"]

#: The phase whose data a second phase's waits behind.
_FIRST_PHASE = {int(Phase.GATHER): int(Phase.REDUCE), int(Phase.PULL): int(Phase.PUSH)}
_FIRST = frozenset(_FIRST_PHASE.values())


def nic_pacer(config: TransportConfig) -> Pacer | None:
    """The pacer of the rank's NIC cap (``nic_rate_Bps``), or None without one."""
    if config.nic_rate_Bps <= 0:
        return None
    return Pacer(
        replace(
            config.pacing,
            controller="fixed",
            initial_rate_Bps=config.nic_rate_Bps,
            max_rate_Bps=max(config.pacing.max_rate_Bps, config.nic_rate_Bps),
            burst_bytes=max(config.pacing.burst_bytes, 4 * config.slot_bytes),
        )
    )


class PaceGate:
    """The token rules of a sending pass over the sender's pacers (see the module doc).

    ``pacers`` maps (peer, path) to its pacer, ``nic`` is the shared NIC pacer (or None), and
    ``usable(peer)`` lists the paths toward ``peer`` that may carry data now.
    """

    def __init__(
        self,
        config: TransportConfig,
        pacers: dict[tuple[int, int], Pacer],
        nic: Pacer | None,
        usable: Callable[[int], Sequence[int]],
    ) -> None:
        self._slot = config.slot_bytes
        self._quantum_packets = config.tx_quantum_packets
        self._pacers = pacers
        self._nic = nic
        self._usable = usable
        # With tx_quantum_min_packets, the quantum and the pacers' depths follow loss (see
        # adapt); the full-quantum depths are where they scale from.
        self._burst: BurstControl | None = None
        if config.tx_quantum_min_packets:
            self._burst = BurstControl(
                config.tx_quantum_packets,
                config.tx_quantum_min_packets,
                hold_s=config.min_rto_s,
                grow_s=config.tx_quantum_grow_s,
                loss_thresh=config.tx_quantum_loss_thresh,
            )
        self._depths = {key: p.depth for key, p in pacers.items()}
        self._nic_depth = nic.depth if nic is not None else 0

    def on_sent(self, now: float, n: int) -> None:
        """``n`` datagrams left (what the loss rate of :meth:`on_loss` is a share of)."""
        if self._burst is not None:
            self._burst.on_sent(now, n)

    def on_loss(self, now: float, n: int = 1) -> None:
        """``n`` datagrams were found lost: a shorter burst from the next pass when the loss
        rate says the bursts are too long (adaptive quantum only)."""
        if self._burst is not None:
            self._burst.on_loss(now, n)

    @property
    def burst_cuts(self) -> int:
        """Times the adaptive quantum was halved (0 with a fixed quantum)."""
        return self._burst.cuts if self._burst is not None else 0

    def adapt(self, now: float) -> None:
        """Set the quantum, and the pacers' depths in proportion, to the burst loss allows at
        ``now`` (at the start of a pass; nothing to do with a fixed quantum)."""
        burst = self._burst
        if burst is None:
            return
        q = burst.packets(now)
        if q == self._quantum_packets:
            return
        self._quantum_packets = q
        full = burst.max_packets
        # Never deeper than configured, never below one datagram; a quantum deeper than a
        # bucket waits for a full bucket (the NIC's in the sender, the paths' in ready()).
        for key, p in self._pacers.items():
            p.set_depth(max(self._slot, self._depths[key] * q // full))
        if self._nic is not None:
            self._nic.set_depth(max(self._slot, self._nic_depth * q // full))

    def quantum(self, urgent: bool) -> int:
        """Tokens a paced send waits for: a whole quantum, or one datagram while class 0 waits.
        Protected chunks must not sit in the sender for a quantum's worth of tokens (at a
        per-peer share of a 200 Mbit/s link, 64 jumbo datagrams take 70 ms to accrue): they
        leave as soon as one datagram may, and the switches' priority queues hold them."""
        return self._slot if urgent else self._slot * self._quantum_packets

    def batch_need(self, t: OutTransfer, cls: int) -> int:
        """Tokens toward ``t``'s peer that make a send of class ``cls`` worth a pass: a quantum,
        or one datagram for class 0 and when ``t`` has fewer chunks than a quantum left."""
        left = t.n_chunks - t.cursor + t.n_lost
        return self.quantum(cls == 0 or left < self._quantum_packets)

    def allowance(self, peer: int, now: float) -> int:
        """Bytes the usable paths toward ``peer`` may send at ``now``."""
        return sum(self._pacers[(peer, q)].allowance(now) for q in self._usable(peer))

    def ready(self, peer: int, need: int, now: float) -> bool:
        """Whether a path toward ``peer`` has ``need`` bytes of tokens (capped at its bucket's
        depth): exactly when :meth:`wake_time` would say now, so a wait never spins."""
        return any(
            self._pacers[(peer, q)].next_send_time(now, need) <= now for q in self._usable(peer)
        )

    def wake_time(self, now: float, budget: int, needs: dict[int, int]) -> float:
        """When sending can resume: now if only the burst budget stopped the pass, else when
        the NIC has a quantum and some peer's path has the tokens its next batch waits for
        (``needs``: peer -> bytes, :meth:`batch_need`)."""
        if budget <= 0:
            return now
        urgent = any(n <= self._slot for n in needs.values())
        nic = self._nic
        t_nic = nic.next_send_time(now, self.quantum(urgent)) if nic is not None else now
        t_peer = min(
            (
                self._pacers[(p, q)].next_send_time(now, need)
                for p, need in needs.items()
                for q in self._usable(p)
            ),
            default=now,
        )
        return max(t_nic, t_peer, now)


class PhaseOrder:
    """The collectives whose reduce (push) data has chunks to send, during one pass.

    ``shared``: a NIC cap makes every peer's traffic compete, so a gather waits for the
    collective's reduce data to any peer; otherwise only to its own peer.
    """

    def __init__(self, shared: bool) -> None:
        self._shared = shared
        self._pending: Counter[tuple[int, ...]] = Counter()

    def _group(self, key: OutKey) -> tuple[int, ...]:
        if self._shared:
            return (key.step, key.bucket)
        return (key.step, key.bucket, key.dst)

    def add(self, key: OutKey) -> None:
        """``key``'s transfer has chunks to send (a no-op unless it is a first phase)."""
        if key.phase in _FIRST:
            self._pending[self._group(key)] += 1

    def remove(self, key: OutKey) -> None:
        """``key``'s transfer has sent all it had (a no-op unless it is a first phase)."""
        if key.phase in _FIRST:
            self._pending[self._group(key)] -= 1

    def rank(self, key: OutKey, cls: int) -> int:
        """The place of ``key``'s next chunks (class ``cls``) before class and layer: 1 for a
        second phase's below class 0 under a NIC cap (after every first phase's data of its
        step), else 0."""
        return int(self._shared and cls > 0 and key.phase in _FIRST_PHASE)

    def holds_back(self, key: OutKey) -> bool:
        """Whether ``key`` is a second phase whose collective still has first-phase data."""
        return key.phase in _FIRST_PHASE and self._pending[self._group(key)] > 0
