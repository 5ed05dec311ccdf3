"""In-memory wiring of N sans-I/O endpoints with a fake clock (aioquic's client_and_server shape).

Datagrams are delivered after ``latency`` (+ seeded jitter, which reorders them) unless the
``drop`` predicate says otherwise; ``mangle`` may duplicate or rewrite them. No bandwidth model:
that is the network simulator's job. Everything is deterministic for a seed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import Datagram, flat
from gradlane.transport.wire.header import BITMAP_KINDS, Header, Kind, encode


@dataclass
class Wire:
    """Connects endpoints (anything with the driver API) and runs them on simulated time."""

    endpoints: list
    latency: float = 50e-6
    jitter: float = 0.0
    seed: int = 0
    drop: Callable[[int, Datagram, int], bool] | None = None
    """(source rank, datagram, sequence number) -> drop it?"""
    mangle: Callable[[int, Datagram], list[bytes]] | None = None
    """(source rank, datagram) -> the byte strings to deliver instead (duplicates, forgeries)."""
    now: float = 0.0
    events: list = field(default_factory=list)
    sent: int = 0
    dropped: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self._q: list[tuple[float, int, int, bytes, int]] = []
        self._seq = 0

    def inject(self, dst: int, data: bytes, path: int = 0, delay: float = 0.0) -> None:
        """Deliver arbitrary bytes to ``dst`` (garbage, forgeries)."""
        self._seq += 1
        heapq.heappush(self._q, (self.now + delay, self._seq, dst, bytes(data), path))

    def _collect(self, i: int) -> None:
        ep = self.endpoints[i]
        for dg in flat(ep.datagrams_to_send(self.now)):
            self.sent += 1
            if self.drop is not None and self.drop(i, dg, self.sent):
                self.dropped += 1
                continue
            payloads = self.mangle(i, dg) if self.mangle else [dg.wire()]
            for data in payloads:
                delay = self.latency + (self.rng.random() * self.jitter if self.jitter else 0.0)
                self._seq += 1
                heapq.heappush(self._q, (self.now + delay, self._seq, dg.peer, data, dg.path))
        while (ev := ep.next_event()) is not None:
            self.events.append((i, self.now, ev))

    def run(self, until: Callable[[], bool], max_time: float = 30.0, max_steps: int = 2_000_000):
        """Advance until ``until()`` is true; returns the simulated time. Fails loudly on a hang."""
        for i in range(len(self.endpoints)):
            self._collect(i)
        steps = 0
        while not until():
            steps += 1
            if steps > max_steps:
                raise AssertionError("wire: too many steps (livelock?)")
            timers = [
                (t, i) for i, ep in enumerate(self.endpoints) if (t := ep.get_timer()) is not None
            ]
            t_timer, who = min(timers) if timers else (np.inf, -1)
            t_pkt = self._q[0][0] if self._q else np.inf
            if t_timer == np.inf and t_pkt == np.inf:
                raise AssertionError("wire: nothing left to do but the condition is not met")
            if t_pkt <= t_timer:
                self.now = max(self.now, t_pkt)
                _, _, dst, data, path = heapq.heappop(self._q)
                self.endpoints[dst].receive_datagram(data, path, self.now)
                self._collect(dst)
            else:
                self.now = max(self.now, t_timer)
                self.endpoints[who].handle_timer(self.now)
                self._collect(who)
            if self.now > max_time:
                raise AssertionError(f"wire: simulated time passed {max_time}s")
        return self.now


def forge(
    config: TransportConfig, kind: int, *, src: int = 1, dst: int = 0, **fields: int
) -> bytes:
    """A packet of ``kind`` from ``src`` to ``dst`` with a valid header and tag under
    ``config``'s job and key: what a peer, or anyone holding the secret, can send. Bitmap kinds
    carry ``count`` set bits; DATA ``count`` float32 ones."""
    h = Header(kind=kind, job=config.job, src=src, dst=dst, **fields)
    if kind in BITMAP_KINDS:
        payload = b"\xff" * -(-h.count // 8)
    elif kind == Kind.DATA:
        payload = np.ones(h.count, np.float32).tobytes()
    else:
        payload = b""
    return encode(h, payload, config.tag_key)
