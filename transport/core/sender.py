"""Sans-I/O sender core: sends shards in priority order, retransmits what is missing.

Theory of operation
-------------------
The per-chunk state of each outgoing transfer and its packet headers are
:mod:`gradlane.transport.core.outgoing`'s; this module decides what goes out when. Sending order is
global: a heap over transfers keyed by (step, phase rank, class of the next chunk, layer position,
bucket start order, share already sent, creation order), so an older step's data goes first (a peer
cannot use a newer step's before it finished the older one), then a front-layer bucket preempts a
back-layer one and protected chunks of any bucket go first (the policy's ``send_position`` places a
transfer within its class: ``flat`` keeps start order; under a NIC cap, within one bucket the least
advanced transfer goes first, part of a quantum at a time, so its shards reach their owners at one
pace); retransmissions of a class go before new chunks of that class, and nothing takes a peer's
tokens while data ahead of it to that peer waits for them. Within one collective the reduce data
goes before the gather data (under a NIC cap, within one step, but for class 0), and a pass sends
toward a peer only whole batches of tokens: :mod:`gradlane.transport.core.send_pass`'s rules. Bytes
toward a peer are paced per path and spread over paths by
:class:`gradlane.scheduling.paths.PathSet`; the per-peer path state the sender keeps on top (RTOs,
probes, control paths) is :mod:`gradlane.transport.core.peer_paths`'s.

Loss detection: RACK (a chunk sent well before the newest acknowledged one on the same path
and priority class is lost), a retransmission timeout per path, and the receiver's NACKs. A
timeout resends at once only what a later chunk overtook in its lane; for the rest it first sends
one probe per path and lets the ACKs tell a receiver that reads late from a loss
(``_on_timeout``). Evidence never crosses lanes: with chunks sprayed over paths of unequal
queues, a later chunk arriving first over a shorter queue says nothing of an earlier one.
With a loss bound, the sender tells the receiver its protected chunks (MANIFEST, repeated until
an ACK carries the PROTECTED flag) and, when it has nothing left to send but abandoned chunks, a
FIN with their bitmap so the receiver can complete at once instead of waiting for a deadline.
A STOP from the receiver, all chunks acknowledged, or the hard deadline ends the transfer.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from gradlane.scheduling.loss import LossPolicy
from gradlane.scheduling.pacing import Pacer
from gradlane.scheduling.precision import PrecisionPolicy
from gradlane.scheduling.priority import MAX_CLASSES, PriorityPolicy
from gradlane.transport import kernels
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import Datagram, DatagramRun, SenderReport
from gradlane.transport.core.outgoing import (
    ABANDONED,
    INFLIGHT,
    PENDING,
    OutKey,
    OutTransfer,
    SparePayloads,
)
from gradlane.transport.core.peer_paths import PeerPaths
from gradlane.transport.core.send_pass import PaceGate, PhaseOrder, nic_pacer
from gradlane.transport.core.sender_loss import LossHandling
from gradlane.transport.kernels._ack import note_lanes, note_sent
from gradlane.transport.kernels._pick import after_sent, fit_chunks, pick_chunks
from gradlane.transport.kernels.encoding import Encoded
from gradlane.transport.wire.header import HEADER_SIZE, DType, Kind

__all__ = ["OutKey", "OutTransfer", "SenderCore"]

log = logging.getLogger(__name__)

#: A wire format's slot in the report's bytes per format (float32, bfloat16, E4M3).
_FORMAT_SLOT = np.zeros(256, dtype=np.int64)
_FORMAT_SLOT[[DType.F32, DType.BF16, DType.E4M3]] = [0, 1, 2]


@dataclass
class _ClassStats:
    sent: np.ndarray
    dropped: np.ndarray
    retransmitted: np.ndarray
    path_bytes: np.ndarray
    bytes_sent: int = 0
    first_seq: int = 0
    """The start order of the bucket's first transfer: its transfers' place among equals."""
    format_bytes: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))
    """Payload bytes of the chunks started, each once, by wire format (float32, bfloat16,
    E4M3)."""
    lossy_elems: int = 0
    elems: int = 0
    err2: float = 0.0
    norm2: float = 0.0
    """The started chunks' squared rounding error and squared values, summed."""


#: A transfer's place in a sending pass's heap: step, phase rank, class, layer position, bucket
#: start order, share sent (under a NIC cap), start order, then the key itself.
_Entry = tuple[int, int, int, float, int, float, int, OutKey]


