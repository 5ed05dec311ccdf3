"""The UDP data plane (ARCHITECTURE §6): an event loop on its own thread driving one rank's
:class:`~gradlane.transport.core.collective.TransposeAllReduce` over real UDP sockets.

Theory of operation
-------------------
The protocol core is sans-I/O; :class:`UdpPlane` is its driver, like aioquic's asyncio glue,
and uses only the core's public API. All core calls happen on the loop thread. After every
input (a read wakeup, the timer, a submitted bucket) the plane runs ``_service``: it sends
``datagrams_to_send(now)``, turns events into Future results, and re-arms the one loop timer
from ``get_timer()``. ``now`` is always ``time.monotonic()``; the loop's own clock is only used
to place the timer. The sockets (:class:`~gradlane.transport.drivers.udp.sockets.UdpPaths`)
receive straight into the core's receive arena, many datagrams per system call.

Other threads talk to the plane with :meth:`UdpPlane.submit`, which returns a
``concurrent.futures.Future`` resolved on the loop thread with ``(result, CollectiveReport)``,
or failed with the transport's error (``PeerTimeout`` naming the late ranks). It is a
:class:`~gradlane.transport.drivers.plane.Plane`.

Receive taps
------------
``UdpPlane(rx_tap=...)`` puts a wrapper (:class:`RxTap`) between the sockets and the core's
arena. :class:`InjectedLoss` is the one in use: tests and demos drop a seeded fraction of what
a rank receives, because loopback never loses a datagram; everything after it runs as on a
lossy network, on the real receive path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.drivers.futures import (
    CollectiveRequest,
    CollectiveResult,
    PendingCollectives,
    urgency,
)
from gradlane.transport.drivers.peers import Address, Rendezvous
from gradlane.transport.drivers.udp.sockets import RxArena, UdpPaths, new_event_loop
from gradlane.transport.drivers.warmup import warm_up
from gradlane.transport.errors import ConfigError, TransferFailed

__all__ = [
    "InjectedLoss",
    "LossyArena",
    "RxTap",
    "TappedArena",
    "UdpPlane",
    "default_local_addrs",
]

log = logging.getLogger(__name__)

#: How long ``start``/``stats``/``close`` wait for the loop thread before giving up.
CONTROL_TIMEOUT_S = 10.0
#: How often the shutdown drain re-checks for unacknowledged outgoing transfers.
DRAIN_POLL_S = 0.001
#: Mixed into each rank's :class:`InjectedLoss` seed, apart from the core's own generator.
_LOSS_STREAM = 0x10557


def default_local_addrs(n_paths: int) -> list[Address]:
    """Loopback path addresses 127.0.0.1, 127.0.0.2, ... (port 0: any free port)."""
    return [(f"127.0.0.{1 + p}", 0) for p in range(n_paths)]


class TappedArena(RxArena, Protocol):
    """What an :class:`RxTap` puts in front of the core's arena: an arena the sockets fill and
    commit to, with counters of its own for :meth:`UdpPlane.stats`."""

    def stats(self) -> dict[str, int]:
        """Counters merged into the plane's stats (e.g. ``injected_drops``)."""
        ...


class RxTap(Protocol):
    """A receive tap of :class:`UdpPlane`: wraps the core's receive arena once, when the plane
    is made. The sockets then fill the rows of what :meth:`wrap` returns and commit them to
    it; it commits what the core is to see. Tests and demos only (:class:`InjectedLoss`)."""

    def wrap(self, arena: RxArena, rank: int) -> TappedArena:
        """The arena the sockets use in place of ``arena`` (the core's) at rank ``rank``."""
        ...


class ArenaWrapper:
    """A receive arena in front of another: its rows and first free row are the wrapped
    one's; a subclass decides in ``commit_datagrams`` what the wrapped arena is given (the
    taps of :class:`RxTap`)."""

    def __init__(self, arena: RxArena) -> None:
        self._arena = arena

    @property
    def rx_arena(self) -> np.ndarray:
        """The wrapped arena's rows."""
        return self._arena.rx_arena

    @property
    def rx_free(self) -> int:
        """The wrapped arena's first free row."""
        return self._arena.rx_free


