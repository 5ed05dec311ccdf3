"""How ranks find each other's data-plane addresses (ARCHITECTURE §6).

A :class:`Rendezvous` maps a rank to one ``(host, port)`` per path. :class:`StaticPeers` is a
fixed table (a peer list from a config file, or addresses exchanged by a test after binding
port 0); a TCPStore-backed implementation in ``integrations`` plugs in behind the same ABC.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from gradlane.transport.errors import ConfigError

__all__ = ["Address", "Rendezvous", "StaticPeers"]

Address = tuple[str, int]
"""A UDP address: host (an IP literal) and port."""


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
        """Record ``rank``'s addresses (validated: non-empty, (str, port) pairs)."""
        checked = []
        for a in addrs:
            host, port = a
            if not isinstance(host, str) or not 0 < int(port) < 65536:
                raise ConfigError(f"rank {rank}: address {a!r} is not a (host, port) pair")
            checked.append((host, int(port)))
        if not checked:
            raise ConfigError(f"rank {rank}: needs at least one path address")
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
