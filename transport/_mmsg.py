"""Batched UDP system calls (Linux ``sendmmsg`` / ``recvmmsg``) for the UDP adapter.

Why: on loopback a 64 KB datagram costs the kernel ~10 µs to send and ~8 µs to receive, and a
Python loop of ``sendmsg`` / ``recv_into`` adds ~5 µs per datagram on each side (the call, its
argument parsing and the bookkeeping around it) — a third on top of the kernel's own work. One
``sendmmsg`` carries a whole run of datagrams (header row plus payload view each, gathered by the
kernel, no copy in user space) and one ``recvmmsg`` fills many rows of the receive arena. The
message and iovec tables are NumPy arrays (a small compiled pass appends a run's rows to its
paths' tables); the calls go through ``ctypes``, which releases the GIL while the kernel works.
Each message names its own destination and carries its own IP TOS as a control message
(``IP_TOS``, Linux >= 3.13; ``IPV6_TCLASS``), so the runs of a whole sending pass — every peer,
every priority class — leave with one ``sendmmsg`` per path.

Only 64-bit Linux with glibc's (or a compatible) ``struct mmsghdr`` layout is supported;
:data:`AVAILABLE` is False elsewhere, and the adapter then keeps its one-call-per-datagram path.
``GRADLANE_NO_MMSG=1`` turns the batched calls off (for A/B measurements and as an escape hatch).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import sys
from typing import Any

import numpy as np
from numba import njit

__all__ = ["AVAILABLE", "MSG_DTYPE", "RecvTable", "SendBatch", "sockaddr", "tos_cmsg", "warm_up"]

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


#: ``CMSG_LEN(sizeof(int))`` and ``CMSG_SPACE(sizeof(int))`` on 64-bit Linux.
_CMSG_LEN_INT, _CMSG_SPACE_INT = 20, 24
_IPPROTO_IP, _IP_TOS = int(socket.IPPROTO_IP), int(getattr(socket, "IP_TOS", 1))
_IPPROTO_IPV6, _IPV6_TCLASS = int(socket.IPPROTO_IPV6), int(getattr(socket, "IPV6_TCLASS", 67))


def tos_cmsg(tos: int, v6: bool) -> np.ndarray:
    """The control message marking one datagram with IP TOS (IPv6: traffic class) ``tos``, as
    bytes in an array a message table may point at (``struct cmsghdr`` then an ``int``)."""
    level, kind = (_IPPROTO_IPV6, _IPV6_TCLASS) if v6 else (_IPPROTO_IP, _IP_TOS)
    raw = struct.pack("<QiiI", _CMSG_LEN_INT, level, kind, int(tos) & 0xFF)
    out = np.zeros(_CMSG_SPACE_INT, dtype=np.uint8)
    out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


class SendBatch:
    """Message and iovec tables for ``sendmmsg``, one per local path, that the runs of a whole
    sending pass are appended to: two iovecs per datagram (header row, payload view), and per
    datagram its own destination (``msg_name``) and its own IP TOS (an ``IP_TOS`` /
    ``IPV6_TCLASS`` control message). So one ``sendmmsg`` per path carries every peer's and
    every priority class's datagrams of the pass, where a table per run needed one call per
    (peer, class, path) — at 4 ranks × 1 MB, ~4 calls per collective and rank instead of ~20.

    :meth:`append` lays a run out (one compiled pass); :meth:`send` sends a path's rows;
    :meth:`clear` empties the tables for the next pass. ``run[q, r]`` and ``order[q, r]`` say
    which appended run, and which datagram of it, row ``r`` of path ``q`` is (for the rows the
    kernel will not take now, which the caller then queues one by one).
    """

    def __init__(self, n_paths: int, capacity: int = 256) -> None:
        self.n_paths = int(n_paths)
        self.fill = np.zeros(self.n_paths, dtype=np.int64)
        self.nbytes = np.zeros(self.n_paths, dtype=np.int64)
        self.capacity = 0
        self.msgs = np.zeros((self.n_paths, 0), dtype=MSG_DTYPE)
        self.iov = np.zeros((self.n_paths, 0, 2, 2), dtype=np.uint64)
        self.order = np.zeros((self.n_paths, 0), dtype=np.int64)
        self.run = np.zeros((self.n_paths, 0), dtype=np.int64)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        p, old = self.n_paths, self.capacity
        msgs = np.zeros((p, capacity), dtype=MSG_DTYPE)
        iov = np.zeros((p, capacity, 2, 2), dtype=np.uint64)
        order = np.zeros((p, capacity), dtype=np.int64)
        run = np.zeros((p, capacity), dtype=np.int64)
        if old:  # rows already laid out this pass move along (their iovec pointers do not)
            msgs[:, :old] = self.msgs
            iov[:, :old] = self.iov
            order[:, :old] = self.order
            run[:, :old] = self.run
        step = np.arange(p * capacity, dtype=np.uint64).reshape(p, capacity) * np.uint64(2 * _IOV)
        msgs["iov"] = np.uint64(iov.ctypes.data) + step
        msgs["iovlen"] = 2
        self.msgs, self.iov, self.order, self.run = msgs, iov, order, run
        self._words = msgs.view(np.uint64).reshape(p, capacity, MSG_DTYPE.itemsize // 8)
        self._base = int(msgs.ctypes.data)
        self.capacity = capacity

    def append(
        self,
        run_id: int,
        hdr_base: int,
        header_bytes: int,
        chunks: np.ndarray,
        pay_base: int,
        starts: np.ndarray,
        sizes: np.ndarray,
        paths: np.ndarray,
        names: np.ndarray,
        controls: np.ndarray,
    ) -> bool:
        """Lay out datagram ``i`` (header row ``chunks[i]`` of ``header_bytes`` at ``hdr_base``,
        payload ``sizes[i]`` bytes at ``pay_base + starts[i]``) after the rows of its path
        ``paths[i]``, each path's in run order, to the address ``names[q]`` (``(address,
        length)`` of a ``struct sockaddr``, per path) with the control message ``controls[q]``
        (``(address, length)``; per path, since its level follows the path's address family).
        False, and nothing laid out, when a path is outside ``0 .. n_paths - 1``."""
        n = int(chunks.shape[0])
        need = int(self.fill.max()) + n
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity))
        ok = _append(
            self._words, self.iov, self.order, self.run, self.fill, self.nbytes, run_id,
            hdr_base, header_bytes, chunks, pay_base, starts, sizes, paths, names, controls,
        )  # fmt: skip
        return bool(ok)

    def row_bytes(self, path: int, first: int, end: int) -> int:
        """Bytes (headers and payloads) of rows ``first .. end - 1`` of ``path``."""
        return int(self.iov[path, first:end, :, 1].sum())

    def clear(self) -> None:
        """Forget every row (the next pass starts empty)."""
        self.fill[:] = 0
        self.nbytes[:] = 0

    def send(self, fd: int, path: int, first: int, count: int) -> tuple[int, int]:
        """Send rows ``first .. first + count - 1`` of ``path`` on socket ``fd``. Returns
        ``(sent, err)``: how many went out from ``first``, and the ``errno`` that stopped the
        call before the end (0 when all went out). ``EINTR`` is retried."""
        assert _calls is not None
        call = _calls[0]
        size = MSG_DTYPE.itemsize
        base = self._base + (path * self.capacity + first) * size
        sent = 0
        while sent < count:
            k = call(fd, base + sent * size, count - sent, 0)
            if k > 0:
                sent += k
                continue
            err = ctypes.get_errno() if k < 0 else errno.EIO
            if err == errno.EINTR:
                continue
            return sent, err
        return sent, 0


@njit(nogil=True, cache=True)
def _append(
    words: np.ndarray,
    iov: np.ndarray,
    order: np.ndarray,
    run: np.ndarray,
    fill: np.ndarray,
    nbytes: np.ndarray,
    run_id: int,
    hdr_base: int,
    hb: int,
    chunks: np.ndarray,
    pay_base: int,
    starts: np.ndarray,
    sizes: np.ndarray,
    paths: np.ndarray,
    names: np.ndarray,
    controls: np.ndarray,
) -> bool:
    # One pass to check, one to place. What this replaced per run — a counting sort into a
    # table of its own, then a sendmmsg per path, per peer and per class — cost a system call
    # and ~40 us of Python per (peer, class, path).
    n_paths = fill.shape[0]
    for i in range(chunks.shape[0]):
        if paths[i] < 0 or paths[i] >= n_paths:
            return False
    for i in range(chunks.shape[0]):
        q = paths[i]
        r = fill[q]
        fill[q] = r + 1
        iov[q, r, 0, 0] = hdr_base + chunks[i] * hb
        iov[q, r, 0, 1] = hb
        iov[q, r, 1, 0] = pay_base + starts[i]
        iov[q, r, 1, 1] = sizes[i]
        w = words[q, r]
        w[0] = names[q, 0]  # msg_name, msg_namelen
        w[1] = names[q, 1]
        w[4] = controls[q, 0]  # msg_control, msg_controllen
        w[5] = controls[q, 1]
        w[6] = 0  # msg_flags
        w[7] = 0  # msg_len (the kernel's answer)
        order[q, r] = i
        run[q, r] = run_id
        nbytes[q] += hb + sizes[i]
    return True


def warm_up() -> None:
    """Compile (or load from numba's cache) the table filler with the argument types the UDP
    adapter passes (int64 arrays), so a run's first ``sendmmsg`` does not compile it. No
    system call is made."""
    z = np.zeros(1, dtype=np.int64)
    pairs = np.zeros((1, 2), dtype=np.uint64)
    SendBatch(1, 1).append(0, 0, 1, z, 0, z, z, z, pairs, pairs)


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
