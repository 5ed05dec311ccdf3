"""The per-host transport daemon (ARCHITECTURE §4 hierarchical, §6 daemon).

Theory of operation
-------------------
One daemon per host serves that host's trainer ranks over a ZeroMQ ROUTER on an ``ipc://``
socket (file mode 0600: only this user's processes may connect) and runs the inter-host
all-reduce among the job's daemons with its own
:class:`~gradlane.transport.drivers.udp.plane.UdpPlane` (host rank among ``hosts``). Tensors never
cross the socket: each trainer copies a bucket into its own shared-memory segment, a memfd it
cannot shrink (:mod:`gradlane.transport.daemon.shm`), and sends a small JSON ``SUBMIT``
(:mod:`gradlane.transport.daemon.messages`) naming it; the daemon maps it through
``/proc/<pid>/fd`` (the pid is the socket peer's, from the kernel).

Per (step, bucket) the daemon keeps a *slot*. When every local rank has submitted, it sums
their buckets (numba, :func:`gradlane.transport.kernels.local_sum`) into a daemon-owned buffer,
hands that to the engine (the global sum over hosts comes back in place), copies the result into
every local rank's segment and answers ``DONE`` with the :class:`CollectiveReport`. The
trainer's result is therefore the sum over all ranks, exactly as in embedded mode.

Everything runs on one loop thread that polls the ROUTER and a wake-up pipe (the engine's
Future callbacks, on the engine's thread, queue their result and write one byte), with a poll
timeout set by the earliest slot deadline. Failures stay local and named:

* a slot that does not fill within ``slot_timeout`` (a trainer died or hangs) fails for the
  ranks that did submit — naming the missing local and global ranks — and is freed;
* a bad message (malformed, oversized, too deep, unknown kind, unknown rank, missing segment,
  stale generation, duplicate) is counted by reason and answered ``REJECT``/``FAIL``; serving goes
  on. Every message is hostile: whatever handling one raises is counted (``internal``) and
  answered, and an answer that cannot be built is counted (``reply_failed``), never raised;
* a segment is mapped only once verified to be a memfd of the daemon's user sealed against
  shrinking (:mod:`~gradlane.transport.daemon.shm`), so no truncate, even during a copy, can
  kill the daemon with ``SIGBUS``; a segment failing a check gets a FAIL naming why;
* a second daemon on the same socket path finds the path's lock taken and refuses to start;
* :meth:`Daemon.stop` (SIGTERM) drains: new submissions fail, slots still filling fail, the
  collectives already running finish (bounded by the hard deadline); then the socket and its
  lock file are removed and the segments unmapped (as when a trainer leaves or exits).

A restarted daemon has a new ``generation`` (its start time in µs); trainers notice the
reconnect, fail what was in flight with a clear error, say HELLO again and continue. A daemon
outlives jobs: when a trainer arrives and none of the earlier ones is alive, it restarts its
engine on the same addresses, so the new session's steps may start from 0 again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import zmq
from gradlane.transport.core.collective import from_f32
from gradlane.transport.daemon import messages as ipc
from gradlane.transport.daemon.config import DaemonConfig
from gradlane.transport.daemon.metrics import DaemonMetrics, MetricsServer
from gradlane.transport.daemon.shm import PeerSegments, SegmentError, SegmentFile
from gradlane.transport.drivers.peers import Rendezvous, StaticPeers
from gradlane.transport.drivers.udp.plane import UdpPlane
from gradlane.transport.drivers.waker import Waker
from gradlane.transport.errors import GradlaneError
from gradlane.transport.kernels import local_sum
from gradlane.transport.wire.header import ITEMSIZE, DType

__all__ = ["Daemon", "DaemonError"]

log = logging.getLogger(__name__)

#: Longest poll wait: bounds how late a stop request or a deadline is noticed.
POLL_MS = 200
#: Messages read per wake-up before deadlines and completions get their turn.
BURST = 256
#: Refresh the engine's path and reject gauges at most this often.
GAUGE_PERIOD_S = 1.0
_WIRE_NP = {DType.F32: np.float32, DType.F16: np.uint16, DType.BF16: np.uint16}


class DaemonError(GradlaneError):
    """The daemon cannot start (socket in use, bad rendezvous) — the message says what to do."""


@dataclass
class _Rank:
    """One connected trainer."""

    identity: bytes
    local_rank: int
    rank: int
    world: int
    pid: int
    """The process, in the daemon's pid namespace."""
    prefix: str
    segments: PeerSegments


