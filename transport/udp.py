"""UDP adapter (ARCHITECTURE §6): the sockets of one rank on an asyncio (or uvloop) event loop.

Theory of operation
-------------------
Every local path address (e.g. 127.0.0.1 and 127.0.0.2 on loopback, or one address per NIC)
gets one *main* socket: it is the address peers send to, every datagram arriving on it is
handed to the driver with that path's index, and it sends datagrams of its own TOS.

DSCP: the IP TOS byte is a socket option, and asyncio transports may queue a datagram and send
it later, so setting ``IP_TOS`` before a ``sendto`` batch could mark a queued packet with the
wrong class. Instead each path has one *send-only* socket per extra TOS value, bound to the
same local address (port 0: a UDP receiver does not care about the source port), with
``IP_TOS`` fixed at open. A datagram goes out on the socket of its (path, tos); a TOS nobody
declared at open goes out on the path's main socket and is counted as ``tos_fallback``.

Receiving: uvloop (libuv) reads up to 32 datagrams per wakeup and calls ``datagram_received``
for each; asyncio's selector reads one per socket per loop iteration. Either way the adapter
only copies the datagram into the endpoint (``on_datagram``) and asks the driver to run *once*
for the whole wakeup (``on_readable``, coalesced by the driver), so output is flushed per batch
rather than per packet.

Socket buffers are set to ``bufsize`` (16 MiB by default); Linux caps them at
``net.core.rmem_max`` / ``wmem_max`` and one log line says so, because a capped receive buffer
is the first cause of loss at line rate.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from transport.errors import ConfigError
from transport.events import Datagram
from transport.rendezvous import Address

__all__ = ["DEFAULT_BUFSIZE", "UdpCounters", "UdpPaths", "new_event_loop"]

log = logging.getLogger(__name__)

DEFAULT_BUFSIZE = 16 << 20
"""Requested SO_RCVBUF / SO_SNDBUF (bytes)."""


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
    """Datagram and byte counts of one rank's sockets (for ``Engine.stats``)."""

    rx_datagrams: int = 0
    rx_bytes: int = 0
    tx_datagrams: int = 0
    tx_bytes: int = 0
    tx_errors: int = 0
    """Sends the kernel refused (e.g. ICMP port unreachable reported back)."""
    unroutable: int = 0
    """Datagrams for a rank or path with no known address (dropped)."""
    tos_fallback: int = 0
    """Datagrams whose TOS had no socket of its own (sent on the path's main socket)."""


class _PathProtocol(asyncio.DatagramProtocol):
    """Feeds a path's datagrams to the driver; send-only sockets ignore what they receive."""

    def __init__(self, paths: UdpPaths, path: int, receives: bool) -> None:
        self._paths = paths
        self._path = path
        self._receives = receives
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._receives:
            self._paths._received(data, self._path)

    def error_received(self, exc: Exception) -> None:
        # Unconnected UDP sockets see ICMP errors only occasionally; a dead peer is detected
        # by the protocol's deadlines, so this is a counter, not a failure.
        self._paths.counters.tx_errors += 1
        log.debug("path %d: socket error %s", self._path, exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class UdpPaths:
    """The UDP sockets of one rank: one main socket per local path address, plus one send-only
    socket per (path, extra TOS). All methods run on the event loop's thread.

    ``on_datagram(data, path)`` is called for every datagram received; ``on_readable()`` once
    per read wakeup may be coalesced by the caller (it is called after each datagram).
    """

    def __init__(
        self,
        on_datagram: Callable[[bytes, int], None],
        on_readable: Callable[[], None],
        *,
        bufsize: int = DEFAULT_BUFSIZE,
    ) -> None:
        self._on_datagram = on_datagram
        self._on_readable = on_readable
        self._bufsize = bufsize
        self.counters = UdpCounters()
        self._transports: list[asyncio.DatagramTransport] = []
        self._protocols: list[_PathProtocol] = []
        self._tx: list[dict[int, asyncio.DatagramTransport]] = []  # per path: tos -> transport
        self._main: list[asyncio.DatagramTransport] = []
        self._peers: list[list[Address]] = []
        self.local: list[Address] = []

    async def open(
        self, local_addrs: Sequence[Address], tos_values: Iterable[int] = (), main_tos: int = 0
    ) -> list[Address]:
        """Bind one main socket per ``(host, port)`` (port 0: any) and the send-only sockets for
        ``tos_values``; returns the bound addresses in path order.

        A port in use raises :class:`ConfigError` naming the address; nothing stays open.
        """
        extra = sorted({int(t) & 0xFF for t in tos_values} - {main_tos & 0xFF})
        try:
            for path, (host, port) in enumerate(local_addrs):
                main = await self._endpoint(path, host, port, main_tos, receives=True)
                self._main.append(main)
                self.local.append(main.get_extra_info("sockname")[:2])
                tx = {main_tos & 0xFF: main}
                for tos in extra:
                    tx[tos] = await self._endpoint(path, host, 0, tos, receives=False)
                self._tx.append(tx)
        except BaseException:
            self.close()
            raise
        return list(self.local)

    def set_peers(self, peers: Sequence[Sequence[Address]]) -> None:
        """Destination addresses: ``peers[rank][path]``."""
        self._peers = [list(p) for p in peers]

    def send(self, datagrams: Iterable[Datagram]) -> None:
        """Send each datagram from its path's socket for its TOS to its peer's path address."""
        c = self.counters
        peers, tx_sockets = self._peers, self._tx
        n_paths = len(tx_sockets)
        for data, peer, path, tos in datagrams:
            try:
                addrs = peers[peer]
                dest = addrs[path % len(addrs)]
            except (IndexError, ZeroDivisionError):
                c.unroutable += 1
                continue
            by_tos = tx_sockets[path % n_paths]
            tr = by_tos.get(tos)
            if tr is None:
                c.tos_fallback += 1
                tr = self._main[path % n_paths]
            # A memoryview into the sender's arena is passed as is: the view keeps the buffer
            # alive, and asyncio copies what it has to queue.
            tr.sendto(data, dest)
            c.tx_datagrams += 1
            c.tx_bytes += len(data)

    def close(self) -> None:
        """Close every socket (the fds are released once the loop runs their close callbacks)."""
        for tr in self._transports:
            tr.close()

    async def wait_closed(self) -> None:
        """Close and wait until every socket's fd is released."""
        self.close()
        await asyncio.gather(*(p.closed for p in self._protocols))

    # -- internals -------------------------------------------------------------------------------
    def _received(self, data: bytes, path: int) -> None:
        self.counters.rx_datagrams += 1
        self.counters.rx_bytes += len(data)
        self._on_datagram(data, path)
        self._on_readable()

    async def _endpoint(
        self, path: int, host: str, port: int, tos: int, *, receives: bool
    ) -> asyncio.DatagramTransport:
        sock = _make_socket(host, port, tos, self._bufsize, receives)
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await loop.create_datagram_endpoint(
                lambda: _PathProtocol(self, path, receives), sock=sock
            )
        except BaseException:
            sock.close()
            raise
        self._transports.append(transport)
        self._protocols.append(protocol)
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


def _set_buffer(sock: socket.socket, option: int, size: int, host: str) -> None:
    sock.setsockopt(socket.SOL_SOCKET, option, size)
    # Linux reports twice the usable size it granted (bookkeeping overhead included).
    got = sock.getsockopt(socket.SOL_SOCKET, option) // 2
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
