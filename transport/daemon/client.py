"""The trainer's side of daemon mode: a data plane that hands buckets to the host's daemon.

Theory of operation
-------------------
:class:`DaemonPlane` offers the same ``submit/stats/drain/close`` as the embedded planes (it is
a :class:`~gradlane.transport.drivers.plane.Plane`). One I/O thread owns a ZeroMQ DEALER
connected to the daemon's
``ipc://`` socket, a monitor of that socket and a wake-up pipe. ``submit`` only queues the
request and returns a Future; the I/O thread copies the bucket into one of this rank's
shared-memory segments (sealed memfds created here, named under the prefix the daemon assigned:
:mod:`gradlane.transport.daemon.shm`), sends ``SUBMIT`` naming the segment and its descriptor
and, when ``DONE`` arrives, copies the all-reduced result out of the segment into ``out`` and
resolves the Future with ``(result, CollectiveReport)``. A segment holds one descriptor of this
process until it is dropped: on close, on a daemon restart, when a bucket outgrows it, or when
a request times out (a slow daemon may still write it).

The connection has a lifecycle of its own, read from the socket monitor:

* *connected* → the client says ``HELLO``; ``WELCOME`` names the daemon's generation;
  submissions made before that wait (with their deadline), so trainers may start first;
* *disconnected* (the daemon exited or was killed) → every submission in flight fails at once
  with an error naming the daemon, its host and generation; later ones wait for a daemon;
* a ``WELCOME`` with a new generation (a restarted daemon) → old segments are closed, and the
  waiting submissions go to the new daemon: training continues.

Every wait is bounded: :meth:`start` by ``connect_timeout_s`` (then a clear "no gradlane daemon
at ipc://... (start `gradlane daemon ...`)"), each submission by ``request_timeout_s``, and
while the daemon is gone a submission waits for a new one at most ``connect_timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from gradlane.transport.core.collective import from_f32, to_f32, wire_view
from gradlane.transport.daemon import messages as ipc
from gradlane.transport.daemon.shm import Segment
from gradlane.transport.drivers.futures import CollectiveRequest, CollectiveResult
from gradlane.transport.drivers.waker import Waker
from gradlane.transport.errors import ConfigError, GradlaneError, TransferFailed
from gradlane.transport.wire.header import ITEMSIZE, DType
from zmq.utils.monitor import recv_monitor_message

__all__ = ["DaemonPlane", "DaemonUnavailable"]

log = logging.getLogger(__name__)

#: Longest poll wait of the I/O thread (a close request is noticed within this).
POLL_MS = 200
#: How much longer than ``connect_timeout_s`` a trainer waits for a daemon that is alive (it
#: holds its socket's lock) but has not answered yet: its first start on a host compiles the
#: kernels first, which takes a minute or more on a small machine.
STARTING_WAIT_S = 600.0


class DaemonUnavailable(GradlaneError):
    """No daemon answered at the socket in time, or the daemon refused this trainer."""


@dataclass
class _Request:
    """A submission as the I/O thread tracks it. ``spec.data`` holds the bucket's wire words
    and ``spec.dtype`` their wire dtype; ``spec.out`` is the caller's array that receives the
    result, ``out_wire`` the same memory as wire words."""

    fut: concurrent.futures.Future[CollectiveResult]
    spec: CollectiveRequest
    out_wire: np.ndarray
    deadline: float
    seg: list[Any] | None = None  # [Segment, busy]

    @property
    def step(self) -> int:
        """The collective's step."""
        return self.spec.step

    @property
    def bucket(self) -> int:
        """The collective's bucket."""
        return self.spec.bucket


