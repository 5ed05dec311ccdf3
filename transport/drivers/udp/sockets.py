"""UDP adapter (ARCHITECTURE §6): the sockets of one rank on an asyncio (or uvloop) event loop.

Theory of operation
-------------------
Every local path address (e.g. 127.0.0.1 and 127.0.0.2 on loopback, or one address per NIC)
gets one *receive* socket: it is the address peers send to, and every datagram arriving on it is
handed to the driver with that path's index.

DSCP: the IP TOS byte is a socket option, and asyncio transports may queue a datagram and send
it later, so setting ``IP_TOS`` before a ``sendto`` batch could mark a queued packet with the
wrong class. Instead each path has one *send* socket per TOS value, bound to the same local
address (port 0: a UDP receiver does not care about the source port), with ``IP_TOS`` fixed at
open, each wrapped in an asyncio datagram transport (which queues a datagram when the kernel's
send buffer is full). A datagram goes out on the socket of its (path, tos); a TOS nobody
declared at open goes out on the path's main-TOS socket and is counted as ``tos_fallback``.
A DATA datagram comes as a header and a view of the sender's buffer: it goes out with one
gathering ``sendmsg`` straight on the socket, so the payload is copied once, by the kernel.
When the socket's buffer is full (the kernel answers EAGAIN) the two parts are joined into
one ``bytes`` and handed to the transport, which queues it until the socket is writable: the
queued copy no longer depends on the sender's buffer.

The sender hands out runs of DATA datagrams (:class:`DatagramRun`: header rows and payload
offsets as arrays); on Linux the runs of one ``send`` call — every peer, every priority class —
go out together (up to ``MERGE_ROWS`` datagrams and the run that reaches it) with one
``sendmmsg`` per path, from the path's main socket (``_mmsg.SendBatch``): each
message carries its own destination and its TOS as a control message (``IP_TOS``, which a
message's ancillary data sets for that datagram alone), so there is no Python and no system
call per datagram, nor per peer or class. What the kernel refuses with EAGAIN mid-pass is
queued as copies on the transport of its (path, TOS), as above, in order; a refused datagram
(an ICMP error) is counted and skipped. Where the kernel has UDP GSO (``udp_gso``), a run's
equal-sized datagrams on a path share one message (``_mmsg.SendBatch``), which the kernel cuts
back into them; a path whose kernel refuses such a message (a device that cannot segment, a
segment over the MTU) sends its datagrams one by one and stops using GSO.

Receiving skips asyncio's datagram protocol: a reader callback on each receive socket reads
straight into the driver's receive arena (:class:`RxArena`: the core's ``rx_arena``,
``rx_free``, ``commit_datagrams``), up to ``READ_BURST`` datagrams per wakeup, with one clock
reading per burst, then calls ``on_readable()`` once, so the driver processes and answers the
whole batch together. On Linux one ``recvmmsg`` fills many arena rows; elsewhere ``recv_into``
fills one row per call; either way ``commit_datagrams`` takes the lengths of what one burst
filled at once — no ``bytes`` object and no copy. Where datagrams are small enough to coalesce
(at most 4 KB) and the kernel has UDP GRO, a receive socket takes a peer's runs as coalesced
messages into a small staging area (``_mmsg.GroTable``), and a compiled pass splits each into
the arena's rows, one datagram per row.
:meth:`UdpPaths.poll` does the same on demand: the UDP plane drains its sockets before each
send burst, so acknowledgements are processed (and sent) promptly while it is also sending at
full speed.

Socket buffers are set to ``bufsize`` (``TransportConfig.socket_buffer_bytes``); Linux caps them
at ``net.core.rmem_max`` / ``wmem_max`` unless the process may use SO_RCVBUFFORCE (root or
CAP_NET_ADMIN), which is tried next; when the buffer is still capped one log line says so,
because a capped receive buffer is the first cause of loss at line rate.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from gradlane.transport.core.events import Datagram, DatagramRun
from gradlane.transport.drivers.peers import Address
from gradlane.transport.drivers.udp import mmsg as _mmsg
from gradlane.transport.errors import ConfigError

__all__ = ["UdpCounters", "UdpPaths", "new_event_loop"]

log = logging.getLogger(__name__)

READ_BURST = 128
"""Most datagrams read from one socket per wakeup (then the driver runs: ACKs go out). Large
enough for few, large batches through the core, whose cost is mostly per batch; two paths'
bursts (256 rows) still leave half the endpoint's 512-row arena free."""
RX_TABLES = 8
"""``recvmmsg`` tables kept, one per receive arena (the core uses a few: see
``gradlane.transport.core.endpoint.RX_ARENAS``)."""
GRO_MAX_ROW = 4096
"""Receive with UDP GRO only where the arena's rows (datagrams) are at most this wide."""
MERGE_ROWS = 16
"""Runs of one ``send`` call are merged into one ``sendmmsg`` per path until they hold this many
datagrams, then go out. Merging saves the system calls of small runs (a handful per collective
instead of one per run); merging without a limit would put a pass's whole share of a path on
its socket in one burst, which is slower than alternating the paths run by run."""
_MSG_TRUNC = int(getattr(socket, "MSG_TRUNC", 0))  # an int: enum members are slow in hot calls


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is importable, else asyncio's default loop.

    This is the only place that knows which loop runs; everything else uses the asyncio API.
    """
    try:
        import uvloop  # noqa: PLC0415 (optional dependency, Linux only)
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


@dataclass
class UdpCounters:
    """Datagram and byte counts of one rank's sockets (for ``UdpPlane.stats``)."""

    rx_datagrams: int = 0
    rx_bytes: int = 0
    tx_datagrams: int = 0
    tx_bytes: int = 0
    tx_errors: int = 0
    """Sends the kernel refused (e.g. ICMP port unreachable reported back)."""
    rx_errors: int = 0
    """Receive calls that failed with an error other than "nothing to read"."""
    unroutable: int = 0
    """Datagrams for a rank or path with no known address (dropped)."""
    tos_fallback: int = 0
    """Datagrams whose TOS had no socket of its own (sent on the path's main socket)."""
    gso_sends: int = 0
    """Messages that carried several datagrams with UDP GSO (counted in ``tx_datagrams`` as
    the datagrams they carried)."""
    gso_refused: int = 0
    """GSO sends the kernel refused (a device that cannot segment, a segment over the MTU):
    their datagrams went out one by one, and that path stopped using GSO."""
    gro_messages: int = 0
    """Received messages that carried several datagrams coalesced by UDP GRO (counted in
    ``rx_datagrams`` as the datagrams they carried)."""


