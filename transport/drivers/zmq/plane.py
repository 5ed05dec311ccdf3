"""Reliable ZeroMQ data plane: gradlane packets as ZeroMQ frames, driven on one thread.

Theory of operation
-------------------
:class:`ZmqPlane` is a driver of the sans-I/O
:class:`~gradlane.transport.core.collective.TransposeAllReduce` (the aioquic shape, STYLE rule
1), like the UDP plane, with ZeroMQ in place of datagrams, and a
:class:`~gradlane.transport.drivers.plane.Plane`:

* every rank binds one PULL socket per path on its own endpoint (all peers fan in), and connects
  one PUSH socket per (peer, path) to the peers' endpoints. A frame carries gradlane packets,
  header and tag included, so the same validation runs as over UDP: a pass's DATA packets for
  one (peer, path) travel as batch frames of up to 4 MiB
  (:mod:`gradlane.transport.drivers.zmq.frames`: far fewer messages than one per packet; ``python
  -m gradlane.bench.perf.allreduce --zmq-batch-compare`` times both), whose rows the core
  processes where libzmq received them (no copy); a control packet is one frame;
* one thread runs a :class:`zmq.Poller` loop (:class:`_Loop`): it drains the PULL sockets
  (``recv(copy=False)``: a batch frame's rows go to the core in place, a lone packet is copied
  into the core's batching arena), runs ``handle_timer`` when ``get_timer()`` is due, sends
  ``datagrams_to_send(now)`` to ``dg.peer`` on path ``dg.path``, and turns ``next_event()``
  into Future results. The poll timeout is ``get_timer() - now``, so the loop sleeps when idle;
* other threads talk to it through :meth:`ZmqPlane.submit`: a thread-safe queue plus a wake
  message on an inproc PAIR socket (ZeroMQ sockets are not thread-safe, so only the loop thread
  ever touches the data sockets). What the callers and the loop share is one small object
  (:class:`_Shared`) with its lock; the loop touches nothing else of the plane's.

Large frames go out zero-copy (``send(memoryview, copy=False)``): a batch frame is a buffer of
its own, filled from the caller's data, and the memoryview keeps it alive until ZeroMQ has sent
it. Small frames (ACKs) are copied, which is cheaper than the zero-copy bookkeeping. A socket
whose high-water mark is reached is not blocked on: its frames wait in an ordered backlog and
the loop polls for POLLOUT. On the receiving side libzmq puts every large frame in a buffer
it allocates and frees; :meth:`ZmqPlane.start` sets glibc's malloc thresholds where glibc's own
adjustment ends, so those buffers stay mapped from the first frame instead of being faulted in
afresh for each (:mod:`gradlane.transport.drivers.zmq.malloc`: process-wide, on by default).

ZeroMQ over TCP/IPC is reliable and ordered, so :func:`zmq_config` defaults to
``loss_bound = 0`` (exact all-reduce), 65000-byte chunks, loss-recovery timers pushed out to
about a second (they can only fire spuriously here) and a fixed (unpaced) rate: TCP and the
high-water marks already do flow control. The cores are the same as
over UDP, so ACKs still flow (about one small frame per received batch frame). That is
acceptable: they cost a fraction of a percent of the bytes, they are what completes each transfer
(the receiver's completion *is* its ACK bookkeeping), and keeping one core for both planes means
one set of tests and no second protocol to keep in sync.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.pacing import PacingConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import Datagram, DatagramRun
from gradlane.transport.drivers.futures import (
    CollectiveRequest,
    CollectiveResult,
    PendingCollectives,
    urgency,
)
from gradlane.transport.drivers.warmup import warm_up
from gradlane.transport.drivers.zmq import frames as zmq_batch
from gradlane.transport.drivers.zmq.malloc import retain_freed_memory
from gradlane.transport.errors import ConfigError, TransferFailed

__all__ = ["ZERO_COPY_MIN_BYTES", "ZmqPlane", "zmq_config"]

log = logging.getLogger(__name__)

#: Frames at least this large are sent zero-copy; smaller ones are copied (cheaper for ACKs).
ZERO_COPY_MIN_BYTES = 16384
#: Most frames drained from one socket per loop turn, so timers and sends are not starved.
RX_DRAIN = 1024


def zmq_config(**overrides: Any) -> TransportConfig:
    """A :class:`TransportConfig` suited to the reliable ZeroMQ plane; ``overrides`` win.

    ZeroMQ never loses a frame, so every loss-recovery trigger of the cores can only fire
    spuriously (a stalled thread on a loaded host) and turn into duplicate frames: the RTO, the
    RACK reorder window and the soft deadline (after which a receiver NACKs what is missing) are
    all pushed out to around a second. Exact all-reduce (``loss_bound = 0``); a peer that has
    not delivered after ``hard_deadline_s`` is dead or wedged, so the collective fails with
    ``PeerTimeout`` rather than completing degraded. 65000-byte chunks; a fixed, effectively
    unlimited pacing rate, because TCP and the high-water marks already do flow control. An
    ACK per 256 DATA packets (``ack_every``; the ``ack_delay_s`` timer and a transfer's
    completion still answer every batch at once): over a wire that does not lose, ACKs only
    complete transfers and free their sources, and each costs both loops a message.
    """
    base: dict[str, Any] = {
        "chunk_bytes": 65000,
        "min_rto_s": 1.0,
        "reorder_window_s": 1.0,
        "burst_packets": 256,
        "ack_every": 256,
        "loss": LossConfig(
            loss_bound=0.0,
            soft_deadline_min_s=1.0,
            soft_deadline_max_s=5.0,
            hard_deadline_s=30.0,
            on_hard_deadline="raise",
        ),
        "pacing": PacingConfig(
            controller="fixed",
            initial_rate_Bps=1.0e11,
            max_rate_Bps=1.0e11,
            burst_bytes=8 << 20,
        ),
    }
    base.update(overrides)
    return TransportConfig(**base)


#: A submitted collective on its way to the loop thread.
_Job = tuple[CollectiveRequest, Future[CollectiveResult]]

#: The plane's counters (``stats()``), all written by the loop thread.
_COUNTERS = ("completed", "failed", "frames_in", "frames_out", "packets_in", "packets_out",
             "bytes_in", "bytes_out", "backlogged", "bad_frames", "send_buffers")  # fmt: skip


@dataclass
class _Shared:
    """What a :class:`ZmqPlane`'s callers and its loop thread share. ``lock`` guards
    ``closed`` and ``fatal`` (and the plane's wake socket); ``counters`` and
    ``endpoint_stats`` are written by the loop only and read from any thread (plain reads of
    an int or a reference are atomic in CPython)."""

    me: int
    inbox: queue.SimpleQueue[_Job] = field(default_factory=queue.SimpleQueue)
    pending: PendingCollectives = field(default_factory=PendingCollectives)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    endpoint_stats: dict[str, object] = field(default_factory=dict)
    closed: bool = False
    fatal: BaseException | None = None

    def fail_pending(self, reason: str) -> None:
        """Fail every queued or running collective (loop thread, or after it has exited)."""
        with self.lock:
            while True:
                try:
                    req, fut = self.inbox.get_nowait()
                except queue.Empty:
                    break
                self.pending.add(req.step, req.bucket, fut)
        self.pending.fail_all(
            lambda step, bucket: TransferFailed(
                f"rank {self.me}: all-reduce of step {step} bucket {bucket} did not "
                f"complete: {reason} while it was in flight"
            )
        )


class ZmqPlane:
    """One rank's reliable data plane over ZeroMQ, driving a :class:`TransposeAllReduce`.

    ``endpoints[r]`` is where rank r's PULL sockets listen: one string, or one string per path
    (``config.n_paths`` of them). This rank binds ``endpoints[me]`` and connects to the others.
    :meth:`start` (or ``with``) starts the loop thread; :meth:`submit` is thread-safe;
    :meth:`close` fails in-flight Futures with :class:`TransferFailed` and closes every socket.
    ``hwm`` is the per-socket high-water mark in frames (of up to ``batch_bytes`` each, so
    ZeroMQ queues at most ``hwm × batch_bytes`` per socket; beyond it frames wait in the
    loop's backlog until the socket drains). ``batch_bytes`` caps a batch frame
    (:mod:`gradlane.transport.drivers.zmq.frames`); 0 sends one packet per frame (for
    comparisons: the receiver takes either kind). ``tune_malloc`` (default True): set glibc's
    malloc parameters at :meth:`start` so libzmq's receive buffers stay mapped
    (:func:`~gradlane.transport.drivers.zmq.malloc.retain_freed_memory`, process-wide;
    ``GRADLANE_NO_MALLOC_TUNING=1`` also turns it off); ``stats()["malloc_tuned"]`` says
    whether they were set.
    """

    def __init__(
        self,
        me: int,
        world: int,
        config: TransportConfig | None = None,
        endpoints: Sequence[str | Sequence[str]] = (),
        *,
        rng: np.random.Generator | None = None,
        hwm: int = 1024,
        batch_bytes: int = zmq_batch.BATCH_BYTES,
        tune_malloc: bool = True,
    ) -> None:
        self.me = me
        self.world = world
        self.config = cfg = config or zmq_config()
        if len(endpoints) != world:
            raise ConfigError(f"{len(endpoints)} data endpoints for a world of {world}")
        self.endpoints: tuple[tuple[str, ...], ...] = tuple(
            (e,) if isinstance(e, str) else tuple(e) for e in endpoints
        )
        for r, eps in enumerate(self.endpoints):
            if len(eps) != cfg.n_paths:
                raise ConfigError(
                    f"rank {r} has {len(eps)} data endpoint(s) but n_paths={cfg.n_paths}: "
                    "give one endpoint per path"
                )
        self._core = TransposeAllReduce(me, world, cfg, rng)
        self._hwm = hwm
        if batch_bytes < 0:
            raise ConfigError(
                f"batch_bytes must be >= 0 (0: one packet per frame), got {batch_bytes}"
            )
        self.batch_bytes = batch_bytes
        self._tune_malloc = tune_malloc
        #: glibc keeps freed receive buffers mapped (:mod:`gradlane.transport.drivers.zmq.malloc`)
        self.malloc_tuned = False
        self._shared = _Shared(me)
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._wake_tx: zmq.Socket[bytes] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> ZmqPlane:
        """Bind, connect and start the loop thread (idempotent); returns ``self``."""
        if self._shared.closed:
            raise TransferFailed(f"rank {self.me}: the ZeroMQ data plane is closed")
        if self._thread is not None:
            return self
        # Compile the kernels now, not inside the first collective's deadlines.
        warm_up(zmq=True)
        if self._tune_malloc:  # before libzmq's I/O thread allocates its first frame
            self.malloc_tuned = retain_freed_memory()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self._ctx = ctx
        made: list[zmq.Socket[bytes]] = []

        def sock(kind: int) -> zmq.Socket[bytes]:
            s = ctx.socket(kind)
            made.append(s)
            s.linger = 0
            return s

        try:
            pulls = []
            for ep in self.endpoints[self.me]:
                s = sock(zmq.PULL)
                s.rcvhwm = self._hwm
                s.bind(ep)
                pulls.append(s)
            pushes: dict[tuple[int, int], zmq.Socket[bytes]] = {}
            for r in range(self.world):
                if r == self.me:
                    continue
                for q, ep in enumerate(self.endpoints[r]):
                    s = sock(zmq.PUSH)
                    s.sndhwm = self._hwm
                    s.copy_threshold = ZERO_COPY_MIN_BYTES
                    s.connect(ep)  # queued until the peer binds: no start order between ranks
                    pushes[(r, q)] = s
            wake_rx, wake_tx = sock(zmq.PAIR), sock(zmq.PAIR)
            addr = f"inproc://gl-zmq-plane-wake-{id(self)}"
            wake_rx.bind(addr)
            wake_tx.connect(addr)
        except zmq.ZMQError as exc:
            for s in made:
                s.close(linger=0)
            ctx.term()
            self._ctx = None
            raise TransferFailed(f"rank {self.me}: cannot set up the ZeroMQ plane: {exc}") from exc
        self._wake_tx = wake_tx
        loop = _Loop(self._core, self._shared, pulls, pushes, wake_rx, self.batch_bytes)
        self._thread = threading.Thread(
            target=loop.run, name=f"gl-zmq-plane-{self.me}", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the loop, fail in-flight Futures with :class:`TransferFailed`, close all sockets."""
        shared = self._shared
        with shared.lock:
            if shared.closed:
                return
            # Under the lock: a submit() either sees the plane closed or is in the inbox
            # before close() drains it, so no Future is ever left pending.
            shared.closed = True
        shared.stopping.set()
        if self._thread is not None:
            self._wake()
            self._thread.join()
        shared.fail_pending("the ZeroMQ data plane was closed")
        with shared.lock:
            if self._wake_tx is not None:
                self._wake_tx.close(linger=0)
                self._wake_tx = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> ZmqPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- API ------------------------------------------------------------------------------------
    def submit(
        self,
        step: int,
        bucket: int,
        data: np.ndarray,
        layer_position: float = 0.5,
        dtype: int | None = None,
        servers: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        *,
        scale: float = 1.0,
        pinned: bool = False,
    ) -> Future[CollectiveResult]:
        """All-reduce ``data`` (1-D float32/float16, or raw 16-bit words with ``dtype``);
        ``servers`` makes it a parameter-server push/pull, ``out`` receives the result,
        ``scale`` multiplies it and ``pinned`` protects every chunk (all as
        :meth:`gradlane.transport.drivers.udp.plane.UdpPlane.submit`).

        Thread-safe. The Future resolves to ``(sum over ranks, CollectiveReport)`` or fails with
        the collective's error (:class:`TransferFailed` if the plane closes first). ``data`` is
        read on the loop thread until the Future resolves: do not modify it before.
        """
        fut: Future[CollectiveResult] = Future()
        srv = None if servers is None else tuple(servers)
        req = CollectiveRequest(
            step, bucket, data, layer_position, dtype, srv, out=out, scale=scale, pinned=pinned
        )
        shared = self._shared
        with shared.lock:
            if shared.closed or self._thread is None or shared.fatal is not None:
                if shared.fatal is not None:
                    state = f"broken ({shared.fatal!r})"
                else:
                    state = "closed" if shared.closed else "not started (call start())"
                fut.set_exception(
                    TransferFailed(f"rank {self.me}: the ZeroMQ data plane is {state}")
                )
                return fut
            shared.inbox.put((req, fut))
        self._wake()
        return fut

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Nothing to wait for: ZeroMQ delivers (and resends) queued frames itself, and a rank
        completes a collective only once every peer's frames of it arrived. Always True (the
        :meth:`gradlane.transport.drivers.udp.plane.UdpPlane.drain` of the reliable plane)."""
        return True

    def stats(self) -> dict[str, Any]:
        """Frame/byte counters and the endpoint's reject counters (thread-safe snapshot)."""
        shared = self._shared
        return {
            "rank": self.me,
            **dict(shared.counters),
            "malloc_tuned": self.malloc_tuned,
            "endpoint": dict(shared.endpoint_stats),
        }

    def _wake(self) -> None:
        with self._shared.lock:
            if self._wake_tx is None:
                return
            # Again means a wake is already queued, and one is enough.
            with contextlib.suppress(zmq.Again):
                self._wake_tx.send(b"", zmq.NOBLOCK)


class _SendBuffers:
    """Batch-frame buffers of ``nbytes``, reused once ZeroMQ has sent what they held.

    ZeroMQ sends a zero-copy frame later, from its I/O thread, so a buffer is free again only
    when pyzmq's ``MessageTracker`` says so. Reusing them saves what a fresh buffer per
    frame would cost: a page fault per 4 KB, most of the plane's sending time. Idle buffers
    are kept up to ``keep_bytes`` (at least two); a frame larger than ``nbytes`` (one
    oversized packet) gets its own.
    """

    def __init__(self, nbytes: int, counters: dict[str, int], keep_bytes: int = 64 << 20) -> None:
        self.nbytes = nbytes
        self.keep = max(2, keep_bytes // nbytes)
        self._n = counters  # "send_buffers": pooled buffers made so far
        self.free: list[np.ndarray] = []
        # Sent buffers in sending order, with their trackers (None: ZeroMQ copied the frame).
        self.busy: deque[tuple[np.ndarray, zmq.MessageTracker | None]] = deque()

    def take(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes that nothing else uses."""
        if n > self.nbytes:
            return np.empty(n, dtype=np.uint8)
        busy = self.busy
        while busy and (busy[0][1] is None or busy[0][1].done):
            buf = busy.popleft()[0]
            if len(self.free) < self.keep:
                self.free.append(buf)
        if self.free:
            return self.free.pop()
        self._n["send_buffers"] += 1
        return np.empty(self.nbytes, dtype=np.uint8)

    def sent(self, buf: np.ndarray, tracker: zmq.MessageTracker | None) -> None:
        """``buf`` went to ZeroMQ; it is free once ``tracker`` is done."""
        if buf.shape[0] == self.nbytes:
            self.busy.append((buf, tracker))


class _Loop:
    """The loop thread's state: only this thread touches the data sockets and the core; what
    it shares with the plane's callers is ``shared``."""

    def __init__(
        self,
        core: TransposeAllReduce,
        shared: _Shared,
        pulls: list[zmq.Socket[bytes]],
        pushes: dict[tuple[int, int], zmq.Socket[bytes]],
        wake_rx: zmq.Socket[bytes],
        batch_bytes: int,
    ) -> None:
        self.core = core
        self.shared = shared
        self.n = shared.counters
        self.batch_bytes = batch_bytes
        self.pulls = pulls
        self.pushes = pushes
        self.wake_rx = wake_rx
        # Frames waiting for a full socket, in order, with the pooled buffer each one is in.
        self.backlog: dict[zmq.Socket[bytes], deque[tuple[bytes | memoryview, np.ndarray | None]]]
        self.backlog = {}
        self.buffers = _SendBuffers(max(batch_bytes, 1), shared.counters)
        self.poller = zmq.Poller()
        for s in pulls:
            self.poller.register(s, zmq.POLLIN)
        self.poller.register(wake_rx, zmq.POLLIN)

    def run(self) -> None:
        """Turn until the plane stops; a crash fails every Future and marks the plane broken."""
        shared = self.shared
        try:
            while not shared.stopping.is_set():
                self._turn()
        except BaseException as exc:
            # A bug here must not hang callers: close() fails every Future with this cause.
            log.exception("rank %s: ZeroMQ data plane loop crashed", shared.me)
            with shared.lock:
                shared.fatal = exc
            shared.fail_pending(f"the ZeroMQ data plane loop crashed ({exc!r})")
        finally:
            for s in (*self.pulls, *self.pushes.values(), self.wake_rx):
                s.close(linger=0)

    def _turn(self) -> None:
        core, n = self.core, self.n
        timer = core.get_timer()
        timeout_ms: int | None = None
        if timer is not None:
            # Round up: a sub-millisecond wait rounded to 0 would spin until the timer is due.
            timeout_ms = max(0, math.ceil((timer - time.monotonic()) * 1000.0))
        ready = dict(self.poller.poll(timeout_ms))
        now = time.monotonic()
        if self.wake_rx in ready:
            while True:
                try:
                    self.wake_rx.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
            self._start_jobs(now)
        for path, s in enumerate(self.pulls):
            if s not in ready:
                continue
            for _ in range(RX_DRAIN):
                try:
                    frame = s.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                buf = frame.buffer
                n["frames_in"] += 1
                n["bytes_in"] += len(buf)
                if zmq_batch.is_batch(buf):
                    self._receive_batch(buf, path, now)
                else:
                    n["packets_in"] += 1
                    core.receive_datagram(buf, path, now)
        for s, ev in ready.items():
            if ev & zmq.POLLOUT and isinstance(s, zmq.Socket):
                self._flush_backlog(s)
        timer = core.get_timer()
        if timer is not None and now >= timer:
            core.handle_timer(now)
        runs: list[DatagramRun] = []
        for item in core.datagrams_to_send(now):
            if isinstance(item, DatagramRun):
                runs.append(item)
            else:
                if runs:  # keep each socket's order: earlier DATA before this packet
                    self._send_runs(runs)
                    runs = []
                self._send(item)
        if runs:
            self._send_runs(runs)
        self._deliver_events()

    def _receive_batch(self, buf: memoryview, path: int, now: float) -> None:
        """Hand a batch frame's rows to the core where they lie (see
        :mod:`gradlane.transport.drivers.zmq.frames`); a malformed frame is dropped and
        counted."""
        n = self.n
        rows, lengths = zmq_batch.rows(np.frombuffer(buf, dtype=np.uint8))
        if not lengths.shape[0]:
            n["bad_frames"] += 1
            log.debug("rank %s path %d: malformed batch frame dropped", self.shared.me, path)
            return
        n["packets_in"] += int(lengths.shape[0])
        self.core.receive_rows(rows, lengths, path, now)

    def _send_runs(self, runs: list[DatagramRun]) -> None:
        """Runs of DATA packets as batch frames: per (peer, path), every run's packets in
        order, framed together (a pass's transfers and priority classes share frames)."""
        n, limit = self.n, self.batch_bytes
        if limit == 0:
            for run in runs:
                for dg in run:
                    self._send(dg)
            return
        streams: dict[tuple[int, int], list[zmq_batch.Segment]] = {}
        for run in runs:
            paths = run.paths
            for q in np.unique(paths).tolist():
                sel = np.flatnonzero(paths == q)
                streams.setdefault((run.peer, q), []).append((run, sel))
                n["packets_out"] += int(sel.shape[0])
        for key, segments in streams.items():
            s = self.pushes[key]
            for a, b, stride, total in zmq_batch.frame_bounds(segments, limit):
                buf = self.buffers.take(total)
                zmq_batch.fill(segments, a, b, stride, buf[:total])
                n["frames_out"] += 1
                n["bytes_out"] += total
                self._push(s, buf[:total].data, buf)  # the view keeps the buffer alive

    def _start_jobs(self, now: float) -> None:
        shared = self.shared
        jobs = []
        while True:
            try:
                jobs.append(shared.inbox.get_nowait())
            except queue.Empty:
                break
        policy = self.core.endpoint.priority
        for req, fut in sorted(jobs, key=lambda job: urgency(job[0], policy)):
            if shared.pending.start(self.core, fut, req, now):
                # world == 1 completes inside start(); deliver it now rather than at the next wake.
                self._deliver_events()

    def _send(self, dg: Datagram) -> None:
        s = self.pushes[(dg.peer, dg.path)]
        n = self.n
        # One frame per packet: a DATA packet's header and payload view are joined into an
        # owned buffer, which ZeroMQ may then send without another copy.
        data = dg.data if dg.payload is None else dg.wire()
        n["frames_out"] += 1
        n["packets_out"] += 1
        n["bytes_out"] += len(data)
        self._push(s, data)

    def _push(
        self, s: zmq.Socket[bytes], data: bytes | memoryview, buf: np.ndarray | None = None
    ) -> None:
        """Send one frame without blocking, behind any backlog of its socket (order kept);
        ``buf``: the pooled buffer ``data`` lies in (see :class:`_SendBuffers`)."""
        pending = self.backlog.get(s)
        if pending:  # keep per-socket order: never overtake the backlog
            pending.append((data, buf))
            return
        try:
            self._send_now(s, data, buf)
        except zmq.Again:
            self.backlog[s] = deque([(data, buf)])
            self.poller.register(s, zmq.POLLOUT)
            self.n["backlogged"] += 1

    def _send_now(
        self, s: zmq.Socket[bytes], data: bytes | memoryview, buf: np.ndarray | None
    ) -> None:
        copy = len(data) < ZERO_COPY_MIN_BYTES
        if buf is None:
            s.send(data, zmq.NOBLOCK, copy=copy)
        elif copy:
            s.send(data, zmq.NOBLOCK, copy=True)
            self.buffers.sent(buf, None)
        else:
            self.buffers.sent(buf, s.send(data, zmq.NOBLOCK, copy=False, track=True))

    def _flush_backlog(self, s: zmq.Socket[bytes]) -> None:
        pending = self.backlog[s]
        while pending:
            data, buf = pending[0]
            try:
                self._send_now(s, data, buf)
            except zmq.Again:
                return
            pending.popleft()
        del self.backlog[s]
        self.poller.unregister(s)

    def _deliver_events(self) -> None:
        shared, n = self.shared, self.n
        completed, failed = shared.pending.deliver(self.core)
        n["completed"] += completed
        n["failed"] += failed
        if completed or failed:
            shared.endpoint_stats = self.core.stats()