class DaemonPlane:
    """This rank's connection to its host's daemon (see the module docstring).

    ``socket_path``: the daemon's ``ipc://`` socket file. ``local_rank``/``local_world``: this
    rank among the host's trainers (``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` under torchrun).
    """

    def __init__(
        self,
        socket_path: str,
        *,
        job: int,
        rank: int,
        world: int,
        local_rank: int,
        local_world: int,
        connect_timeout_s: float = 60.0,
        request_timeout_s: float = 60.0,
        start_wait_s: float = STARTING_WAIT_S,
    ) -> None:
        if not 0 <= local_rank < local_world:
            raise ConfigError(f"local rank {local_rank} is not in a host of {local_world}")
        if connect_timeout_s <= 0 or request_timeout_s <= 0 or start_wait_s < 0:
            raise ConfigError(
                "connect_timeout_s and request_timeout_s must be > 0, start_wait_s >= 0"
            )
        self.socket_path = socket_path
        self.endpoint = f"ipc://{socket_path}"
        self.job, self.rank, self.world = job, rank, world
        self.local_rank, self.local_world = local_rank, local_world
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.start_wait_s = start_wait_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._waker = Waker()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._welcomed = threading.Event()
        self._refused: str | None = None
        # -- I/O thread state
        self.generation: int | None = None
        self.host: int | None = None
        self._prefix = ""
        self._serial = itertools.count()
        self._segments: dict[int, list[list[Any]]] = {}
        self._inflight: dict[tuple[int, int], _Request] = {}
        self._waiting: list[_Request] = []
        self._lost_at: float | None = None  # when the daemon disconnected (None: connected)
        self.counters = {"submitted": 0, "done": 0, "failed": 0, "reconnects": 0, "rejected": 0}

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> DaemonPlane:
        """Connect and wait (at most ``connect_timeout_s``) for the daemon's WELCOME; a daemon
        that is alive but still starting is waited for up to ``start_wait_s`` more."""
        self._thread = threading.Thread(
            target=self._run, name=f"gradlane-ipc-r{self.rank}", daemon=True
        )
        self._thread.start()
        welcomed = self._welcomed.wait(self.connect_timeout_s)
        starting = None if welcomed else ipc.daemon_pid(self.socket_path)
        if starting is not None:
            # It holds its socket's lock but has not answered: on a host's first start it
            # compiles its kernels before it serves.
            log.info(
                "rank %d: the gradlane daemon (pid %d) at %s is still starting; waiting up "
                "to %.0f s more",
                self.rank, starting, self.endpoint, self.start_wait_s,
            )  # fmt: skip
            limit = time.monotonic() + self.start_wait_s
            while not welcomed and time.monotonic() < limit:
                welcomed = self._welcomed.wait(min(1.0, max(limit - time.monotonic(), 0.0)))
                if not welcomed and ipc.daemon_pid(self.socket_path) is None:
                    break  # it died while starting
        if not welcomed or self._refused:
            if self._refused:
                why = self._refused
            elif starting is not None:
                why = (
                    f"the gradlane daemon (pid {starting}) at {self.endpoint} did not answer "
                    f"within {self.connect_timeout_s + self.start_wait_s:.0f}s of its start "
                    "(see its log)"
                )
            else:
                why = (
                    f"no gradlane daemon at {self.endpoint} answered within "
                    f"{self.connect_timeout_s:.0f}s (start `gradlane daemon --socket "
                    f"{self.endpoint[6:]} ...` on this host first, or wait for it)"
                )
            self.close()
            raise DaemonUnavailable(why)
        log.info(
            "rank %d: connected to the gradlane daemon of host %s at %s (generation %x)",
            self.rank,
            self.host,
            self.endpoint,
            self.generation,
        )
        return self

    def close(self) -> None:
        """Say BYE, fail what is in flight, remove this rank's segments, stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._requests.put(None)
        self._waker.wake()
        if self._thread is not None:
            self._thread.join(10.0)
        self._waker.close()

    def __enter__(self) -> DaemonPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the Plane API ---------------------------------------------------------------------------
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
    ) -> concurrent.futures.Future[CollectiveResult]:
        """All-reduce ``data`` through the daemon (sum over every rank of every host).

        Same contract as :meth:`gradlane.transport.drivers.udp.plane.UdpPlane.submit`;
        ``servers`` is not offered in daemon mode (the daemons run the transpose all-reduce
        among themselves).
        ``scale`` is applied here as the bucket is copied into the shared segment (the same pass),
        before the sum: a float16 sum of scaled buckets does not overflow where the raw one could.
        ``pinned`` reaches the daemon's UDP plane (the bucket is pinned if any local rank says so).
        """
        fut: concurrent.futures.Future[CollectiveResult] = concurrent.futures.Future()
        try:
            if servers is not None:
                raise ConfigError(
                    "daemon mode runs the transpose all-reduce; servers= is not offered"
                )
            scale = float(scale)
            if not math.isfinite(scale):
                raise ValueError(f"scale must be a finite number, got {scale}")
            wire, wdtype = wire_view(data, dtype)
            if out is None:
                out = np.empty_like(data)
            out_wire, _ = wire_view(out, wdtype)
            if out_wire.shape != wire.shape or out_wire.dtype != wire.dtype:
                raise ValueError(
                    f"out {out.dtype}[{out.size}] does not match data {data.dtype}[{data.size}]"
                )
        except (ValueError, GradlaneError) as e:
            fut.set_exception(e)
            return fut
        position = float(min(max(layer_position, 0.0), 1.0))
        spec = CollectiveRequest(
            step, bucket, wire, position, wdtype, out=out, scale=scale, pinned=bool(pinned)
        )
        req = _Request(fut, spec, out_wire, time.monotonic() + self.request_timeout_s)
        with self._lock:
            if self._closed:
                fut.set_exception(
                    TransferFailed(
                        f"daemon client closed: step {step} bucket {bucket} not submitted"
                    )
                )
                return fut
            self._requests.put(req)
        self._waker.wake()
        return fut

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Always True: the host's daemon, not this rank, sends to the other hosts, and it keeps
        serving (and draining) after this rank's job ends."""
        return True

    def stats(self) -> dict[str, Any]:
        """Counters of this connection."""
        return {
            "mode": "daemon",
            "endpoint": self.endpoint,
            "host": self.host,
            "generation": self.generation,
            "in_flight": len(self._inflight),
            **self.counters,
        }

    # -- I/O thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        for s in (sock, monitor):
            poller.register(s, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        try:
            while self._loop_once(sock, monitor, poller):
                pass
        except Exception as e:  # a bug must not leave Futures waiting forever
            log.exception("rank %d: daemon client failed", self.rank)
            self._fail_everything(f"daemon client error: {e!r}")
        finally:
            if self.generation is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.send_multipart(ipc.encode("BYE"), zmq.NOBLOCK)
            self._fail_everything(f"the daemon client of rank {self.rank} was closed")
            for segs in self._segments.values():
                for seg, _ in segs:
                    seg.close()
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def _loop_once(self, sock: zmq.Socket, monitor: zmq.Socket, poller: zmq.Poller) -> bool:
        due = min((r.deadline for r in (*self._waiting, *self._inflight.values())), default=None)
        timeout = (
            POLL_MS
            if due is None
            else int(min(POLL_MS, max(0.0, due - time.monotonic()) * 1e3) + 1)
        )
        events = dict(poller.poll(timeout))
        if monitor in events:
            while monitor.poll(0):
                self._on_monitor(sock, recv_monitor_message(monitor))
        if sock in events:
            while sock.poll(0):
                self._on_message(sock.recv_multipart())
        if self._waker.fd in events:
            self._waker.drain()
        while True:
            try:
                req = self._requests.get_nowait()
            except queue.Empty:
                break
            if req is None:
                return False
            self._waiting.append(req)
        if self.generation is not None and self._welcomed.is_set():
            waiting, self._waiting = self._waiting, []
            for req in waiting:
                self._send_submit(sock, req)
        self._expire(time.monotonic())
        return True

    def _on_monitor(self, sock: zmq.Socket, event: Any) -> None:
        if event["event"] == zmq.EVENT_CONNECTED:
            sock.send_multipart(
                ipc.encode(
                    "HELLO",
                    job=self.job,
                    rank=self.rank,
                    world=self.world,
                    local_rank=self.local_rank,
                    local_world=self.local_world,
                    pid=os.getpid(),
                )
            )
        elif event["event"] == zmq.EVENT_DISCONNECTED and self.generation is not None:
            self.counters["reconnects"] += 1
            text = (
                f"the gradlane daemon at {self.endpoint} (host {self.host}, generation "
                f"{self.generation:x}) disconnected — it exited, crashed or is restarting"
            )
            log.error("rank %d: %s", self.rank, text)
            self._welcomed.clear()
            self._lost_at = time.monotonic()
            # Everything submitted before now was meant for the daemon that is gone: it fails
            # (sent or still queued); what is submitted from now on waits for a new daemon.
            self._fail_everything(f"{text}; it was in flight")

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            kind, msg = ipc.decode(frames)
        except ipc.IpcError as e:
            self.counters["rejected"] += 1
            log.warning("rank %d: bad message from the daemon: %s", self.rank, e)
            return
        if kind == "WELCOME":
            if self.generation is not None and msg["generation"] != self.generation:
                log.warning(
                    "rank %d: the daemon restarted (generation %x -> %x)",
                    self.rank,
                    self.generation,
                    msg["generation"],
                )
                for segs in self._segments.values():
                    for seg, _ in segs:
                        seg.close()
                self._segments.clear()
            self.generation, self.host, self._prefix = msg["generation"], msg["host"], msg["prefix"]
            self._lost_at = None
            self._welcomed.set()
        elif kind in ("DONE", "FAIL"):
            req = self._inflight.get((msg["step"], msg["bucket"]))
            if req is None or msg["generation"] != self.generation:
                return  # an answer for something already failed (timeout, disconnect)
            if kind == "FAIL":
                self._finish(
                    req,
                    error=TransferFailed(
                        f"gradlane daemon of host {self.host} ({self.endpoint}): {msg['error']}"
                    ),
                )
                return
            try:
                report = ipc.report_from_wire(msg["report"])
                assert req.seg is not None and req.spec.out is not None
                seg, wire = req.seg[0], req.spec.data
                np.copyto(req.out_wire, seg.array(wire.dtype, wire.shape[0]))
            except (ipc.IpcError, GradlaneError) as e:
                self._finish(req, error=TransferFailed(f"bad DONE from the daemon: {e}"))
                return
            self._finish(req, result=(req.spec.out, report))
        elif kind == "REJECT":
            self.counters["rejected"] += 1
            text = (
                f"the gradlane daemon at {self.endpoint} refused rank {self.rank}: "
                f"{msg['reason']}: {msg['detail']}"
            )
            log.error("rank %d: %s", self.rank, text)
            if self.generation is None:  # our HELLO was refused: start() reports it
                self._refused = text
                self._welcomed.set()

    def _send_submit(self, sock: zmq.Socket, req: _Request) -> None:
        key = (req.step, req.bucket)
        if not req.fut.set_running_or_notify_cancel():
            return
        if key in self._inflight:
            req.fut.set_exception(
                TransferFailed(f"step {req.step} bucket {req.bucket} is already being all-reduced")
            )
            return
        spec = req.spec
        wire, wdtype = spec.data, spec.dtype
        assert wdtype is not None  # submit() sets the wire dtype
        nbytes = wire.shape[0] * ITEMSIZE[wdtype]
        try:
            req.seg = self._segment(req.bucket, max(nbytes, 1))
            shared = req.seg[0].array(wire.dtype, wire.shape[0])
            if spec.scale == 1.0:
                np.copyto(shared, wire)
            elif wdtype == DType.F32:  # scaled as it is copied in: the same one pass
                np.multiply(wire, np.float32(spec.scale), out=shared)
            else:  # 16-bit words: scaled in float32 and rounded once, so the sum cannot overflow
                from_f32(to_f32(wire, wdtype) * np.float32(spec.scale), wdtype, shared)
            frames = ipc.encode(
                "SUBMIT",
                generation=self.generation,
                step=req.step,
                bucket=req.bucket,
                shm=req.seg[0].name,
                fd=req.seg[0].fd,
                offset=0,
                numel=int(wire.shape[0]),
                dtype=wdtype,
                layer_position=spec.layer_position,
                pinned=spec.pinned,
            )
            sock.send_multipart(frames, zmq.NOBLOCK)
        except (GradlaneError, zmq.ZMQError) as e:
            self._inflight[key] = req
            self._finish(
                req,
                error=TransferFailed(
                    f"step {req.step} bucket {req.bucket} not submitted to the daemon: {e}"
                ),
            )
            return
        self._inflight[key] = req
        self.counters["submitted"] += 1

    def _segment(self, bucket: int, nbytes: int) -> list[Any]:
        """An idle segment of at least ``nbytes`` for ``bucket`` (grown by replacing it)."""
        segs = self._segments.setdefault(bucket, [])
        for i, idle in enumerate(segs):
            if idle[1]:
                continue
            if idle[0].size >= nbytes:
                idle[1] = True
                return idle
            idle[0].close()
            segs[i] = [Segment.create(self._name(bucket, i), nbytes), True]
            return segs[i]
        segs.append([Segment.create(self._name(bucket, len(segs)), nbytes), True])
        return segs[-1]

    def _name(self, bucket: int, index: int) -> str:
        return f"{self._prefix}b{bucket}.{index}-{next(self._serial)}"

    def _finish(
        self,
        req: _Request,
        *,
        result: CollectiveResult | None = None,
        error: BaseException | None = None,
    ) -> None:
        self._inflight.pop((req.step, req.bucket), None)
        if req.seg is not None:
            req.seg[1] = False
        if req.fut.done():
            return
        if error is not None:
            self.counters["failed"] += 1
            req.fut.set_exception(error)
        else:
            self.counters["done"] += 1
            req.fut.set_result(result)  # type: ignore[arg-type]

    def _expire(self, now: float) -> None:
        if self._lost_at is not None and now - self._lost_at > self.connect_timeout_s:
            # The daemon went away and has not come back within connect_timeout_s (as long as
            # a trainer waits for a daemon at start): what waits for it fails now; a daemon
            # that comes back later serves the steps that follow.
            for req in self._waiting:
                req.deadline = min(req.deadline, now)
        for req in [r for r in self._waiting if r.deadline <= now]:
            self._waiting.remove(req)
            if req.fut.set_running_or_notify_cancel():
                since = (
                    ""
                    if self._lost_at is None
                    else (f" (it disconnected {now - self._lost_at:.1f}s ago, host {self.host})")
                )
                req.fut.set_exception(
                    TransferFailed(
                        f"step {req.step} bucket {req.bucket}: no gradlane daemon at "
                        f"{self.endpoint}{since}: start `gradlane daemon` on this host"
                    )
                )
        for req in [r for r in self._inflight.values() if r.deadline <= now]:
            if req.seg is not None:
                # A slow daemon may still write this segment later: never reuse it.
                segs = self._segments.get(req.bucket, [])
                if req.seg in segs:
                    segs.remove(req.seg)
                req.seg[0].close()
                req.seg = None
            self._finish(
                req,
                error=TransferFailed(
                    f"the gradlane daemon at {self.endpoint} (host {self.host}) did not answer "
                    f"step {req.step} bucket {req.bucket} within {self.request_timeout_s:.1f}s"
                ),
            )

    def _fail_everything(self, text: str) -> None:
        """Fail every submission: sent, waiting, or still queued (a close request stays)."""
        for req in list(self._inflight.values()):
            self._finish(req, error=TransferFailed(f"{text}: step {req.step} bucket {req.bucket}"))
        for req in self._waiting:
            if req.fut.set_running_or_notify_cancel():
                req.fut.set_exception(
                    TransferFailed(f"{text}: step {req.step} bucket {req.bucket}")
                )
        self._waiting.clear()
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                return
            if item is None:  # close() asked: keep the request for the loop
                self._requests.put(None)
                return
            if item.fut.set_running_or_notify_cancel():
                item.fut.set_exception(
                    TransferFailed(f"{text}: step {item.step} bucket {item.bucket}")
                )
