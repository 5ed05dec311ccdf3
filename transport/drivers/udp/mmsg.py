"""Batched UDP system calls (Linux ``sendmmsg`` / ``recvmmsg``) for the UDP adapter.

Why: a Python loop of ``sendmsg`` / ``recv_into`` adds, per datagram on each side, the call,
its argument parsing and the bookkeeping around it: a large share on top of the kernel's own
work, even for 64 KB datagrams on loopback. One ``sendmmsg`` carries a whole run of datagrams
(header row plus payload view each, gathered by the kernel, no copy in user space) and one
``recvmmsg`` fills many rows of the receive arena. The
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
from dataclasses import dataclass
from typing import Any

import numpy as np
from gradlane.transport.kernels import copy_bytes
from numba import njit

__all__ = [
    "AVAILABLE",
    "GSO_CONTROL_BYTES",
    "GSO_MAX_BYTES",
    "GSO_MAX_SEGMENTS",
    "MSG_DTYPE",
    "GroTable",
    "RecvTable",
    "RunRows",
    "SendBatch",
    "gro_enable",
    "gso_control",
    "gso_supported",
    "sockaddr",
    "tos_cmsg",
    "warm_up",
]

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


#: ``SOL_UDP`` / ``UDP_SEGMENT`` (linux/udp.h; the socket module exports neither).
SOL_UDP, UDP_SEGMENT = 17, 103
#: Most datagrams one UDP GSO send may carry (the kernel's ``UDP_MAX_SEGMENTS``: 64 before
#: Linux 6.2, 128 since; the smaller is safe everywhere).
GSO_MAX_SEGMENTS = 64
#: Most bytes one GSO send may carry: a UDP datagram's largest payload over IPv4.
GSO_MAX_BYTES = 65507
#: Control area of a GSO message: the TOS control message, then UDP_SEGMENT's (each
#: ``CMSG_SPACE`` of its int / u16: 24 + 24 bytes); the segment size sits at byte 40.
GSO_CONTROL_BYTES = 48
_GSO_SIZE_AT = 40


def gso_control(tos: int, v6: bool) -> np.ndarray:
    """The control area of a GSO message marked ``tos``: its TOS (IPv6: traffic class) control
    message, then a ``UDP_SEGMENT`` one whose u16 segment size (bytes 40-41) the table filler
    writes per message."""
    out = np.zeros(GSO_CONTROL_BYTES, dtype=np.uint8)
    out[:_CMSG_SPACE_INT] = tos_cmsg(tos, v6)
    head = struct.pack("<Qii", 18, SOL_UDP, UDP_SEGMENT)  # CMSG_LEN(sizeof(u16)) = 18
    out[_CMSG_SPACE_INT : _CMSG_SPACE_INT + 16] = np.frombuffer(head, dtype=np.uint8)
    return out


def gso_supported(sock: socket.socket) -> bool:
    """True when ``sock``'s kernel takes UDP GSO (``UDP_SEGMENT``, Linux >= 4.18) and the
    batched calls are in use; ``GRADLANE_NO_GSO=1`` says False (A/B runs, escape hatch). A
    device that cannot segment still refuses a GSO send (the adapter then stops using it)."""
    if not AVAILABLE or os.environ.get("GRADLANE_NO_GSO", "") not in ("", "0"):
        return False
    try:
        sock.getsockopt(SOL_UDP, UDP_SEGMENT)
    except OSError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class RunRows:
    """Where the datagrams of one run lie in memory, and the path of each (what
    :meth:`SendBatch.append` lays out): datagram ``i`` is header row ``chunks[i]`` (rows of
    ``header_bytes`` from address ``hdr_base``) followed by ``sizes[i]`` payload bytes at
    address ``pay_base + starts[i]``, and leaves on local path ``paths[i]``. The arrays are
    int64; the memory must stay alive until the batch is sent."""

    hdr_base: int
    header_bytes: int
    chunks: np.ndarray
    pay_base: int
    starts: np.ndarray
    sizes: np.ndarray
    paths: np.ndarray


class SendBatch:
    """Message and iovec tables for ``sendmmsg``, one per local path, that the runs of a whole
    sending pass are appended to: two iovecs per datagram (header row, payload view), and per
    message its own destination (``msg_name``) and its own IP TOS (an ``IP_TOS`` /
    ``IPV6_TCLASS`` control message). So one ``sendmmsg`` per path carries every peer's and
    every priority class's datagrams of the pass: a few calls per collective, not one per
    (peer, class, path).

    UDP GSO (Linux >= 4.18), on the paths whose ``gso`` flag is set: consecutive datagrams of
    one run on one path share one message — their iovecs in a row, a ``UDP_SEGMENT`` control
    message naming their length — when they all have the first one's length (the last may be
    shorter), up to :data:`GSO_MAX_SEGMENTS` and :data:`GSO_MAX_BYTES`. The kernel cuts the
    message into those datagrams (on the way out, or in the NIC), so the stack is traversed
    once per message instead of once per datagram: the saving grows as datagrams shrink (1.4 KB
    ones on a 1500-byte MTU). Every datagram stays a whole packet of ours; the receiver sees
    no difference.

    :meth:`append` lays a run out (one compiled pass); :meth:`send` sends a path's messages
    (rows); :meth:`clear` empties the tables for the next pass. Per row ``r`` of path ``q``:
    ``run[q, r]`` is the appended run it came from, ``count[q, r]`` its datagrams, and
    :meth:`row_order` which datagrams of the run those are (for the rows the kernel will not
    take now, which the caller then queues one datagram at a time). Without GSO every row is
    one datagram and ``order[q, r]`` is its index in its run.
    """

    def __init__(self, n_paths: int, capacity: int = 256) -> None:
        self.n_paths = int(n_paths)
        self.fill = np.zeros(self.n_paths, dtype=np.int64)  # rows (messages) per path
        self.slots = np.zeros(self.n_paths, dtype=np.int64)  # datagrams per path
        self.nbytes = np.zeros(self.n_paths, dtype=np.int64)
        self.gso = np.zeros(self.n_paths, dtype=np.bool_)
        self.capacity = 0
        self.msgs = np.zeros((self.n_paths, 0), dtype=MSG_DTYPE)
        self.iov = np.zeros((self.n_paths, 0, 2, 2), dtype=np.uint64)
        self.order = np.zeros((self.n_paths, 0), dtype=np.int64)
        self.ctl = np.zeros((self.n_paths, 0, GSO_CONTROL_BYTES), dtype=np.uint8)
        # Per row: run, first slot, datagram count, segment size, last datagram's size (the
        # row's bytes follow: (count - 1) * segment + last).
        self._rows = np.zeros((5, self.n_paths, 0), dtype=np.int64)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        p, old = self.n_paths, self.capacity
        msgs = np.zeros((p, capacity), dtype=MSG_DTYPE)
        iov = np.zeros((p, capacity, 2, 2), dtype=np.uint64)
        order = np.zeros((p, capacity), dtype=np.int64)
        rows = np.zeros((5, p, capacity), dtype=np.int64)
        ctl = np.zeros((p, capacity, GSO_CONTROL_BYTES), dtype=np.uint8)
        if old:  # rows already laid out this pass move along; their pointers are redone below
            msgs[:, :old] = self.msgs
            iov[:, :old] = self.iov
            order[:, :old] = self.order
            rows[:, :, :old] = self._rows
            ctl[:, :old] = self.ctl
        self.msgs, self.iov, self.order, self.ctl = msgs, iov, order, ctl
        self._rows = rows
        self.run, self.slot0, self.count = rows[0], rows[1], rows[2]
        self._seg, self._last = rows[3], rows[4]
        self._words = msgs.view(np.uint64).reshape(p, capacity, MSG_DTYPE.itemsize // 8)
        self._base = int(msgs.ctypes.data)
        self._iov_base = int(iov.ctypes.data)
        self._ctl_base = int(ctl.ctypes.data)
        self.capacity = capacity
        q, r = np.indices((p, capacity))
        live = r < self.fill[:, None]
        at = (q * capacity + self.slot0).astype(np.uint64)
        msgs["iov"] = np.where(live, np.uint64(self._iov_base) + at * np.uint64(2 * _IOV), 0)
        gso = live & (self.count > 1)
        cat = (q * capacity + r).astype(np.uint64) * np.uint64(GSO_CONTROL_BYTES)
        msgs["control"] = np.where(gso, np.uint64(self._ctl_base) + cat, msgs["control"])

    def append(
        self,
        run_id: int,
        rows: RunRows,
        names: np.ndarray,
        controls: np.ndarray,
        gso_controls: np.ndarray | None = None,
    ) -> bool:
        """Lay out each datagram of ``rows`` after the rows of its path, each path's in run
        order, to the address ``names[q]`` (``(address, length)`` of a ``struct sockaddr``, per
        path) with the control message ``controls[q]`` (``(address, length)``; per path, since
        its level follows the path's address family). With ``gso_controls`` (per path,
        :func:`gso_control` of the run's TOS), datagrams of this run share GSO messages on the
        paths whose :attr:`gso` flag is set. ``run_id`` names the run in :attr:`run`.
        False, and nothing laid out, when a path is outside ``0 .. n_paths - 1``."""
        n = int(rows.chunks.shape[0])
        need = int(self.slots.max()) + n
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity))
        use_gso = gso_controls is not None and bool(self.gso.any())
        tpl = gso_controls if gso_controls is not None and use_gso else _NO_GSO
        # A compiled kernel: positional arguments, as numba's nopython mode takes them.
        ok = _append(
            self._words, self.iov, self.order, self._rows, self.ctl, self.fill, self.slots,
            self.nbytes, run_id, rows.hdr_base, rows.header_bytes, rows.chunks, rows.pay_base,
            rows.starts, rows.sizes, rows.paths, names, controls,
            self.gso if use_gso else _NO_PATHS, tpl, self._iov_base, self._ctl_base,
        )  # fmt: skip
        return bool(ok)

    def row_bytes(self, path: int, first: int, end: int) -> int:
        """Bytes (headers and payloads) of rows ``first .. end - 1`` of ``path``."""
        count = self.count[path, first:end]
        return int(((count - 1) * self._seg[path, first:end] + self._last[path, first:end]).sum())

    def row_datagrams(self, path: int, first: int, end: int) -> int:
        """Datagrams in rows ``first .. end - 1`` of ``path``."""
        return int(self.count[path, first:end].sum())

    def row_order(self, path: int, row: int) -> np.ndarray:
        """Which datagrams of its run row ``row`` of ``path`` carries (indices into the run)."""
        a = int(self.slot0[path, row])
        return self.order[path, a : a + int(self.count[path, row])]

    def clear(self) -> None:
        """Forget every row (the next pass starts empty)."""
        self.fill[:] = 0
        self.slots[:] = 0
        self.nbytes[:] = 0

    def send(self, fd: int, path: int, first: int, count: int) -> tuple[int, int]:
        """Send rows ``first .. first + count - 1`` of ``path`` on socket ``fd``. Returns
        ``(sent, err)``: how many rows went out from ``first``, and the ``errno`` that stopped
        the call before the end (0 when all went out). ``EINTR`` is retried."""
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


_NO_GSO = np.zeros((0, GSO_CONTROL_BYTES), dtype=np.uint8)
_NO_PATHS = np.zeros(0, dtype=np.bool_)


@njit(nogil=True, cache=True)
def _append(
    words: np.ndarray,
    iov: np.ndarray,
    order: np.ndarray,
    rows: np.ndarray,
    ctl: np.ndarray,
    fill: np.ndarray,
    slots: np.ndarray,
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
    gso: np.ndarray,
    gso_controls: np.ndarray,
    iov_base: int,
    ctl_base: int,
) -> bool:
    # One pass to check, one to place: no Python and no system call per (peer, class, path).
    n_paths = fill.shape[0]
    cap = order.shape[1]
    for i in range(chunks.shape[0]):
        if paths[i] < 0 or paths[i] >= n_paths:
            return False
    run, slot0, count, seg, last = rows[0], rows[1], rows[2], rows[3], rows[4]
    for i in range(chunks.shape[0]):
        q = paths[i]
        d = slots[q]
        slots[q] = d + 1
        length = hb + sizes[i]
        iov[q, d, 0, 0] = hdr_base + chunks[i] * hb
        iov[q, d, 0, 1] = hb
        iov[q, d, 1, 0] = pay_base + starts[i]
        iov[q, d, 1, 1] = sizes[i]
        order[q, d] = i
        nbytes[q] += length
        r = fill[q] - 1
        if (
            gso.shape[0] > 0
            and gso[q]
            and r >= 0
            and run[q, r] == run_id
            and count[q, r] < GSO_MAX_SEGMENTS
            and last[q, r] == seg[q, r]  # every datagram so far is full-sized
            and length <= seg[q, r]
            and count[q, r] * seg[q, r] + length <= GSO_MAX_BYTES  # all full so far: see above
        ):
            count[q, r] += 1
            last[q, r] = length
            w = words[q, r]
            w[3] = 2 * count[q, r]  # msg_iovlen: this row's iovecs are consecutive
            if count[q, r] == 2:  # now a GSO message: TOS and UDP_SEGMENT control messages
                c = ctl[q, r]
                c[:] = gso_controls[q]
                c[_GSO_SIZE_AT] = seg[q, r] & 0xFF
                c[_GSO_SIZE_AT + 1] = (seg[q, r] >> 8) & 0xFF
                w[4] = ctl_base + (q * cap + r) * GSO_CONTROL_BYTES
                w[5] = GSO_CONTROL_BYTES
            continue
        r += 1
        fill[q] = r + 1
        run[q, r] = run_id
        slot0[q, r] = d
        count[q, r] = 1
        seg[q, r] = length
        last[q, r] = length
        w = words[q, r]
        w[0] = names[q, 0]  # msg_name, msg_namelen
        w[1] = names[q, 1]
        w[2] = iov_base + (q * cap + d) * 2 * 16  # msg_iov: this datagram's two iovecs
        w[3] = 2
        w[4] = controls[q, 0]  # msg_control, msg_controllen
        w[5] = controls[q, 1]
        w[6] = 0  # msg_flags
        w[7] = 0  # msg_len (the kernel's answer)
    return True


def warm_up() -> None:
    """Compile (or load from numba's cache) the table filler and the GRO table's kernels with
    the argument types the UDP adapter passes (int64 arrays), so a run's first ``sendmmsg`` (or
    GRO receive) does not compile them. No system call is made."""
    z = np.zeros(1, dtype=np.int64)
    pairs = np.zeros((1, 2), dtype=np.uint64)
    # One signature whether a path has GSO or not (its flags and control areas are arrays of
    # the same types either way).
    SendBatch(1, 1).append(0, RunRows(0, 1, z, 0, z, z, z), pairs, pairs)
    # The GRO table's parser and splitter, with the endpoint arena's types.
    gro = GroTable(1)
    ones = np.ones(1, dtype=np.int64)
    _gro_sizes(ones, ones, gro.ctl, gro.lengths, gro.segments)
    gro.split(1, 0, 0, np.zeros((1, 8), dtype=np.uint8), 0, np.zeros(1, dtype=np.int64))


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


#: ``UDP_GRO`` (linux/udp.h): the socket takes coalesced datagrams, with their segment size.
UDP_GRO = 104
#: Largest coalesced datagram (its IP length field), the staging rows' width.
GRO_ROW_BYTES = 65536
_GRO_CONTROL_BYTES = 64  # room for the UDP_GRO control message (and any other)


def gro_enable(sock: socket.socket) -> bool:
    """Ask ``sock``'s kernel for UDP GRO (``UDP_GRO``, Linux >= 5.0); True if it took it.
    ``GRADLANE_NO_GRO=1`` says no (A/B runs, escape hatch)."""
    if not AVAILABLE or os.environ.get("GRADLANE_NO_GRO", "") not in ("", "0"):
        return False
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True


class GroTable:
    """``recvmmsg`` with UDP GRO: messages land in a small staging area of 64 KB rows (each a
    run of datagrams the kernel coalesced — same flow, all of one size but the last — or one
    datagram), and :meth:`split` copies them, datagram by datagram, into a receive arena's
    rows. The kernel then handles one message per run instead of one per datagram (and on
    loopback a GSO message arrives whole); the split's copy is of bytes still in cache (the
    staging area is ``rows`` × 64 KB, 1 MB by default).
    """

    def __init__(self, rows: int = 16) -> None:
        self.capacity = int(rows)
        self.stage = np.zeros((rows, GRO_ROW_BYTES), dtype=np.uint8)
        self.ctl = np.zeros((rows, _GRO_CONTROL_BYTES), dtype=np.uint8)
        self.iov = np.zeros((rows, 2), dtype=np.uint64)
        self.iov[:, 0] = self.stage.ctypes.data + np.arange(rows, dtype=np.uint64) * GRO_ROW_BYTES
        self.iov[:, 1] = GRO_ROW_BYTES
        self.msgs = np.zeros(rows, dtype=MSG_DTYPE)
        self.msgs["iov"] = self.iov.ctypes.data + np.arange(rows, dtype=np.uint64) * _IOV
        self.msgs["iovlen"] = 1
        step = np.arange(rows, dtype=np.uint64) * np.uint64(_GRO_CONTROL_BYTES)
        self.msgs["control"] = np.uint64(self.ctl.ctypes.data) + step
        self._base = int(self.msgs.ctypes.data)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.segments = np.zeros(rows, dtype=np.int64)  # segment size (0: one datagram)

    def receive(self, fd: int, count: int) -> tuple[int, int]:
        """Receive up to ``count`` (at most the capacity) waiting messages into the staging
        rows without blocking; their lengths and segment sizes go to :attr:`lengths` and
        :attr:`segments`. Returns ``(messages, errno)`` (EAGAIN — nothing waiting — is 0)."""
        assert _calls is not None
        count = min(count, self.capacity)
        msgs = self.msgs[:count]
        msgs["controllen"] = _GRO_CONTROL_BYTES  # the kernel writes what it used
        msgs["flags"] = 0
        call = _calls[1]
        while True:
            k = call(fd, self._base, count, _MSG_DONTWAIT, None)
            if k >= 0:
                break
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            return 0, 0 if err in (errno.EAGAIN, errno.EWOULDBLOCK) else err
        _gro_sizes(self.msgs["len"][:k].astype(np.int64), self.msgs["controllen"][:k].astype(
            np.int64), self.ctl, self.lengths, self.segments)  # fmt: skip
        return k, 0

    def split(
        self, count: int, message: int, segment: int, arena: np.ndarray, first: int,
        lengths: np.ndarray,
    ) -> tuple[int, int, int]:  # fmt: skip
        """Copy datagrams of staged messages ``message ..`` (from its datagram ``segment``)
        into ``arena`` rows ``first ..`` while rows remain, their lengths to ``lengths``
        (``lengths[0]`` for row ``first``; one longer than a row is cut to it and reads as
        ``width + 1``, the caller's "oversized"). Returns ``(rows written, next message,
        next segment)``: ``next message == count`` when every staged message is placed."""
        w, m, s = _split(self.stage, self.lengths, self.segments, count, message, segment,
                         arena, first, lengths)  # fmt: skip
        return int(w), int(m), int(s)


@njit(nogil=True, cache=True)
def _gro_sizes(
    lengths: np.ndarray,
    controllen: np.ndarray,
    ctl: np.ndarray,
    out_len: np.ndarray,
    out_seg: np.ndarray,
) -> None:
    # Each message's UDP_GRO control message (struct cmsghdr: u64 len, i32 level, i32 type,
    # then the int segment size), walked in CMSG_NXTHDR's 8-byte steps.
    for i in range(lengths.shape[0]):
        out_len[i] = lengths[i]
        out_seg[i] = 0
        c = ctl[i]
        off = 0
        while off + 20 <= controllen[i]:
            clen = 0
            for b in range(8):
                clen |= np.int64(c[off + b]) << (8 * b)
            level = np.int64(c[off + 8]) | (np.int64(c[off + 9]) << 8)
            kind = np.int64(c[off + 12]) | (np.int64(c[off + 13]) << 8)
            if level == SOL_UDP and kind == UDP_GRO and clen >= 20:
                v = 0
                for b in range(4):
                    v |= np.int64(c[off + 16 + b]) << (8 * b)
                out_seg[i] = v
                break
            if clen < 16:
                break
            off += (clen + 7) & ~7


@njit(nogil=True, cache=True)
def _split(
    stage: np.ndarray,
    lengths: np.ndarray,
    segments: np.ndarray,
    count: int,
    message: int,
    segment: int,
    arena: np.ndarray,
    first: int,
    out: np.ndarray,
) -> tuple[int, int, int]:
    width = arena.shape[1]
    w = 0
    m, s = message, segment
    while m < count and first + w < arena.shape[0]:
        total = lengths[m]
        seg = segments[m] if segments[m] > 0 else max(total, 1)
        a = s * seg
        if a >= total and not (a == 0 and total == 0):
            m += 1
            s = 0
            continue
        n = min(seg, total - a)
        copy_bytes(arena[first + w], stage[m], a, min(n, width))
        out[w] = n if n <= width else width + 1
        w += 1
        s += 1
        if a + n >= total:
            m += 1
            s = 0
    return w, m, s