class LossyArena(ArenaWrapper):
    """A receive arena that drops each datagram with probability ``rate`` (``rng``: seeded)
    before ``arena`` sees it. The sockets fill its rows as always (``recvmmsg``, a GRO split,
    or ``recv_into``); of each committed batch, the kept rows move down over the dropped ones,
    in order, and only they are committed: the core and everything after it run exactly as
    on a lossy network."""

    def __init__(self, arena: RxArena, rate: float, rng: np.random.Generator) -> None:
        super().__init__(arena)
        self._rate = rate
        self._rng = rng
        self.dropped = 0
        """Datagrams dropped so far."""

    def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
        """Drop a random part of the ``len(lengths)`` rows just filled; commit the rest."""
        keep = np.flatnonzero(self._rng.random(lengths.shape[0]) >= self._rate)
        moved = keep != np.arange(keep.shape[0])  # kept rows below a dropped one
        self.dropped += lengths.shape[0] - keep.shape[0]
        if moved.any():
            # Each moves down (fancy indexing reads them all before writing), only as wide as
            # the longest of them.
            d = int(np.argmax(moved))
            first, rows = self._arena.rx_free, self._arena.rx_arena
            width = min(rows.shape[1], -(-int(lengths[keep[d:]].max()) // 8) * 8)
            rows[first + d : first + keep.shape[0], :width] = rows[first + keep[d:], :width]
        self._arena.commit_datagrams(lengths[keep], path, now)

    def stats(self) -> dict[str, int]:
        """``injected_drops``: the datagrams dropped so far."""
        return {"injected_drops": self.dropped}


@dataclass(frozen=True)
class InjectedLoss:
    """Tests and demos only: a :class:`UdpPlane` drops this fraction (``rate``) of the
    datagrams it receives, at random, before the protocol sees them, so that loss shows on a
    loopback that never loses. Rank ``r`` draws from ``np.random.default_rng([seed, r,
    0x10557])``: the same seed drops the same datagrams of the same batches. Never on a real
    network. Shared by every rank's plane; each gets an arena (:class:`LossyArena`) of its own.
    """

    rate: float
    """The fraction of received datagrams dropped, in [0, 1)."""
    seed: int = 0
    """Seeds the drops (with the rank); the demo and bench pass the transport's ``seed``."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate < 1.0:
            raise ConfigError(
                f"inject_loss rate={self.rate}: a fraction of datagrams in [0, 1) (0 = none)"
            )

    def wrap(self, arena: RxArena, rank: int) -> LossyArena:
        """Rank ``rank``'s lossy arena in front of ``arena``."""
        rng = np.random.default_rng([self.seed, rank, _LOSS_STREAM])
        return LossyArena(arena, self.rate, rng)


class UdpPlane:
    """One rank's UDP data plane: sockets, event loop thread and all-reduce core.

    ``local_addrs`` are the local path addresses, one per ``config.n_paths`` (``(host, port)``
    or a bare host for port 0; default: 127.0.0.1, 127.0.0.2, ...). With a ``rendezvous``,
    :meth:`start` publishes the bound addresses and looks up every peer's; without one, call
    :meth:`set_peers` after :meth:`start` (so tests can bind port 0, then exchange addresses).

    ``bufsize`` overrides ``config.socket_buffer_bytes`` (the sockets' buffer size).
    ``rx_tap`` (tests and demos: :class:`InjectedLoss`) stands between the sockets and the
    core's receive arena; its counters join :meth:`stats`.

    Use as a context manager, or call :meth:`close`; it fails in-flight Futures with
    :class:`TransferFailed`, closes the sockets and joins the thread.
    """

    def __init__(
        self,
        me: int,
        world: int,
        config: TransportConfig | None = None,
        rendezvous: Rendezvous | None = None,
        local_addrs: Sequence[Address | str] | None = None,
        *,
        bufsize: int | None = None,
        rx_tap: RxTap | None = None,
    ) -> None:
        self.me = me
        self.world = world
        self.config = cfg = config or TransportConfig()
        addrs = default_local_addrs(cfg.n_paths) if local_addrs is None else local_addrs
        self.local_addrs: list[Address] = [
            (a, 0) if isinstance(a, str) else (a[0], int(a[1])) for a in addrs
        ]
        if len(self.local_addrs) != cfg.n_paths:
            raise ConfigError(
                f"{len(self.local_addrs)} local address(es) {self.local_addrs} for "
                f"n_paths={cfg.n_paths}: give one address per path"
            )
        self._rendezvous = rendezvous
        self._core = core = TransposeAllReduce(me, world, cfg)
        # Datagrams go straight into the core's arena, many per system call (recvmmsg, or GRO):
        # no forwarding call per datagram. A tap sits between the sockets and the core on that
        # same path, so what a lossy test or demo measures is the real receive path.
        self._tap = rx_tap.wrap(core, me) if rx_tap is not None else None
        self._udp = UdpPaths(
            None,
            None,
            self._on_readable,
            bufsize=cfg.socket_buffer_bytes if bufsize is None else bufsize,
            arena=self._tap or core,
            gso=cfg.udp_gso,
            gro=cfg.udp_gro,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pending = PendingCollectives()
        # Submitted requests wait here for the loop, which starts all that wait at once, most
        # urgent first (see _start_queued); guarded by _lock.
        self._inbox: list[
            tuple[concurrent.futures.Future[CollectiveResult], CollectiveRequest]
        ] = []
        self._timer: asyncio.TimerHandle | None = None
        self._armed: float | None = None
        self._service_pending = False
        self._batches_seen = 0  # the core's processed batches at the end of the last pass
        self._held_wakeups = 0  # socket wakeups that read datagrams and left them coalescing
        # Timer wakeups and the loop thread's CPU spent in them (stats()["loop"]): with the
        # service passes they cause, that is the plane's cost when no datagram arrives.
        self._timer_passes = 0
        self._timer_cpu_s = 0.0
        self._closed = False  # no new work
        self._io_done = False  # the loop no longer serves the core (after the drain)
        self._stopping = False
        self._lock = threading.Lock()  # guards _closed against submit() racing close()
        self.bound: list[Address] = []

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> list[Address]:
        """Start the loop thread and bind the sockets; returns the bound addresses per path.

        Raises :class:`ConfigError` (e.g. a port in use, naming the address); the plane is then
        closed.
        """
        if self._thread is not None:
            raise RuntimeError("the UDP plane is already started")
        if self._closed:
            raise RuntimeError("the UDP plane is closed")
        # Compile the kernels now, not inside the first collective's deadlines.
        warm_up(udp=True)
        loop = self._loop = new_event_loop()
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name=f"gradlane-engine-r{self.me}", daemon=True
        )
        self._thread.start()
        pr = self.config.priority
        tos_values = [pr.tos(c) for c in range(pr.n_classes)]
        fut = asyncio.run_coroutine_threadsafe(
            self._udp.open(self.local_addrs, tos_values, main_tos=pr.tos(0)), loop
        )
        try:
            self.bound = fut.result(CONTROL_TIMEOUT_S)
            if self._rendezvous is not None:
                self._rendezvous.publish(self.me, self.bound)
                self.set_peers(self._rendezvous)
        except BaseException:
            self.close()
            raise
        log.info("rank %d/%d bound %s", self.me, self.world, self.bound)
        return list(self.bound)

    def set_peers(self, rendezvous: Rendezvous) -> None:
        """Look up every rank's path addresses (blocking on the rendezvous if it must)."""
        peers = [rendezvous.addresses(r) for r in range(self.world)]
        self._call(lambda: self._udp.set_peers(peers))

    def close(self, drain_s: float = 2.0) -> None:
        """Fail in-flight Futures, drain, close the sockets, stop the loop and join its thread.

        A rank completes a collective once it has *received* everything, while peers may still
        lack some of what it sent; for up to ``drain_s`` the plane keeps serving until those
        outgoing transfers are acknowledged, so a rank that closes right after its last step does
        not strand a peer until its hard deadline. Idempotent. Called on the loop thread (e.g.
        from a Future's done-callback), it only schedules the shutdown: a thread cannot join
        itself.
        """
        with self._lock:
            self._closed = True
            initiate = not self._stopping  # exactly one caller runs the shutdown
            self._stopping = True
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        on_loop = threading.current_thread() is thread
        if initiate and on_loop:
            task = loop.create_task(self._shutdown(drain_s))
            task.add_done_callback(lambda _: loop.stop())
        elif initiate:
            try:
                fut = asyncio.run_coroutine_threadsafe(self._shutdown(drain_s), loop)
                fut.result(CONTROL_TIMEOUT_S + drain_s)
            except concurrent.futures.TimeoutError:
                log.error("rank %d: UDP plane shutdown timed out; stopping the loop", self.me)
            except RuntimeError:  # the loop thread died (a bug): nothing left to shut down
                log.error("rank %d: UDP plane loop was already closed", self.me)
            if not loop.is_closed():
                loop.call_soon_threadsafe(loop.stop)
        if not on_loop:
            thread.join(CONTROL_TIMEOUT_S)
            if thread.is_alive():
                log.error("rank %d: UDP plane thread did not stop", self.me)

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Wait until peers have acknowledged what this rank sent them; True when nothing is owed.

        A rank completes a collective once it has *received* everything; a peer may still lack
        some of what this rank sent (a lost datagram, a lost ACK or STOP). That peer's plane
        must be up to answer the resends. So at the end of a job call ``drain()`` on every rank,
        then a barrier (``dist.barrier()``), then :meth:`close`: a rank that closes while a
        peer still drains leaves that peer resending into silence until ``close``'s own bound
        (2 s and a warning). Waits at most ``timeout_s``; collectives still in flight do not
        count (their Futures are the caller's to wait on). Thread-safe; False on a closed plane
        that still owed data.
        """
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive() or self._stopping:
            return not self._owes()  # not serving (or closing, whose own drain runs)
        if threading.current_thread() is thread:
            raise RuntimeError("UdpPlane.drain() waits on the plane's loop: not from its thread")
        fut = asyncio.run_coroutine_threadsafe(self._drain(timeout_s), loop)
        return bool(fut.result(max(timeout_s, 0.0) + CONTROL_TIMEOUT_S))

    def __enter__(self) -> UdpPlane:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread-safe API ---------------------------------------------------------------------
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
        """All-reduce ``data`` (1-D float32/float16, or raw 16-bit words with ``dtype``).

        Returns a Future of ``(result, CollectiveReport)``; the result is a new array (the SUM
        over ranks). The plane reads ``data`` on its thread: do not modify it until the Future
        is done. Errors (a bad bucket, a late peer, a closed plane) fail the Future.
        ``servers`` (ranks) makes it a parameter-server push/pull instead of the transpose
        all-reduce (see :meth:`TransposeAllReduce.start`); every rank passes the same list.
        ``out`` receives the result (it may be ``data``: in place, like ``dist.all_reduce``).
        ``pinned``: every chunk of this bucket is protected and in class 0 (a pinned layer, see
        ``PriorityConfig.pins``). ``scale`` multiplies the result (``1 / world`` for the mean),
        at no extra pass over the buffer (see :meth:`TransposeAllReduce.start`).
        """
        fut: concurrent.futures.Future[CollectiveResult] = concurrent.futures.Future()
        srv = None if servers is None else tuple(servers)
        req = CollectiveRequest(
            step, bucket, data, layer_position, dtype, srv, out=out, scale=scale, pinned=pinned
        )
        with self._lock:
            loop = self._loop
            if self._closed or loop is None:
                state = "closed" if self._closed else "not started"
                fut.set_exception(
                    TransferFailed(f"engine {state}: step {step} bucket {bucket} not submitted")
                )
                return fut
            self._inbox.append((fut, req))
            if len(self._inbox) == 1:  # else a wakeup is already on its way
                loop.call_soon_threadsafe(self._start_queued)
        return fut

    def stats(self) -> dict[str, Any]:
        """The endpoint's reject counters and totals, the sockets' counters (``"udp"``), each
        peer's path statistics (``"paths"``), the loop thread's CPU seconds with the timer
        wakeups' count and share (``"loop"``: ``cpu_s``, ``timer_passes``, ``timer_cpu_s``, and
        ``held_wakeups``: socket wakeups that only read, their datagrams left to coalesce), and
        the receive tap's counters (``"injected_drops"``: 0 without a tap)."""

        def collect() -> dict[str, Any]:
            out = dict(self._core.stats())
            out["udp"] = asdict(self._udp.counters)
            out["in_flight"] = self._core.in_flight
            out["injected_drops"] = 0  # without a tap; an InjectedLoss tap sets its count
            if self._tap is not None:
                out.update(self._tap.stats())
            # The loop thread's CPU so far (this runs on it), and how much of it timer wakeups
            # took, with their count.
            on_loop = threading.current_thread() is self._thread
            out["loop"] = {
                "cpu_s": time.thread_time() if on_loop else None,  # None: the loop is not running
                "timer_passes": self._timer_passes,
                "timer_cpu_s": self._timer_cpu_s,
                "held_wakeups": self._held_wakeups,
            }
            # Per peer, per path: state, rate, RTT, loss EWMA, sent/acked/lost bytes.
            out["paths"] = self._core.path_stats()
            return out

        return self._call(collect)

    # -- loop thread -----------------------------------------------------------------------------
    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(self._udp.wait_closed())
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    def _call(self, fn: Any) -> Any:
        """Run ``fn()`` on the loop thread and return its result (directly when not running)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return fn()

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(CONTROL_TIMEOUT_S)

    async def _shutdown(self, drain_s: float) -> None:
        self._start_queued()  # closed: fails what still waits to start
        aborted = self._pending.keys()
        self._pending.fail_all(
            lambda step, bucket: TransferFailed(
                f"engine closed while rank {self.me} was all-reducing step {step} bucket {bucket}"
            )
        )
        if not await self._drain(drain_s, aborted):
            log.warning("rank %d: closing with unacknowledged data after %.1fs", self.me, drain_s)
        self._io_done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await self._udp.wait_closed()

    async def _drain(self, timeout_s: float, skip: set[tuple[int, int]] | None = None) -> bool:
        """Serve (timers, ACKs, retransmissions: the loop runs while this waits) until every
        outgoing transfer of a collective not in ``skip`` (None: of every completed one) is
        acknowledged or stopped by its receiver, or ``timeout_s`` passes; True when none is
        left."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while self._owes(skip) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return not self._owes(skip)

    def _owes(self, skip: set[tuple[int, int]] | None = None) -> bool:
        """Some outgoing transfer of a collective not in ``skip`` (None: of every completed
        one) is neither acknowledged nor stopped. May run off the loop thread (see
        :meth:`TransposeAllReduce.owed`)."""
        running = self._pending.keys() if skip is None else skip
        return bool(self._core.owed() - running)

    def _start_queued(self) -> None:
        """Start every request waiting in the inbox, most urgent first, then one service pass
        that sends their first datagrams (the sender's heap orders those by class and layer).
        A protected bucket submitted while the loop was busy thus starts with the buckets
        submitted before it, not one whole start-and-send pass behind each of them."""
        with self._lock:
            jobs, self._inbox = self._inbox, []
        started = False
        now = time.monotonic()
        policy = self._core.endpoint.priority
        for fut, req in sorted(jobs, key=lambda job: urgency(job[1], policy)):
            if self._closed:
                fut.set_exception(
                    TransferFailed(f"engine closed: step {req.step} bucket {req.bucket}")
                )
            elif self._pending.start(self._core, fut, req, now):
                started = True
        if started:
            self._service(send_first=True)

    def _on_readable(self) -> None:
        # One service per wakeup: the datagrams read in this loop iteration are batched by the
        # endpoint and answered together.
        if self._service_pending or self._loop is None:
            return
        core = self._core
        now = time.monotonic()
        if core.batches == self._batches_seen and core.input_held(now):
            # Coalescing (rx_coalesce_s): what was just read waits for its window, and nothing
            # was processed since the last pass, so unless something else is due (a paced
            # send), a pass now would find nothing to do. The timer runs it when the window
            # ends; on a paced network, where datagrams come one at a time, this saves a full
            # pass per datagram.
            when = core.get_timer()
            if when is not None and when > now:
                self._held_wakeups += 1
                self._arm(when, now)
                return
        self._service_pending = True
        self._loop.call_soon(self._service)

    def _on_timer(self) -> None:
        self._timer = None
        self._armed = None
        if self._io_done:
            return
        c0 = time.thread_time()
        try:
            self._core.handle_timer(time.monotonic())
        except Exception as e:
            self._crashed(e)
            return
        self._service()
        self._timer_passes += 1
        self._timer_cpu_s += time.thread_time() - c0

    def _service(self, send_first: bool = False) -> None:
        """Flush output, resolve finished collectives, re-arm the timer."""
        self._service_pending = False
        if self._io_done:
            return
        try:
            self._service_once(send_first)
        except Exception as e:
            self._crashed(e)

    def _crashed(self, e: Exception) -> None:
        # A bug in the core must not leave callers waiting forever on their Futures.
        log.exception("rank %d: UDP plane failed", self.me)

        def error(step: int, bucket: int) -> TransferFailed:
            err = TransferFailed(f"engine error during step {step} bucket {bucket}: {e!r}")
            err.__cause__ = e
            return err

        self._pending.fail_all(error)

    def _service_once(self, send_first: bool = False) -> None:
        core = self._core
        if send_first:
            # A collective just started: its first datagrams go on the wire before anything is
            # read or processed, since the peers wait on them, while a batch (read now, or
            # before the start) can mean a peer's whole shard to reduce and a gather phase to
            # start first, delaying them by as much.
            self._udp.send(core.datagrams_to_send(time.monotonic(), process_input=False))
        # Take in what has arrived first: acknowledgements free the window and are answered in
        # this same pass, so a rank sending at full speed still reads (and ACKs) promptly.
        # A drain counts from the poll's start: a datagram that reached a socket after that
        # socket was read (while another was) is not behind it.
        began = time.monotonic()
        drained = self._udp.poll()
        now = time.monotonic()
        if drained:
            core.note_drained(began)
        self._udp.send(core.datagrams_to_send(now))
        self._pending.deliver(core)
        self._batches_seen = core.batches
        self._arm(core.get_timer(), now)

    def _arm(self, when: float | None, now: float) -> None:
        if when == self._armed:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed = when
        if when is not None:
            assert self._loop is not None
            # The core's clock is time.monotonic(); the loop's timers count whole milliseconds
            # (libuv truncates: a 0.3 ms wait would fire at once, and again, and again — a busy
            # spin of full service passes until the deadline). Round up: a timer may be up to
            # 1 ms late, never early; socket input still wakes the loop at once.
            delay = max(0.0, when - now)
            if delay > 0.0:
                delay = math.ceil(delay * 1000.0) / 1000.0
            self._timer = self._loop.call_later(delay, self._on_timer)
