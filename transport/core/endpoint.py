"""One rank's protocol endpoint: a batching receive path, a dispatch table, sender and receiver.

The endpoint is the aioquic-shaped object a driver talks to (``datagrams_to_send``,
``get_timer``, ``handle_timer``, ``next_event``). Received datagrams land in a small arena and
are processed in batches: framing checks are vectorised over the batch's headers, DATA rows are
grouped by transfer and handed to one kernel call per group, and control packets (a few per
hundred DATA) go through :func:`gradlane.transport.wire.header.validate` and a dispatch table
keyed by :class:`~gradlane.transport.wire.header.Kind` (STYLE rule 5).

The table has an entry for every kind, and each handler returns the
:class:`~gradlane.transport.wire.header.Reason` its packet is counted under: a packet that
passed :func:`~gradlane.transport.wire.header.validate` can still be one this endpoint does not
take (HELLO belongs to the control plane's handshake) or a bitmap reaching past its transfer's
chunks; either is counted and dropped, never raised, so no datagram a peer (or anyone who can
reach the port) sends fails a collective. A bitmap is unpacked only once its span is known to
lie within the transfer it names, so the work a control packet causes is bounded by what the
transfer tracks, whatever count it claims.

Receiving
---------
There is one way in: a driver writes datagrams into the free rows of :attr:`Endpoint.rx_arena`
(from row :attr:`Endpoint.rx_free` on, one datagram per row, as many as one system call
brings: ``recvmmsg``, a GRO split, a ZeroMQ batch frame) and hands their lengths to
:meth:`Endpoint.commit_datagrams`. Nothing is copied and nothing is done per datagram in
Python. :meth:`Endpoint.receive_datagram` is the same for one datagram given as bytes (a copy
into the next row): the form in-memory drivers use (simulator, tests).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from gradlane.scheduling.loss import LossPolicy
from gradlane.scheduling.pacing import Pacer
from gradlane.scheduling.priority import make_priority_policy
from gradlane.transport import kernels
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import Datagram, DatagramRun, Event
from gradlane.transport.core.incoming import InKey
from gradlane.transport.core.receiver import ReceiverCore
from gradlane.transport.core.sender import OutKey, SenderCore
from gradlane.transport.kernels.batch import frame_rows, group_rows
from gradlane.transport.wire.header import (
    HEADER_SIZE,
    MAGIC,
    N_REASONS,
    VERSION,
    DType,
    Flags,
    HeaderFields,
    Kind,
    Phase,
    Reason,
    SessionSpec,
    encode_values,
    header_view,
    validate_data_rows,
)
from gradlane.transport.wire.tag import TAG_FAST

__all__ = ["Endpoint"]

log = logging.getLogger(__name__)

#: Rows of the receive arena: a batch is processed when it reaches the last row even if nobody
#: asks. 512 slots of 65000-byte datagrams are 33 MB of address space, touched only as deep as
#: batches go; fewer rows would make a rank a whole scatter phase behind its peers (hundreds of
#: early datagrams) copy the early data that does not fit in place.
RX_BATCH = 512
#: Fewest arena rows left above a batch whose early data the receiver may hold in place: the
#: next batches go there, or into another arena (below).
MIN_ROOM = 64
#: Most receive arenas an endpoint keeps. Batches the receiver holds in place (early data) keep
#: their rows; once fewer than ``MIN_ROOM`` rows are left above them, the next batches go into
#: an arena that holds nothing (made on first need, then reused), so early data is copied out
#: only while every arena holds some (a rank its peers are a scatter phase ahead of would copy a
#: few MB per collective, memory-bound). The extra arenas come out of ``early_buffer_bytes``,
#: the budget for early data: at most that many bytes of them.
RX_ARENAS = 4
_OK = int(Reason.OK)  # an int: comparing arrays with an enum member takes NumPy's slow path
_UNEXPECTED_KIND = int(Reason.UNEXPECTED_KIND)
_BITMAP_RANGE = int(Reason.BITMAP_RANGE)

#: A control handler: (packet, its header fields, path, now) -> the Reason it is counted under.
_Handler = Callable[[bytes, dict[str, int], int, float], int]


def _arena_of(ref: weakref.ref[np.ndarray]) -> np.ndarray | None:
    """The arena a held batch's view is of (None once the receiver let it go)."""
    view = ref()
    return None if view is None else view.base


