"""Sans-I/O receiver core: validates and reduces DATA, acknowledges, decides completion.

Theory of operation
-------------------
An *incoming transfer* is one shard (step, bucket, shard, phase) that several senders (reduce
phase) or one sender (gather phase) deliver to this rank. Its owner (the collective) allocates
the target: a float32 accumulator plus contributor counts for the reduce phase, the result's
slice for the gather phase. Batches of DATA packets go through one numba kernel call that
validates every field and the tag before writing (``reduce_into`` / ``place_into``).

Acknowledgements are full per-sender bitmaps, sent after ``ack_every`` new packets or
``ack_delay_s``; each names the chunk that triggered it so the sender can sample the RTT.

Completion, checked after each batch and on timers, in this order:

1. every chunk of every sender arrived → COMPLETE (lossless);
2. every chunk arrived or was given up by its sender (FIN), each sender's given-up part within
   the phase's loss bound and none of it protected → COMPLETE at once, no deadline wait;
3. otherwise the loss policy decides from the chunk state and the deadlines (soft: complete if
   within the bound with every protected chunk; hard: degrade or fail). While it says CONTINUE
   after the soft deadline, the chunks it still needs are NACKed to their senders — once the
   driver has read its sockets empty since the deadline (or the last NACK): a loaded host that
   reads late would otherwise ask again for data waiting in its own sockets.

A sender's first pass ends with a chunk flagged ``PASS_END``. Once it came, the driver has
read its sockets empty since (:meth:`ReceiverCore.note_drained`; a driver that never says so
delivers everything at once), and ``reorder_window_s`` has passed, what that sender still
lacks is lost, not on its way: a gap the bound allows (none of it protected, the manifest
known) settles the sender as its FIN would; any other gap is NACKed at once. (The drain
matters: the pass end may be read from one path's socket while the other's still holds
hundreds of that sender's packets — a large burst on a loaded host — and NACKing those would
resend whole shards that are merely unread.) Without this a tail loss would wait for the
sender's loss detection and FIN, or for the soft deadline, and a reliable phase's for the NACK
deadline. A NACK sent once a drain followed the sender's newest
arrival names that chunk, so the sender can tell a chunk sent before it (lost) from one sent
after (maybe still on its way).

A finished transfer is remembered for ``linger_s``, and never less than the hard deadline (its
sender may ask until then), so late DATA is answered with STOP instead of being reduced twice.
DATA for a transfer this rank has not started yet (a faster peer) is held, within
``early_buffer_bytes``, and replayed when it starts; so are its MANIFEST and FIN, within a
bounded share of the same budget (:data:`CONTROL_SHARE`). What does not fit is dropped and
counted; what is held expires after ``linger_s``, by the receiver's timer, collective or not.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import numpy as np
from gradlane.scheduling.loss import Decision, LossPolicy
from gradlane.transport import kernels
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import (
    Datagram,
    Event,
    LossReport,
    PeerTimedOut,
    TransferComplete,
)
from gradlane.transport.core.incoming import HeldRows, InKey, InTransfer
from gradlane.transport.errors import PeerTimeout
from gradlane.transport.kernels.batch import note_arrivals, pass_end_gaps
from gradlane.transport.wire.header import (
    HEADER_SIZE,
    N_REASONS,
    Flags,
    Kind,
    Phase,
    Reason,
    SessionSpec,
    TransferSpec,
    header_fields,
)

__all__ = ["CONTROL_OVERHEAD", "CONTROL_SHARE", "REJECTS_KEPT", "ReceiverCore"]

log = logging.getLogger(__name__)

#: Rejected packets whose headers :attr:`ReceiverCore.rejected_recent` keeps (the newest).
REJECTS_KEPT = 16
_OK = int(Reason.OK)
_DUPLICATE = int(Reason.DUPLICATE)

#: Held early MANIFEST/FIN take at most ``early_buffer_bytes // CONTROL_SHARE``: a sender's
#: own are a few small bitmaps per transfer; a flood of forged ones leaves the rest to data.
CONTROL_SHARE = 8
#: Bytes charged per held control packet besides its length (its Python objects, and a new
#: transfer's key and dict entries): header-only floods are bounded too.
CONTROL_OVERHEAD = 512
_OK = int(Reason.OK)


class ReceiverCore:
    """All incoming transfers of one rank.

    ``encode(kind, key, dst, chunk=, count=, payload=, aux=, flags=)`` builds control packets;
    ``emit(event)`` queues an event for the endpoint's driver.
    """

    def __init__(
        self,
        me: int,
        world: int,
        config: TransportConfig,
        loss: LossPolicy,
        encode: Callable[..., bytes],
        emit: Callable[[Event], None],
        control_tos: int,
    ) -> None:
        self.me = me
        self.world = world
        self.config = config
        self.loss = loss
        self.encode = encode
        self.emit = emit
        self.tos = control_tos
        self.transfers: dict[InKey, InTransfer] = {}
        self.tombstones: dict[InKey, float] = {}
        # A finished transfer is remembered while its sender may still ask about it: a sender
        # whose STOP was lost backs off its probes and FINs (up to 64 RTOs) and gives up only at
        # its hard deadline. Forgotten sooner, a late probe would be held as early data and
        # answered HELD, not STOP, and the sender would wait out its hard deadline.
        self.linger_s = max(config.linger_s, config.loss.hard_deadline_s)
        # Held early DATA per transfer: rows of the endpoint's arena (pinned) or copies of them.
        self.early: dict[InKey, list[HeldRows]] = {}
        # Held early MANIFEST/FIN: early_bytes + early_control_bytes <= early_buffer_bytes.
        self.early_control: dict[InKey, list[tuple[bytes, int]]] = {}
        self.early_bytes = 0
        self.early_control_bytes = 0
        self._early_at: dict[InKey, float] = {}  # when each transfer's first early data came
        self.early_expired = 0
        self.early_copied = 0  # early DATA rows copied out of the arena (not held in place)
        self.early_control_dropped = 0
        self.counters = np.zeros(N_REASONS, dtype=np.int64)
        # The newest rejected packets (duplicates aside), what each claimed to be: the counters
        # say how many, these say which (a forgery, or bytes changed under their tag).
        self.rejected_recent: deque[dict[str, object]] = deque(maxlen=REJECTS_KEPT)
        self.late = 0
        self.early_dropped = 0
        self._out: list[Datagram] = []
        self._stop_sent: dict[tuple[InKey, int], float] = {}
        self._held_sent: dict[tuple[InKey, int], float] = {}  # HELD ACKs of early data
        self._ack_pending: dict[InKey, InTransfer] = {}
        self._soft_seen = (loss.soft_deadline(False), loss.soft_deadline(True))
        # When the driver last read its sockets empty; inf: it never queues (see note_drained).
        self.drained_at = np.inf
        self._pass_ended: dict[InKey, InTransfer] = {}  # a pass ended, gaps maybe left
        self._drain_wait: dict[InKey, InTransfer] = {}  # NACK deadline passed, no drain since

    # -- set-up ----------------------------------------------------------------------------
    def expect(
        self,
        key: InKey,
        spec: TransferSpec,
        senders: tuple[int, ...],
        target: np.ndarray,
        contrib: np.ndarray,
        received: np.ndarray,
        now: float,
        session: SessionSpec,
        *,
        stats: kernels.ChunkStats | None = None,
        final: int = 0,
        scale: float = 1.0,
        order: kernels.SumOrder | None = None,
    ) -> InTransfer:
        """Start receiving ``key`` into ``target``; replays any packets that came early.

        ``stats`` (an F32 reduce): the reduce kernel multiplies every chunk whose ``contrib``
        reaches ``final`` by ``scale`` and writes its statistics there, from the finished sum
        (see :func:`kernels.prepare_receive`). ``order`` (a reduce): contributions are added in
        that order of senders (:func:`kernels.sum_order`); what is still staged at completion
        is added then.
        """
        t = InTransfer(
            key, spec, senders, target, contrib, received, now, stats, final, scale, order
        )
        self.transfers[key] = t
        self._refresh_check(t)
        self._early_at.pop(key, None)
        for s in senders:
            self._held_sent.pop((key, s), None)
        for h in self.early.pop(key, []):
            self.early_bytes -= h.nbytes
            if not t.done:  # the kernel checks every held packet (tag included) as it lands
                self.on_data(t, h.arena, h.lengths, h.rows, h.paths, now, session)
            else:  # complete from an earlier held batch: the rest came for a finished transfer
                self.late += int(h.rows.shape[0])
        for data, path in self.early_control.pop(key, []):
            self.early_control_bytes -= len(data) + CONTROL_OVERHEAD
            why = self.on_control(data, path, now, t_hint=t)
            if why != _OK:  # counted as accepted when held; its transfer now says otherwise
                self.counters[why] += 1
        if t.got >= t.expected or t.fin.any():
            # Complete already (an empty shard, or early data), or a sender gave chunks up.
            # Anything else is decided when data comes or at the transfer's first check time
            # (_refresh_check): the loss policy has nothing to decide on before then.
            self._check(t, now)
        return t

    # -- input --------------------------------------------------------------------------------
    def on_data(
        self,
        t: InTransfer,
        arena: np.ndarray,
        lengths: np.ndarray,
        rows: np.ndarray,
        paths: np.ndarray,
        now: float,
        session: SessionSpec,
    ) -> None:
        """Reduce (or place) a batch of DATA rows of ``arena`` belonging to ``t``."""
        if not t.running:  # the senders have begun: the deadlines count from now
            self._start_clock(t, now)
        verdicts = np.zeros(rows.shape[0], dtype=np.uint8)
        plan = t.plan
        if plan is not None and plan.session is not session:  # the step window moved on
            plan = t.plan = kernels.replan(plan, session)
        elif plan is None:  # checked once per transfer
            plan = t.plan = kernels.prepare_receive(
                session, t.spec, t.target, t.contrib, t.received, self.counters,
                place=t.gather, stats=t.stats, final=t.final, scale=t.scale,
                nonfinite=t.nonfinite if t.gather else None, order=t.order,
            )  # fmt: skip
        accepted = kernels.receive_batch(plan, arena, lengths, rows, verdicts)  # our own arrays
        # Rare: anything but OK (duplicates are left out there).
        if accepted < rows.shape[0] and verdicts.any():
            self.note_rejected(arena, lengths, rows, verdicts, paths, now)
        # The ACK state follows the judged rows (see
        # gradlane.transport.kernels.batch.note_arrivals).
        n_ok, n_dup, nbytes, n_end = note_arrivals(
            arena,
            lengths,
            rows,
            verdicts,
            paths,
            t.spec.src_lo,
            now,
            now + self.config.ack_delay_s,
            t.new_since_ack,
            t.trigger,
            t.trigger_at,
            t.path,
            t.ack_due,
            t.pass_end,
        )
        t.duplicates += n_dup
        t.rejected += rows.shape[0] - n_ok - n_dup
        if n_ok:
            if t.nack_at == -np.inf:  # data asked for again says nothing of the normal pace
                t.last_data_at = now
            t.got += n_ok
            t.bytes_received += nbytes
        if n_ok or n_dup:
            self._ack_pending[t.key] = t
        if t.got >= t.expected:
            self._complete(t, now, degraded=False)
            return
        for row in (t.new_since_ack >= self.config.ack_every).nonzero()[0].tolist():
            self._ack(t, row, now)
        if n_end:  # a sender's first pass ended: look at its gaps (see note_drained)
            self._pass_ended[t.key] = t
            self._refresh_check(t)
        if t.fin.any():
            self._check(t, now)

    def note_rejected(
        self,
        arena: np.ndarray,
        lengths: np.ndarray,
        rows: np.ndarray,
        why: np.ndarray,
        paths: np.ndarray,
        now: float,
    ) -> None:
        """Keep what the rejected ``rows`` of ``arena`` (reason ``why`` each, duplicates left
        out) claimed to be in :attr:`rejected_recent`: their header fields as they arrived
        (unauthenticated, so possibly forged), the path and the time. Rows that fail the
        framing checks (truncated, magic, version, kind, another job) are only counted."""
        bad = np.flatnonzero((why != _OK) & (why != _DUPLICATE))
        for i in bad[-REJECTS_KEPT:].tolist():
            r = int(rows[i])
            n = int(lengths[r])
            entry: dict[str, object] = {
                "reason": Reason(int(why[i])).name.lower(),
                "path": int(paths[r]),
                "length": n,
                "at": now,
            }
            if n >= HEADER_SIZE:
                h = header_fields(arena[r])
                entry.update(
                    kind=int(h.kind), phase=int(h.phase), dtype=int(h.dtype), step=int(h.step),
                    bucket=int(h.bucket), shard=int(h.shard), src=int(h.src),
                    chunk=int(h.chunk), count=int(h.count), flags=int(h.flags),
                )  # fmt: skip
            self.rejected_recent.append(entry)

    def on_control(
        self,
        data: bytes | memoryview,
        path: int,
        now: float,
        t_hint: InTransfer | None = None,
        header: dict | None = None,
    ) -> int:
        """MANIFEST or FIN from a sender (validated by the endpoint): the :class:`Reason` to
        count it under (``OK``: taken, held early, dropped for room, or of a finished transfer).
        Its bitmap is unpacked only once it fits its transfer."""
        h = header if header is not None else header_fields(np.frombuffer(data, np.uint8))._asdict()
        key = InKey(h["step"], h["bucket"], h["shard"], h["phase"])
        t = t_hint or self.transfers.get(key)
        if t is None:
            if key in self.tombstones:  # our STOP was lost: the sender still FINs, answer again
                self._stop_late(key, h["src"], now)
            else:
                self._hold_control(key, data, path, now)
            return _OK
        if t.done:
            return _OK
        r = h["src"] - t.spec.src_lo
        if not 0 <= r < t.received.shape[0]:
            return int(Reason.BAD_RANK)
        if h["chunk"] + h["count"] > t.spec.n_chunks:
            return int(Reason.BITMAP_RANGE)
        if h["count"] != t.spec.n_chunks:
            return int(Reason.COUNT_MISMATCH)
        bits = np.unpackbits(
            np.frombuffer(data, dtype=np.uint8)[48:], count=h["count"], bitorder="little"
        ).astype(bool)
        if h["kind"] == Kind.MANIFEST:
            t.protected[r] = bits
            t.manifest_known[r] = True
            t.ack_due[r] = min(t.ack_due[r], now)  # tell the sender we have it
            self._ack_pending[t.key] = t
        else:  # FIN: the sender gave these chunks up
            t.abandoned[r] = bits & (t.received[r] == 0)
            t.fin[r] = True
            self._check(t, now)
        return _OK

    def _hold_control(self, key: InKey, data: bytes | memoryview, path: int, now: float) -> None:
        """Hold a MANIFEST or FIN for a transfer not started here, within its share of the
        early buffer (see :data:`CONTROL_SHARE`); dropped and counted when it does not fit."""
        self._expire_early(now)
        charge = len(data) + CONTROL_OVERHEAD
        budget = self.config.early_buffer_bytes
        held = self.early_control_bytes + charge
        if held > budget // CONTROL_SHARE or self.early_bytes + held > budget:
            self.early_control_dropped += 1
            return
        self.early_control.setdefault(key, []).append((bytes(data), path))
        self._early_at.setdefault(key, now)
        self.early_control_bytes = held

    def on_unknown_data(
        self,
        key: InKey,
        arena: np.ndarray,
        lengths: np.ndarray,
        paths: np.ndarray,
        rows: np.ndarray,
        srcs: np.ndarray,
        now: float,
        pin: bool = False,
    ) -> bool:
        """DATA rows of ``arena`` (validated at session level; ``srcs`` their senders) for a
        transfer that is not running here: held within ``early_buffer_bytes`` until it starts,
        or answered with STOP when it has ended.

        With ``pin``, the caller lets full-size datagrams be held in place: ``arena`` itself is
        kept (every row counted at its full width), and True returned; the caller then writes
        nothing into ``arena`` while this holds it (until the transfer starts or the data
        expires). Otherwise, and for small datagrams, the rows are copied into a block
        as wide as the longest of them. Copying costs tens of µs per 64 KB row on a busy host,
        where most of a rank's early data arrives while its peers have already started.
        """
        self._expire_early(now)
        if key in self.tombstones:
            self.late += int(rows.shape[0])
            for src in np.unique(srcs).tolist():
                self._stop_late(key, int(src), now)
            return False
        sizes = lengths[rows]
        # A copy is as wide as its longest datagram (rounded up to whole u64 words, as the
        # receive kernels read rows), and what it holds is what counts against the buffer: a
        # flood of tiny datagrams cannot hold a full arena row each for a few bytes counted.
        width = min(arena.shape[1], -(-int(sizes.max()) // 8) * 8)
        pin = pin and 2 * width >= arena.shape[1]  # tiny datagrams: a compact copy is cheap
        charge = arena.shape[1] if pin else width
        room = self.config.early_buffer_bytes - self.early_bytes - self.early_control_bytes
        fit = max(room, 0) // charge  # rows (>= 48 B)
        if fit < rows.shape[0]:
            self.early_dropped += int(rows.shape[0] - fit)
            rows, sizes = rows[:fit], sizes[:fit]
            if not rows.size:
                return False
        if pin:
            held = HeldRows(
                arena, lengths.copy(), paths.copy(), rows.copy(), rows.shape[0] * charge
            )
        else:
            held = self._copied(arena, paths, rows, sizes, width)
            self.early_copied += int(rows.shape[0])
        self.early.setdefault(key, []).append(held)
        self._early_at.setdefault(key, now)
        self.early_bytes += held.nbytes
        # Tell each sender its data is held (Flags.HELD), at most once per min_rto_s: without
        # it, a sender whose peer starts the collective late resent whole shards by timeout.
        for src in np.unique(srcs[: rows.shape[0]]).tolist():
            last = self._held_sent.get((key, src), -np.inf)
            if now - last >= self.config.min_rto_s:
                self._held_sent[(key, src)] = now
                ack = self.encode(Kind.ACK, key, src, flags=int(Flags.HELD))
                self._out.append(Datagram(ack, src, int(paths[rows[0]]), self.tos))
        return pin

    @staticmethod
    def _copied(
        arena: np.ndarray, paths: np.ndarray, rows: np.ndarray, sizes: np.ndarray, width: int
    ) -> HeldRows:
        """``rows`` of ``arena`` copied into a block ``width`` bytes wide."""
        block = arena[rows, :width]
        n = int(rows.shape[0])
        return HeldRows(block, sizes, paths[rows], np.arange(n), block.nbytes)

    def _stop_late(self, key: InKey, src: int, now: float) -> None:
        """Answer a sender still talking about a finished transfer with STOP (rate-limited)."""
        last = self._stop_sent.get((key, src), -np.inf)
        if now - last >= self.config.min_rto_s:
            self._stop_sent[(key, src)] = now
            self._out.append(Datagram(self.encode(Kind.STOP, key, src), src, 0, self.tos))

    # -- output and time ---------------------------------------------------------------------
    def datagrams_to_send(self, now: float) -> list[Datagram]:
        """ACKs that are due, NACKs, STOPs."""
        for t in list(self._ack_pending.values()):
            if t.done:
                self._ack_pending.pop(t.key, None)
                continue
            for r in (t.ack_due <= now).nonzero()[0].tolist():
                self._ack(t, r, now)
        out, self._out = self._out, []
        return out

    def get_timer(self) -> float | None:
        """Earliest ACK due, soft/hard deadline or NACK repeat, tombstone or early expiry."""
        best = min((t.check_at for t in self.transfers.values()), default=np.inf)
        for t in self._ack_pending.values():
            best = min(best, float(t.ack_due.min()))
        if self.tombstones:
            best = min(best, next(iter(self.tombstones.values())) + self.linger_s)
        if self._early_at:  # held early packets expire even when no collective runs
            best = min(best, next(iter(self._early_at.values())) + self.linger_s)
        return None if best == np.inf else float(best)

    def note_drained(self, now: float) -> None:
        """The driver read its sockets empty at ``now`` (everything that had arrived is
        processed): pass ends seen before it can be trusted (see the theory of operation)."""
        self.drained_at = now
        for t in self._pass_ended.values():  # live ones: _finish and abort take theirs out
            self._refresh_check(t)
        for t in self._drain_wait.values():  # their NACK deadline passed: look again now
            t.check_at = min(t.check_at, now)
        self._drain_wait.clear()

    def handle_timer(self, now: float) -> None:
        """Deadlines and policy decisions; forget old tombstones."""
        for t in list(self.transfers.values()):
            if not t.done and now >= t.check_at:
                self._check(t, now)
                if not t.done:
                    self._refresh_check(t)
        self._expire_early(now)
        linger = self.linger_s
        while self.tombstones:
            key, at = next(iter(self.tombstones.items()))
            if now < at + linger:
                break
            del self.tombstones[key]
            for s in range(self.world):
                self._stop_sent.pop((key, s), None)

    def _expire_early(self, now: float) -> None:
        """Drop early data held longer than a transfer may live (its hard deadline, or the
        linger time if longer): a collective that has not started here by then never will (a
        peer's stale step, a job restarted under the same token), and its held bytes would
        otherwise keep new early data out of ``early_buffer_bytes`` for good."""
        limit = self.linger_s  # as long as a transfer may live
        while self._early_at:
            key, at = next(iter(self._early_at.items()))
            if now < at + limit:
                return
            del self._early_at[key]
            for s in range(self.world):
                self._held_sent.pop((key, s), None)
            for h in self.early.pop(key, []):
                self.early_bytes -= h.nbytes
                self.early_expired += int(h.rows.shape[0])
            for data, _ in self.early_control.pop(key, []):
                self.early_control_bytes -= len(data) + CONTROL_OVERHEAD

    def abort(self, key: InKey) -> None:
        """Forget a transfer without completing it (its collective failed)."""
        t = self.transfers.pop(key, None)
        self._pass_ended.pop(key, None)
        self._drain_wait.pop(key, None)
        if t is not None:
            t.done = True

    # -- internals ---------------------------------------------------------------------------
    def restart_clock(self, key: InKey, now: float) -> None:
        """The phase ``key`` waits on ended here only now: its hard deadline counts from now
        (unless its data already started its clock).

        A gather transfer is expected from the collective's start, but its data cannot flow
        before its sender's reduce phase ends. Its soft deadline, and with it its NACKs, runs
        from its first datagram: timed from the collective's start, it would learn the reduce
        phase's length too and fire NACKs at senders that have not begun; timed from this
        rank's own gather start, a gather whose data has mostly come already would learn a
        near-zero duration — a deadline of milliseconds, then NACKs for whole shards at peers
        still reducing (a slower peer's gather starts later than ours).
        """
        t = self.transfers.get(key)
        if t is None or t.done or t.running:
            return
        t.started = max(t.started, now)  # the hard deadline counts from here
        self._refresh_check(t)

    def _start_clock(self, t: InTransfer, now: float) -> None:
        t.running = True
        t.started = max(t.started, now)
        t.last_data_at = max(t.last_data_at, t.started)
        self._refresh_check(t)

    def _refresh_check(self, t: InTransfer) -> None:
        """When the policy must next look at ``t`` without new packets.

        The soft deadline adapts (it may move later after a NACK went out): re-check at the later
        of it and the NACK repeat, never in the past of both; the hard deadline caps it. Before
        a gather's clock runs, only the hard deadline.
        """
        hard = t.started + self.config.loss.hard_deadline_s
        if not t.running:
            t.check_at = hard
            return
        soft = t.started + self.loss.nack_deadline(t.gather, t.elems)
        t.check_at = min(hard, max(soft, t.nack_at + self._nack_interval(t)))
        if t.key in self._drain_wait:  # past the NACK deadline: the next drain re-checks
            t.check_at = hard
        if t.key in self._pass_ended:
            first = self._read_to_pass_end(t, np.empty(t.rows.shape[0], dtype=bool))
            if first < np.inf:
                when = first + self.config.reorder_window_s
                t.check_at = min(t.check_at, max(when, t.nack_at + self._nack_interval(t)))

    def _read_to_pass_end(self, t: InTransfer, gap: np.ndarray) -> float:
        """Per sender of ``t`` (over ``t.rows``), into ``gap``: its first pass ended, a drain
        began after that and after its newest arrival, and it still lacks chunks (not complete,
        no FIN) — a gap that is loss once the reorder window has passed (the theory of
        operation). Returns the earliest pass end among them (``inf``: none)."""
        return float(
            pass_end_gaps(t.received, t.rows, t.pass_end, t.trigger_at, t.fin, self.drained_at, gap)
        )

    def _nack_interval(self, t: InTransfer) -> float:
        base = max(self.config.min_rto_s, 4 * self.config.ack_delay_s)
        return base * t.nack_backoff

    def _ack(self, t: InTransfer, r: int, now: float) -> None:
        src = int(r + t.spec.src_lo)
        bits = t.received[r] != 0
        flags = 2 if t.manifest_known[r] else 0  # Flags.PROTECTED: "manifest received"
        max_bits = self.config.chunk_bytes * 8
        for base in range(0, max(bits.shape[0], 1), max_bits):
            part = bits[base : base + max_bits]
            payload = np.packbits(part, bitorder="little").tobytes()
            data = self.encode(
                Kind.ACK,
                t.key,
                src,
                chunk=base,
                count=int(part.shape[0]),
                payload=payload,
                aux=int(t.trigger[r]),
                flags=flags,
                norm=max(now - float(t.trigger_at[r]), 0.0),
            )
            self._out.append(Datagram(data, src, int(t.path[r]), self.tos))
        t.new_since_ack[r] = 0
        t.ack_due[r] = np.inf
        if np.isinf(t.ack_due).all():
            self._ack_pending.pop(t.key, None)

    def _check(self, t: InTransfer, now: float) -> None:
        if t.done:
            return
        if t.got >= t.expected:
            self._complete(t, now, degraded=False)
            return
        gather = t.gather
        budget = self.loss.budget_elems(gather=gather, expected_elems=t.spec.n_elems)
        rows = t.rows
        got = t.received[rows] != 0
        # A sender is settled when everything arrived, or it sent FIN and the rest arrived.
        complete_rows = got.all(axis=1)
        lacking = np.empty(rows.shape[0], dtype=bool)
        self._read_to_pass_end(t, lacking)
        lacking &= t.pass_end[rows] + self.config.reorder_window_s <= now
        gaps = self._settle_passes(t, got, lacking.nonzero()[0], budget) if lacking.any() else None
        settled_rows = complete_rows | (t.fin[rows] & (got | t.abandoned[rows]).all(axis=1))
        if t.fin[rows].any() and settled_rows.all():
            lost = ~got
            lost_elems = (lost * t.counts).sum(axis=1)
            prot_lost = (lost & t.protected[rows]).any()
            if not prot_lost and (lost_elems <= budget).all():
                self._complete(t, now, degraded=False)
                return
        if gaps is not None and gaps.size:
            self._nack(t, gaps, now)  # rate-limited like every NACK of this transfer
        if not t.running and now < t.started + self.config.loss.hard_deadline_s:
            return  # no data and no sign the senders began: nothing is late yet
        if now < t.started + self.loss.soft_deadline(gather, t.elems):
            # The policy could only say CONTINUE, and no NACK is due (its deadline is never
            # earlier): skip building its view of every chunk. Most checks under loss come
            # here (pass ends, NACK repeats).
            return
        verdict = self.loss.decide_rows(
            gather=gather,
            received=t.received[rows],
            counts=t.counts,
            protected=t.protected[rows],
            known=t.manifest_known[rows],
            started=t.started,
            now=now,
        )
        if verdict.decision == Decision.COMPLETE:
            self._complete(t, now, degraded=False, clean=False)  # ended by the soft deadline
        elif verdict.decision == Decision.COMPLETE_DEGRADED:
            self._complete(t, now, degraded=True, clean=False)
        elif verdict.decision == Decision.FAIL:
            missing = tuple(s for s, m in t.missing_elems().items() if m)
            err = PeerTimeout(
                missing, t.key.step, t.key.bucket, Phase(t.key.phase).name.lower(), now - t.started
            )
            self._finish(t, now)
            self.emit(PeerTimedOut(err, t.key.step, t.key.bucket))
        elif now >= (due := t.started + self.loss.nack_deadline(gather, t.elems)):
            if self.drained_at >= max(due, t.nack_at):
                self._nack(t, verdict.need, now)
            else:
                # The sockets were not read empty since the deadline (or the last NACK): what
                # is missing may be waiting in them, as on a loaded host that reads late, and
                # NACKing it would resend whole shards that have come. The next drain looks
                # again.
                self._drain_wait[t.key] = t

    def _settle_passes(
        self, t: InTransfer, got: np.ndarray, ended: np.ndarray, budget: int
    ) -> np.ndarray:
        """Senders (indices into ``t.rows``) whose first pass ended a reorder window ago, read
        to the end since, with chunks missing: a gap the bound allows — none of it protected,
        the manifest known, within ``budget`` elements — settles the sender as its FIN would
        (the gap given up). Otherwise the chunks that keep it from settling are returned as
        ``(sender index, chunk)`` rows to NACK: the protected ones, or every missing one when
        the rest exceeds the budget or the manifest is unknown; what the bound would allow
        once those came is not asked for (it settles at a later check)."""
        need: list[np.ndarray] = []
        for k in ended.tolist():
            r = int(t.rows[k])
            lost = ~got[k]
            if budget > 0 and t.manifest_known[r]:
                must = lost & t.protected[r]
                if int(t.counts[lost & ~must].sum()) <= budget:
                    if not must.any():
                        t.fin[r] = True
                        t.abandoned[r] = lost
                        continue
                    lost = must
            chunks = lost.nonzero()[0]
            need.append(np.stack((np.full(chunks.shape[0], k), chunks), axis=1))
        return np.concatenate(need) if need else np.empty((0, 2), dtype=np.int64)

    def _read_past(self, t: InTransfer, r: int, now: float) -> bool:
        """Sender row ``r``'s newest arrival is a reorder window old and a drain followed it."""
        at = t.trigger_at[r]
        return bool(
            t.received[r].any()
            and self.drained_at >= at
            and now >= at + self.config.reorder_window_s
        )

    def _nack(self, t: InTransfer, need: np.ndarray, now: float) -> None:
        """Ask senders for the chunks the policy still needs (at most once per interval)."""
        if now < t.nack_at + self._nack_interval(t):
            return
        # Back off while NACKs bring nothing new (a slow or silent sender); any progress resets.
        progressed = t.got != t.got_at_nack
        t.nack_backoff = 1.0 if progressed else min(t.nack_backoff * 2.0, 64.0)
        t.got_at_nack = t.got
        t.nack_at = now
        need = np.asarray(need, dtype=np.int64).reshape(-1, 2)  # rows: (sender index, chunk)
        src_idx, chunks = need[:, 0], need[:, 1]
        if src_idx.size == 0:
            # Nothing specific is needed (e.g. waiting for a manifest): re-ACK everyone so
            # senders learn what is missing and resend the manifest.
            for r in t.rows:
                self._ack(t, int(r), now)
            return
        for i in np.unique(src_idx):
            r = int(t.rows[i])
            src = int(r + t.spec.src_lo)
            bits = np.zeros(t.spec.n_chunks, dtype=bool)
            bits[chunks[src_idx == i]] = True
            data = self.encode(
                Kind.NACK,
                t.key,
                src,
                chunk=0,
                count=t.spec.n_chunks,
                payload=np.packbits(bits, bitorder="little").tobytes(),
                # The newest chunk from this sender, plus one, once the sockets were read empty
                # after it came and a reorder window passed (else 0): a chunk the sender sent
                # before that one's last transmission is then lost, not unread or on its way.
                aux=int(t.trigger[r]) + 1 if self._read_past(t, r, now) else 0,
            )
            self._out.append(Datagram(data, src, int(t.path[r]), self.tos))

    def _complete(self, t: InTransfer, now: float, degraded: bool, clean: bool = True) -> None:
        if t.plan is not None and t.order is not None:
            kernels.flush_order(t.plan)  # contributions a missing sender kept waiting
        n = t.spec.n_elems
        missing = t.missing_elems()
        report = LossReport(
            step=t.key.step,
            bucket=t.key.bucket,
            shard=t.key.shard,
            phase=t.key.phase,
            expected_elems=n * len(t.senders),
            missing_elems=sum(missing.values()),
            delivered={s: (1.0 - m / n) if n else 1.0 for s, m in missing.items()},
            duration=now - t.started,
            degraded=degraded,
            bytes_received=t.bytes_received,
            duplicates=t.duplicates,
            rejected=t.rejected,
            protected_missing=t.protected_missing(),
            nonfinite_chunks=int(np.count_nonzero(t.nonfinite)),
        )
        # The deadline learns how long a transfer's data takes to arrive on its own. A transfer
        # ended by the deadline, or completed by data it had to NACK for, measures that only
        # up to the last packet that came unasked: what never came (or came because the
        # deadline asked for it) says nothing about the pace. Counting the deadline-driven
        # completions in full would make the deadline feed on itself (each step's deadline
        # plus a resend becomes the next one's sample, growing step by step); leaving them
        # out would keep it at its maximum under steady random loss.
        sample, valid = report.duration, clean
        if (not clean or t.nack_at > -np.inf) and t.got > 0:
            sample, valid = t.last_data_at - t.started, True
        self.loss.record(
            gather=t.gather, duration=max(sample, 0.0), clean=valid, elems=report.expected_elems
        )
        soft = (self.loss.soft_deadline(False), self.loss.soft_deadline(True))
        if any(abs(a - b) > 0.05 * b for a, b in zip(soft, self._soft_seen, strict=True)):
            # The adaptive soft deadline moved noticeably: re-derive every transfer's check
            # time (small moves are left for the next check, which re-derives it anyway).
            self._soft_seen = soft
            for other in self.transfers.values():
                self._refresh_check(other)
        self._finish(t, now)
        self.emit(TransferComplete(report))

    def _finish(self, t: InTransfer, now: float) -> None:
        t.done = True
        self.transfers.pop(t.key, None)
        self._pass_ended.pop(t.key, None)
        self._drain_wait.pop(t.key, None)
        self._ack_pending.pop(t.key, None)
        self.tombstones[t.key] = now
        for s in t.senders:
            self._out.append(
                Datagram(
                    self.encode(Kind.STOP, t.key, s), s, int(t.path[s - t.spec.src_lo]), self.tos
                )
            )
            self._stop_sent[(t.key, s)] = now
