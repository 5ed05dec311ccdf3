"""The engine (ARCHITECTURE §6): an event loop on its own thread driving one rank's
:class:`~gradlane.transport.core.collective.TransposeAllReduce` over real UDP sockets.

Theory of operation
-------------------
The protocol core is sans-I/O; the engine is its driver, like aioquic's asyncio glue. All core
calls happen on the loop thread. After every input (a read wakeup, the timer, a submitted
bucket) the engine runs ``_service``: it sends ``datagrams_to_send(now)``, turns events into
Future results, and re-arms the one loop timer from ``get_timer()``. ``now`` is always
``time.monotonic()``; the loop's own clock is only used to place the timer.

Other threads talk to the engine with :meth:`Engine.submit`, which returns a
``concurrent.futures.Future`` resolved on the loop thread with ``(result, CollectiveReport)``,
or failed with the transport's error (``PeerTimeout`` naming the late ranks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.endpoint import Endpoint
from gradlane.transport.drivers.futures import CollectiveResult, PendingCollectives
from gradlane.transport.drivers.peers import Address, Rendezvous
from gradlane.transport.drivers.udp.sockets import UdpPaths, new_event_loop
from gradlane.transport.drivers.warmup import warm_up
from gradlane.transport.errors import ConfigError, TransferFailed

__all__ = ["Engine", "default_local_addrs"]

log = logging.getLogger(__name__)

#: How long ``start``/``stats``/``close`` wait for the loop thread before giving up.
CONTROL_TIMEOUT_S = 10.0
#: How often the shutdown drain re-checks for unacknowledged outgoing transfers.
DRAIN_POLL_S = 0.001

Result = CollectiveResult


def default_local_addrs(n_paths: int) -> list[Address]:
    """Loopback path addresses 127.0.0.1, 127.0.0.2, ... (port 0: any free port)."""
    return [(f"127.0.0.{1 + p}", 0) for p in range(n_paths)]


class _LossyArena:
    """The endpoint's receive side behind ``TransportConfig.inject_loss`` (tests and demos): the
    driver fills arena rows as always (``recvmmsg``, a GRO split, or one ``recv_into`` where
    those are missing), then each datagram is dropped with probability ``rate`` (``rng``:
    seeded per rank) before the endpoint sees it. The kept rows of a batch move down over the
    dropped ones, in order, and only they are committed: the endpoint and everything after it
    run exactly as on a lossy network."""

    def __init__(self, endpoint: Endpoint, rate: float, rng: np.random.Generator) -> None:
        self._ep = endpoint
        self._rate = rate
        self._rng = rng
        self.dropped = 0

    @property
    def rx_arena(self) -> np.ndarray:
        """The endpoint's arena (see :class:`gradlane.transport.drivers.udp.sockets.RxArena`)."""
        return self._ep.rx_arena

    @property
    def rx_free(self) -> int:
        """The endpoint's first free row."""
        return self._ep.rx_free

    def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
        """Drop a random part of the ``len(lengths)`` rows just filled; commit the rest."""
        keep = np.flatnonzero(self._rng.random(lengths.shape[0]) >= self._rate)
        moved = keep != np.arange(keep.shape[0])  # kept rows below a dropped one
        self.dropped += lengths.shape[0] - keep.shape[0]
        if moved.any():
            # Each moves down (fancy indexing reads them all before writing), only as wide as
            # the longest of them.
            d = int(np.argmax(moved))
            first, rows = self._ep.rx_free, self._ep.rx_arena
            width = min(rows.shape[1], -(-int(lengths[keep[d:]].max()) // 8) * 8)
            rows[first + d : first + keep.shape[0], :width] = rows[first + keep[d:], :width]
        self._ep.commit_datagrams(lengths[keep], path, now)

    def commit_datagram(self, nbytes: int, path: int, now: float) -> None:
        """The one datagram just received into the endpoint's buffer: dropped, or committed."""
        if self._rng.random() < self._rate:
            self.dropped += 1
        else:
            self._ep.commit_datagram(nbytes, path, now)


class Engine:
    """One rank's UDP transport: sockets, event loop thread and all-reduce core.

    ``local_addrs`` are the local path addresses, one per ``config.n_paths`` (``(host, port)``
    or a bare host for port 0; default: 127.0.0.1, 127.0.0.2, ...). With a ``rendezvous``,
    :meth:`start` publishes the bound addresses and looks up every peer's; without one, call
    :meth:`set_peers` after :meth:`start` (so tests can bind port 0, then exchange addresses).

    ``bufsize`` overrides ``config.socket_buffer_bytes`` (the sockets' buffer size).

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
        self._core = TransposeAllReduce(me, world, cfg)
        # Datagrams go straight into the endpoint's arena, many per system call (recvmmsg, or
        # GRO): no forwarding call per datagram. Test/demo loss sits between the sockets and
        # the endpoint on that same path, so what a lossy run measures is the real hot path.
        endpoint = self._core.endpoint
        self._lossy = (
            _LossyArena(endpoint, cfg.inject_loss, np.random.default_rng([cfg.seed, me, 0x10557]))
            if cfg.inject_loss > 0
            else None
        )
        self._udp = UdpPaths(
            endpoint.rx_buffer,
            (self._lossy or endpoint).commit_datagram,
            self._on_readable,
            bufsize=cfg.socket_buffer_bytes if bufsize is None else bufsize,
            arena=self._lossy or endpoint,
            gso=cfg.udp_gso,
            gro=cfg.udp_gro,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pending = PendingCollectives()
        self._timer: asyncio.TimerHandle | None = None
        self._armed: float | None = None
        self._service_pending = False
        # Timer wakeups and the loop thread's CPU spent in them (stats()["loop"]): with the
        # service passes they cause, that is the engine's cost when no datagram arrives.
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

        Raises :class:`ConfigError` (e.g. a port in use, naming the address); the engine is then
        closed.
        """
        if self._thread is not None:
            raise RuntimeError("engine already started")
        if self._closed:
            raise RuntimeError("engine is closed")
        # Compile the kernels now, not inside the first collective's deadlines.
        warm_up(keyed=bool(self.config.secret), udp=True)
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
        lack some of what it sent; for up to ``drain_s`` the engine keeps serving until those
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
                log.error("rank %d: engine shutdown timed out; stopping the loop", self.me)
            except RuntimeError:  # the loop thread died (a bug): nothing left to shut down
                log.error("rank %d: engine loop was already closed", self.me)
            if not loop.is_closed():
                loop.call_soon_threadsafe(loop.stop)
        if not on_loop:
            thread.join(CONTROL_TIMEOUT_S)
            if thread.is_alive():
                log.error("rank %d: engine thread did not stop", self.me)

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Wait until peers have acknowledged what this rank sent them; True when nothing is owed.

        A rank completes a collective once it has *received* everything; a peer may still lack
        some of what this rank sent (a lost datagram, a lost ACK or STOP). That peer's engine
        must be up to answer the resends. So at the end of a job call ``drain()`` on every rank,
        then a barrier (``dist.barrier()``), then :meth:`close`: a rank that closed while a
        peer still drained left that peer resending into silence until ``close``'s own bound
        (2 s and a warning). Waits at most ``timeout_s``; collectives still in flight do not
        count (their Futures are the caller's to wait on). Thread-safe; False on a closed engine
        that still owed data.
        """
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive() or self._stopping:
            return not self._owes()  # not serving (or closing, whose own drain runs)
        if threading.current_thread() is thread:
            raise RuntimeError("Engine.drain() waits on the engine's loop: not from its thread")
        fut = asyncio.run_coroutine_threadsafe(self._drain(timeout_s), loop)
        return bool(fut.result(max(timeout_s, 0.0) + CONTROL_TIMEOUT_S))

    def __enter__(self) -> Engine:
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
        pinned: bool = False,
        scale: float = 1.0,
    ) -> concurrent.futures.Future[Result]:
        """All-reduce ``data`` (1-D float32/float16, or raw 16-bit words with ``dtype``).

        Returns a Future of ``(result, CollectiveReport)``; the result is a new array (the SUM
        over ranks). The engine reads ``data`` on its thread: do not modify it until the Future
        is done. Errors (a bad bucket, a late peer, a closed engine) fail the Future.
        ``servers`` (ranks) makes it a parameter-server push/pull instead of the transpose
        all-reduce (see :meth:`TransposeAllReduce.start`); every rank passes the same list.
        ``out`` receives the result (it may be ``data``: in place, like ``dist.all_reduce``).
        ``pinned``: every chunk of this bucket is protected and in class 0 (a pinned layer, see
        ``PriorityConfig.pins``). ``scale`` multiplies the result (``1 / world`` for the mean),
        at no extra pass over the buffer (see :meth:`TransposeAllReduce.start`).
        """
        fut: concurrent.futures.Future[Result] = concurrent.futures.Future()
        with self._lock:
            loop = self._loop
            if self._closed or loop is None:
                state = "closed" if self._closed else "not started"
                fut.set_exception(
                    TransferFailed(f"engine {state}: step {step} bucket {bucket} not submitted")
                )
                return fut
            loop.call_soon_threadsafe(
                self._start, fut, step, bucket, data, layer_position, dtype, servers, out, pinned,
                scale,
            )  # fmt: skip
        return fut

    def stats(self) -> dict[str, Any]:
        """The endpoint's reject counters and totals, the sockets' counters (``"udp"``), each
        peer's path statistics (``"paths"``), and the loop thread's CPU seconds with the timer
        wakeups' count and share (``"loop"``: ``cpu_s``, ``timer_passes``, ``timer_cpu_s``)."""

        def collect() -> dict[str, Any]:
            out = dict(self._core.endpoint.stats())
            out["udp"] = asdict(self._udp.counters)
            out["in_flight"] = self._core.in_flight
            out["injected_drops"] = self._lossy.dropped if self._lossy is not None else 0
            # The loop thread's CPU so far (this runs on it), and how much of it timer wakeups
            # took, with their count.
            on_loop = threading.current_thread() is self._thread
            out["loop"] = {
                "cpu_s": time.thread_time() if on_loop else None,  # None: the loop is not running
                "timer_passes": self._timer_passes,
                "timer_cpu_s": self._timer_cpu_s,
            }
            # Per peer, per path: state, rate, RTT, loss EWMA, sent/acked/lost bytes.
            sender = self._core.endpoint.sender
            out["paths"] = {peer: ps.snapshot() for peer, ps in sender.paths.items()}
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
        one) is neither acknowledged nor stopped. ``list()`` copies the keys in one step under
        the GIL, so it may run off the loop thread while the loop changes them."""
        running = self._pending.keys() if skip is None else skip
        return any(
            (k.step, k.bucket) not in running for k in list(self._core.endpoint.sender.transfers)
        )

    def _start(
        self,
        fut: concurrent.futures.Future[Result],
        step: int,
        bucket: int,
        data: np.ndarray,
        layer_position: float,
        dtype: int | None,
        servers: Sequence[int] | None,
        out: np.ndarray | None,
        pinned: bool = False,
        scale: float = 1.0,
    ) -> None:
        if self._closed:
            fut.set_exception(TransferFailed(f"engine closed: step {step} bucket {bucket}"))
            return
        now = time.monotonic()
        pending = self._pending
        if pending.start(
            self._core, fut, step, bucket, data, layer_position, dtype, now, servers, out, pinned,
            scale,
        ):  # fmt: skip
            self._service(send_first=True)

    def _on_readable(self) -> None:
        # One service per wakeup: the datagrams read in this loop iteration are batched by the
        # endpoint and answered together.
        if not self._service_pending and self._loop is not None:
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
        log.exception("rank %d: engine failed", self.me)

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
            # start first: at 2 x 1 MB that put a rank's first datagram ~1 ms after its start.
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
