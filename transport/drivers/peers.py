"""How ranks find each other's data-plane addresses (ARCHITECTURE §6), and the checks every
configured address passes where it enters.

A :class:`Rendezvous` maps a rank to one ``(host, port)`` per path. :class:`StaticPeers` is a
fixed table (a peer list from a config file, or addresses exchanged by a test after binding
port 0); a TCPStore-backed implementation in ``integrations`` plugs in behind the same ABC.

:func:`check_host` and :func:`check_address` turn a configured host into the numeric address the
planes use, or raise a :class:`ConfigError` that names the value and where it came from: a bad
address must fail when it is read, not as a peer timeout at the hard deadline.
"""

from __future__ import annotations

import ipaddress
import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from numbers import Integral

from gradlane.transport.errors import ConfigError

__all__ = ["Address", "Rendezvous", "StaticPeers", "check_address", "check_host", "check_port"]

Address = tuple[str, int]
"""A UDP address: host (an IP literal) and port."""


def check_host(host: object, where: str) -> str:
    """``host`` as a numeric address: an IPv4 or IPv6 literal as given, a name resolved once to
    its first IPv4 address (a host without ``:`` gets an ``AF_INET`` socket in both planes, so a
    name must resolve for IPv4). ``ConfigError`` naming ``where`` otherwise."""
    if not isinstance(host, str) or not host.strip():
        raise ConfigError(f"{where}: {host!r} is not a host (give an IP address or a host name)")
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(
            f"{where}: {host!r} is not an IP address and does not resolve ({reason})"
        ) from None
    return str(infos[0][4][0])


def check_port(port: object, where: str, *, any_port: bool = False) -> int:
    """``port`` as an int in 1..65535 (0 too with ``any_port``: bind any free port)."""
    low = 0 if any_port else 1
    if isinstance(port, bool) or not isinstance(port, Integral) or not low <= int(port) <= 65535:
        want = "0 (any) to 65535" if any_port else "1 to 65535"
        raise ConfigError(f"{where}: port {port!r} is not a port number ({want})")
    return int(port)


def check_address(address: object, where: str, *, any_port: bool = False) -> Address:
    """A ``(host, port)`` pair checked by :func:`check_host` and :func:`check_port`."""
    if isinstance(address, str | bytes) or not isinstance(address, Sequence) or len(address) != 2:
        raise ConfigError(f"{where}: {address!r} is not a (host, port) pair")
    host, port = address
    return check_host(host, where), check_port(port, where, any_port=any_port)


class Rendezvous(ABC):
    """Publishes this rank's per-path addresses and looks up those of the others."""

    @abstractmethod
    def publish(self, rank: int, addrs: Sequence[Address]) -> None:
        """Make ``rank``'s bound addresses (one per path, in path order) known to the others."""

    @abstractmethod
    def addresses(self, rank: int) -> list[Address]:
        """The addresses of ``rank``, one per path; may block until the rank has published."""


class StaticPeers(Rendezvous):
    """A fixed table of per-rank, per-path addresses.

    ``peers`` is a mapping ``rank -> [(host, port), ...]`` or a sequence indexed by rank.
    ``publish`` records (or overwrites) an entry, so planes that bound port 0 can share one
    table in-process.
    """

    def __init__(self, peers: Mapping[int, Sequence[Address]] | Sequence[Sequence[Address]]):
        items = peers.items() if isinstance(peers, Mapping) else enumerate(peers)
        self._peers: dict[int, list[Address]] = {}
        for rank, addrs in items:
            self.publish(rank, addrs)

    def publish(self, rank: int, addrs: Sequence[Address]) -> None:
        """Record ``rank``'s addresses: at least one, each an IP literal or a name that resolves
        (stored resolved) with a port in 1..65535; a ``ConfigError`` names the rank and path."""
        checked = [check_address(a, f"peer {rank} path {p}") for p, a in enumerate(addrs)]
        if not checked:
            raise ConfigError(f"peer {rank}: needs at least one path address")
        self._peers[rank] = checked

    def addresses(self, rank: int) -> list[Address]:
        """The addresses of ``rank``; a ``ConfigError`` naming the known ranks if absent."""
        try:
            return list(self._peers[rank])
        except KeyError:
            raise ConfigError(
                f"no addresses for rank {rank}; the static peer list has ranks "
                f"{sorted(self._peers)}"
            ) from None