#: How a (peer, path, tos) is sent one datagram at a time: transport, its socket, destination,
#: and 1 if a TOS fallback.
_Route = tuple[asyncio.DatagramTransport, socket.socket, Address, int]
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)
#: What a kernel answers a GSO send it cannot do: no UDP_SEGMENT (ENOPROTOOPT), a segment over
#: the MTU or a socket without checksums (EINVAL, EMSGSIZE), a device that cannot segment (EIO).
_GSO_REFUSED = (errno.EINVAL, errno.EIO, errno.EMSGSIZE, errno.ENOPROTOOPT, errno.EOPNOTSUPP)


class RxArena(Protocol):
    """A receive arena the sockets fill several rows of per system call: the core's receive
    side (:class:`gradlane.transport.core.endpoint.Endpoint`'s ``rx_arena``, ``rx_free`` and
    ``commit_datagrams``), or a wrapper of it (``UdpPlane``'s ``rx_tap``)."""

    @property
    def rx_arena(self) -> np.ndarray:
        """Rows of one datagram each; the free ones start at :attr:`rx_free`."""
        ...

    @property
    def rx_free(self) -> int:
        """The first free row of :attr:`rx_arena`."""
        ...

    def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
        """The ``len(lengths)`` rows from :attr:`rx_free` on hold datagrams of these real
        lengths (longer than a row: truncated), received on ``path`` at ``now``."""
        ...