class Endpoint:
    """Sender and receiver of one rank, behind the sans-I/O driver API."""

    def __init__(
        self,
        me: int,
        world: int,
        config: TransportConfig | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        if not 0 <= me < world:
            raise ValueError(f"rank {me} outside world of {world}")
        self.me = me
        self.world = world
        self.config = cfg = config or TransportConfig()
        self.rng = rng or np.random.default_rng(cfg.seed + me)
        self.priority = make_priority_policy(cfg.priority)
        self.loss = LossPolicy(cfg.loss)
        self.key = cfg.tag_key
        self._newest_step = 0
        self.session = self._session()
        control_tos = cfg.priority.tos(0)
        self.sender = SenderCore(
            me,
            world,
            cfg,
            self.priority,
            self.loss,
            self.rng,
            self._encode,
            lambda: Pacer(cfg.pacing),
        )
        self._events: deque[Event] = deque()
        self.receiver = ReceiverCore(
            me, world, cfg, self.loss, self._encode_to, self._events.append, control_tos
        )
        self._rx = np.zeros((RX_BATCH, cfg.slot_bytes), dtype=np.uint8)
        # Every arena made so far (the current one is _rx), and how many there may be (see
        # RX_ARENAS).
        self._arenas = [self._rx]
        self._max_arenas = max(1, min(RX_ARENAS, 1 + cfg.early_buffer_bytes // self._rx.nbytes))
        self._rx_len = np.zeros(RX_BATCH, dtype=np.int64)  # as the receive kernels read them
        self._rx_path = np.zeros(RX_BATCH, dtype=np.int64)
        self._rx_n = 0  # the next free row
        self._rx_base = 0  # the current batch's first row (above rows held in place)
        # Batches the receiver holds in place (early data): (end row, weak reference to the
        # batch's view of its arena, which the receiver keeps while it holds the rows).
        self._pins: list[tuple[int, weakref.ref[np.ndarray]]] = []
        self._batch_key = np.zeros(4, dtype=np.int64)  # frame_rows' key of a batch's DATA
        self._rx_first = 0.0
        # Batches processed so far: a driver that saw this count at the end of its last pass
        # and sees it unchanged knows that no answer (ACK, event) waits for a pass.
        self.batches = 0
        self._drained_at: float | None = None  # a drain noted before its batch was processed
        self._now = 0.0
        self._control: list[Datagram] = []
        self.counters = self.receiver.counters  # one set of reject counters per endpoint
        # Every kind has an entry: DATA never reaches the table (the framing pass sends it to
        # the data path) and HELLO belongs to the control plane's handshake, so both are
        # counted as unexpected here.
        self._dispatch: dict[int, _Handler] = {
            Kind.DATA: self._on_unexpected,
            Kind.HELLO: self._on_unexpected,
            Kind.ACK: self._on_ack,
            Kind.NACK: self._on_nack,
            Kind.STOP: self._on_stop,
            Kind.PROBE: self._on_probe,
            Kind.PROBE_ACK: self._on_probe_ack,
            Kind.MANIFEST: self._on_receiver_control,
            Kind.FIN: self._on_receiver_control,
        }
        assert set(self._dispatch) == set(Kind), "a Kind without a control handler"

    # -- driver API ---------------------------------------------------------------------------
    @property
    def rx_arena(self) -> np.ndarray:
        """The receive arena: one datagram per row, ``slot_bytes`` wide. The free rows are
        ``rx_arena[rx_free:]``: fill some of them from the first, then
        :meth:`commit_datagrams`. The rows are only valid until then, and the arena itself may
        change with a commit (held early data keeps its rows): read it again after each."""
        return self._rx

    @property
    def rx_free(self) -> int:
        """The first free row of :attr:`rx_arena`."""
        return self._rx_n

    def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
        """The ``len(lengths)`` datagrams just written into rows ``rx_free, rx_free + 1, ...``
        of :attr:`rx_arena`, all from ``path``, have these real lengths (longer than a row:
        truncated, counted as oversized). At most ``len(rx_arena) - rx_free`` of them. A batch
        is processed before any output or event is produced, and at once when the arena is
        full (so :attr:`rx_free` may be back at the top after this call)."""
        k = int(lengths.shape[0])
        if k == 0:
            return
        i = self._rx_n
        if i + k > self._rx.shape[0]:
            raise ValueError(f"{k} datagrams committed with {self._rx.shape[0] - i} rows free")
        self._rx_len[i : i + k] = lengths
        self._rx_path[i : i + k] = path
        self._committed(i, k, now)

    def receive_datagram(self, data: bytes | memoryview, path: int, now: float) -> None:
        """:meth:`commit_datagrams` for one datagram given as bytes: copied into the next row
        (cut to the row's width: a longer one counts as oversized), then committed."""
        i, n = self._rx_n, len(data)
        if n <= self._rx.shape[1]:
            self._rx[i, :n] = np.frombuffer(data, dtype=np.uint8)
        self._rx_len[i] = n
        self._rx_path[i] = path
        self._committed(i, 1, now)

    def receive_rows(self, rows: np.ndarray, lengths: np.ndarray, path: int, now: float) -> None:
        """Process, at once and in place, datagrams that lie one per row in the driver's own
        buffer (a ZeroMQ batch frame: no copy into :attr:`rx_arena`), after any committed
        before them. ``rows``: C-contiguous uint8 rows a multiple of 8 bytes wide (cut to
        ``slot_bytes``: a longer datagram counts as oversized, as in
        :meth:`commit_datagrams`); ``lengths``: int64, one per row, at most the width. The
        receiver may keep views of some rows (early data) until their collective starts: the
        buffer must not change while views of it live."""
        k = int(rows.shape[0])
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] % 8:
            raise ValueError(f"rows must be uint8 rows of a multiple of 8 bytes, got {rows.shape}")
        if lengths.dtype != np.int64 or lengths.shape != (k,):
            raise ValueError(
                f"lengths must be {k} int64 values, got {lengths.dtype}{lengths.shape}"
            )
        self._now = now
        self._flush(now)
        if k == 0:
            return
        width = self.config.slot_bytes
        if rows.shape[1] > width:
            rows = np.ascontiguousarray(rows[:, :width])
            lengths = np.where(lengths > width, width + 1, lengths)
        elif not rows.flags.c_contiguous:
            rows = np.ascontiguousarray(rows)
        self.batches += 1
        self._process(rows, lengths, np.full(k, path, dtype=np.int64), now, True)

    def note_drained(self, now: float) -> None:
        """The driver read every receive socket empty in a pass that began at ``now``: whatever
        had reached this host before ``now`` has been committed. Drivers whose input can queue
        unread (sockets) say so after each pass that emptied them all; the receiver then trusts
        a sender's pass end only once such a pass began after it came (see
        :mod:`gradlane.transport.core.receiver`). Drivers that never call this deliver everything at
        once (in-memory wires)."""
        if self._rx_n == self._rx_base:
            self.receiver.note_drained(now)
        else:  # once what was read is processed (it may wait for rx_coalesce_s)
            self._drained_at = now

    def _committed(self, first: int, k: int, now: float) -> None:
        """Rows ``first .. first + k`` hold new datagrams: process the batch once it is full."""
        self._now = now
        self._rx_n = first + k
        if first == self._rx_base:
            self._rx_first = now
        if self._rx_n == RX_BATCH:
            self._flush(now)

    def datagrams_to_send(
        self, now: float, *, process_input: bool = True
    ) -> list[Datagram | DatagramRun]:
        """Receiver control (ACK/NACK/STOP), probe answers, then sender output.

        Received datagrams whose coalescing window has passed are processed first, unless
        ``process_input`` is False: a driver that just started a collective sends its first
        datagrams before it spends time on a batch that is waiting (the peers wait on them).
        """
        self._now = now
        if process_input and now >= self._rx_first + self.config.rx_coalesce_s:
            self._flush(now)
        out: list[Datagram | DatagramRun] = list(self.receiver.datagrams_to_send(now))
        if self._control:
            out.extend(self._control)
            self._control = []
        out.extend(self.sender.datagrams_to_send(now))
        return out

    def input_held(self, now: float) -> bool:
        """True while the datagrams received last wait out ``rx_coalesce_s``: a batch is open
        and its window has not passed, so it is processed at :meth:`get_timer`, not before. A
        driver that just read datagrams then needs no pass until that timer, unless a batch
        was processed meanwhile (:attr:`batches` moved: its answers wait for a pass)."""
        return (
            self.config.rx_coalesce_s > 0
            and self._rx_n > self._rx_base
            and now < self._rx_first + self.config.rx_coalesce_s
        )

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must run next (now, if received datagrams await processing)."""
        if self._rx_n > self._rx_base:
            return self._rx_first + self.config.rx_coalesce_s
        times = [t for t in (self.receiver.get_timer(), self.sender.get_timer()) if t is not None]
        return min(times) if times else None

    def handle_timer(self, now: float) -> None:
        """Process pending input, then the receiver's and sender's time-driven work."""
        self._now = now
        self._flush(now)
        self.receiver.handle_timer(now)
        self.sender.handle_timer(now)

    def pop_event(self) -> Event | None:
        """Pop the next event already produced (received datagrams are left unprocessed)."""
        return self._events.popleft() if self._events else None

    def next_event(self) -> Event | None:
        """Pop the next event (after processing input whose coalescing window has passed)."""
        if self._now >= self._rx_first + self.config.rx_coalesce_s:
            self._flush(self._now)
        return self._events.popleft() if self._events else None

    # -- helpers for collectives -------------------------------------------------------------
    @property
    def now(self) -> float:
        """The latest time a driver (or a collective's start) passed in."""
        return self._now

    def note_time(self, now: float) -> None:
        """A collective started at ``now``: later processing must not use an older time."""
        self._now = max(self._now, now)

    def note_step(self, step: int) -> None:
        """Move the accepted step window forward when a newer step starts locally."""
        if step > self._newest_step:
            self._newest_step = step
            self.session = self._session()

    def owed(self) -> set[tuple[int, int]]:
        """The (step, bucket) of every outgoing transfer neither acknowledged nor stopped by its
        receiver. May run off the driver's thread: ``list()`` copies the keys in one step
        under the GIL while the driver changes them."""
        return {(k.step, k.bucket) for k in list(self.sender.transfers)}

    def path_stats(self) -> dict[int, dict[str, Any]]:
        """Per peer, per path: state, rate, RTT, loss EWMA, sent/acked/lost bytes."""
        return {peer: ps.snapshot() for peer, ps in self.sender.paths.items()}

    def stats(self) -> dict[str, object]:
        """Reject counters by reason and a few totals (for logs and reports)."""
        return {
            "rejected": {
                r.name.lower(): int(self.counters[r])
                for r in Reason
                if r != Reason.OK and self.counters[r]
            },
            "accepted": int(self.counters[Reason.OK]),
            "late": self.receiver.late,
            "early_dropped": self.receiver.early_dropped,
            "early_expired": self.receiver.early_expired,
            "early_copied": self.receiver.early_copied,
            "early_control_dropped": self.receiver.early_control_dropped,
            "burst_cuts": self.sender.burst_cuts,
            "rx_arenas": len(self._arenas),
            # The newest rejected packets (duplicates aside) and what they claimed to be.
            "rejected_recent": list(self.receiver.rejected_recent),
        }

    # -- internals ---------------------------------------------------------------------------
    def _session(self) -> SessionSpec:
        w = self.config.step_window
        return SessionSpec(
            job=self.config.job,
            me=self.me,
            world=self.world,
            key=self.key,
            step_lo=max(0, self._newest_step - w),
            step_hi=self._newest_step + w,
            max_datagram=self.config.slot_bytes,
        )

    def _encode(
        self,
        kind: int,
        key: OutKey,
        *,
        chunk: int = 0,
        count: int = 0,
        payload: bytes = b"",
        aux: int = 0,
        flags: int = 0,
    ) -> bytes:
        return self._encode_to(
            kind, key, key.dst, chunk=chunk, count=count, payload=payload, aux=aux, flags=flags
        )

    def _encode_to(
        self,
        kind: int,
        key: tuple[int, ...],
        dst: int,
        *,
        chunk: int = 0,
        count: int = 0,
        payload: bytes = b"",
        aux: int = 0,
        flags: int = 0,
        norm: float = 0.0,
    ) -> bytes:
        # HEADER_DTYPE's order (tag left out): no Header object per control packet.
        values = (
            MAGIC, VERSION, kind, flags, 0, DType.F32, key[3], self.config.job, key[0], key[1],
            key[2], self.me, dst, chunk, count, norm, aux,
        )  # fmt: skip
        return encode_values(values, payload, self.key)

    def _flush(self, now: float) -> None:
        b, e = self._rx_base, self._rx_n
        if e == b:
            return
        self._rx_n = b  # a flush nested in this one finds nothing to do
        self.batches += 1
        arena = self._rx[b:e]
        # Early data may stay in place only if the next batches have room: above this one, or
        # in an arena that holds nothing; otherwise the receiver copies it out of the arena.
        pin = RX_BATCH - e >= MIN_ROOM or self._spare_arena() is not None
        if self._process(arena, self._rx_len[b:e], self._rx_path[b:e], now, pin):
            self._pins.append((e, weakref.ref(arena)))
        del arena
        if self._drained_at is not None:
            self.receiver.note_drained(self._drained_at)
            self._drained_at = None
        # The next batch starts above every batch the receiver still holds in place in this
        # arena (it drops a held batch when its collective starts or the data expires), else
        # at the top; with too few rows left there, at the top of an arena that holds nothing.
        self._pins = [(end, ref) for end, ref in self._pins if ref() is not None]
        top = max((end for end, ref in self._pins if _arena_of(ref) is self._rx), default=0)
        if RX_BATCH - top < MIN_ROOM:
            spare = self._spare_arena()
            if spare is not None:
                self._rx, top = spare, 0
        self._rx_base = self._rx_n = top

    def _spare_arena(self) -> np.ndarray | None:
        """An arena other than the current one that holds no batch in place (a new one when
        none does and fewer than the most are made: untouched, it takes no memory yet), or
        None."""
        held = {id(_arena_of(ref)) for _, ref in self._pins}
        for a in self._arenas:
            if a is not self._rx and id(a) not in held:
                return a
        if len(self._arenas) >= self._max_arenas:
            return None
        self._arenas.append(np.zeros_like(self._rx))
        return self._arenas[-1]

    def _process(
        self, arena: np.ndarray, lengths: np.ndarray, paths: np.ndarray, now: float, pin: bool
    ) -> bool:
        """Process one batch of datagrams (with ``pin``, early data may be held in place);
        True when the receiver holds some of its rows in place."""
        n = arena.shape[0]
        data_rows = np.empty(n, dtype=np.int64)
        ctrl_rows = np.empty(n, dtype=np.int64)
        key = self._batch_key
        # Framing checks (validate()'s first six, in its order; failures counted) and the split
        # into DATA and control rows, in one pass: see gradlane.transport.kernels.batch.
        nd, nc, mixed = frame_rows(
            arena, lengths, n, self.config.job, self.counters, data_rows, ctrl_rows, key
        )
        # The header records, made only when something reads them (DATA batches do not):
        # control packets, or data of a transfer not running here.
        hv = header_view(arena) if nc else None
        if nd:
            rows = data_rows[:nd]
            if mixed:
                groups = self._groups(arena, rows)
            else:
                groups = [(InKey(int(key[0]), int(key[1]), int(key[2]), int(key[3])), rows)]
            pinned = self._flush_data(arena, lengths, paths, hv, groups, now, pin)
        else:
            pinned = False
        if not nc:
            return pinned
        assert hv is not None
        # validate()'s checks, the tag included, for every control row in one compiled pass:
        # only packets that pass them (from a peer, with a secret) cost Python each.
        crow = ctrl_rows[:nc]
        why = kernels.session_checks(arena, lengths, crow, self.session)
        good = why == _OK
        if not good.all():
            bad = why[~good]
            self.counters += np.bincount(bad, minlength=N_REASONS)[:N_REASONS]
            self.receiver.note_rejected(arena, lengths, crow, why, paths, now)
            crow = crow[good]
        for i, n_i, path in zip(
            crow.tolist(), lengths[crow].tolist(), paths[crow].tolist(), strict=True
        ):
            raw = arena[i, :n_i].tobytes()
            h = HeaderFields._make(hv[i].item())  # every field at once, as Python numbers
            # The checks took only Kind values: the dispatch table has each of them.
            reason: int = self._dispatch.get(h.kind, self._on_unexpected)(
                raw, h._asdict(), path, now
            )
            self.counters[reason] += 1
        return pinned

    @staticmethod
    def _groups(arena: np.ndarray, rows: np.ndarray) -> list[tuple[InKey, np.ndarray]]:
        """DATA ``rows`` of ``arena`` grouped by transfer key (a batch that mixes transfers),
        in key order, each group in batch order: one compiled pass (a NumPy sort of the
        structured records' fields would cost tens of µs a batch)."""
        n = int(rows.shape[0])
        out = np.empty(n, dtype=np.int64)  # fresh: held early data may keep a group's rows
        keys = np.empty((n, 4), dtype=np.int64)
        starts = np.empty(n + 1, dtype=np.int64)
        g = group_rows(arena, rows, out, keys, starts)
        bounds = starts[: g + 1].tolist()
        return [
            (InKey(*k), out[a:b])
            for k, a, b in zip(keys[:g].tolist(), bounds[:-1], bounds[1:], strict=True)
        ]

    def _flush_data(
        self,
        arena: np.ndarray,
        lengths: np.ndarray,
        paths: np.ndarray,
        hv: np.ndarray | None,
        groups: Iterable[tuple[InKey, np.ndarray]],
        now: float,
        pin: bool,
    ) -> bool:
        """DATA rows to their transfers, or held as early data; True if any are held in place."""
        pinned = False
        for key, grp in groups:
            t = self.receiver.transfers.get(key)
            if t is not None:
                self.receiver.on_data(t, arena, lengths, grp, paths, now, self.session)
                if t.gather and t.got and not t.sent_stopped:
                    # The owner gathers: its reduce of this shard is over, and our result
                    # (the caller's buffer, when in place) now holds its sums where our
                    # contribution was. Resending that would send other bytes under the
                    # tag computed at the start: stop at once, as its STOP would.
                    t.sent_stopped = True
                    self.sender.on_stop(OutKey(key.step, key.bucket, key.shard, Phase.REDUCE,
                                               key.shard))  # fmt: skip
                continue
            # Data for a transfer not running here is held (or answered with STOP), checked as a
            # batch. Without a secret its tag is a checksum, which the receive kernel checks
            # when held data is replayed: not computing it here saves a slow pass over each
            # early 64 KB packet. With a secret, nothing unauthenticated is held or answered.
            if hv is None:
                hv = header_view(arena)
            if self.key.mode != TAG_FAST:  # every check, the tag first, as validate() orders
                why = kernels.session_checks(arena, lengths, grp, self.session)
            else:
                why = validate_data_rows(hv[grp], lengths[grp], self.session)
            bad = why != _OK
            held = grp
            if bad.any():
                self.counters += np.bincount(why[bad], minlength=N_REASONS)[:N_REASONS]
                self.receiver.note_rejected(arena, lengths, grp, why, paths, now)
                held = grp[~bad]
            if held.size:
                pinned |= self.receiver.on_unknown_data(
                    key, arena, lengths, paths, held, hv["src"][held], now, pin=pin
                )
        return pinned

    # -- control handlers (dispatch table) -----------------------------------------------------
    # Each returns the Reason its packet is counted under (OK: accepted, acted on or not).
    @staticmethod
    def _bits(raw: bytes, count: int) -> np.ndarray:
        return np.unpackbits(
            np.frombuffer(raw, dtype=np.uint8, offset=HEADER_SIZE), count=count, bitorder="little"
        ).astype(bool)

    @staticmethod
    def _out_key(f: dict[str, int]) -> OutKey:
        return OutKey(f["step"], f["bucket"], f["shard"], f["phase"], f["src"])

    def _bitmap(self, key: OutKey, raw: bytes, f: dict[str, int]) -> tuple[int, np.ndarray | None]:
        """The reason to count an ACK or NACK about outgoing transfer ``key`` under, and its
        bitmap: None when there is nothing to apply (the transfer is finished or was never
        ours, an ordinary late packet) or the bitmap reaches past the transfer's chunks
        (``BITMAP_RANGE``, nothing unpacked). A receiver's bitmaps cover chunks ``chunk ..
        chunk + count`` within the shard, never beyond it."""
        n = self.sender.n_chunks(key)
        if n is None:
            return _OK, None
        if f["chunk"] + f["count"] > n:
            return _BITMAP_RANGE, None
        return _OK, self._bits(raw, f["count"])

    def _on_unexpected(self, raw: bytes, f: dict[str, int], path: int, now: float) -> int:
        return _UNEXPECTED_KIND

    def _on_ack(self, raw: bytes, f: dict[str, int], path: int, now: float) -> int:
        key = self._out_key(f)
        if f["flags"] & Flags.HELD:
            self.sender.on_held(key)
            return _OK
        why, bits = self._bitmap(key, raw, f)
        if bits is None:
            return why
        ack_delay = f["norm"]  # the receiver's hold time travels in the norm field
        self.sender.on_ack(
            key,
            f["chunk"],
            bits,
            f["aux"],
            bool(f["flags"] & Flags.PROTECTED),
            now,
            ack_delay=ack_delay if np.isfinite(ack_delay) and ack_delay >= 0 else 0.0,
        )
        return _OK

    def _on_nack(self, raw: bytes, f: dict[str, int], path: int, now: float) -> int:
        key = self._out_key(f)
        why, bits = self._bitmap(key, raw, f)
        if bits is None:
            return why
        # aux: the newest chunk that reached the receiver from us, plus one (0: none yet).
        self.sender.on_nack(key, f["chunk"], bits, now, newest=f["aux"] - 1)
        return _OK

    def _on_stop(self, raw: bytes, f: dict[str, int], path: int, now: float) -> int:
        self.sender.on_stop(self._out_key(f))
        return _OK

    def _on_probe(self, raw: bytes, f: dict[str, int], path: int, now: float) -> int:
        # The probe's step (within our window, so within the prober's): not step 0, which
        # falls out of every window 64 steps into a job.
        reply = self._encode_to(Kind.PROBE_ACK, (f["step"], 0, 0, 0), f["src"], aux=f["aux"])
        self._control.append(Datagram(reply, f["src"], path, self.config.priority.tos(0)))
        return _OK

    def _on_probe_ack(self, raw: bytes, f: dict[str, int], path: int, now: float) -> int:
        self.sender.on_probe_ack(f["src"], path, f["aux"], now)
        return _OK

    def _on_receiver_control(self, raw: bytes, f: dict[str, int], path: int, now: float) -> int:
        return self.receiver.on_control(raw, path, now, header=f)
