"""Runtime pieces of the simulator's randomness and cross traffic (private to
:mod:`gradlane.bench.sim.simulator`).

Every random stream is its own ``numpy.random.Generator`` seeded from ``(seed, purpose, index)``,
so a link's loss draws do not depend on how much cross traffic another link carries, and the
same seed gives the same run. Draws are taken in blocks and handed out one by one.
"""

from __future__ import annotations

import math

import numpy as np
from gradlane.bench.sim.network import CrossTraffic

# Stream purposes: the second word of every seed, so streams never overlap.
LINK_STREAM = 1
CROSS_STREAM = 2


def stream(seed: int, purpose: int, index: int) -> np.random.Generator:
    """The generator of one purpose and index under a simulation seed."""
    return np.random.default_rng([seed, purpose, index])


class Uniforms:
    """Uniform draws in ``[0, 1)`` from a seeded generator, in blocks (cheap per call)."""

    __slots__ = ("_buf", "_i", "_rng")

    def __init__(self, rng: np.random.Generator, block: int = 4096) -> None:
        self._rng = rng
        self._buf: list[float] = rng.random(block).tolist()
        self._i = 0

    def __call__(self) -> float:
        i = self._i
        buf = self._buf
        if i == len(buf):
            buf = self._buf = self._rng.random(len(buf)).tolist()
            i = 0
        self._i = i + 1
        return buf[i]


class Periods:
    """The on/off schedule of one cross source, extended lazily as time goes on.

    ``on_start .. on_end`` is the current (or next) on period; queries must not go back in time.
    A steady source has one on period from ``start`` to ``end``.
    """

    __slots__ = ("_u", "end", "off_s", "on_end", "on_s", "on_start", "random")

    def __init__(self, spec: CrossTraffic, u: Uniforms) -> None:
        self._u = u
        self.end = math.inf if spec.end is None else spec.end
        self.on_s = spec.on_s
        self.off_s = spec.off_s or 0.0
        self.random = spec.random_periods
        self.on_start = spec.start
        self.on_end = self.end if spec.on_s is None else spec.start + self._draw(spec.on_s)

    def _draw(self, mean: float) -> float:
        # Exponential by inversion; 1 - u is in (0, 1] so the log is finite.
        return -mean * math.log(1.0 - self._u()) if self.random else mean

    def advance(self) -> None:
        """Move to the next on period."""
        if self.on_s is None:
            self.on_start = self.on_end = math.inf
            return
        self.on_start = self.on_end + self._draw(self.off_s)
        self.on_end = self.on_start + self._draw(self.on_s)

    def active(self, t: float) -> bool:
        """Whether the source is on at ``t``."""
        while t >= self.on_end:
            self.advance()
        return self.on_start <= t < self.end

    def on_time(self, until: float) -> float:
        """Total on time in ``[start, until)`` (consumes the schedule: use a fresh instance)."""
        total = 0.0
        until = min(until, self.end)
        while self.on_start < until:
            total += min(self.on_end, until) - self.on_start
            self.advance()
        return total


class PacketSource:
    """Arrival times of one packet-model cross source (paced, jittered, within on periods)."""

    __slots__ = ("_u", "gap", "jitter", "periods")

    def __init__(self, spec: CrossTraffic, rate: float, rng: np.random.Generator) -> None:
        self._u = Uniforms(rng)
        self.periods = Periods(spec, self._u)
        self.gap = spec.packet_bytes / rate
        self.jitter = spec.jitter

    def first(self) -> float | None:
        """Time of the first packet (a random phase within one gap of the start)."""
        return self._fit(self.periods.on_start + self._u() * self.gap)

    def next(self, t: float) -> float | None:
        """Time of the packet after one sent at ``t``, or None when the source is done."""
        return self._fit(t + self.gap * (1.0 + self.jitter * (2.0 * self._u() - 1.0)))

    def _fit(self, t: float) -> float | None:
        p = self.periods
        while t >= p.on_end:
            p.advance()
            if p.on_start >= p.end:
                return None
            t = p.on_start + self._u() * self.gap
        return t if t < p.end else None


class FluidLink:
    """The fluid cross sources of one link: they stretch the service time of packets.

    Each source is ``(class, fraction of this link's rate, Periods)``. A packet of class ``k``
    competes with a source of class ``c`` when ``c <= k`` or the link is priority-unaware.
    """

    __slots__ = ("priority", "sources")

    def __init__(self, priority: bool) -> None:
        self.priority = priority
        self.sources: list[tuple[int, float, Periods]] = []

    def stretch(self, ser: float, t: float, cls: int) -> float:
        """Serialisation time of a packet of class ``cls`` that starts at ``t``."""
        f = 0.0
        prio = self.priority
        for c, frac, per in self.sources:
            if (c <= cls or not prio) and per.active(t):
                f += frac
        return ser / (1.0 - f) if f else ser
