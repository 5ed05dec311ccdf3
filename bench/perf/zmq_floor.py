"""How fast could an all-reduce over ZeroMQ be on this machine? A protocol-free floor.

``gradlane.bench.perf.allreduce`` runs it (``zmq_floor``) interleaved with gloo and gradlane's
ZeroMQ data plane, whenever it runs the plane: ``summary.zmq_floor_vs_gloo`` and
``summary.zmq_vs_floor`` come from the same run.

Each rank runs the same transpose all-reduce as gradlane (reduce-scatter by direct all-to-all,
then all-gather) with nothing of a transport around it: no packets, headers, tags,
acknowledgements, priorities or paths. One PULL socket per rank (all peers fan in) and one PUSH
socket per peer, over TCP on loopback as the plane's; each shard travels as frames of up to
4 MiB, each a 16-byte header (repetition, phase, sender, offset) and a zero-copy view of the
buffer, and each received frame is added (reduce) or copied (gather) into the buffer straight
from libzmq's message, with one NumPy operation. So it costs what libzmq (its I/O thread's copies
and TCP's) and the sums cost by themselves: a ZeroMQ transport cannot be faster than this here.

Frames of the gather phase that come while this rank is still reducing (a faster peer) are kept
and applied afterwards: their place in the buffer is what this rank's reduce-phase frames are
still being sent from.
"""

from __future__ import annotations

import concurrent.futures
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

__all__ = ["FRAME_FLOATS", "FloorReport", "ZmqFloorPlane"]

#: Floats per frame: 4 MiB, the ZeroMQ plane's batch frames' size.
FRAME_FLOATS = 1 << 20
#: A frame's header: repetition, phase, sender, offset (in floats) of its payload in the buffer.
_HEADER = struct.Struct("<IIIQ")
#: Seconds without a frame before a repetition fails (TCP does not lose frames: a peer is gone).
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FloorReport:
    """What a floor's result reports in place of a ``CollectiveReport``: it either has every
    datagram or frame, or fails (this floor's and ``bench.perf.allreduce``'s UDP floor's)."""

    delivered_fraction: float = 1.0
    degraded: bool = False


class ZmqFloorPlane:
    """One rank of the floor behind the calls the all-reduce benchmark makes of a plane
    (``submit``, ``drain``, ``close``): ``endpoints[r]`` is where rank ``r`` binds its PULL
    socket. ``submit`` runs the exchange on the caller's thread and returns a done Future.

    Frames are sent zero-copy, with no protocol to say when a peer has them: when ``submit``
    returns, this rank's reduced shard may still be queued in libzmq (pyzmq keeps the buffer
    alive), so the caller must not write to the buffer afterwards. The benchmark gives every
    repetition a fresh copy; a transport could not work this way, which is part of why this
    is a floor."""

    def __init__(self, rank: int, world: int, endpoints: list[str], hwm: int = 1024) -> None:
        self.rank, self.world = rank, world
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.rcvhwm = hwm
        self.pull.linger = 0
        self.pull.bind(endpoints[rank])
        self.push: dict[int, zmq.Socket[bytes]] = {}
        for r, ep in enumerate(endpoints):
            if r != rank:
                s = self.ctx.socket(zmq.PUSH)
                s.sndhwm = hwm
                s.linger = 0
                s.connect(ep)
                self.push[r] = s
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)

    def submit(
        self, step: int, bucket: int, data: np.ndarray, out: np.ndarray | None = None
    ) -> concurrent.futures.Future[Any]:
        """All-reduce float32 ``data`` (into ``out``, which may be ``data``) as repetition
        ``step`` (the same on every rank): a done Future of ``(result, report)``."""
        buf = data.copy() if out is None else out
        if out is not None and out is not data:
            buf[:] = data
        self._exchange(buf, step & 0xFFFFFFFF)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        fut.set_result((buf, FloorReport()))
        return fut

    def _send(
        self, dst: int, phase: int, buf: np.ndarray, lo: int, hi: int, rep: int
    ) -> list[zmq.MessageTracker | None]:
        """Send ``buf[lo:hi]`` to ``dst`` as frames of phase ``phase``; their trackers."""
        trackers = []
        for off in range(lo, hi, FRAME_FLOATS):
            end = min(off + FRAME_FLOATS, hi)
            head = _HEADER.pack(rep, phase, self.rank, off)
            trackers.append(
                self.push[dst].send_multipart([head, buf[off:end].data], copy=False, track=True)
            )
        return trackers

    def _exchange(self, buf: np.ndarray, rep: int) -> None:
        me, world = self.rank, self.world
        bounds = np.linspace(0, buf.shape[0], world + 1).astype(np.int64).tolist()
        lo, hi = bounds[me], bounds[me + 1]
        peers = [j for j in range(world) if j != me]
        sent = []
        for j in peers:  # reduce phase: each peer's shard of this buffer, to that peer
            sent += self._send(j, 0, buf, bounds[j], bounds[j + 1], rep)
        need = [(hi - lo) * len(peers), sum(bounds[j + 1] - bounds[j] for j in peers)]
        got = [0, 0]
        early: list[tuple[int, np.ndarray]] = []  # gather frames that came during the reduce
        while got[0] < need[0]:
            off, phase, pay = self._recv(rep)
            if phase == 0:
                buf[off : off + pay.shape[0]] += pay
                got[0] += pay.shape[0]
            else:
                early.append((off, pay))
        for j in peers:  # gather phase: the reduced shard, to every peer
            self._send(j, 1, buf, lo, hi, rep)
        # The reduce-phase frames are sent from where the gather phase writes: wait for libzmq
        # to let go of them (it has: each peer's gather frames needed them all).
        for t in sent:
            if t is not None:
                t.wait(TIMEOUT_S)
        for off, pay in early:
            buf[off : off + pay.shape[0]] = pay
            got[1] += pay.shape[0]
        while got[1] < need[1]:
            off, phase, pay = self._recv(rep)
            buf[off : off + pay.shape[0]] = pay
            got[1] += pay.shape[0]

    def _recv(self, rep: int) -> tuple[int, int, np.ndarray]:
        """The next frame of repetition ``rep``: (offset, phase, payload as float32)."""
        while True:
            if not self.poller.poll(int(TIMEOUT_S * 1000)):
                raise TimeoutError(f"rank {self.rank}: zmq_floor had no frame for {TIMEOUT_S} s")
            head, body = self.pull.recv_multipart(copy=False)
            r, phase, _src, off = _HEADER.unpack(head.bytes)
            if r == rep:
                return int(off), int(phase), np.frombuffer(body.buffer, dtype=np.float32)
            # A frame of another repetition: the benchmark separates repetitions with a barrier,
            # so only a stale one can come (dropped).

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Nothing to wait for (each exchange ends with every frame received)."""
        return True

    def close(self) -> None:
        """Close the sockets and the context."""
        for s in (self.pull, *self.push.values()):
            s.close(linger=0)
        self.ctx.term()