def _grid_floor(t: float, step: float, at: float) -> float:
    """The last point ``t + k * step`` (k >= 0) at or before ``at`` (``t`` itself when ``at``
    comes sooner than ``t + step``), summed step by step as ticks in a row sum it; far off at
    once."""
    if at - t > 64 * step:
        t += (np.floor((at - t) / step) - 1.0) * step
    while t + step <= at:
        t += step
    return float(t)


class SenderCore(LossHandling):
    """All outgoing transfers of one rank; produces DATA and the sender's control packets.

    ``encode`` builds a control packet (the endpoint owns headers and tags). Time is a parameter
    everywhere; nothing here reads a clock or touches a socket.
    """

    def __init__(
        self,
        me: int,
        world: int,
        config: TransportConfig,
        priority: PriorityPolicy,
        loss: LossPolicy,
        rng: np.random.Generator,
        encode: Callable[..., bytes],
        make_pacer: Callable[[], Pacer],
    ) -> None:
        self.me = me
        self.world = world
        self.config = config
        self.priority = priority
        self.loss = loss
        self.key = config.tag_key
        self.encode = encode
        self.transfers: dict[OutKey, OutTransfer] = {}
        self._seq = 0
        self._n_paths = config.n_paths
        self.net = PeerPaths(me, world, config, rng)
        self.paths = self.net.sets  # per peer: its PathSet
        self.pacers = {(p, q): make_pacer() for p in self.paths for q in range(config.n_paths)}
        n_classes = config.priority.n_classes
        self._tos = [config.priority.tos(c) for c in range(n_classes)]
        self.stats: dict[tuple[int, int], _ClassStats] = {}
        self._control: list[Datagram | DatagramRun] = []
        # Probe copies due (transfer, chunk, path, TOS): built when sent, from the transfer as
        # it is then, so a transfer stopped or detached meanwhile never sends stale bytes.
        self._probes: list[tuple[OutKey, int, int, int]] = []
        self._spares = SparePayloads()  # payload buffers of detached transfers, for reuse
        self._now = 0.0
        self._sendable: set[OutKey] = set()
        self._tick_at = np.inf
        self._tick_last = np.inf  # the grid's anchor: the last tick (or a first start)
        self._pace_at = np.inf
        self.nic = nic_pacer(config)
        self._gate = PaceGate(config, self.pacers, self.nic, self.net.usable)

    # -- API used by the endpoint ------------------------------------------------------------
    def loss_bound(self, gather: bool) -> float:
        """The loss bound of a phase (0 = reliable)."""
        return self.config.loss.bound(gather)

    def start(
        self,
        key: OutKey,
        data: np.ndarray,
        dtype: int,
        layer_position: float,
        now: float,
        pinned: bool = False,
        stats: kernels.ChunkStats | None = None,
        *,
        precision: PrecisionPolicy | None = None,
        residual: np.ndarray | None = None,
        encoded: Encoded | None = None,
        decoded: np.ndarray | None = None,
        count_error: bool = True,
    ) -> OutTransfer:
        """Begin sending ``data`` (one shard, wire dtype ``dtype``) to ``key.dst``.

        ``data`` is read (not copied) until the transfer ends or :meth:`detach`; ``stats`` are
        its :func:`kernels.chunk_stats` when the caller sends the same shard to several peers.
        ``precision``, ``residual``, ``encoded`` and ``decoded``: the lossy wire formats (see
        :class:`OutTransfer`); the step's report counts the payload bytes per format of
        every transfer started, and the rounding error and energy of its shard unless
        ``count_error`` is False (a shard sent to several peers counts once).
        """
        if key in self.transfers:
            raise ValueError(f"transfer {key} already in flight")
        self._seq += 1
        t = OutTransfer(
            key,
            self._seq,
            data,
            dtype,
            layer_position,
            now,
            pinned,
            me=self.me,
            config=self.config,
            priority=self.priority,
            loss=self.loss,
            stats=stats,
            precision=precision,
            residual=residual,
            encoded=encoded,
            decoded=decoded,
        )
        self.transfers[key] = t
        if t.n_chunks:
            # The shard's energy only where it can be rounded: the float32 path pays nothing.
            self._note_formats(t, count_error and precision is not None and precision.lossy)
        t.group = self._stats(key.step, key.bucket, self._seq).first_seq
        if t.n_chunks == 0:
            self._retire(t)
            return t
        if not t.manifest_acked:
            self._queue_manifest(t, now)
        # Probes due go now: a collective shorter than tick_s never ticks (DOWN paths wait).
        self._probe(now, {key.dst})
        self._sendable.add(key)
        if len(self.transfers) == 1:  # the only one: the tick grid starts here
            self._tick_last, self._tick_at = now, now + self.config.tick_s
        else:
            self._wake(now)
        return t

    def report(self, step: int, bucket: int) -> SenderReport:
        """What was sent for (step, bucket) so far, per class, and in which wire formats."""
        s = self._stats(step, bucket)
        return SenderReport(
            sent=tuple(int(x) for x in s.sent),
            dropped=tuple(int(x) for x in s.dropped),
            retransmitted=tuple(int(x) for x in s.retransmitted),
            bytes_sent=s.bytes_sent,
            per_path_bytes=tuple(int(x) for x in s.path_bytes),
            format_bytes=tuple(int(x) for x in s.format_bytes),
            lossy_elems=s.lossy_elems,
            elems=s.elems,
            err2=s.err2,
            norm2=s.norm2,
        )

    def _note_formats(self, t: OutTransfer, count_error: bool) -> None:
        """Count a started transfer's payload bytes per format and its lossy elements, and its
        shard's rounding error and energy (``count_error``), for the step's report."""
        s = self._stats(t.key.step, t.key.bucket)
        s.elems += t.n_elems
        if count_error:
            s.norm2 += float(np.square(t.norms, dtype=np.float64).sum())
        enc = t.encoded
        if enc is None:  # every chunk in the shard's own type
            s.format_bytes[0] += t.n_elems * t.chunk_bytes // t.chunk_elems  # × itemsize
            return
        pay = enc.lengths.astype(np.int64) - HEADER_SIZE
        s.format_bytes += np.bincount(_FORMAT_SLOT[enc.formats], weights=pay, minlength=3).astype(
            np.int64
        )
        s.lossy_elems += int(t.counts[enc.formats != 0].sum())
        if count_error:
            s.err2 += float(enc.err2.sum())

    def detach(self, step: int, bucket: int) -> None:
        """Stop reading the source buffers of (step, bucket)'s outgoing transfers: the
        collective is over and its buffers go back to the caller, while peers may still need
        retransmissions (the payloads still owed are copied)."""
        for t in self.transfers.values():
            if t.key.step == step and t.key.bucket == bucket:
                t.release_source(self._spares)

    def owes(self, step: int, bucket: int) -> bool:
        """True while an outgoing transfer of (step, bucket) is not over (some chunk is neither
        acknowledged nor settled by the receiver's STOP)."""
        return any(k.step == step and k.bucket == bucket for k in self.transfers)

    def forget_stats(self, step: int, bucket: int) -> None:
        """Drop the per-(step, bucket) counters once reported."""
        self.stats.pop((step, bucket), None)

    # -- control input ------------------------------------------------------------------------
    def on_ack(
        self,
        key: OutKey,
        base: int,
        bits: np.ndarray,
        trigger: int,
        manifest: bool,
        now: float,
        ack_delay: float = 0.0,
    ) -> None:
        """Apply an ACK bitmap covering chunks ``base .. base+len(bits)``.

        ``ack_delay`` is how long the receiver held the ACK after the trigger chunk arrived; it
        is subtracted from that chunk's RTT sample (as QUIC does) so ACK batching does not look
        like queueing to the delay-based congestion response.
        """
        span = self._bitmap_span(key, base, bits)
        if span is None:
            return
        t, _ = span
        self._wake(now)
        if t.held:  # the receiver started: its ACKs come now, the timeouts run from here
            t.held, t.rto_since = False, now
        if manifest:
            t.manifest_acked = True
        # One compiled pass (gradlane.transport.kernels._ack) finds the newly acknowledged chunks
        # (bit set, state INFLIGHT, LOST or ABANDONED), marks them ACKED and gathers what follows,
        # RACK's losses included: on each path, chunks sent well before the newest acknowledged one
        # are lost; per priority class too, since classes are separate queues (our per-TOS
        # sockets, the network's priority queues) that legitimately overtake one another.
        r = kernels.apply_ack(
            kernels.SentChunks(t.state, t.tx, t.sent_at, t.path, t.prio, t.counts, t.lengths),
            bits,
            base=base,
            trigger=trigger,
            now=now,
            n_paths=self._n_paths,
            n_classes=len(self._tos),
            reorder_window_s=self.config.reorder_window_s,
        )
        if not r.idx.size:
            return
        self._note_lanes(t, r.idx, now)
        t.n_lost -= r.n_lost
        t.n_inflight -= r.n_inflight
        t.abandoned_elems -= r.abandoned_elems
        t.rto_backoff = 1.0
        peer = key.dst
        # Every first transmission acknowledged now gives its path an RTT sample (Karn: never a
        # retransmission); it includes up to ack_delay_s, which only makes the RTO safer. The
        # congestion controller gets the clean sample of the chunk that triggered the ACK.
        if r.trigger_first:
            clean = max(now - t.sent_at[trigger] - min(ack_delay, self.config.ack_delay_s), 1e-7)
        else:
            clean = None
        # Only chunks still in flight leave the path's outstanding bytes (``counted``): a LOST
        # or ABANDONED one was already taken out when it was declared lost or released.
        self.paths[peer].on_acked(r.paths, r.sizes, now, r.rtt, r.counted)
        if clean is not None:
            self.net.rtt_sample(clean)
        trig_path = int(t.path[trigger]) if clean is not None else -1
        for q in r.path_hit.nonzero()[0].tolist():
            self.pacers[(peer, q)].controller.on_ack(
                now=now, acked_bytes=int(r.path_bytes[q]), rtt=clean if q == trig_path else None
            )
        if r.lost.size:
            self._declare_lost(t, r.lost, now)
        if t.probe_at < np.inf:
            lost = t.probe_answered(r.idx)
            if lost.size:
                self._declare_lost(t, lost, now)
        if not t.outstanding() and t.abandoned_elems == 0:
            self._retire(t)
        else:
            self._maybe_fin(t, now)

    def on_held(self, key: OutKey) -> None:
        """The receiver holds our data for ``key``, a transfer it has not started yet: no
        retransmission timeout until it acknowledges (see ``Flags.HELD``). Whatever it then
        lacks it NACKs (its pass-end check or deadline), and RACK finds the rest."""
        t = self.transfers.get(key)
        if t is not None and not t.done:
            t.held = True

    @property
    def burst_cuts(self) -> int:
        """Times loss halved the send quantum (``tx_quantum_min_packets``; 0 when fixed)."""
        return self._gate.burst_cuts

    def n_chunks(self, key: OutKey) -> int | None:
        """Chunks of the live outgoing transfer ``key`` (None: finished, or never ours): what
        an ACK or NACK about it may cover, checked before its bitmap is unpacked."""
        t = self.transfers.get(key)
        return None if t is None or t.done else t.n_chunks

    def _bitmap_span(
        self, key: OutKey, base: int, bits: np.ndarray
    ) -> tuple[OutTransfer, int] | None:
        """The live transfer a bitmap (ACK/NACK from chunk ``base``) is about, and the end of
        the chunks it covers; None for a finished transfer or a bitmap past its end."""
        t = self.transfers.get(key)
        if t is None or t.done:
            return None
        end = min(base + bits.shape[0], t.n_chunks)
        return (t, end) if base < end else None

    def on_stop(self, key: OutKey) -> None:
        """The receiver completed: stop sending and forget the transfer."""
        t = self.transfers.get(key)
        if t is not None:
            self._retire(t)

    def on_probe_ack(self, peer: int, path: int, seq: int, now: float) -> None:
        """A probe came back: the path works again (see :class:`PeerPaths`)."""
        if self.net.on_probe_ack(peer, path, seq, now):
            self._wake(now)

    # -- output ------------------------------------------------------------------------------
    def datagrams_to_send(self, now: float) -> list[Datagram | DatagramRun]:
        """Control packets first, then data in global priority order within pacing limits."""
        self._now = now
        out: list[Datagram | DatagramRun] = list(self._control)
        self._control = []
        for key, p, q, tos in self._probes:
            t = self.transfers.get(key)
            if t is not None and not t.done:
                out.append(t.run(np.array([p]), np.array([q]), tos))
        self._probes = []
        self._pace_at = np.inf
        if not self._sendable:
            return out
        # Oldest step first, then (under a NIC cap) the step's reduce data before its gather
        # data below class 0 (send_pass's phase order), class, layer position, bucket start
        # order, the share of the transfer already sent and start order. A peer finishes step s
        # before it can use anything of s + 1 (it holds that early), so a newer step's data sent
        # ahead of an older step's unsent tail (a rank that completed s starts s + 1 while its
        # own gather to a peer is still going out) only delays that peer by as much. Under a NIC
        # cap (tokens shared by every peer), within one bucket the least advanced transfer goes
        # first, part of a quantum at a time: the owners' reduce phases progress together and
        # end together, where start order would feed the lowest-numbered owner first and leave
        # the last one waiting (its gather, the step's tail, then starts last).
        heap: list[_Entry] = []
        nic, gate = self.nic, self._gate
        order = PhaseOrder(shared=nic is not None)

        def entry(key: OutKey, t: OutTransfer, cls: int) -> _Entry:
            fair = t.progress if nic is not None else 0.0
            return (key.step, order.rank(key, cls), cls, t.send_position, t.group, fair, t.seq, key)

        for key in list(self._sendable):
            t = self.transfers.get(key)
            cls = t.next_class() if t is not None else None
            if t is None or cls is None:
                self._sendable.discard(key)
            else:
                heap.append(entry(key, t, cls))
                order.add(key)
        heapq.heapify(heap)
        gate.adapt(now)  # the burst loss allows (a fixed quantum unless tx_quantum_min_packets)
        local_left = nic.allowance(now) if nic is not None else 1 << 62
        quantum = gate.quantum(bool(heap) and heap[0][2] == 0)
        if nic is not None:
            # Tokens never exceed the bucket's depth: a quantum deeper than the NIC's bucket
            # waits for a full bucket (else the wait would come true at once, forever).
            quantum = min(quantum, nic.depth)
        if local_left < quantum and nic is not None:
            # Wait for a whole quantum of tokens: same rate, fewer and larger batches.
            self._pace_at = nic.next_send_time(now, quantum)
            return out
        allowance: dict[int, int] = {}
        blocked: dict[int, int] = {}  # peer -> the tokens its next batch waits for
        budget = self.config.burst_packets * self._n_paths
        while heap and budget > 0 and local_left > 0:
            step, late, cls, pos, group, _, _, key = heapq.heappop(heap)
            if order.holds_back(key):
                continue  # its turn comes once this collective's reduce data is out
            t = self.transfers[key]
            peer = key.dst
            if peer in blocked:
                # Data ahead of this to the same peer waits for tokens: nothing behind it takes
                # them first (a newer step's class 0 would otherwise pass an older step's tail).
                continue
            if peer not in allowance:
                allowance[peer] = gate.allowance(peer, now)
            avail = min(allowance[peer], local_left)
            need = gate.batch_need(t, cls)
            if avail <= 0 or not gate.ready(peer, need, now):
                blocked[peer] = min(blocked.get(peer, need), need)
                continue
            if nic is not None and heap and heap[0][:5] == (step, late, cls, pos, group):
                # Equals wait for the NIC's tokens (the other owners' shards of this bucket): an
                # even part of a quantum each, then the least advanced again, so every owner's
                # downlink gets its share in every pass, and a full bucket of tokens after an
                # idle spell does not go to one owner whole. (Without a NIC cap each peer has
                # pacers of its own: nothing to share.)
                equals = 1 + sum(1 for e in heap if e[:5] == (step, late, cls, pos, group))
                avail = min(avail, max(gate.quantum(False) // equals, gate.quantum(True)))
            # The classes after ``cls`` may go in the same batch while no other transfer of
            # this step to this peer has chunks of a class that must precede them: only
            # transfers sharing a peer's pacers and paths compete (and all of them when a NIC
            # cap is shared); a newer step's never precede.
            upto = cls
            if nic is None:
                upto = (
                    min(
                        (c for s_, _, c, _, _, _, _, k in heap if k.dst == peer and s_ == step),
                        default=MAX_CLASSES,
                    )
                    - 1
                )
            sent, consumed, nbytes = self._send_batch(t, cls, now, avail, budget, out, upto)
            gate.on_sent(now, sent)
            budget -= sent
            allowance[peer] -= nbytes
            local_left -= nbytes
            if nic is not None and nbytes:
                nic.consume(nbytes, now)
            nxt = t.next_class()
            if nxt is None:
                self._sendable.discard(key)
                order.remove(key)
            elif consumed:
                heapq.heappush(heap, entry(key, t, nxt))
        if heap or blocked:
            for _, _, c, _, _, _, _, k in heap:  # left over when the budget or the NIC ran out
                need = gate.batch_need(self.transfers[k], c)
                blocked[k.dst] = min(blocked.get(k.dst, need), need)
            self._pace_at = gate.wake_time(now, budget, blocked)
        return out

    def get_timer(self) -> float | None:
        """The housekeeping tick while transfers run, or the pacing release if earlier."""
        best = self._tick_at if self.transfers else np.inf
        if self._sendable:
            best = min(best, self._pace_at if self._pace_at < np.inf else self._now)
        return None if best == np.inf else float(best)

    def handle_timer(self, now: float) -> None:
        """Housekeeping: retransmission timeouts, path health, resends, deadlines, probes.

        It runs on a grid of ``tick_s`` from the last tick: at the next point while anything
        happens (ACKs, NACKs, sends: :meth:`_wake`), else at the first point when something
        can be due, so a sender waiting on a busy peer does not tick a thousand times a second
        for nothing. The ticks it skips would find nothing, and those it runs fall on the same
        grid, so the protocol acts at the same times as if it ticked every ``tick_s``."""
        self._now = now
        if now < self._tick_at:
            return
        # The grid's latest point, not ``now``: a driver may call late (input held for
        # coalescing comes first), and re-anchoring there would shift every later tick.
        self._tick_last = self._grid_at_or_before(now)
        peers = {t.key.dst for t in self.transfers.values()}
        for peer in peers:
            self.paths[peer].tick(now)
        rtos = {peer: self.net.rtos(peer) for peer in peers}  # once per peer, not per transfer
        for t in list(self.transfers.values()):
            if now >= t.hard_deadline:
                log.debug("sender gives up %s at the hard deadline", t.key)
                self._retire(t)
                continue
            reordered = t.rack_lost(len(self._tos), self.config.reorder_window_s, now)
            if reordered.size:
                self._declare_lost(t, reordered, now)
            if t.nack_wait is not None:
                self._resend_asked(t, now)
            late = t.timed_out(rtos[t.key.dst], now)
            if late.size:
                self._on_timeout(t, late, now)
            rto = self._rto(t, rtos[t.key.dst])
            if not t.manifest_acked and now >= t.manifest_sent_at + rto:
                self._queue_manifest(t, now)
            self._maybe_fin(t, now, rto)
        self._probe(now, peers)
        due = np.inf
        for peer in {t.key.dst for t in self.transfers.values()}:  # what the tick left
            due = min(due, self.paths[peer].next_due())
        for t in self.transfers.values():
            p_rtos = rtos[t.key.dst]
            due = min(due, t.next_due(p_rtos, self._rto(t, p_rtos), len(self._tos),
                                      self.config.reorder_window_s))  # fmt: skip
        self._tick_at = self._on_grid(due) if self.transfers else np.inf

    def _wake(self, now: float) -> None:
        """Something changed (an ACK, NACK, probe answer, send or new transfer): tick at the
        grid's next point, which then works out when it is next needed."""
        self._tick_at = min(self._tick_at, self._on_grid(now))

    def _grid_at_or_before(self, now: float) -> float:
        """The grid's last point at or before ``now``: the scheduled tick (a tick runs at or
        after it) or a later point of its grid."""
        t = self._tick_at
        if not np.isfinite(t) or not np.isfinite(now):
            return now
        return _grid_floor(t, self.config.tick_s, now)

    def _on_grid(self, at: float) -> float:
        """The first tick of the grid after the last one, ``_tick_last + k * tick_s``
        (k >= 1), at or after ``at``; summed step by step as ticks in a row sum it (so a
        run of skipped ticks changes no time), far off at once."""
        step = self.config.tick_s
        t = self._tick_last + step
        if not t < at:  # the next point (and inf, NaN)
            return t
        if at == np.inf:
            return at
        t = _grid_floor(t, step, at)
        return t if t == at else t + step

    # -- internals ---------------------------------------------------------------------------
    def _stats(self, step: int, bucket: int, seq: int = 0) -> _ClassStats:
        s = self.stats.get((step, bucket))
        if s is None:
            n = self.config.priority.n_classes
            z = np.zeros(n, dtype=np.int64)
            paths = np.zeros(self.config.n_paths, dtype=np.int64)
            s = _ClassStats(z.copy(), z.copy(), z.copy(), paths, first_seq=seq)
            self.stats[(step, bucket)] = s
        return s

    def _note_lanes(self, t: OutTransfer, acked: np.ndarray, now: float) -> None:
        """Newly acknowledged chunks advance their lanes' newest delivered sequence (one
        compiled pass; the numpy formulation is the reference in tests/support/naive.py)."""
        note_lanes(t.path, t.prio, t.tx_seq, acked, len(self._tos), t.lane_seq, t.lane_at, now)

    def _rto(self, t: OutTransfer, path_rtos: np.ndarray | None = None) -> float:
        """The transfer's RTO for control repeats (manifest, FIN): the largest of its usable
        paths', backed off; ``path_rtos``: :meth:`PeerPaths.rtos` of its peer, if at hand."""
        rtos = self.net.rtos(t.key.dst) if path_rtos is None else path_rtos
        return float(max(rtos[q] for q in self.net.usable(t.key.dst))) * t.rto_backoff

    def _send_batch(
        self,
        t: OutTransfer,
        cls: int,
        now: float,
        avail: int,
        budget: int,
        out: list[Datagram | DatagramRun],
        upto: int,
    ) -> tuple[int, int, int]:
        """Send up to ``budget`` chunks of class ``cls`` from ``t`` within the peer's allowance,
        and new chunks of the classes after it up to ``upto`` (one run per class: each class
        has its own TOS).

        Returns (chunks sent, chunks consumed including skipped ones, bytes sent).
        """
        peer = t.key.dst
        # The class's retransmissions, then new chunks within cls .. upto, cut to the tokens:
        # one compiled pass (the NumPy formulation is tests/support/naive.py's pick_chunks).
        picked = np.empty(budget, dtype=np.int64)
        n_retx, n_fresh = pick_chunks(
            t.state, t.prio, t.order, t.cursor, t.n_lost, cls, max(cls, upto), budget, picked
        )
        chunks = picked[: n_retx + n_fresh]
        skipped = 0
        if n_fresh and t.budget_elems > 0 and self.config.skip_late_droppable:
            fresh = chunks[n_retx:]
            kept = self._skip_late_droppable(t, fresh, now)
            skipped = int(fresh.size - kept.size)
            if skipped:
                chunks = np.concatenate((chunks[:n_retx], kept))
        if chunks.size == 0:
            t.advance_cursor()
            self._maybe_fin(t, now)
            return 0, skipped, 0
        fit = fit_chunks(t.lengths, chunks, int(avail))
        chunks = chunks[:fit]
        n_retx = min(n_retx, fit)
        starts = np.empty(fit, dtype=np.int64)
        sizes = np.empty(fit, dtype=np.int64)  # payload bytes (the datagram's less the header)
        lengths = t.lengths[chunks]  # datagram bytes
        if self.config.multipath:
            paths = self.paths[peer].assign(now=now, sizes=lengths, protected=t.protected[chunks])
        else:
            paths = np.full(fit, self.net.usable(peer)[0], dtype=np.int64)
        paths = np.asarray(paths, dtype=np.int64)
        st = self._stats(t.key.step, t.key.bucket)
        per_path = np.zeros(self._n_paths, dtype=np.int64)
        bounds = np.empty(fit + 1, dtype=np.int64)
        # State, send times, paths, transmission counts, per-class and per-path counters, and
        # the class stretches, in one compiled pass (not a dozen NumPy operations per batch).
        total, n_runs = note_sent(
            t.state, t.sent_at, t.path, t.tx, t.prio, t.lengths, chunks, paths, n_retx, now,
            st.sent, st.retransmitted, per_path, bounds,
        )  # fmt: skip
        t.n_inflight += fit
        t.n_lost -= n_retx
        self._wake(now)
        # Sequence numbers, the run's payload offsets and sizes, and the cursor past what left.
        t.cursor = after_sent(
            t.state, t.order, t.cursor, t.tx_seq, t.next_tx_seq, chunks, t.lengths,
            t.chunk_bytes, HEADER_SIZE, starts, sizes,
        )  # fmt: skip
        t.next_tx_seq += fit
        self.paths[peer].on_sent(paths, lengths, now)
        for q, nb in enumerate(per_path.tolist()):
            if nb:
                self.pacers[(peer, q)].consume(nb, now)
        st.bytes_sent += total
        st.path_bytes += per_path[: st.path_bytes.shape[0]]
        # One datagram per chunk (its header row and a view of its payload, never copied), as
        # one run per class: a socket driver sends it with one system call per path and no
        # Python per datagram. New chunks come in class order, so each class is one stretch.
        for a, b in zip(bounds[:n_runs].tolist(), bounds[1 : n_runs + 1].tolist(), strict=True):
            tos = self._tos[int(t.prio[chunks[a]])]
            out.append(t.run(chunks[a:b], paths[a:b], tos, starts[a:b], sizes[a:b]))
        return fit, fit + skipped, total

    def _skip_late_droppable(self, t: OutTransfer, fresh: np.ndarray, now: float) -> np.ndarray:
        """Skip droppable chunks that cannot make the soft deadline, within the budget.

        Returns the chunks of ``fresh`` still to send; skipped ones become ABANDONED.
        """
        if not (self.config.skip_late_droppable and t.budget_elems > 0 and fresh.size):
            return fresh
        drop = t.droppable[fresh]
        if not drop.any():
            return fresh
        # The receiver's deadline is for everything it expects: this shard from each sender.
        senders = 1 if t.gather else self.world - 1
        deadline = t.started + self.loss.soft_deadline(t.gather, t.n_elems * senders)
        rate = sum(
            self.pacers[(t.key.dst, q)].controller.rate_Bps for q in self.net.usable(t.key.dst)
        )
        remaining = float(t.lengths[t.order[t.cursor :]].sum())
        if now + remaining / max(rate, 1.0) <= deadline:
            return fresh
        cand = fresh[drop]
        room = t.budget_elems - t.abandoned_elems
        skip = cand[np.cumsum(t.counts[cand]) <= room]
        if not skip.size:
            return fresh
        t.state[skip] = ABANDONED
        t.abandoned_elems += int(t.counts[skip].sum())
        n_cls = len(self._tos)
        self._stats(t.key.step, t.key.bucket).dropped += np.bincount(t.prio[skip], minlength=n_cls)[
            :n_cls
        ]
        return fresh[t.state[fresh] == PENDING]

    def _queue_manifest(self, t: OutTransfer, now: float) -> None:
        key = t.key
        payload = np.packbits(t.protected, bitorder="little").tobytes()
        data = self.encode(Kind.MANIFEST, key, chunk=0, count=t.n_chunks, payload=payload)
        self._control.append(
            Datagram(data, key.dst, self.net.control_path(key.dst, self._now), self._tos[0])
        )
        t.manifest_sent_at = now

    def _release(self, t: OutTransfer, idx: np.ndarray) -> None:
        """Chunks in flight that the sender stops tracking leave their paths' outstanding bytes."""
        self.paths[t.key.dst].on_released(t.path[idx].astype(np.int64), t.lengths[idx])

    def _retire(self, t: OutTransfer) -> None:
        """The transfer is over (acknowledged, stopped, or past its deadline): free it."""
        if t.n_inflight:
            self.paths[t.key.dst].on_released_where(t.state, INFLIGHT, t.path, t.lengths)
        t.done = True
        t.return_buffer(self._spares)
        self.transfers.pop(t.key, None)
        self._sendable.discard(t.key)

    def _maybe_fin(self, t: OutTransfer, now: float, rto: float | None = None) -> None:
        """When only abandoned chunks remain unacknowledged (:meth:`OutTransfer.owes_fin`),
        tell the receiver (FIN), and repeat it every RTO (``rto``, else :meth:`_rto`) until
        its STOP."""
        if not t.owes_fin() or now < t.fin_sent_at + (self._rto(t) if rto is None else rto):
            return
        payload = np.packbits(t.state == ABANDONED, bitorder="little").tobytes()
        data = self.encode(Kind.FIN, t.key, chunk=0, count=t.n_chunks, payload=payload)
        self._control.append(
            Datagram(data, t.key.dst, self.net.control_path(t.key.dst, self._now), self._tos[0])
        )
        t.fin_sent_at = now

    def _probe(self, now: float, peers: set[int]) -> None:
        """Probe suspect paths toward peers we are sending to (with the newest step in flight:
        receivers take only steps in their window)."""
        step = max((k.step for k in self.transfers), default=0)
        for peer, q, seq in self.net.probes_due(now, peers):
            data = self.encode(Kind.PROBE, OutKey(step, 0, 0, 0, peer), aux=seq)
            self._control.append(Datagram(data, peer, q, self._tos[0]))
