"""Outgoing transfers: the per-chunk state of one shard toward one peer, and its packet headers.

Theory of operation
-------------------
An *outgoing transfer* is one shard (step, bucket, shard, phase) for one peer. At start the shard
is read once for its per-chunk statistics (:func:`kernels.chunk_stats`: L2 norms and the payload's
fast-tag sums; the gather phase computes them once for all its destinations), classified by the
priority policy, and every chunk's 48-byte header is written (:func:`kernels.fill_headers`).
Nothing is copied: a datagram is a header row plus a view of the caller's buffer, which the
driver sends with one gathering ``sendmsg`` (the kernel copies the payload once, as it must).
The caller's buffer is therefore read until the transfer ends; :meth:`OutTransfer.release_source`
copies the payloads still owed when the buffer must go back to the caller (a collective that
completed or failed while peers may still need retransmissions — the collective first waits a
little for their acknowledgements, ``ack_wait_s``, so that usually nothing is left to copy), into
a buffer that :class:`SparePayloads` recycles once the transfer ends. A payload that changed under a
transfer cannot be delivered wrong: the tag in its header was computed from the original bytes,
so the receiver rejects it (``bad_tag``).

Per-chunk state lives in numpy arrays (STYLE rule 3):

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
the LOST ones. What to send when, and the loss detection, are
:mod:`gradlane.transport.core.sender`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gradlane.scheduling.loss import LossPolicy
from gradlane.scheduling.precision import PrecisionPolicy, check_formats
from gradlane.scheduling.priority import PriorityPolicy
from gradlane.transport import kernels
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import DatagramRun
from gradlane.transport.kernels._ack import next_due, rack_due, timed_out
from gradlane.transport.kernels._pick import advance_cursor as _advance_cursor
from gradlane.transport.kernels.encoding import Encoded, encode_shard, fill_headers_as
from gradlane.transport.wire.header import (
    HEADER_SIZE,
    ITEMSIZE,
    DType,
    Flags,
    Kind,
    Phase,
    chunk_counts,
)

__all__ = [
    "ABANDONED",
    "ACKED",
    "INFLIGHT",
    "LOST",
    "PENDING",
    "OutKey",
    "OutTransfer",
    "SparePayloads",
]

PENDING, INFLIGHT, LOST, ACKED, ABANDONED = 0, 1, 2, 3, 4


_PROTECTED = np.uint8(Flags.PROTECTED)
_DROPPABLE = np.uint8(Flags.DROPPABLE)
_LAST = np.uint8(Flags.LAST)
_PASS_END = np.uint8(Flags.PASS_END)


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
    chunks the sender may give up on; ``stats`` are ``data``'s :func:`kernels.chunk_stats` when
    the caller has them (one shard sent to several peers), else they are computed here.

    A float32 shard whose ``precision`` policy puts some chunks in a lossy wire format is
    encoded into a payload buffer of its own (:func:`~gradlane.transport.kernels.encoding.
    encode_shard`; ``residual``, the shard's float32 error-feedback slice, gets what the
    rounding removed, 0 where nothing was rounded), or comes ``encoded`` already (one shard
    sent to several peers); either way the caller's buffer is not read after the start.
    ``decoded`` (float32, the shard's shape; may be ``data``) gets the values the receiver
    will decode.
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
        stats: kernels.ChunkStats | None = None,
        precision: PrecisionPolicy | None = None,
        residual: np.ndarray | None = None,
        encoded: Encoded | None = None,
        decoded: np.ndarray | None = None,
    ) -> None:
        cfg = config
        self.key = key
        self.seq = seq
        # Start order of its bucket's first transfer (the sender's): one bucket's transfers are
        # equals in the send order, served least advanced first.
        self.group = seq
        self.layer_position = float(layer_position)
        # Its place among transfers of one class in the sender's queue (the policy's choice).
        self.send_position = float(priority.send_position(self.layer_position))
        self.started = now
        self.hard_deadline = now + cfg.loss.hard_deadline_s
        gather = key.phase == Phase.GATHER
        self.chunk_elems = cfg.chunk_elems(dtype)
        self.n_elems = int(data.shape[0])
        self.counts = chunk_counts(self.n_elems, self.chunk_elems)
        n = self.n_chunks = int(self.counts.shape[0])
        if stats is None:
            stats = kernels.chunk_stats(
                data, dtype=DType(dtype), chunk_elems=self.chunk_elems, key=cfg.tag_key
            )
        classes = priority.classify(norms=stats.norms, layer_position=layer_position, pinned=pinned)
        self.prio = np.ascontiguousarray(classes.prio, dtype=np.uint8)
        self.protected = np.asarray(classes.protected, dtype=bool)
        self.droppable = np.asarray(classes.droppable, dtype=bool) & ~self.protected
        if not self.prio.shape == self.protected.shape == self.droppable.shape == (n,):
            # A policy is pluggable: its arrays reach a kernel that does not check them.
            raise ValueError(
                f"priority policy {type(priority).__name__} classified {n} chunks into arrays "
                f"of shapes {self.prio.shape}, {self.protected.shape}, {self.droppable.shape}"
            )
        if stats.norms.shape[0] != n or stats.sum_a.shape[0] != n or stats.sum_b.shape[0] != n:
            raise ValueError(f"stats for {stats.norms.shape[0]} chunks, the shard has {n}")
        self.norms = stats.norms  # each chunk's L2 norm (the report's energy of the shard)
        # Send order: by class, then chunk index — send_order_key's order for one transfer, whose
        # chunks share one layer position (transfers are merged by the sender's heap): a stable
        # sort of the classes is that order, without building the keys.
        self.order = np.argsort(self.prio, kind="stable").astype(np.int64, copy=False)
        # Booleans viewed as 0/1 bytes: the flag bits by two multiplies, no temporaries.
        flags = self.protected.view(np.uint8) * _PROTECTED
        flags |= self.droppable.view(np.uint8) * _DROPPABLE
        if n:
            flags[-1] |= _LAST
            flags[self.order[-1]] |= _PASS_END  # the first pass's last chunk (Flags.PASS_END)
        if encoded is None and precision is not None and precision.lossy and n:
            encoded = self._encode(data, dtype, stats, precision, residual, decoded, cfg)
        if encoded is None and residual is not None:
            residual[:] = 0.0  # sent as it is: nothing for the next step to make up
        self.encoded = encoded
        self.hdr = np.empty((n, HEADER_SIZE), dtype=np.uint8)
        words = kernels.fields_words(
            Kind.DATA, key.phase, dtype, cfg.job, key.step, key.bucket, key.shard, me, key.dst
        )
        if encoded is not None:
            self.lengths = np.zeros(max(n, 1), dtype=np.int32)
            self.lengths[:n] = encoded.lengths
            fill_headers_as(
                self.hdr, encoded, stats.norms, n_elems=self.n_elems,
                chunk_elems=self.chunk_elems, words=words, key=cfg.tag_key, prio=self.prio,
                flags=flags,
            )  # fmt: skip
        elif n:
            # Datagram lengths, one allocation.
            self.lengths = (self.counts * ITEMSIZE[dtype] + HEADER_SIZE).astype(np.int32)
            # The checked words, then the kernel without write_headers' argument checks: every
            # array here is this transfer's own, of the shapes checked above.
            kernels.fill_headers(
                self.hdr,
                data,
                self.counts,
                stats,
                dtype=DType(dtype),
                words=words,
                chunk_elems=self.chunk_elems,
                key=cfg.tag_key,
                prio=self.prio,
                flags=flags,
            )
        else:
            self.lengths = np.zeros(1, dtype=np.int32)
        # Flat memoryviews of the headers and payload: what a DatagramRun points into.
        self.hdr_view = self.hdr.reshape(-1).data
        self.chunk_bytes = self.chunk_elems * ITEMSIZE[dtype]
        flat = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if encoded is not None:  # sent from its own payload, one stride apart
            self.chunk_bytes = encoded.stride
            flat = encoded.payload
        self.payload = flat.data
        # Their addresses, once: a driver's sendmmsg tables point into them, and finding an
        # address from a memoryview costs microseconds, twice per run.
        self.hdr_addr = int(self.hdr.ctypes.data)
        self.payload_addr = int(flat.ctypes.data)
        self._owned: np.ndarray | None = None  # the copied-out payload, once released
        self.state = np.zeros(n, dtype=np.uint8)
        self.sent_at = np.zeros(n, dtype=np.float64)
        # Transmission order (RACK by sequence): a batch leaves at one timestamp, so send times
        # cannot tell which of its chunks went first. Per lane (path × class), the newest
        # acknowledged sequence and when it was learned (:meth:`rack_lost`).
        self.tx_seq = np.zeros(n, dtype=np.int64)
        self.next_tx_seq = 0
        n_lanes = cfg.n_paths * cfg.priority.n_classes
        self.lane_seq = np.full(n_lanes, -1, dtype=np.int64)
        self.lane_at = np.full(n_lanes, np.inf)
        self.path = np.zeros(n, dtype=np.int16)
        self.tx = np.zeros(n, dtype=np.uint8)
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
        # The receiver holds our data for a transfer it has not started (a HELD ACK): no
        # timeouts until it acknowledges; then the timeout clock restarts (rto_since).
        self.held = False
        self.rto_since = -np.inf
        # When the first timeout of a round sent its probes (SenderCore._on_timeout; inf: no
        # round), and the probed chunks whose ACK has not come.
        self.probe_at = np.inf
        self.probes = np.empty(0, dtype=np.int64)
        # Per chunk: how long after its last transmission a chunk that a NACK asked for while
        # it was still on its way counts as lost (inf: not asked; None: no request yet).
        self.nack_wait: np.ndarray | None = None
        self.done = False
        self.gather = gather

    # -- payload -------------------------------------------------------------------------------
    def _encode(
        self,
        data: np.ndarray,
        dtype: int,
        stats: kernels.ChunkStats,
        precision: PrecisionPolicy,
        residual: np.ndarray | None,
        decoded: np.ndarray | None,
        cfg: TransportConfig,
    ) -> Encoded | None:
        """The shard encoded in the formats ``precision`` picks (None: every chunk float32)."""
        if dtype != DType.F32:
            raise ValueError(f"lossy wire formats need a float32 shard, not {DType(dtype).name}")
        formats = check_formats(
            precision.formats(
                norms=stats.norms,
                protected=self.protected,
                droppable=self.droppable,
                gather=self.key.phase == Phase.GATHER,
            ),
            self.n_chunks,
        )
        if not formats.any():
            return None
        return encode_shard(
            data,
            formats,
            chunk_elems=self.chunk_elems,
            key=cfg.tag_key,
            residual=residual,
            decoded=decoded,
        )

    def run(
        self,
        chunks: np.ndarray,
        paths: np.ndarray,
        tos: int,
        starts: np.ndarray | None = None,
        sizes: np.ndarray | None = None,
    ) -> DatagramRun:
        """The datagrams of ``chunks`` (one each), on ``paths`` with IP TOS ``tos``, as one run:
        header rows and views of the payload, never copied (the sender's hot path). ``starts``
        and ``sizes`` (int64: each payload's offset and bytes) when the caller has them."""
        chunks = chunks.astype(np.int64, copy=False)
        if starts is None or sizes is None:
            starts = chunks * self.chunk_bytes
            sizes = self.lengths[chunks].astype(np.int64) - HEADER_SIZE
        return DatagramRun(
            self.hdr_view,
            HEADER_SIZE,
            self.payload,
            chunks,
            starts,
            sizes,
            self.key.dst,
            paths,
            tos,
            self.hdr_addr,
            self.payload_addr,
        )

    def release_source(self, spares: SparePayloads | None = None) -> None:
        """Stop reading the caller's buffer: copy out every payload that may still be sent —
        any chunk not acknowledged, abandoned ones included (a NACK can still ask for one) —
        into a buffer from ``spares`` (or a new one)."""
        if self._owned is not None or self.encoded is not None:
            return  # the payload is this transfer's own already
        src = np.frombuffer(self.payload, dtype=np.uint8)
        owned = spares.take(src.shape[0]) if spares is not None else np.empty_like(src)
        owed = (self.state != ACKED).nonzero()[0]
        if owed.size:
            # One slice copy per run of consecutive owed chunks: usually a single run (the tail
            # still in flight), and never a temporary the size of what is copied.
            cut = (np.diff(owed) != 1).nonzero()[0] + 1
            first = owed[np.concatenate(([0], cut))] * self.chunk_bytes
            end = np.minimum((owed[np.concatenate((cut - 1, [owed.size - 1]))] + 1)
                             * self.chunk_bytes, src.shape[0])  # fmt: skip
            for a, b in zip(first.tolist(), end.tolist(), strict=True):
                owned[a:b] = src[a:b]
        self._owned = owned
        self.payload = owned.data
        self.payload_addr = int(owned.ctypes.data)

    def return_buffer(self, spares: SparePayloads) -> None:
        """The transfer is over: hand its copied-out payload buffer (if any) to ``spares``."""
        if self._owned is not None:
            self.payload = memoryview(b"")
            self.payload_addr = -1
            spares.give(self._owned)
            self._owned = None

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

    def tolerable(self, idx: np.ndarray) -> np.ndarray:
        """The chunks of ``idx`` that the loss budget still lets go: never protected ones,
        droppable first, then the least important normal chunks."""
        if self.budget_elems <= 0:
            return idx[:0]
        cand = idx[~self.protected[idx]]
        cand = cand[np.lexsort((-self.prio[cand].astype(np.int64), ~self.droppable[cand]))]
        cum = np.cumsum(self.counts[cand])
        return cand[cum <= self.budget_elems - self.abandoned_elems]

    def overtaken(self, idx: np.ndarray, n_classes: int) -> np.ndarray:
        """The chunks of ``idx`` sent before a first transmission acknowledged in their own
        lane (path × ``n_classes`` + class: one FIFO queue). Only first transmissions count:
        an ACK cannot say which copy of a resent chunk came. Another lane's ACK proves nothing:
        a chunk on a path with a deeper queue is still on its way when a later one on a
        shallower path is acknowledged."""
        first = ((self.state == ACKED) & (self.tx == 1)).nonzero()[0]
        if not first.size or not idx.size:
            return idx[:0]
        newest = np.full(self.lane_seq.shape[0], -1, dtype=np.int64)
        np.maximum.at(newest, self.lanes(first, n_classes), self.tx_seq[first])
        return idx[self.tx_seq[idx] < newest[self.lanes(idx, n_classes)]]

    def lanes(self, idx: np.ndarray, n_classes: int) -> np.ndarray:
        """The lane of each chunk of ``idx``: its path × ``n_classes`` + its class (one FIFO
        queue; the numbering of :attr:`lane_seq` and the RACK kernels)."""
        return self.path[idx].astype(np.int64) * n_classes + self.prio[idx]

    def on_way_for(
        self,
        idx: np.ndarray,
        newest: int,
        floor: np.ndarray,
        bound: np.ndarray,
        n_classes: int,
    ) -> np.ndarray:
        """How long after its last transmission each chunk of ``idx``, asked for by a NACK, may
        still be on its way (0: it is lost).

        ``newest`` is the newest chunk the receiver had when it asked (-1: unknown), ``floor``
        and ``bound`` per path the least time a chunk takes (smallest RTT, at least the reorder
        window) and the longest it may take (the caller's choice: smoothed RTT plus four
        deviations, :meth:`~gradlane.scheduling.paths.PathSet.rtt_bounds`, or the smoothed RTT
        alone where no queue of the sender's own can grow). A chunk that ``newest``
        overtook in its own lane (path × ``n_classes`` + class: one FIFO queue) is lost; one
        sent after it in that lane is on its way for ``floor``. A chunk on another lane may sit
        behind a deeper queue there: what arrived over one path says nothing of another's, so
        it is on its way for its path's ``bound``, as every chunk is without ``newest``."""
        path = self.path[idx]
        if newest < 0:
            return bound[path]
        same = self.lanes(idx, n_classes) == self.lanes(np.array([newest]), n_classes)[0]
        overtaken = same & (self.tx_seq[idx] < self.tx_seq[newest])
        wait = np.where(same, floor[path], np.maximum(floor, bound)[path])
        return np.where(overtaken, 0.0, wait)

    def ask_later(self, idx: np.ndarray, wait: np.ndarray) -> None:
        """A NACK asked for in-flight chunks ``idx`` that may still be on their way for
        ``wait`` (seconds after their last transmission): each is lost if that passes before
        its ACK (:meth:`asked_lost`). The request is kept, not dropped: the receiver backs off
        its NACKs while they bring nothing, so waiting for the next one would cost more."""
        if self.nack_wait is None:
            self.nack_wait = np.full(self.n_chunks, np.inf)
        self.nack_wait[idx] = np.minimum(self.nack_wait[idx], wait)

    def asked_lost(self, now: float) -> np.ndarray:
        """In-flight chunks a NACK asked for whose wait (:meth:`ask_later`) has passed since
        their last transmission; their requests are done."""
        if self.nack_wait is None or not self.n_inflight:
            return np.empty(0, dtype=np.int64)
        lost = ((self.state == INFLIGHT) & (self.sent_at + self.nack_wait <= now)).nonzero()[0]
        self.nack_wait[lost] = np.inf
        return lost

    def _asked_due(self) -> float:
        """When the first request kept by :meth:`ask_later` falls due (inf: none)."""
        if self.nack_wait is None or not self.n_inflight:
            return np.inf
        flying = self.state == INFLIGHT
        return float((self.sent_at[flying] + self.nack_wait[flying]).min(initial=np.inf))

    def rack_lost(self, n_classes: int, reorder_window_s: float, now: float) -> np.ndarray:
        """In-flight chunks sent before a chunk of their lane that was acknowledged at least
        ``reorder_window_s`` ago (RACK, RFC 8985, ordered by transmission sequence).

        A lane is one path and one class (one socket and TOS, one queue of a priority
        network; lanes are path × ``n_classes``): in it, a chunk overtaken by a later one for
        that long is lost. The ACK-time check (kernels.apply_ack) compares send times, and a
        batch's chunks share one: without this, a chunk lost from the middle of a batch would
        wait for the retransmission timeout (milliseconds on a loaded host), not the window.
        """
        if not self.n_inflight:
            return np.empty(0, dtype=np.int64)
        out = np.empty(self.n_chunks, dtype=np.int64)
        n = rack_due(self.state, self.tx_seq, self.path, self.prio, n_classes, self.lane_seq,
                     self.lane_at, reorder_window_s, now, out)  # fmt: skip
        return out[:n]

    def timed_out(self, path_rtos: np.ndarray, now: float) -> np.ndarray:
        """In-flight chunks older than their own path's retransmission timeout (``path_rtos``,
        backed off; none while the receiver holds the transfer)."""
        if not self.n_inflight or self.held:
            return np.empty(0, dtype=np.int64)
        out = np.empty(self.n_chunks, dtype=np.int64)
        n = timed_out(self.state, self.sent_at, self.path, path_rtos, self.rto_backoff,
                      self.rto_since, now, out)  # fmt: skip
        return out[:n]

    def next_due(
        self, path_rtos: np.ndarray, rto: float, n_classes: int, reorder_window_s: float
    ) -> float:
        """When the sender's tick will next have work for this transfer as it stands (an ACK,
        NACK or send changes that): its hard deadline, a RACK loss or retransmission timeout
        (:func:`~gradlane.transport.kernels._ack.next_due`: the same sums as :meth:`rack_lost` and
        :meth:`timed_out`, so at that time they find it), a manifest or FIN to repeat.
        ``path_rtos`` are the peer's per-path timeouts, ``rto`` the transfer's (backed off)
        one for control repeats; lanes are path × ``n_classes``."""
        if self.done:
            return np.inf
        due = min(self.hard_deadline, next_due(
            self.state, self.sent_at, self.tx_seq, self.path, self.prio, n_classes,
            self.lane_seq, self.lane_at, reorder_window_s, path_rtos, self.rto_backoff,
            self.rto_since, not self.held))  # fmt: skip
        if not self.manifest_acked:
            due = min(due, self.manifest_sent_at + rto)
        if self.nack_wait is not None:
            due = min(due, self._asked_due())
        if self.owes_fin():
            due = min(due, self.fin_sent_at + rto)
        return float(due)

    def owes_fin(self) -> bool:
        """Only abandoned chunks remain unacknowledged: the receiver is told so by a FIN
        (repeated every RTO until its STOP)."""
        return bool(
            not self.done and self.abandoned_elems and not (self.n_lost or self.n_inflight)
            and self.cursor >= self.n_chunks
        )  # fmt: skip

    def probe_answered(self, acked: np.ndarray) -> np.ndarray:
        """An ACK after a timeout's probe (``SenderCore._on_timeout``) newly acknowledged
        ``acked``; returns the chunks now known lost.

        An original sent before the probes among them: the late chunks are arriving, the
        timeout was spurious, and the round ends (nothing lost). Else, for each probe's chunk
        among them, the probe came through its path and nothing sent before it there did:
        those chunks are lost now (RACK would wait a reorder window more, though the probe
        left a whole RTO after them). Paths whose probe did not come wait for the next timeout.
        """
        none = np.empty(0, dtype=np.int64)
        if ((self.tx[acked] == 1) & (self.sent_at[acked] < self.probe_at)).any():
            self.probe_at, self.probes = np.inf, none
            return none
        came = np.isin(self.probes, acked)
        if not came.any():
            return none
        lost = np.zeros(self.n_chunks, dtype=bool)
        for p in self.probes[came].tolist():  # one probe per path: the sets are disjoint
            on_path = (self.state == INFLIGHT) & (self.path == self.path[p])
            lost |= on_path & (self.sent_at <= self.sent_at[p])
        self.probes = self.probes[~came]
        if not self.probes.size:
            self.probe_at = np.inf
        return lost.nonzero()[0]

    def outstanding(self) -> bool:
        """True while some chunk is neither acknowledged nor abandoned."""
        return bool((self.state < ACKED).any())

    @property
    def progress(self) -> float:
        """The share of the chunks already sent or skipped once (0 at the start, 1 when every
        chunk has gone out at least once): the sender serves the least advanced of equals first."""
        return self.cursor / self.n_chunks if self.n_chunks else 1.0

    def advance_cursor(self) -> None:
        """Move the cursor past chunks that are no longer PENDING (sent or skipped)."""
        self.cursor = _advance_cursor(self.state, self.order, self.cursor)


class SparePayloads:
    """Buffers that held copied-out payloads (:meth:`OutTransfer.release_source`), kept for the
    next copy: a new multi-megabyte array costs a page fault per 4 KiB page on its first write,
    which in a busy process takes several times as long as the copy itself. At most ``per_size``
    buffers of each size and ``max_bytes`` in all are kept."""

    def __init__(self, max_bytes: int = 128 << 20, per_size: int = 4) -> None:
        self.max_bytes = max_bytes
        self.per_size = per_size
        self.bytes = 0
        self._free: dict[int, list[np.ndarray]] = {}

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes`` (contents undefined)."""
        free = self._free.get(nbytes)
        if free:
            self.bytes -= nbytes
            return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Keep ``buf`` for a later :meth:`take` (if there is room); nobody may use it after."""
        free = self._free.setdefault(buf.nbytes, [])
        if len(free) < self.per_size and self.bytes + buf.nbytes <= self.max_bytes:
            free.append(buf)
            self.bytes += buf.nbytes