@dataclass
class _Slot:
    """One (step, bucket) being collected from the local ranks, then all-reduced."""

    step: int
    bucket: int
    numel: int
    dtype: int
    layer_position: float
    opened: float
    deadline: float
    arrived: dict[int, tuple[bytes, SegmentFile, int]] = field(default_factory=dict)
    """local rank -> (identity, the segment holding its bucket, the bucket's byte offset)."""
    launched: bool = False
    buffer: np.ndarray | None = None
    pinned: bool = False
    """Any local rank submitted it pinned (all of them do: the same model, the same config)."""


class Daemon:
    """One host's daemon: IPC server, local sum, inter-host engine, metrics.

    ``rendezvous`` overrides the config's static peer list (the CLI passes a TCPStore one).
    :meth:`start` binds everything and starts the loop thread; :meth:`stop` drains and cleans up;
    :meth:`wait` blocks until the loop has ended; :attr:`error` then says whether it failed.
    """

    def __init__(self, config: DaemonConfig, rendezvous: Rendezvous | None = None) -> None:
        self.config = cfg = config
        # Start time in µs: unique per start, and exact as a Prometheus float (< 2**53).
        self.generation = time.time_ns() // 1000
        self.prefix = f"gradlane-{cfg.job}-h{cfg.host_rank}-{self.generation:x}"
        self.endpoint = f"ipc://{cfg.socket_path}"
        self.metrics = DaemonMetrics(self.generation)
        # Kept for the daemon's life: host 0's TCPStore server lives in it, and the other
        # daemons may still be reading their peers' addresses from it.
        self._rendezvous = rendezvous
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router: zmq.Socket | None = None
        self._lock_fd: int | None = None
        self._engine: UdpPlane | None = None
        self._server: MetricsServer | None = None
        self._thread: threading.Thread | None = None
        self._waker = Waker()
        self._done: collections.deque[tuple[_Slot, concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        self._ranks: dict[bytes, _Rank] = {}
        self._by_local: dict[int, bytes] = {}
        self._local_world = cfg.local_world
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._pool: dict[tuple[int, int], list[np.ndarray]] = {}
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._gauges_at = 0.0
        self._running = 0
        self._served = 0  # collectives completed by the current engine
        self.bound: list[tuple[str, int]] = []
        self._peers: StaticPeers | None = None
        self._error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Daemon:
        """Take the socket path, start the engine and the metrics endpoint, start serving."""
        try:
            # The socket and its lock first: trainers that connect while the kernels compile
            # (a minute on a fresh install) see a live daemon and keep waiting for it.
            self._bind_ipc()
            warm = np.ones(8, dtype=np.float32)  # compile the local sum now, not in a deadline
            local_sum(warm, [warm, warm], DType.F32)
            local_sum(warm, [warm.view(np.uint16)[:8]] * 2, DType.BF16)
            self._start_engine()
            if self.config.metrics:
                from gradlane.transport.daemon.config import parse_address  # noqa: PLC0415

                host, port = parse_address(self.config.metrics)
                self._server = MetricsServer(self.metrics.registry, host, port)
                log.info("daemon host %d: metrics at %s", self.config.host_rank, self._server.url)
        except BaseException:
            self._cleanup()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"gradlane-daemon-h{self.config.host_rank}", daemon=True
        )
        self._thread.start()
        log.info(
            "daemon host %d/%d serving %s (generation %x, paths %s)",
            self.config.host_rank,
            self.config.hosts,
            self.endpoint,
            self.generation,
            self.bound,
        )
        return self

    @property
    def metrics_url(self) -> str | None:
        """Where the Prometheus text is served (None when disabled)."""
        return self._server.url if self._server is not None else None

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the loop (None while it serves, and after a clean stop)."""
        return self._error

    def stop(self) -> None:
        """Ask the loop to drain and stop (safe from a signal handler or any thread)."""
        self._stopping.set()
        self._waker.wake()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the daemon has stopped and cleaned up; True if it has."""
        return self._stopped.wait(timeout)

    def close(self) -> None:
        """:meth:`stop` and :meth:`wait` (bounded by the drain time plus a margin)."""
        self.stop()
        if self._thread is not None:
            self._thread.join(self.config.transport.loss.hard_deadline_s + 30.0)
        else:
            self._cleanup()

    def __enter__(self) -> Daemon:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _bind_ipc(self) -> None:
        path = self.config.socket_path
        fd = os.open(ipc.lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DaemonError(
                f"another gradlane daemon (pid {other}) already serves ipc://{path}; stop it "
                "or give this one another --socket"
            ) from None
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket of a daemon that died (we hold the lock)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, ipc.MAX_MESSAGE_BYTES + 64)  # oversized: dropped by zmq
        old = os.umask(0o177)  # the socket file is created 0600, never briefly wider
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            sock.close(0)
            raise DaemonError(f"cannot bind {self.endpoint}: {e}") from None
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self._router = sock

    def _start_engine(self) -> None:
        """Bind the engine, then learn every daemon's addresses (the static list, or the
        store: each daemon publishes its own and waits for the others')."""
        cfg = self.config
        # A restarted engine binds the same addresses, so the table learned first stays valid.
        rdv: Rendezvous | None = self._peers or self._rendezvous
        if rdv is None and cfg.hosts > 1:
            rdv = StaticPeers(cfg.peer_table())
        eng = self._engine = UdpPlane(
            cfg.host_rank, cfg.hosts, cfg.transport, local_addrs=self.bound or cfg.local_addrs()
        )
        self.bound = eng.start()
        if rdv is None:  # one host: the engine's peer table is itself
            rdv = StaticPeers({0: self.bound})
        elif not isinstance(rdv, StaticPeers):
            rdv.publish(cfg.host_rank, self.bound)
        self._peers = StaticPeers({h: rdv.addresses(h) for h in range(cfg.hosts)})
        eng.set_peers(self._peers)

    def _cleanup(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._router is not None:
            self._router.close(0)
            self._router = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
        for r in self._ranks.values():
            r.segments.close()
        self._ranks.clear()
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ipc.lock_path(self.config.socket_path))
            os.close(self._lock_fd)
            self._lock_fd = None
        self._waker.close()
        self._stopped.set()

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
            self._drain()
        except Exception as e:
            self._error = e
            log.exception("daemon loop failed")
            self._fail_all("the gradlane daemon failed (see its log)")
        finally:
            self._cleanup()
            log.info("daemon host %d stopped", self.config.host_rank)

    def _serve(self) -> None:
        router = self._router
        assert router is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        while not self._stopping.is_set():
            due = min((s.deadline for s in self._slots.values() if not s.launched), default=None)
            timeout = POLL_MS
            if due is not None:
                timeout = int(min(POLL_MS, max(0.0, due - time.monotonic()) * 1000) + 1)
            events = dict(poller.poll(timeout))
            if router in events:
                self._read(router)
            if self._waker.fd in events:
                self._waker.drain()
            self._completions()
            self._expire(time.monotonic())
            self._periodic()

    def _read(self, router: zmq.Socket) -> None:
        for _ in range(BURST):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle([f.bytes for f in frames], _peer_pid(frames[0]))

    def _drain(self) -> None:
        """After stop(): fail what has not started, let running collectives finish (bounded)."""
        for key, slot in list(self._slots.items()):
            if not slot.launched:
                self._fail_slot(
                    slot,
                    f"the gradlane daemon of host {self.config.host_rank} "
                    "is shutting down (SIGTERM)",
                )
                del self._slots[key]
        deadline = time.monotonic() + self.config.transport.loss.hard_deadline_s + 1.0
        while self._slots and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                r = self._router
                if r is not None and r.poll(50, zmq.POLLIN):
                    self._read(r)  # answered with FAIL: shutting down
            self._waker.drain()
            self._completions()
        self._fail_all(f"the gradlane daemon of host {self.config.host_rank} shut down")

    # -- messages --------------------------------------------------------------------------------
    def _handle(self, frames: list[bytes], peer_pid: int | None = None) -> None:
        """Serve one message (from ``peer_pid``). Nothing it holds may stop the loop, which
        serves every rank: a message's own faults are IpcErrors, and anything else its handling
        raises is logged, counted as ``internal`` and answered like them."""
        identity, body = frames[0], frames[1:]
        try:
            kind, msg = ipc.decode(body)
            handler = self._HANDLERS.get(kind)
            if handler is None:
                raise ipc.IpcError("unknown_kind", f"{kind} is not a message a trainer sends")
            handler(self, identity, msg, peer_pid)
        except ipc.IpcError as e:
            self._reject(identity, e.why, e.detail)
        except Exception as e:
            log.exception("daemon: handling an IPC message failed")
            self._reject(identity, "internal", f"the daemon failed on this message: {e!r}")

    def _reject(self, identity: bytes, why: str, detail: str) -> None:
        self.metrics.ipc_rejected.labels(why).inc()
        detail = ipc.clip(detail)
        log.warning("daemon: rejected an IPC message (%s): %s", why, detail)
        self._send(identity, "REJECT", reason=why, detail=detail)

    def _send(self, identity: bytes, kind: str, **fields: Any) -> None:
        """Answer ``identity``; never raises (a reply that cannot be built is counted)."""
        router = self._router
        if router is None:
            return
        try:
            frames = ipc.encode(kind, **fields)
        except (GradlaneError, ValueError, TypeError, RecursionError) as e:
            self.metrics.ipc_rejected.labels("reply_failed").inc()
            log.error("daemon: cannot build the %s answer to %r: %s", kind, identity[:32], e)
            return
        try:
            router.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer is gone or its queue is full: its Future times out
            log.debug("daemon: could not answer %r: %s", identity, e)

    def _on_hello(self, identity: bytes, msg: dict[str, Any], peer_pid: int | None) -> None:
        cfg = self.config
        if msg["job"] != cfg.job:
            raise ipc.IpcError(
                "foreign_job", f"HELLO for job {msg['job']}, this daemon serves {cfg.job}"
            )
        lw, lr = msg["local_world"], msg["local_rank"]
        if self._local_world == 0:
            self._local_world = lw
        if lw != self._local_world or lr >= self._local_world:
            raise ipc.IpcError(
                "unknown_rank",
                f"local rank {lr} of {lw}: this daemon serves {self._local_world} local rank(s) "
                f"(local_world); start every trainer of host {cfg.host_rank} with the same count",
            )
        for other in self._ranks.values():
            if other.world != msg["world"] and other.identity != identity:
                raise ipc.IpcError(
                    "mismatch", f"world {msg['world']}, other ranks say {other.world}"
                )
        # The kernel's pid of the socket's peer, in this daemon's pid namespace, is the one
        # /proc knows; HELLO's own only where the socket cannot say.
        pid = msg["pid"] if peer_pid is None else peer_pid
        old_id = self._by_local.get(lr)
        if old_id is not None and old_id != identity and self._ranks[old_id].segments.alive():
            raise ipc.IpcError(
                "duplicate_rank",
                f"local rank {lr} is held by live pid "
                f"{self._ranks[old_id].pid} (HELLO from pid {pid})",
            )
        prefix = f"{self.prefix}-l{lr}-"
        segments = None
        if identity not in self._ranks:
            try:
                segments = PeerSegments(pid)
            except SegmentError as e:
                raise ipc.IpcError("segment_access", f"local rank {lr}: {e}") from None
        if old_id is not None and old_id != identity:
            old = self._ranks.pop(old_id)
            log.warning(
                "daemon: local rank %d reconnected (pid %d -> %d); dropping the old one",
                lr,
                old.pid,
                pid,
            )
            self._forget(old)
        if segments is not None:
            try:
                self._new_session_check(lw)
            except BaseException:
                segments.close()
                raise
            self._ranks[identity] = _Rank(
                identity, lr, msg["rank"], msg["world"], pid, prefix, segments
            )
            self._by_local[lr] = identity
            self.metrics.local_ranks.set(len(self._ranks))
            log.info(
                "daemon: local rank %d (rank %d of %d, pid %d) connected",
                lr,
                msg["rank"],
                msg["world"],
                pid,
            )
        self._send(
            identity,
            "WELCOME",
            generation=self.generation,
            host=cfg.host_rank,
            hosts=cfg.hosts,
            prefix=prefix,
            hard_deadline_s=float(cfg.transport.loss.hard_deadline_s),
        )

    def _new_session_check(self, local_world: int) -> None:
        """A trainer arrives and no trainer of this host is alive: a new session (a new job, or
        torchrun restarting its workers) counts its steps from 0 again, while the engine only
        accepts steps near the newest it has seen. Start a fresh engine on the same addresses
        (the other daemons' peer tables stay valid); their engines do the same when their own
        trainers arrive, and what one sends before the other has reset is retransmitted."""
        for dead in [r for r in self._ranks.values() if not r.segments.alive()]:
            del self._ranks[dead.identity]
            self._forget(dead)
        if self._ranks or not self._served:
            return
        log.info("daemon: a new trainer session; restarting the engine on %s", self.bound)
        self._fail_all(f"the trainers of host {self.config.host_rank} restarted")
        if self._engine is not None:
            self._engine.close(drain_s=0.0)
            self._engine = None
        self._start_engine()
        self._served = 0
        self._local_world = self.config.local_world or local_world

    def _on_bye(self, identity: bytes, msg: dict[str, Any], peer_pid: int | None) -> None:
        r = self._ranks.pop(identity, None)
        if r is None:
            raise ipc.IpcError("unknown_rank", "BYE from a trainer that never said HELLO")
        log.info("daemon: local rank %d (pid %d) left", r.local_rank, r.pid)
        self._forget(r)

    def _forget(self, r: _Rank) -> None:
        if self._by_local.get(r.local_rank) == r.identity:
            del self._by_local[r.local_rank]
        r.segments.close()
        self.metrics.local_ranks.set(len(self._ranks))

    def _on_submit(self, identity: bytes, msg: dict[str, Any], peer_pid: int | None) -> None:
        r = self._ranks.get(identity)
        if r is None:
            raise ipc.IpcError("unknown_rank", "SUBMIT from a trainer that never said HELLO")
        step, bucket = msg["step"], msg["bucket"]
        what = f"step {step} bucket {bucket}"
        if msg["generation"] != self.generation:
            self.metrics.ipc_rejected.labels("stale_generation").inc()
            self._send(
                identity,
                "FAIL",
                generation=msg["generation"],
                step=step,
                bucket=bucket,
                error=f"{what} names daemon generation {msg['generation']:x}, this daemon "
                f"is generation {self.generation:x} (it restarted): say HELLO again",
            )
            return
        if self._stopping.is_set():
            self._fail_one(
                identity,
                step,
                bucket,
                f"the gradlane daemon of host {self.config.host_rank} is shutting down (SIGTERM)",
            )
            return
        try:
            seg = self._segment(r, msg)
        except (SegmentError, ipc.IpcError) as e:
            why = e.why if isinstance(e, ipc.IpcError) else "bad_segment"
            self.metrics.ipc_rejected.labels(why).inc()
            self._fail_one(identity, step, bucket, f"{what}: {e}")
            return
        now = time.monotonic()
        slot = self._slots.get((step, bucket))
        if slot is None:
            slot = self._slots[(step, bucket)] = _Slot(
                step,
                bucket,
                msg["numel"],
                msg["dtype"],
                msg["layer_position"],
                now,
                now + self.config.slot_timeout,
            )
        problem = None
        if slot.launched or r.local_rank in slot.arrived:
            problem = (
                "duplicate_submit",
                f"{what} was already submitted by local rank {r.local_rank}",
            )
        elif (slot.numel, slot.dtype) != (msg["numel"], msg["dtype"]):
            problem = (
                "mismatch",
                f"{what}: {msg['numel']} x {DType(msg['dtype']).name} from local "
                f"rank {r.local_rank}, other ranks sent {slot.numel} x {DType(slot.dtype).name}",
            )
        if problem is not None:
            self.metrics.ipc_rejected.labels(problem[0]).inc()
            self._fail_one(identity, step, bucket, problem[1])
            return
        slot.arrived[r.local_rank] = (identity, seg, msg["offset"])
        slot.pinned = slot.pinned or msg["pinned"]
        if len(slot.arrived) == self._local_world:
            self._launch(slot)

    def _segment(self, r: _Rank, msg: dict[str, Any]) -> SegmentFile:
        """The segment a SUBMIT names, checked: named under the rank's prefix, aligned, within
        the limit, then reached and verified (:meth:`PeerSegments.get`)."""
        name, offset, numel, dtype = msg["shm"], msg["offset"], msg["numel"], msg["dtype"]
        if not name.startswith(r.prefix):
            raise ipc.IpcError(
                "bad_segment",
                f"segment {name!r} is not local rank "
                f"{r.local_rank}'s (names start with {r.prefix!r})",
            )
        nbytes = numel * ITEMSIZE[dtype]
        if offset + nbytes > self.config.max_segment_bytes:
            raise ipc.IpcError(
                "oversized",
                f"{nbytes} B at offset {offset} exceeds "
                f"max_segment_bytes={self.config.max_segment_bytes}",
            )
        if offset % ITEMSIZE[dtype]:
            raise ipc.IpcError("bad_segment", f"offset {offset} is not a multiple of the dtype")
        return r.segments.get(name, msg["fd"], offset + nbytes)

    def _fail_one(self, identity: bytes, step: int, bucket: int, text: str) -> None:
        self._send(
            identity, "FAIL", generation=self.generation, step=step, bucket=bucket, error=text
        )

    _HANDLERS: ClassVar[dict[str, Callable[[Daemon, bytes, dict[str, Any], int | None], None]]] = {
        "HELLO": _on_hello,
        "SUBMIT": _on_submit,
        "BYE": _on_bye,
    }

    # -- the collective --------------------------------------------------------------------------
    def _launch(self, slot: _Slot) -> None:
        f32 = self._take(slot.numel, np.float32)
        try:
            self._sum_segments(slot, f32)
        except SegmentError as e:  # released since its SUBMIT (its trainer left): no sum
            self._give(f32)
            del self._slots[(slot.step, slot.bucket)]
            self.metrics.ipc_rejected.labels("bad_segment").inc()
            log.warning("daemon: step %d bucket %d: %s", slot.step, slot.bucket, e)
            self._fail_slot(slot, f"step {slot.step} bucket {slot.bucket}: {e}")
            return
        slot.launched = True
        if slot.dtype == DType.F32:
            wire = f32
        else:
            wire = self._take(slot.numel, np.uint16)
            from_f32(f32, slot.dtype, wire)
            self._give(f32)
        slot.buffer = wire
        eng = self._engine
        try:
            if eng is None:
                raise RuntimeError("the inter-host engine is not running")
            fut = eng.submit(
                slot.step,
                slot.bucket,
                wire,
                slot.layer_position,
                dtype=slot.dtype,
                out=wire,
                pinned=slot.pinned,
            )
        except (GradlaneError, RuntimeError, ValueError) as e:  # refused: fail it, keep serving
            del self._slots[(slot.step, slot.bucket)]
            self._give(wire)
            self.metrics.collectives.labels("failed").inc()
            self._fail_slot(
                slot,
                f"host {self.config.host_rank}'s inter-host all-reduce refused step "
                f"{slot.step} bucket {slot.bucket}: {type(e).__name__}: {e}",
            )
            return
        self._running += 1
        self.metrics.in_flight.set(self._running)

        def done(f: concurrent.futures.Future[Any]) -> None:  # engine thread: hand over
            self._done.append((slot, f))
            self._waker.wake()

        fut.add_done_callback(done)

    def _take(self, numel: int, dtype: type) -> np.ndarray:
        free = self._pool.get((numel, np.dtype(dtype).itemsize))
        return free.pop() if free else np.empty(numel, dtype=dtype)

    def _sum_segments(self, slot: _Slot, f32: np.ndarray) -> None:
        """Sum the local ranks' buckets into ``f32`` from their segments; :class:`SegmentError`
        names the local rank whose segment is gone (released when its trainer left)."""
        wire_np = _WIRE_NP[DType(slot.dtype)]
        srcs = []
        for lr in sorted(slot.arrived):  # local rank order: the sum's order is fixed
            _, seg, offset = slot.arrived[lr]
            try:
                srcs.append(seg.view(wire_np, slot.numel, offset))
            except SegmentError as e:
                raise SegmentError(f"local rank {lr}: {e}") from None
        local_sum(f32, srcs, slot.dtype)

    def _give(self, buf: np.ndarray) -> None:
        free = self._pool.setdefault((buf.shape[0], buf.dtype.itemsize), [])
        if len(free) < 4:
            free.append(buf)

    def _completions(self) -> None:
        while self._done:
            slot, fut = self._done.popleft()
            self._slots.pop((slot.step, slot.bucket), None)
            self._running -= 1
            self.metrics.in_flight.set(self._running)
            now = time.monotonic()
            try:
                result, report = fut.result()
            except Exception as e:
                self.metrics.collectives.labels("failed").inc()
                text = (
                    f"host {self.config.host_rank}'s inter-host all-reduce failed: "
                    f"{type(e).__name__}: {e}"
                )
                self._fail_slot(slot, text)
            else:
                wire = result.view(_WIRE_NP[DType(slot.dtype)])
                for lr, (identity, seg, offset) in slot.arrived.items():
                    try:
                        np.copyto(seg.view(wire.dtype, wire.shape[0], offset), wire)
                    except SegmentError as e:
                        self.metrics.ipc_rejected.labels("bad_segment").inc()
                        self._fail_one(
                            identity,
                            slot.step,
                            slot.bucket,
                            f"step {slot.step} bucket {slot.bucket} of local rank {lr}: {e}",
                        )
                        continue
                    self._send(
                        identity,
                        "DONE",
                        generation=self.generation,
                        step=slot.step,
                        bucket=slot.bucket,
                        report=ipc.report_to_wire(report),
                    )
                self.metrics.collective(report, now - slot.opened)
                self._served += 1
            if slot.buffer is not None:
                self._give(slot.buffer)

    def _fail_slot(self, slot: _Slot, text: str) -> None:
        for identity, _, _ in slot.arrived.values():
            self._fail_one(identity, slot.step, slot.bucket, text)

    def _expire(self, now: float) -> None:
        for key, slot in list(self._slots.items()):
            if slot.launched or now < slot.deadline:
                continue
            del self._slots[key]
            missing = sorted(set(range(self._local_world)) - set(slot.arrived))
            ranks = [
                self._ranks[i].rank
                for lr in missing
                if (i := self._by_local.get(lr)) in self._ranks
            ]
            self.metrics.slot_timeouts.inc()
            self.metrics.drop("local_rank_timeout", "all")
            text = (
                f"local rank(s) {missing} (global rank(s) {ranks or 'unknown'}) did not submit "
                f"step {slot.step} bucket {slot.bucket} to the gradlane daemon of host "
                f"{self.config.host_rank} within {self.config.slot_timeout:.3f}s (crashed or hung?)"
            )
            log.warning("daemon: %s", text)
            self._fail_slot(slot, text)

    def _fail_all(self, text: str) -> None:
        for slot in self._slots.values():
            self._fail_slot(slot, text)
        self._slots.clear()

    # -- statistics ------------------------------------------------------------------------------
    def _periodic(self) -> None:
        """Once a second: drop the mappings of trainers whose process is gone (their memory is
        freed now, not at the next HELLO), refresh the engine's gauges."""
        now = time.monotonic()
        if now - self._gauges_at < GAUGE_PERIOD_S:
            return
        self._gauges_at = now
        for r in self._ranks.values():
            if not r.segments.closed and not r.segments.alive():
                log.warning("daemon: local rank %d (pid %d) exited", r.local_rank, r.pid)
                r.segments.close()
        if self._engine is None:
            return
        try:
            st = self._engine.stats()
        except (concurrent.futures.TimeoutError, RuntimeError):
            return
        self.metrics.engine(st)

    def stats(self) -> dict[str, Any]:
        """A few counters for logs and tests (the full set is the Prometheus text)."""
        return {
            "generation": self.generation,
            "local_ranks": len(self._ranks),
            "slots": len(self._slots),
            "rejected": {
                r: self.metrics.value("gradlane_ipc_rejected_total", reason=r) for r in ipc.REASONS
            },
        }


def _peer_pid(frame: zmq.Frame) -> int | None:
    """The sender's pid from the kernel (``SO_PEERCRED``), which ZeroMQ appends to an ``ipc``
    peer's address as ``:uid:gid:pid``; None where the socket does not say."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    creds = str(address).rsplit(":", 3)[1:]
    return int(creds[2]) if len(creds) == 3 and all(c.isdigit() for c in creds) else None
