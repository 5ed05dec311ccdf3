"""Per-path pacing and a minimal, loss-tolerant congestion response.

Theory of operation
-------------------
Each path has a :class:`Pacer`: a token bucket filled at its congestion controller's rate and
capped at ``burst_bytes``. The sender asks once per batch how many bytes it may put on the path
now (:meth:`Pacer.allowance`), sends up to that many, reports them (:meth:`Pacer.consume`) and, if
it has more, re-arms its timer at :meth:`Pacer.next_send_time`. Sending at most the allowance
keeps the bytes sent in any interval ``[t0, t1]`` within ``rate·(t1 - t0) + burst_bytes``.

Controllers are pluggable (:class:`CongestionController`, :func:`register_controller`) the way
aioquic's congestion control is. The default ``loss-tolerant`` controller follows from what the
transport tolerates: gradlane *expects* to lose droppable and ordinary packets within its loss
budget (and marks them for the network to drop first), so their loss alone says nothing the
loss budget does not already handle and is **not** a congestion signal. Two things are:

* **delay growth**: an RTT sample above ``min_rtt·(1 + delay_threshold)`` (and at least
  ``delay_floor_s`` above ``min_rtt``) means a queue is building (as in TIMELY, Mittal et al.
  SIGCOMM'15, and Swift, Kumar et al. SIGCOMM'20);
* **protected loss**: a protected packet was dropped even though the network should have dropped
  lower classes first: the path is overloaded beyond what priorities absorb. The sender reports
  every chunk of a reliable transfer (loss bound 0) as protected: it must be resent, so its loss
  is congestion as it is to TCP (otherwise a reliable transfer on a lossy path would resend
  into the same queue at full rate as fast as it detects losses).

Either multiplies the rate by ``decrease``, at most once per smoothed RTT (one reaction per
congestion event, as TCP's fast recovery does). While acks come back clean the rate grows by
``increase_Bps_per_s`` per second, plus ``increase_gain`` of itself per RTT (multiplicative
probing; 0 keeps the increase purely additive). The rate stays in
``[min_rate_Bps, max_rate_Bps]``.

**Burst size** (:class:`BurstControl`). Rate is one thing, burst another: a pacer's depth is how
many bytes may leave back to back, and a queue shorter than that burst (a shallow port, the small
queue of a low-priority class) drops its tail at any rate. A sender that waits for a quantum of
tokens and sends it at once (fewer, larger batches: the way to keep a pass's fixed cost low) can
let :class:`BurstControl` set that quantum by loss, additive increase and multiplicative
decrease as TCP sets its window: halve on a loss event, at most once per ``hold_s``; grow by one
datagram per ``grow_s`` without one; within ``[min_packets, max_packets]``. The pacers' depths
follow (:meth:`Pacer.set_depth`). A loss event is a loss *rate*, as in BBRv2 (Cardwell et al.,
IETF 104, 2019: inflight is cut only when a round loses more than 2%): the datagrams lost in a
window of the ones sent (at least ``4 · max_packets`` and ``hold_s`` long) above ``loss_thresh``
of them. A queue that drops the tails of bursts loses a share of every burst; a stray loss (a
datagram declared lost that was only late, its receiver or its ACK waiting for a core; a bit
error) is no sign that bursts are too long, and cutting on it would cost a clean network its
large bursts. A clean network keeps them; a lossy one gets short ones, and they grow back once
the losses stop.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gradlane.scheduling.errors import ConfigError

__all__ = [
    "BurstControl",
    "CongestionController",
    "FixedRate",
    "LossTolerant",
    "Pacer",
    "PacingConfig",
    "controller_names",
    "make_controller",
    "register_controller",
]

_TOKEN_EPS = 1e-6  # bytes


@dataclass(frozen=True)
class PacingConfig:
    """Configuration of per-path pacing and congestion control.

    Attributes:
        controller: registered name of the :class:`CongestionController`
            (see :func:`controller_names`).
        initial_rate_Bps: pacing rate before any feedback (bytes/s); the constant rate of
            ``fixed``. The default, 10 Gb/s per path, suits a datacenter NIC; set it near the
            path's real rate (a loopback "path" takes ~10 GB/s: see ``loopback_config``).
        min_rate_Bps: the rate never drops below this (bytes/s).
        max_rate_Bps: the rate never grows above this (bytes/s).
        burst_bytes: token-bucket depth: the most bytes sent back-to-back after an idle period.
            Must hold the largest datagram.
        delay_threshold: relative RTT growth over ``min_rtt`` that counts as congestion.
        delay_floor_s: absolute RTT growth below which delay is never congestion (on loopback
            and in a datacenter ``min_rtt`` is tens of microseconds; jitter alone would trip a
            purely relative threshold). The 2 ms default absorbs a real host's scheduling noise
            (a Python process waiting for its interpreter lock sees ms-scale RTT swings with no
            queue anywhere); a simulated network with exact clocks can use ~100 µs.
        decrease: multiplicative decrease factor on a congestion signal, in (0, 1).
        increase_Bps_per_s: additive increase while clean, bytes/s gained per second.
        increase_gain: multiplicative increase while clean, fraction of the rate per RTT.
        initial_rtt_s: RTT assumed before the first sample (spacing of decreases).
        rtt_alpha: weight of a new sample in the smoothed RTT.
    """

    controller: str = "loss-tolerant"
    initial_rate_Bps: float = 1.25e9  # noqa: N815 (B = bytes)
    min_rate_Bps: float = 1e6  # noqa: N815 (B = bytes)
    max_rate_Bps: float = 1.25e10  # noqa: N815 (B = bytes)
    burst_bytes: int = 1 << 20
    delay_threshold: float = 0.5
    delay_floor_s: float = 0.002
    decrease: float = 0.7
    increase_Bps_per_s: float = 1.25e9  # noqa: N815 (B = bytes)
    increase_gain: float = 0.0
    initial_rtt_s: float = 0.001
    rtt_alpha: float = 0.125

    def __post_init__(self) -> None:
        if self.controller not in _CONTROLLERS:
            raise ConfigError(
                f"congestion controller {self.controller!r} is not registered; "
                f"valid names: {', '.join(controller_names())}"
            )
        if not 0.0 < self.min_rate_Bps <= self.initial_rate_Bps <= self.max_rate_Bps < math.inf:
            raise ConfigError(
                "rates must satisfy 0 < min_rate_Bps <= initial_rate_Bps <= max_rate_Bps < inf, "
                f"got {self.min_rate_Bps}, {self.initial_rate_Bps}, {self.max_rate_Bps}"
            )
        if self.burst_bytes < 1:
            raise ConfigError(f"burst_bytes must be >= 1, got {self.burst_bytes}")
        if not 0.0 < self.delay_threshold < math.inf:
            raise ConfigError(f"delay_threshold must be > 0, got {self.delay_threshold}")
        if not 0.0 <= self.delay_floor_s < math.inf:
            raise ConfigError(f"delay_floor_s must be >= 0, got {self.delay_floor_s}")
        if not 0.0 < self.decrease < 1.0:
            raise ConfigError(f"decrease must be in (0, 1), got {self.decrease}")
        if not 0.0 <= self.increase_Bps_per_s < math.inf:
            raise ConfigError(f"increase_Bps_per_s must be >= 0, got {self.increase_Bps_per_s}")
        if not 0.0 <= self.increase_gain < math.inf:
            raise ConfigError(f"increase_gain must be >= 0, got {self.increase_gain}")
        if not 0.0 < self.initial_rtt_s < math.inf:
            raise ConfigError(f"initial_rtt_s must be > 0, got {self.initial_rtt_s}")
        if not 0.0 < self.rtt_alpha <= 1.0:
            raise ConfigError(f"rtt_alpha must be in (0, 1], got {self.rtt_alpha}")


class CongestionController(ABC):
    """Sets one path's sending rate from acks and losses.

    Callbacks are keyword-only and take ``now`` (seconds); :attr:`rate_Bps` is read by the
    :class:`Pacer` whenever it refills.
    """

    def __init__(self, config: PacingConfig) -> None:
        self.config = config

    @property
    @abstractmethod
    def rate_Bps(self) -> float:  # noqa: N802 (B = bytes)
        """Current pacing rate in bytes/s."""

    @abstractmethod
    def on_ack(self, *, now: float, acked_bytes: int, rtt: float | None) -> None:
        """Bytes were acknowledged; ``rtt`` is a sample in seconds when the ack carried one."""

    @abstractmethod
    def on_loss(self, *, now: float, lost_bytes: int, protected: bool) -> None:
        """Bytes were declared lost; ``protected`` says whether any of them was protected."""


_C = TypeVar("_C", bound=type[CongestionController])
_CONTROLLERS: dict[str, type[CongestionController]] = {}


def register_controller(name: str) -> Callable[[_C], _C]:
    """Class decorator registering a :class:`CongestionController` under ``name``."""

    def decorate(cls: _C) -> _C:
        if name in _CONTROLLERS:
            raise ConfigError(f"congestion controller {name!r} is already registered")
        _CONTROLLERS[name] = cls
        return cls

    return decorate


def controller_names() -> list[str]:
    """Names of the registered congestion controllers, sorted."""
    return sorted(_CONTROLLERS)


def make_controller(config: PacingConfig) -> CongestionController:
    """Instantiate the controller named by ``config.controller``."""
    try:
        cls = _CONTROLLERS[config.controller]
    except KeyError:
        raise ConfigError(
            f"congestion controller {config.controller!r} is not registered; "
            f"valid names: {', '.join(controller_names())}"
        ) from None
    return cls(config)


@register_controller("loss-tolerant")
class LossTolerant(CongestionController):
    """Default controller: decrease on delay growth or protected loss, probe up while clean."""

    def __init__(self, config: PacingConfig) -> None:
        super().__init__(config)
        self._rate = config.initial_rate_Bps
        self._srtt = math.nan
        self._min_rtt = math.inf
        self._next_decrease = -math.inf  # earliest time the next decrease may happen
        self._last_ack = math.nan  # time of the previous clean ack (increase integrates from it)
        self.decreases = 0
        """Number of multiplicative decreases so far (for reports)."""

    @property
    def rate_Bps(self) -> float:  # noqa: N802 (B = bytes)
        """Current pacing rate in bytes/s."""
        return self._rate

    @property
    def min_rtt(self) -> float:
        """Smallest RTT sample seen (seconds), ``inf`` before any."""
        return self._min_rtt

    def on_ack(self, *, now: float, acked_bytes: int, rtt: float | None) -> None:
        """Decrease on delay growth; otherwise grow additively (and multiplicatively)."""
        cfg = self.config
        if rtt is not None and math.isfinite(rtt) and rtt >= 0.0:
            self._min_rtt = min(self._min_rtt, rtt)
            self._srtt = (
                rtt
                if math.isnan(self._srtt)
                else (1.0 - cfg.rtt_alpha) * self._srtt + cfg.rtt_alpha * rtt
            )
            queueing = rtt - self._min_rtt
            if queueing > max(self._min_rtt * cfg.delay_threshold, cfg.delay_floor_s):
                self._decrease(now)
                self._last_ack = now
                return
        if acked_bytes <= 0:
            return
        if not math.isnan(self._last_ack):
            # Integrate over at most one RTT: after an idle gap the path has not shown it can
            # carry more, so the gap earns no increase.
            rtt_now = self._rtt()
            dt = min(max(now - self._last_ack, 0.0), rtt_now)
            grown = self._rate * (1.0 + cfg.increase_gain * dt / rtt_now)
            self._rate = min(cfg.max_rate_Bps, grown + cfg.increase_Bps_per_s * dt)
        self._last_ack = now

    def on_loss(self, *, now: float, lost_bytes: int, protected: bool) -> None:
        """Only the loss of a protected packet is a congestion signal (see module doc)."""
        if protected and lost_bytes > 0:
            self._decrease(now)

    def _rtt(self) -> float:
        return self.config.initial_rtt_s if math.isnan(self._srtt) else max(self._srtt, 1e-6)

    def _decrease(self, now: float) -> None:
        if now < self._next_decrease:
            return  # already reacted to this congestion event
        self._rate = max(self.config.min_rate_Bps, self._rate * self.config.decrease)
        self._next_decrease = now + self._rtt()
        self.decreases += 1


@register_controller("fixed")
class FixedRate(CongestionController):
    """Baseline: a constant rate (``initial_rate_Bps``), feedback ignored."""

    @property
    def rate_Bps(self) -> float:  # noqa: N802 (B = bytes)
        """The configured ``initial_rate_Bps``."""
        return self.config.initial_rate_Bps

    def on_ack(self, *, now: float, acked_bytes: int, rtt: float | None) -> None:
        """Ignored."""

    def on_loss(self, *, now: float, lost_bytes: int, protected: bool) -> None:
        """Ignored."""


class Pacer:
    """Token bucket for one path, filled at its controller's rate (see module doc).

    The bucket starts full at the first call. :meth:`consume` may take more than the allowance
    (a datagram larger than the tokens left); the bucket then goes into debt and the next
    allowance waits for it to be repaid, so the long-run rate still holds.
    """

    def __init__(
        self, config: PacingConfig | None = None, controller: CongestionController | None = None
    ) -> None:
        self.config = config if config is not None else PacingConfig()
        self.controller = controller if controller is not None else make_controller(self.config)
        self._depth = float(self.config.burst_bytes)
        self._tokens = self._depth
        self._last = math.nan

    @property
    def depth(self) -> int:
        """The bucket's depth now: ``burst_bytes`` unless :meth:`set_depth` changed it."""
        return int(self._depth)

    def set_depth(self, nbytes: int) -> None:
        """Hold at most ``nbytes`` of tokens from now on (>= 1); tokens above it are dropped,
        a debt is kept."""
        if nbytes < 1:
            raise ValueError(f"depth must be >= 1 byte, got {nbytes}")
        self._depth = float(nbytes)
        self._tokens = min(self._tokens, self._depth)

    @property
    def rate_Bps(self) -> float:  # noqa: N802 (B = bytes)
        """The controller's current rate."""
        return self.controller.rate_Bps

    def allowance(self, now: float) -> int:
        """Bytes that may be sent on this path at ``now`` (0 while in debt)."""
        self._refill(now)
        # The epsilon forgives float round-off in ``rate × dt`` (999.9999999 means 1000).
        return max(0, math.floor(self._tokens + _TOKEN_EPS))

    def consume(self, nbytes: int, now: float) -> None:
        """Record ``nbytes`` sent at ``now``."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._refill(now)
        self._tokens -= nbytes

    def next_send_time(self, now: float, nbytes: int) -> float:
        """Earliest time ``nbytes`` may be sent at the current rate; never earlier than ``now``.

        A pure query (the bucket does not move), so a driver's ``get_timer`` may call it. A
        datagram larger than the depth may go once the bucket is full.
        """
        if math.isnan(self._last):
            return now
        need = min(float(nbytes), self._depth)
        deficit = need - self._tokens  # tokens as of the last refill
        if deficit <= 0.0:
            return now
        # One byte of margin absorbs float round-off in the times, so that ``allowance`` at the
        # returned time really is >= nbytes rather than one byte short.
        return max(now, self._last + (deficit + 1.0) / self.controller.rate_Bps)

    def _refill(self, now: float) -> None:
        if not math.isnan(self._last):
            # A clock that steps backwards earns nothing (and takes nothing).
            dt = max(0.0, now - self._last)
            self._tokens = min(self._depth, self._tokens + dt * self.controller.rate_Bps)
        self._last = now if math.isnan(self._last) else max(self._last, now)


class BurstControl:
    """Datagrams a sender lets go back to back, set by loss (see the module doc).

    ``packets(now)`` is the current burst. The sender reports what it sends (``on_sent``) and
    what it finds lost (``on_loss``); when the losses of the current and the previous window
    exceed ``loss_thresh`` of their datagrams (and of ``4 · max_packets`` while fewer were
    sent; a window closes once that many left and ``hold_s`` passed), the
    burst halves — at most once per ``hold_s``, so the losses of one burst count once — and its
    growth restarts, one datagram per ``grow_s`` without such a loss, up to ``max_packets``.
    ``loss_thresh`` 0 cuts on every loss. ``min_packets == max_packets`` keeps it fixed. Pure:
    times are passed in.
    """

    def __init__(
        self,
        max_packets: int,
        min_packets: int,
        hold_s: float,
        grow_s: float,
        loss_thresh: float = 0.02,
    ) -> None:
        if not 1 <= min_packets <= max_packets:
            raise ConfigError(
                f"burst bounds must satisfy 1 <= min_packets <= max_packets, got {min_packets}, "
                f"{max_packets}"
            )
        if not (0.0 <= hold_s < math.inf and 0.0 < grow_s < math.inf):
            raise ConfigError(f"hold_s must be >= 0 and grow_s > 0, got {hold_s}, {grow_s}")
        if not 0.0 <= loss_thresh < 1.0:
            raise ConfigError(f"loss_thresh must be in [0, 1), got {loss_thresh}")
        self.max_packets = max_packets
        self.min_packets = min_packets
        self._hold = hold_s
        self._grow = grow_s
        self._thresh = loss_thresh
        # The loss rate's window: datagrams sent and lost since it opened (a few bursts at
        # least, so that one burst's tail is a share of something), with the previous window's
        # counts, since a loss is found a round trip after its datagram left.
        self._window = 4 * max_packets
        self._sent = self._lost = self._prev_sent = self._prev_lost = 0
        self._opened = -math.inf
        self._base = max_packets  # the burst at ``_anchor``, growing from there
        self._anchor = -math.inf
        self._cut_at = -math.inf
        #: Times the burst was halved (for stats and tests).
        self.cuts = 0

    def packets(self, now: float) -> int:
        """The burst at ``now``, in datagrams."""
        if self._base >= self.max_packets:
            return self.max_packets
        grown = int(max(0.0, now - self._anchor) / self._grow)
        return min(self.max_packets, self._base + grown)

    def on_sent(self, now: float, n: int) -> None:
        """``n`` datagrams left at ``now``."""
        self._sent += n
        if self._sent >= self._window and now >= self._opened + self._hold:
            self._open(now)

    def on_loss(self, now: float, n: int = 1) -> None:
        """``n`` datagrams were found lost at ``now``."""
        self._lost += n
        sent = self._sent + self._prev_sent
        if self._lost + self._prev_lost <= self._thresh * max(sent, self._window):
            return  # a loss rate no burst length explains
        burst = self.packets(now)
        if now >= self._cut_at + self._hold:
            burst = max(self.min_packets, burst // 2)
            self._cut_at = now
            self.cuts += 1
            self._open(now)
            self._prev_sent = self._prev_lost = 0  # what follows a cut is judged on its own
        self._base = burst
        self._anchor = now

    def _open(self, now: float) -> None:
        self._prev_sent, self._prev_lost = self._sent, self._lost
        self._sent = self._lost = 0
        self._opened = now