class _SendProtocol(asyncio.DatagramProtocol):
    """The protocol of a send socket: counts errors; it receives nothing (no peer sends to it)."""

    def __init__(self, paths: UdpPaths, path: int) -> None:
        self._paths = paths
        self._path = path
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def error_received(self, exc: Exception) -> None:
        # Unconnected UDP sockets see ICMP errors only occasionally; a dead peer is detected
        # by the protocol's deadlines, so this is a counter, not a failure.
        self._paths.counters.tx_errors += 1
        log.debug("path %d: socket error %s", self._path, exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class UdpPaths:
    """The UDP sockets of one rank: one receive socket per local path address, plus one send
    socket per (path, TOS). All methods run on the event loop's thread.

    Received datagrams go into the rows of ``arena`` (the core's receive side, see
    :class:`RxArena`), many per system call where Linux has ``recvmmsg``, and each burst's are
    committed together (``now``: ``time.monotonic()`` read once per burst). ``on_readable()``
    is called once per read wakeup, after its datagrams. Without an arena (a socket user with
    no core behind it, e.g. a test), ``rx_buffer()`` gives the writable buffer each datagram
    is received into and ``on_datagram(nbytes, path, now)`` takes it, one at a time
    (``nbytes``: the real length, over the buffer's when truncated).
    """

    def __init__(
        self,
        rx_buffer: Callable[[], memoryview] | None,
        on_datagram: Callable[[int, int, float], None] | None,
        on_readable: Callable[[], None],
        *,
        bufsize: int,
        arena: RxArena | None = None,
        gso: bool = True,
        gro: bool = True,
    ) -> None:
        if arena is None and (rx_buffer is None or on_datagram is None):
            raise TypeError("UdpPaths needs an arena, or both rx_buffer and on_datagram")
        self._rx_buffer = rx_buffer
        self._gso = gso
        self._gro = gro
        self._gro_table: _mmsg.GroTable | None = None  # staging rows, when a path has GRO
        self._gro_paths: list[bool] = []
        self._gro_lengths = np.zeros(0, dtype=np.int64)
        self._on_datagram = on_datagram
        self._on_readable = on_readable
        self._bufsize = bufsize
        self._arena = arena
        self._batched = _mmsg.AVAILABLE  # recvmmsg (read at creation, as tests switch it)
        self._rx_tables: dict[int, _mmsg.RecvTable] = {}  # see _recv_table
        self._rx_views: list[memoryview] = []  # one per arena row, for recv_into
        self._rx_views_of: np.ndarray | None = None  # the arena they are views of
        self._rx_lengths = np.zeros(READ_BURST, dtype=np.int64)
        self._tx_batch: _mmsg.SendBatch | None = None  # made at open, one table per path
        self._main_fds: list[int] = []
        self._v6: list[bool] = []
        self._names: dict[int, np.ndarray] = {}  # peer -> per path (sockaddr address, length)
        self._controls: dict[int, np.ndarray] = {}  # tos -> per path (cmsg address, length)
        self._gso_controls: dict[int, np.ndarray] = {}  # tos -> per path GSO control area
        self._keep: list[np.ndarray] = []  # the sockaddrs and cmsgs those tables point into
        self.counters = UdpCounters()
        self._transports: list[asyncio.DatagramTransport] = []
        self._protocols: list[_SendProtocol] = []
        self._rx_socks: list[socket.socket] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tx: list[dict[int, asyncio.DatagramTransport]] = []  # per path: tos -> transport
        self._main: list[asyncio.DatagramTransport] = []
        self._socks: dict[asyncio.DatagramTransport, socket.socket] = {}
        self._routes: dict[tuple[int, int, int], _Route] = {}  # (peer, path, tos) -> route
        self._peers: list[list[Address]] = []
        self.local: list[Address] = []

    async def open(
        self, local_addrs: Sequence[Address], tos_values: Iterable[int] = (), main_tos: int = 0
    ) -> list[Address]:
        """Bind one receive socket per ``(host, port)`` (port 0: any) and the send sockets for
        ``main_tos`` and ``tos_values``; returns the bound receive addresses in path order.

        A port in use raises :class:`ConfigError` naming the address; nothing stays open.
        """
        self._loop = loop = asyncio.get_running_loop()
        main = main_tos & 0xFF
        tos_all = [main, *sorted({int(t) & 0xFF for t in tos_values} - {main})]
        try:
            for path, (host, port) in enumerate(local_addrs):
                rx = _make_socket(host, port, 0, self._bufsize, receives=True)
                self._rx_socks.append(rx)
                self._gro_paths.append(self._want_gro() and _mmsg.gro_enable(rx))
                loop.add_reader(rx.fileno(), self._readable, rx, path)
                self.local.append(rx.getsockname()[:2])
                tx = {tos: await self._sender(path, host, tos) for tos in tos_all}
                self._main.append(tx[tos_all[0]])
                self._main_fds.append(self._socks[tx[tos_all[0]]].fileno())
                self._v6.append(":" in host)
                self._tx.append(tx)
            if _mmsg.AVAILABLE:
                batch = self._tx_batch = _mmsg.SendBatch(len(self._main))
                for q, tr in enumerate(self._main):
                    batch.gso[q] = self._gso and _mmsg.gso_supported(self._socks[tr])
        except BaseException:
            self.close()
            raise
        return list(self.local)

    def set_peers(self, peers: Sequence[Sequence[Address]]) -> None:
        """Destination addresses: ``peers[rank][path]``."""
        self._peers = [list(p) for p in peers]
        self._routes = {}
        self._names = {}

    def send(self, datagrams: Iterable[Datagram | DatagramRun]) -> None:
        """Send each datagram from its path's socket for its TOS to its peer's path address.
        Where Linux has ``sendmmsg``, the :class:`DatagramRun` items of the call go out together,
        ``MERGE_ROWS`` datagrams or more at a time: one ``sendmmsg`` per path for all their peers
        and classes (each datagram carries its destination and TOS); single datagrams (control
        packets) go out as they come."""
        batch = self._tx_batch
        runs: list[DatagramRun] = []
        for item in datagrams:
            if isinstance(item, DatagramRun):
                if batch is not None and self._queue_run(batch, item, len(runs)):
                    runs.append(item)
                    if int(batch.fill.sum()) >= MERGE_ROWS:
                        self._send_batch(batch, runs)
                        runs = []
                else:
                    self._send_each(item)
            else:
                self._send_each((item,))
        if runs:
            assert batch is not None
            self._send_batch(batch, runs)

    def _send_each(self, datagrams: Iterable[Datagram]) -> int:
        """Send (or queue) each datagram on its (path, TOS) socket; returns how many went."""
        c = self.counters
        routes, route = self._routes, self._route
        went = 0
        for data, peer, path, tos, payload in datagrams:
            r = routes.get((peer, path, tos))
            if r is None:
                r = route(peer, path, tos)
                if r is None:
                    c.unroutable += 1
                    continue
            tr, sock, dest, fallback = r
            if payload is None:
                # The socket's own call releases the GIL during the system call (the loop's
                # transport holds it); asyncio copies what it has to queue when it is full.
                try:
                    sock.sendto(data, dest)
                except (BlockingIOError, InterruptedError):
                    tr.sendto(data, dest)
                except OSError as e:  # e.g. an ICMP error reported on this send: count, go on
                    c.tx_errors += 1
                    log.debug("path %d: send error %s", path, e)
                    continue
                went += 1
                c.tx_datagrams += 1
                c.tos_fallback += fallback
                c.tx_bytes += len(data)
                continue
            try:
                sock.sendmsg((data, payload), (), 0, dest)
            except (BlockingIOError, InterruptedError):
                tr.sendto(b"".join((data, payload)), dest)  # queued: an owned copy
            except OSError as e:  # e.g. an ICMP error reported on this send: count, go on
                c.tx_errors += 1
                log.debug("path %d: send error %s", path, e)
                continue
            went += 1
            c.tx_datagrams += 1
            c.tos_fallback += fallback
            c.tx_bytes += len(data) + len(payload)
        return went

    def _queue_run(self, batch: _mmsg.SendBatch, run: DatagramRun, run_id: int) -> bool:
        """Lay ``run`` out in the pass's ``sendmmsg`` tables; False when it must go one datagram
        at a time (a peer address ``sendmmsg`` cannot take, an unknown peer, a path beyond the
        local ones: ``_send_each`` routes and counts those as it always did)."""
        names = self._names.get(run.peer)
        if names is None:
            names = self._peer_names(run.peer)
            if names is None:
                return False
        controls = self._controls.get(run.tos)
        if controls is None:
            controls = self._tos_controls(run.tos)
        gso = self._gso_controls.get(run.tos)
        if gso is None:
            gso = self._gso_controls[run.tos] = np.stack(
                [_mmsg.gso_control(run.tos, v6) for v6 in self._v6]
            )
        hdr_addr, pay_addr = run.hdr_addr, run.payload_addr
        rows = _mmsg.RunRows(
            hdr_addr if hdr_addr >= 0 else _mmsg.address_of(run.hdr),
            run.header_bytes,
            run.chunks,
            pay_addr if pay_addr >= 0 else _mmsg.address_of(run.payload),
            run.starts,
            run.sizes,
            run.paths,
        )
        return batch.append(run_id, rows, names, controls, gso)

    def _send_batch(self, batch: _mmsg.SendBatch, runs: list[DatagramRun]) -> None:
        """One ``sendmmsg`` per path for the pass's runs: no Python per datagram."""
        c = self.counters
        try:
            for q, n in enumerate(batch.fill.tolist()):
                if not n:
                    continue
                fd = self._main_fds[q]
                i = 0
                while i < n:
                    sent, err = batch.send(fd, q, i, n - i)
                    if sent:
                        c.tx_datagrams += batch.row_datagrams(q, i, i + sent)
                        c.tx_bytes += batch.row_bytes(q, i, i + sent)
                        c.gso_sends += int(np.count_nonzero(batch.count[q, i : i + sent] > 1))
                    i += sent
                    if i >= n:
                        break
                    if err in _AGAIN:  # the socket's buffer is full: the transports queue copies
                        self._queue_rows(batch, runs, q, i, n)
                        break
                    if err in _GSO_REFUSED and batch.count[q, i] > 1:
                        self._gso_refused(batch, runs, q, i, err)
                        i += 1
                        continue
                    # Refused (e.g. an ICMP error reported on this send): count, skip, go on.
                    c.tx_errors += int(batch.count[q, i])
                    log.debug("path %d: send error %s", q, errno.errorcode.get(err, err))
                    i += 1
        finally:
            batch.clear()

    def _gso_refused(
        self, batch: _mmsg.SendBatch, runs: list[DatagramRun], q: int, row: int, err: int
    ) -> None:
        """The kernel refused GSO row ``row`` of path ``q`` with an error a GSO send can cause
        (a device without checksum offload, a segment over the path's MTU) — or any send to a
        bad address. Its datagrams go one by one; if any of them goes out, GSO was the cause:
        that path stops using it (the rest of this pass's GSO rows on it take this way too)."""
        run = runs[int(batch.run[q, row])]
        if not self._send_each(run.select(batch.row_order(q, row))):
            return  # every one refused by itself: the destination, not GSO
        self.counters.gso_refused += 1
        if batch.gso[q]:
            batch.gso[q] = False
            log.warning(
                "path %d: the kernel refused a UDP GSO send (%s); sending one datagram per "
                "message on this path from now on",
                q,
                errno.errorcode.get(err, err),
            )

    def _queue_rows(
        self, batch: _mmsg.SendBatch, runs: list[DatagramRun], q: int, first: int, end: int
    ) -> None:
        """Rows the kernel would not take now: owned copies queued on the transport of their
        (peer, path, TOS), whose socket carries that TOS, in row order."""
        c = self.counters
        for r in range(first, end):
            run = runs[int(batch.run[q, r])]
            route = self._routes.get((run.peer, q, run.tos)) or self._route(run.peer, q, run.tos)
            if route is None:  # cannot happen: the run was laid out for a known peer
                c.unroutable += int(batch.count[q, r])
                continue
            tr, _, dest, fallback = route
            for dg in run.select(batch.row_order(q, r)):
                wire = dg.wire()
                tr.sendto(wire, dest)
                c.tx_datagrams += 1
                c.tos_fallback += fallback
                c.tx_bytes += len(wire)

    def _peer_names(self, peer: int) -> np.ndarray | None:
        """``(address, length)`` of each local path's ``struct sockaddr`` for ``peer`` (its
        address list read modulo its length, as :meth:`_route` does), cached; None when the
        peer is unknown or an address is not numeric."""
        try:
            addrs = self._peers[peer]
            socks = [_mmsg.sockaddr(addrs[q % len(addrs)]) for q in range(len(self._main))]
        except (IndexError, ZeroDivisionError, OSError, ValueError):
            return None
        names = np.array([(s.ctypes.data, s.shape[0]) for s in socks], dtype=np.uint64)
        self._names[peer] = names
        self._keep.extend(socks)  # the table points into them
        return names

    def _tos_controls(self, tos: int) -> np.ndarray:
        """``(address, length)`` of the control message marking a datagram with ``tos``, per
        local path (its address family picks IP_TOS or IPV6_TCLASS), cached."""
        msgs = [_mmsg.tos_cmsg(tos, v6) for v6 in self._v6]
        controls = np.array([(m.ctypes.data, m.shape[0]) for m in msgs], dtype=np.uint64)
        self._controls[tos] = controls
        self._keep.extend(msgs)
        return controls

    def _route(self, peer: int, path: int, tos: int) -> _Route | None:
        """Transport, socket, destination and fallback flag of (peer, path, tos), cached."""
        try:
            addrs = self._peers[peer]
            dest = addrs[path % len(addrs)]
            by_tos = self._tx[path % len(self._tx)]
        except (IndexError, ZeroDivisionError):
            return None
        tr = by_tos.get(tos)
        fallback = tr is None  # a TOS nobody declared: the path's main socket, counted
        if tr is None:
            tr = self._main[path % len(self._main)]
        r = self._routes[(peer, path, tos)] = (tr, self._socks[tr], dest, int(fallback))
        return r

    def poll(self) -> bool:
        """Receive whatever is waiting on every receive socket now (without waiting). True when
        every socket was drained (each gave fewer than ``READ_BURST`` datagrams): what had
        arrived before the call has all been read."""
        drained = True
        for path, sock in enumerate(self._rx_socks):
            drained &= self._read(sock, path) < READ_BURST
        return drained

    def close(self) -> None:
        """Close every socket (the send sockets' fds are released once the loop runs their close
        callbacks; the receive sockets' at once)."""
        for tr in self._transports:
            tr.close()
        for sock in self._rx_socks:
            if self._loop is not None and not self._loop.is_closed() and sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._rx_socks = []

    async def wait_closed(self) -> None:
        """Close and wait until every socket's fd is released."""
        self.close()
        await asyncio.gather(*(p.closed for p in self._protocols))

    # -- internals -------------------------------------------------------------------------------
    def _readable(self, sock: socket.socket, path: int) -> None:
        if self._read(sock, path):
            self._on_readable()

    def _want_gro(self) -> bool:
        """GRO pays where datagrams are small (at most 4 KB: the arena's rows say how large they
        come), 16 or more per coalesced message: with MTU-sized ones the kernel's saving is
        large, around 4 KB it about equals the cost of the split's copy and the larger
        batches, beyond that the copy costs more, and loopback's 65000-byte datagrams have
        nothing to coalesce."""
        return (
            self._gro
            and self._batched
            and self._arena is not None
            and self._arena.rx_arena.shape[1] <= GRO_MAX_ROW
        )

    def _read(self, sock: socket.socket, path: int) -> int:
        """Receive up to ``READ_BURST`` datagrams into the driver's arena; returns how many."""
        arena = self._arena
        if arena is not None:
            if not self._batched:
                return self._read_rows(sock, path, arena)
            if self._gro_paths[path]:
                return self._read_gro(sock, path, arena)
            return self._read_many(sock, path, arena)
        c = self.counters
        rx_buffer, on_datagram = self._rx_buffer, self._on_datagram
        assert rx_buffer is not None and on_datagram is not None
        now = time.monotonic()  # one reading per burst: the burst arrived together
        got = 0
        for _ in range(READ_BURST):
            try:
                # MSG_TRUNC: the return value is the datagram's real length, so one that did not
                # fit is recognised (and counted by the driver) rather than read as a short one.
                n = sock.recv_into(rx_buffer(), 0, _MSG_TRUNC)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # e.g. an ICMP error queued on the socket: count, go on
                c.rx_errors += 1
                log.debug("path %d: receive error %s", path, e)
                break
            got += 1
            c.rx_datagrams += 1
            c.rx_bytes += n
            on_datagram(n, path, now)
        return got

    def _read_rows(self, sock: socket.socket, path: int, arena: RxArena) -> int:
        """``_read`` where ``recvmmsg`` is missing: one ``recv_into`` per arena row, each
        burst's rows committed together (as :meth:`_read_many` commits a call's)."""
        lengths = self._rx_lengths
        c = self.counters
        now = time.monotonic()  # one reading per burst: the burst arrived together
        got, more = 0, True
        while more and got < READ_BURST:
            rows = arena.rx_arena  # again after each commit: the core may change arenas
            views = self._rx_views
            if self._rx_views_of is not rows:
                views = self._rx_views = [row.data for row in rows]
                self._rx_views_of = rows
            n_rows = rows.shape[0]
            first = arena.rx_free
            room = min(READ_BURST - got, n_rows - first)
            k = 0
            while k < room:
                try:
                    # MSG_TRUNC: the return value is the datagram's real length, so one that
                    # did not fit is recognised (and counted by the core) as oversized.
                    lengths[k] = sock.recv_into(views[first + k], 0, _MSG_TRUNC)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:  # e.g. an ICMP error queued on the socket: count, go on
                    c.rx_errors += 1
                    log.debug("path %d: receive error %s", path, e)
                    break
                k += 1
            more = 0 < k == room  # every row filled: the socket may hold more
            if k:
                got += k
                c.rx_datagrams += k
                c.rx_bytes += int(lengths[:k].sum())
                arena.commit_datagrams(lengths[:k], path, now)  # processes the arena when full
        return got

    def _read_many(self, sock: socket.socket, path: int, arena: RxArena) -> int:
        """``_read`` with ``recvmmsg``: many datagrams per system call, committed together."""
        c = self.counters
        now = time.monotonic()  # one reading per burst: the burst arrived together
        fd, got = sock.fileno(), 0
        while got < READ_BURST:
            table = self._recv_table(arena.rx_arena)  # after each commit: arenas may change
            first = arena.rx_free
            room = min(READ_BURST - got, table.arena.shape[0] - first)
            lengths, err = table.receive(fd, first, room)
            if err:  # e.g. an ICMP error queued on the socket: count, go on
                c.rx_errors += 1
                log.debug("path %d: receive error %s", path, errno.errorcode.get(err, err))
                break
            k = int(lengths.shape[0])
            if k == 0:
                break
            got += k
            c.rx_datagrams += k
            c.rx_bytes += int(lengths.sum())
            arena.commit_datagrams(lengths, path, now)  # processes the arena when it is full
            if k < room:  # drained
                break
        return got

    def _recv_table(self, rows: np.ndarray) -> _mmsg.RecvTable:
        """The ``recvmmsg`` table over ``rows``, one per arena the core has used (it returns
        to the same few; each table keeps its arena alive, so the key stays its own)."""
        table = self._rx_tables.get(id(rows))
        if table is None:
            if len(self._rx_tables) >= RX_TABLES:
                self._rx_tables.clear()
            table = self._rx_tables[id(rows)] = _mmsg.RecvTable(rows)
        return table

    def _read_gro(self, sock: socket.socket, path: int, arena: RxArena) -> int:
        """``_read_many`` with UDP GRO: up to ``READ_BURST`` messages (each a run of coalesced
        datagrams, or one) through the staging rows, split into the arena's rows. Returns the
        datagrams committed, but ``READ_BURST`` or more only while the socket may hold more
        (what :meth:`poll` takes for "not drained")."""
        table = self._gro_table
        if table is None:
            table = self._gro_table = _mmsg.GroTable()
        n_rows = arena.rx_arena.shape[0]
        if self._gro_lengths.shape[0] != n_rows:
            self._gro_lengths = np.zeros(n_rows, dtype=np.int64)
        out = self._gro_lengths
        c = self.counters
        now = time.monotonic()  # one reading per burst: the burst arrived together
        fd, got, messages, drained = sock.fileno(), 0, 0, False
        while messages < READ_BURST:
            want = min(table.capacity, READ_BURST - messages)
            k, err = table.receive(fd, want)
            if err:  # e.g. an ICMP error queued on the socket: count, go on
                c.rx_errors += 1
                log.debug("path %d: receive error %s", path, errno.errorcode.get(err, err))
                drained = True
                break
            messages += k
            seg = table.segments[:k]
            c.gro_messages += int(np.count_nonzero((seg > 0) & (seg < table.lengths[:k])))
            m = s = 0
            while m < k:
                first = arena.rx_free  # and its arena, again after each commit
                w, m, s = table.split(k, m, s, arena.rx_arena, first, out)
                if w == 0:  # no free row: cannot happen (a full arena is processed at once)
                    c.rx_errors += 1
                    break
                got += w
                c.rx_datagrams += w
                c.rx_bytes += int(out[:w].sum())
                arena.commit_datagrams(out[:w], path, now)  # processes the arena when full
            if k < want:
                drained = True
                break
        return min(got, READ_BURST - 1) if drained else max(got, READ_BURST)

    async def _sender(self, path: int, host: str, tos: int) -> asyncio.DatagramTransport:
        sock = _make_socket(host, 0, tos, self._bufsize, receives=False)
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await loop.create_datagram_endpoint(
                lambda: _SendProtocol(self, path), sock=sock
            )
        except BaseException:
            sock.close()
            raise
        self._transports.append(transport)
        self._protocols.append(protocol)
        self._socks[transport] = sock
        return transport


def _make_socket(host: str, port: int, tos: int, bufsize: int, receives: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        _set_buffer(sock, socket.SO_SNDBUF, bufsize, host)
        if receives:
            _set_buffer(sock, socket.SO_RCVBUF, bufsize, host)
        if tos:
            try:
                if family == socket.AF_INET:
                    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
                else:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
            except OSError as e:  # marking is an optimisation: traffic still flows unmarked
                log.warning("cannot set TOS 0x%02x on %s: %s", tos, host, e)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"cannot bind UDP {host}:{port}: the address is already in use "
                    "(another gradlane rank or process holds it; pick another port or 0)"
                ) from e
            raise ConfigError(f"cannot bind UDP {host}:{port}: {e.strerror or e}") from e
    except BaseException:
        sock.close()
        raise
    return sock


_warned: set[tuple[int, int]] = set()


#: The privileged variants of the buffer options: they ignore net.core.{r,w}mem_max (Linux, with
#: CAP_NET_ADMIN), so a root daemon gets the buffers it asks for without a sysctl.
_FORCE = {socket.SO_RCVBUF: 33, socket.SO_SNDBUF: 32}  # SO_RCVBUFFORCE, SO_SNDBUFFORCE


def _set_buffer(sock: socket.socket, option: int, size: int, host: str) -> None:
    sock.setsockopt(socket.SOL_SOCKET, option, size)
    # Linux reports twice the usable size it granted (bookkeeping overhead included).
    got = sock.getsockopt(socket.SOL_SOCKET, option) // 2
    if got < size and sys.platform.startswith("linux"):
        try:
            sock.setsockopt(socket.SOL_SOCKET, _FORCE[option], size)
            got = sock.getsockopt(socket.SOL_SOCKET, option) // 2
        except OSError:  # EPERM without CAP_NET_ADMIN: keep the capped size, and say so below
            pass
    if got < size and (option, got) not in _warned:
        _warned.add((option, got))  # once per process: every socket of every rank hits it
        name = "SO_RCVBUF" if option == socket.SO_RCVBUF else "SO_SNDBUF"
        sysctl = "rmem_max" if option == socket.SO_RCVBUF else "wmem_max"
        log.warning(
            "%s on %s capped by the kernel at %d bytes (asked %d); raise net.core.%s",
            name,
            host,
            got,
            size,
            sysctl,
        )
