"""The sender's view of its paths toward every peer: health, retransmission timeouts, probes.

Theory of operation
-------------------
Each peer has a :class:`gradlane.scheduling.paths.PathSet` (rates, RTTs, loss, UP/SUSPECT/DOWN). On
top
of those, :class:`PeerPaths` keeps what the sender needs across peers and packets:

* the paths a peer may use (all of them with ``multipath``, else one hashed per pair);
* the per-path retransmission timeout, where a path with no RTT sample borrows its peer's
  largest, and a peer with none at all the RTT estimate over every peer (RFC 6298: the fabric
  is shared, so that beats a fixed initial RTO by orders of magnitude);
* the path a control packet takes (a protected one's: never a SUSPECT path while one is UP);
* probes of SUSPECT and DOWN paths: their sequence numbers and send times. An answer counts for
  any of the newest :data:`PROBES_KEPT` probes of its path, not only the newest: a round trip
  may outlast ``probe_interval_s``, and the next probe would replace the one answered.

Pure state and arithmetic, like the rest of the sender: time is a parameter.
"""

from __future__ import annotations

import numpy as np
from gradlane.scheduling.paths import PathSet
from gradlane.transport.config import TransportConfig

__all__ = ["PROBES_KEPT", "PeerPaths"]

#: Probes per (peer, path) whose answer is still taken (round trips up to this many intervals).
PROBES_KEPT = 16


class PeerPaths:
    """Path state of rank ``me`` toward every other rank of ``world``."""

    def __init__(
        self, me: int, world: int, config: TransportConfig, rng: np.random.Generator
    ) -> None:
        self.me = me
        self.config = config
        self.n_paths = config.n_paths
        self.sets = {p: PathSet(config.n_paths, config.paths, rng) for p in range(world) if p != me}
        self._srtt = np.nan
        self._rttvar = np.nan
        self._probe_seq = 0
        # Per (peer, path): the probes in flight, seq -> send time (the newest PROBES_KEPT).
        self._probes: dict[tuple[int, int], dict[int, float]] = {}

    def usable(self, peer: int) -> range | tuple[int]:
        """The paths toward ``peer`` data may take."""
        if self.config.multipath:
            return range(self.n_paths)
        return ((self.me + peer) % self.n_paths,)

    def rtos(self, peer: int) -> np.ndarray:
        """Per-path RTO toward ``peer``; a path with no RTT sample yet borrows the largest RTO
        of the peer's sampled paths (the initial RTO is for a peer we know nothing about)."""
        return self.sets[peer].borrowed_rtos(self._srtt, self._rttvar, self.config.min_rto_s)

    def rtt_sample(self, rtt: float) -> None:
        """One clean RTT sample (any peer) for the estimate over every peer."""
        if np.isnan(self._srtt):
            self._srtt, self._rttvar = rtt, rtt / 2.0
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - rtt)
            self._srtt = 0.875 * self._srtt + 0.125 * rtt

    def control_path(self, peer: int, now: float) -> int:
        """The path of a control packet toward ``peer`` (assigned as a protected packet)."""
        usable = self.usable(peer)
        if len(usable) == 1:
            return usable[0]
        return int(
            self.sets[peer].assign(now=now, sizes=np.array([64]), protected=np.array([True]))[0]
        )

    def probes_due(self, now: float, peers: set[int]) -> list[tuple[int, int, int]]:
        """``(peer, path, seq)`` of each probe to send now toward ``peers``, recorded as sent."""
        out = []
        for peer in peers:
            for q in self.sets[peer].probes_due(now):
                self._probe_seq += 1
                inflight = self._probes.setdefault((peer, q), {})
                inflight[self._probe_seq] = now
                if len(inflight) > PROBES_KEPT:
                    del inflight[min(inflight)]
                out.append((peer, q, self._probe_seq))
        return out

    def on_probe_ack(self, peer: int, path: int, seq: int, now: float) -> bool:
        """A probe came back: True (the path works again) if it answers one in flight."""
        sent = self._probes.get((peer, path), {}).get(seq)
        if sent is None or peer not in self.sets:
            return False
        del self._probes[(peer, path)]
        self.sets[peer].on_probe_ack(path, now, now - sent)
        return True
