"""Batched UDP system calls (Linux ``sendmmsg`` / ``recvmmsg``) for the UDP adapter.

Why: on loopback a 64 KB datagram costs the kernel ~10 µs to send and ~8 µs to receive, and a
Python loop of ``sendmsg`` / ``recv_into`` adds ~5 µs per datagram on each side (the call, its
argument parsing and the bookkeeping around it) — a third on top of the kernel's own work. One
``sendmmsg`` carries a whole run of datagrams (header row plus payload view each, gathered by the
kernel, no copy in user space) and one ``recvmmsg`` fills many rows of the receive arena. The
message and iovec tables are NumPy arrays (a small compiled pass fills a run's rows, grouped by
path); the calls go through ``ctypes``, which releases the GIL while the kernel works.

Only 64-bit Linux with glibc's (or a compatible) ``struct mmsghdr`` layout is supported;
:data:`AVAILABLE` is False elsewhere, and the adapter then keeps its one-call-per-datagram path.
``GRADLANE_NO_MMSG=1`` turns the batched calls off (for A/B measurements and as an escape hatch).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys
from typing import Any

import numpy as np
from numba import njit

__all__ = ["AVAILABLE", "MSG_DTYPE", "RecvTable", "SendTable", "sockaddr", "warm_up"]

#: ``struct mmsghdr`` on 64-bit Linux: ``struct msghdr`` (56 bytes) then ``msg_len`` (+ pad).
MSG_DTYPE = np.dtype(
    [
        ("name", "<u8"),
        ("namelen", "<u4"),
        ("_pad0", "<u4"),
        ("iov", "<u8"),
        ("iovlen", "<u8"),
        ("control", "<u8"),
        ("controllen", "<u8"),
        ("flags", "<i4"),
        ("_pad1", "<u4"),
        ("len", "<u4"),
        ("_pad2", "<u4"),
    ]
)
_IOV = 16  # struct iovec: base, length
# Plain ints: socket's flags are enum members, which cost NumPy and ctypes a slow path per use.
_MSG_TRUNC = int(getattr(socket, "MSG_TRUNC", 0x20))
_MSG_DONTWAIT = int(getattr(socket, "MSG_DONTWAIT", 0x40))


def _bind() -> tuple[Any, Any] | None:
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    if sys.byteorder != "little" or os.environ.get("GRADLANE_NO_MMSG", "") not in ("", "0"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        send, recv = libc.sendmmsg, libc.recvmmsg
    except (OSError, AttributeError):
        return None
    send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    send.restype = ctypes.c_int
    recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    recv.restype = ctypes.c_int
    return send, recv


_calls = _bind()
AVAILABLE = _calls is not None
"""True when the batched calls can be used here."""


def sockaddr(address: tuple[Any, ...]) -> np.ndarray:
    """The ``struct sockaddr_in`` / ``sockaddr_in6`` of a numeric ``(host, port[, flow, scope])``
    address, as bytes in an array (whose memory a message table may point at)."""
    host, port = address[0], int(address[1])
    if ":" in host:
        out = np.zeros(28, dtype=np.uint8)
        out[0:2] = np.frombuffer(np.uint16(socket.AF_INET6).tobytes(), np.uint8)
        out[2:4] = np.frombuffer(port.to_bytes(2, "big"), np.uint8)
        flow = int(address[2]) if len(address) > 2 else 0
        out[4:8] = np.frombuffer(flow.to_bytes(4, "big"), np.uint8)
        out[8:24] = np.frombuffer(socket.inet_pton(socket.AF_INET6, host), np.uint8)
        scope = int(address[3]) if len(address) > 3 else 0
        out[24:28] = np.frombuffer(np.uint32(scope).tobytes(), np.uint8)
        return out
    out = np.zeros(16, dtype=np.uint8)
    out[0:2] = np.frombuffer(np.uint16(socket.AF_INET).tobytes(), np.uint8)
    out[2:4] = np.frombuffer(port.to_bytes(2, "big"), np.uint8)
    out[4:8] = np.frombuffer(socket.inet_pton(socket.AF_INET, host), np.uint8)
    return out


def address_of(buf: Any) -> int:
    """The address of a contiguous buffer (read-only ones included)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class SendTable:
    """Message and iovec tables for ``sendmmsg``: two iovecs per datagram (header, payload).

    :meth:`fill` lays a run's datagrams out grouped by path (one compiled pass); :meth:`send`
    then sends a group of rows with as many ``sendmmsg`` calls as the kernel needs.
    """

    def __init__(self, capacity: int = 256) -> None:
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self.capacity = capacity
        self.msgs = np.zeros(capacity, dtype=MSG_DTYPE)
        self.iov = np.zeros((capacity, 2, 2), dtype=np.uint64)
        self.msgs["iov"] = self.iov.ctypes.data + np.arange(capacity, dtype=np.uint64) * (2 * _IOV)
        self.msgs["iovlen"] = 2
        self.order = np.zeros(capacity, dtype=np.int64)
        self._base = int(self.msgs.ctypes.data)

    def fill(
        self,
        hdr_base: int,
        header_bytes: int,
        chunks: np.ndarray,
        pay_base: int,
        starts: np.ndarray,
        sizes: np.ndarray,
        paths: np.ndarray,
        n_paths: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Lay out datagram ``i`` (header row ``chunks[i]`` of ``header_bytes`` at ``hdr_base``,
        payload ``sizes[i]`` bytes at ``pay_base + starts[i]``) in the rows of its path
        (``paths[i]`` in ``0 .. n_paths - 1``; by default as many paths as the largest one
        needs): path 0's rows first, each path's in run order, and ``order[row]`` = the
        datagram's position in the run. Returns the datagrams and the payload bytes per path.
        Raises ValueError for a path outside that range."""
        n = int(chunks.shape[0])
        if n > self.capacity:
            self._grow(max(n, 2 * self.capacity))
        return _fill(self.iov, self.order, -1 if n_paths is None else n_paths, hdr_base,
                     header_bytes, chunks, pay_base, starts, sizes, paths)  # fmt: skip

    def send(self, fd: int, name: np.ndarray, first: int, count: int) -> tuple[int, int]:
        """Send the ``count`` filled rows from ``first`` to the address ``name`` on socket
        ``fd``. Returns ``(sent, err)``: how many went out from ``first``, and the ``errno``
        that stopped the call before the end (0 when all went out). ``EINTR`` is retried."""
        msgs = self.msgs
        msgs["name"][first : first + count] = name.ctypes.data
        msgs["namelen"][first : first + count] = name.shape[0]
        assert _calls is not None
        call = _calls[0]
        sent = 0
        while sent < count:
            k = call(fd, self._base + (first + sent) * MSG_DTYPE.itemsize, count - sent, 0)
            if k > 0:
                sent += k
                continue
            err = ctypes.get_errno() if k < 0 else errno.EIO
            if err == errno.EINTR:
                continue
            return sent, err
        return sent, 0


@njit(nogil=True, cache=True)
def _fill(
    iov: np.ndarray,
    order: np.ndarray,
    n_paths: int,
    hdr_base: int,
    hb: int,
    chunks: np.ndarray,
    pay_base: int,
    starts: np.ndarray,
    sizes: np.ndarray,
    paths: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    # A stable counting sort by path: one pass to count, one to place. What it replaced — a
    # dozen NumPy operations per path to compute addresses, group and copy them into the
    # table — cost ~100 µs per run of 256 datagrams. n_paths < 0: as many as the largest path
    # needs (found here, not by a NumPy call per run).
    if n_paths < 0:
        n_paths = 1
        for i in range(paths.shape[0]):
            n_paths = max(n_paths, paths[i] + 1)
    counts = np.zeros(n_paths, dtype=np.int64)
    nbytes = np.zeros(n_paths, dtype=np.int64)
    for i in range(chunks.shape[0]):
        q = paths[i]
        if q < 0 or q >= n_paths:
            raise ValueError("SendTable.fill: a path outside 0 .. n_paths - 1")
        counts[q] += 1
        nbytes[q] += sizes[i]
    at = np.empty(n_paths, dtype=np.int64)
    row = 0
    for q in range(n_paths):
        at[q] = row
        row += counts[q]
    for i in range(chunks.shape[0]):
        q = paths[i]
        r = at[q]
        at[q] = r + 1
        iov[r, 0, 0] = hdr_base + chunks[i] * hb
        iov[r, 0, 1] = hb
        iov[r, 1, 0] = pay_base + starts[i]
        iov[r, 1, 1] = sizes[i]
        order[r] = i
    return counts, nbytes


def warm_up() -> None:
    """Compile (or load from numba's cache) the table filler with the argument types the UDP
    adapter passes (int64 arrays), so a run's first ``sendmmsg`` does not compile it. No
    system call is made."""
    z = np.zeros(1, dtype=np.int64)
    SendTable(1).fill(0, 1, z, 0, z, z, z)


class RecvTable:
    """A ``recvmmsg`` message table over the rows of one receive arena (one iovec per row)."""

    def __init__(self, arena: np.ndarray) -> None:
        if arena.ndim != 2 or not arena.flags.c_contiguous:
            raise ValueError("the receive arena must be a C-contiguous 2-D array")
        rows, width = arena.shape
        self.arena = arena  # keeps the memory the table points into alive
        self.iov = np.zeros((rows, 2), dtype=np.uint64)
        self.iov[:, 0] = arena.ctypes.data + np.arange(rows, dtype=np.uint64) * width
        self.iov[:, 1] = width
        self.msgs = np.zeros(rows, dtype=MSG_DTYPE)
        self.msgs["iov"] = self.iov.ctypes.data + np.arange(rows, dtype=np.uint64) * _IOV
        self.msgs["iovlen"] = 1
        self._base = int(self.msgs.ctypes.data)
        self._width = width

    def receive(self, fd: int, first: int, count: int) -> tuple[np.ndarray, int]:
        """Receive up to ``count`` waiting datagrams into rows ``first, first + 1, ...`` without
        blocking. Returns their lengths (a truncated datagram reads as ``width + 1``, so the
        caller counts it as oversized) and the ``errno`` of a failed call (0 when none; EAGAIN
        — nothing waiting — is not a failure).
        """
        assert _calls is not None
        call = _calls[1]
        while True:
            k = call(fd, self._base + first * MSG_DTYPE.itemsize, count, _MSG_DONTWAIT, None)
            if k >= 0:
                break
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                err = 0
            return np.empty(0, dtype=np.int64), err
        got = self.msgs[first : first + k]
        lengths = got["len"].astype(np.int64)
        trunc = (got["flags"] & _MSG_TRUNC) != 0
        if trunc.any():
            lengths[trunc] = self._width + 1
        return lengths, 0
