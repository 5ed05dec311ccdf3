"""The spray's sending side: many datagrams per system call (``sendmmsg``), paced, counted.

:class:`Blaster` owns one UDP socket on a loopback address and sends a batch of datagrams,
each to its own destination, with one ``sendmmsg`` call per batch (``ctypes``, the GIL released
while the kernel copies), or one ``sendto`` per datagram where the call is missing. It counts
what the kernel took, per destination: on loopback a datagram the kernel took is either queued
at the receiving socket or dropped there and counted in that socket's ``drops``
(``/proc/net/udp``), which is what the campaign's accounting relies on.

:class:`Sprayer` is the thread that keeps a :class:`Blaster` busy: batches of datagrams from a
:class:`~gradlane.bench.hardening.forge.PacketFactory`, categories drawn by a seeded generator
from a mix, at a paced rate (datagrams per second; 0 = as fast as it can), until stopped or its
quota is sent. The categories that do not depend on the running step (:data:`POOLED`) come from
a pool built before the level starts, so the sprayer's CPU goes to the system calls, not to
making datagrams on the cores the engines need.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import socket
import sys
import threading
import time
from collections import Counter

import numpy as np
from gradlane.bench.hardening.common import check_loopback
from gradlane.bench.hardening.forge import PacketFactory
from gradlane.transport.drivers.udp.mmsg import MSG_DTYPE, sockaddr

__all__ = ["POOLED", "Blaster", "Sprayer"]

#: Categories whose datagrams do not depend on the running step: built once per level into a
#: pool that the sprayer cycles through, so that its own CPU (a Python call per datagram) stays
#: off the cores the engines run on; the others are made as they are sent.
POOLED = ("random", "mutation", "truncation", "replay", "forged_tag", "foreign_job", "oversized")
#: Pooled datagrams per (category, rank).
POOL_SIZE = 512

#: Datagrams per ``sendmmsg`` call (the kernel's UIO_MAXIOV limit is 1024).
BATCH = 256
#: Longest a send waits for room in the socket's buffer before it gives up on a batch.
SEND_WAIT_S = 1.0


def _bind_sendmmsg() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sendmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_SENDMMSG = _bind_sendmmsg()


class Blaster:
    """A UDP socket on ``host`` (loopback) sending batches to ``targets`` (loopback addresses),
    with per-target counts of the datagrams the kernel took (:attr:`sent`) and of those it
    refused (:attr:`errors`)."""

    def __init__(self, targets: list[tuple[str, int]], host: str = "127.0.0.1") -> None:
        for h, _ in targets:
            check_loopback(h)
        self.targets = list(targets)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((check_loopback(host), 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.sock.setblocking(False)
        self._names = [sockaddr(t) for t in self.targets]
        self.sent = np.zeros(len(targets), dtype=np.int64)
        self.errors = np.zeros(len(targets), dtype=np.int64)

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def send(self, datagrams: list[bytes], dests: np.ndarray) -> int:
        """Send ``datagrams[i]`` to ``targets[dests[i]]``; returns how many the kernel took."""
        if _SENDMMSG is None:
            return self._send_each(datagrams, dests)
        k = len(datagrams)
        buf = np.frombuffer(b"".join(datagrams) or b"\0", dtype=np.uint8)
        lengths = np.fromiter((len(d) for d in datagrams), dtype=np.uint64, count=k)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
        iov = np.empty((k, 2), dtype=np.uint64)
        iov[:, 0] = np.uint64(buf.ctypes.data) + starts
        iov[:, 1] = lengths
        msgs = np.zeros(k, dtype=MSG_DTYPE)
        names = self._names
        msgs["name"] = [names[d].ctypes.data for d in dests.tolist()]
        msgs["namelen"] = [names[d].shape[0] for d in dests.tolist()]
        msgs["iov"] = np.uint64(iov.ctypes.data) + np.arange(k, dtype=np.uint64) * np.uint64(16)
        msgs["iovlen"] = 1
        fd, done, waited = self.sock.fileno(), 0, 0.0
        while done < k:
            n = _SENDMMSG(fd, msgs.ctypes.data + done * MSG_DTYPE.itemsize, k - done, 0)
            if n > 0:
                np.add.at(self.sent, dests[done : done + n], 1)
                done += n
                continue
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS) and waited < SEND_WAIT_S:
                t0 = time.monotonic()
                select.select([], [self.sock], [], SEND_WAIT_S)
                waited += time.monotonic() - t0
                continue
            if err == errno.EINTR:
                continue
            self.errors[dests[done]] += 1  # refused (or no room for too long): skip it
            done += 1
        del buf, names  # the tables pointed into them until here
        return int(k)

    def _send_each(self, datagrams: list[bytes], dests: np.ndarray) -> int:
        for data, d in zip(datagrams, dests.tolist(), strict=True):
            try:
                self.sock.sendto(data, self.targets[d])
            except (BlockingIOError, InterruptedError):
                select.select([], [self.sock], [], SEND_WAIT_S)
                try:
                    self.sock.sendto(data, self.targets[d])
                except OSError:
                    self.errors[d] += 1
                    continue
            except OSError:
                self.errors[d] += 1
                continue
            self.sent[d] += 1
        return len(datagrams)


class Sprayer(threading.Thread):
    """Sends datagrams of ``factory`` to ``targets`` (``(rank, address)``) until stopped or
    ``quota`` have gone, at ``rate`` datagrams per second (0: unpaced). Categories are drawn
    from ``mix`` by ``rng``; :attr:`by_category` and the blaster's counts say what went."""

    def __init__(
        self,
        factory: PacketFactory,
        targets: list[tuple[int, tuple[str, int]]],
        mix: dict[str, float],
        rng: np.random.Generator,
        *,
        rate: float,
        quota: int,
        cpu: int | None = None,
    ) -> None:
        super().__init__(name="gl-hardening-spray", daemon=True)
        self.cpu = cpu  # the core this thread runs on (None: any)
        self.factory = factory
        self.ranks = [r for r, _ in targets]
        self.blaster = Blaster([a for _, a in targets])
        self.names = list(mix)
        weights = np.asarray([mix[n] for n in self.names], dtype=np.float64)
        self.weights = weights / weights.sum()
        self.rng = rng
        self.rate = rate
        self.quota = quota
        self.by_category: Counter[str] = Counter()
        self.pool = {
            (c, r): [factory.make(c, r) for _ in range(POOL_SIZE)]
            for c in POOLED
            if c in mix
            for r in self.ranks
        }
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.elapsed_s = 0.0

    @property
    def sent(self) -> int:
        """Datagrams the kernel took so far."""
        return int(self.blaster.sent.sum())

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the batch in progress and wait for the thread; closes the socket."""
        self.stop_event.set()
        if self.is_alive():
            self.join(timeout_s)
        self.blaster.close()

    def run(self) -> None:
        """Send batches until stopped or the quota is reached (pacing with sleeps)."""
        if self.cpu is not None:  # this thread only (Linux: pid 0 is the calling thread)
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {self.cpu})
        t0 = time.monotonic()
        try:
            while not self.stop_event.is_set() and self.sent < self.quota:
                k = min(BATCH, self.quota - self.sent)
                cats = self.rng.choice(len(self.names), size=k, p=self.weights)
                dests = self.rng.integers(0, len(self.ranks), size=k)
                picks = self.rng.integers(0, POOL_SIZE, size=k).tolist()
                grams = []
                for c, d, i in zip(cats.tolist(), dests.tolist(), picks, strict=True):
                    pooled = self.pool.get((self.names[c], self.ranks[d]))
                    grams.append(
                        pooled[i] if pooled else self.factory.make(self.names[c], self.ranks[d])
                    )
                self.blaster.send(grams, dests)
                for c in cats.tolist():
                    self.by_category[self.names[c]] += 1
                if self.rate > 0:
                    due = t0 + self.sent / self.rate
                    wait = due - time.monotonic()
                    if wait > 0:
                        self.stop_event.wait(wait)
        except BaseException as e:  # reported by the phase, which stops the collectives too
            self.error = e
        finally:
            self.elapsed_s = time.monotonic() - t0
