"""Path choice over a set of network paths toward one peer.

Theory of operation
-------------------
Packets need no order (each names its step, bucket, shard and chunk), so every packet may take
any path. :class:`PathSet` keeps, per path and in numpy arrays: a delivery-rate estimate, RTT
statistics, an EWMA of the loss rate, the bytes outstanding (sent, neither acked nor lost), the
last time the path made progress, and a state:

=========  ==========================================================  =======================
state      entered when                                                 gets
=========  ==========================================================  =======================
UP         start; any ack or probe ack while loss is below threshold    its share of everything
SUSPECT    outstanding data but no progress for ``suspect_after_s``,    no protected packets, a
           or loss EWMA above ``loss_suspect`` and ``loss_ratio`` x     trickle of the others
           the lowest of the other UP paths'
DOWN       no progress for ``down_after_s`` (data outstanding or       nothing; probes only
           already SUSPECT)
=========  ==========================================================  =======================

**Assignment** (:meth:`PathSet.assign`) water-fills a batch's bytes over the usable paths so that
every path's backlog drains at the same time: path ``i`` gets ``max(0, L·rate_i - outstanding_i)``
bytes for the level ``L`` that places the whole batch. With nothing outstanding that is a split
proportional to the rates; a path that is falling behind gets less until it catches up. The
packets are then interleaved over the paths with a golden-ratio (Weyl) sequence started at a
random offset: every prefix of the batch (the most urgent packets come first) is spread over the
paths in proportion, it is fully vectorised, and it is deterministic given the generator.

**Rate estimation**: acked bytes over a measurement window of at least ``rate_window_s`` (and one
smoothed RTT), EWMA-smoothed. A window that ends with the path drained was application-limited,
so it may raise the estimate but never lower it (BBR's rule; Cardwell et al., ACM Queue 2016) —
otherwise idle gaps between training steps would make every path look slow.

**Failure**: when a path goes DOWN its outstanding bytes are written off (:meth:`PathSet.tick`
returns the paths that went down, so the transport re-queues the chunks it had in flight there:
nothing is lost when a path dies) and probes every ``probe_interval_s`` bring it back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from gradlane.scheduling._kernels.paths import (
    ASSIGNED,
    SPREAD_SPLIT,
    ack_update,
    assign_plan,
    assign_spread,
    borrowed_rtos,
    lossy_paths,
    probe_due,
    release_where,
    sent_update,
    tick_due,
    tick_update,
)
from gradlane.scheduling.errors import ConfigError

__all__ = ["PathConfig", "PathSet", "PathState"]

_MIN_RATE = 1.0  # bytes/s; keeps divisions finite for a path that has delivered nothing
_RTO_FLOOR_S = 0.001
_NO_RTT = np.empty(0)


class PathState(IntEnum):
    """Health of one path."""

    UP = 0
    SUSPECT = 1
    DOWN = 2


#: Batches up to this many packets take the scalar path in :meth:`PathSet.assign`.
_SMALL_BATCH = 4


@dataclass(frozen=True)
class PathConfig:
    """Configuration of path health tracking and packet assignment.

    Attributes:
        suspect_after_s: a path with outstanding data and no delivery for this long is SUSPECT.
        down_after_s: no delivery for this long → DOWN (>= ``suspect_after_s``).
        probe_interval_s: interval between probes of a SUSPECT or DOWN path.
        loss_suspect: a loss EWMA above this marks the path SUSPECT, in (0, 1]...
        loss_ratio: ...if it is also above this multiple (>= 1) of the lowest loss EWMA among
            the other UP paths. Loss every path shows — random loss on the links, acknowledgements
            lost and their packets read as lost — is no reason to move traffic off one path:
            with an absolute threshold alone, random loss of a few percent on two equal paths
            (and the acknowledgements it costs) would take one of them out and move its load
            onto the other.
        loss_alpha: weight of one packet in the loss EWMA.
        initial_rate_Bps: rate estimate of a path before it delivered anything (bytes/s).
        rtt_alpha: weight of a new sample in the smoothed RTT (RFC 6298: 1/8); the deviation
            uses twice this weight (RFC 6298: 1/4).
        rate_alpha: weight of a new window in the delivery-rate EWMA.
        rate_window_s: shortest delivery-rate measurement window (the window also spans at
            least one smoothed RTT).
        suspect_share: at most this fraction of a batch's unprotected bytes goes to SUSPECT
            paths (split among them) while some path is UP: enough to notice a recovery.
        initial_rto_s: retransmission timeout of a path before its first RTT sample.
    """

    suspect_after_s: float = 0.05
    down_after_s: float = 0.2
    probe_interval_s: float = 0.02
    loss_suspect: float = 0.3
    loss_ratio: float = 2.0
    loss_alpha: float = 0.05
    initial_rate_Bps: float = 1.25e8  # noqa: N815 (B = bytes)
    rtt_alpha: float = 0.125
    rate_alpha: float = 0.25
    rate_window_s: float = 0.002
    suspect_share: float = 0.02
    initial_rto_s: float = 0.2

    def __post_init__(self) -> None:
        positive = (
            "suspect_after_s",
            "probe_interval_s",
            "initial_rate_Bps",
            "rate_window_s",
            "initial_rto_s",
        )
        for name in positive:
            value = getattr(self, name)
            if not 0.0 < value < math.inf:
                raise ConfigError(f"{name} must be a positive finite number, got {value}")
        if not self.suspect_after_s <= self.down_after_s < math.inf:
            raise ConfigError(
                f"down_after_s ({self.down_after_s}) must be finite and >= suspect_after_s "
                f"({self.suspect_after_s})"
            )
        if not 0.0 < self.loss_suspect <= 1.0:
            raise ConfigError(f"loss_suspect must be in (0, 1], got {self.loss_suspect}")
        if not 1.0 <= self.loss_ratio < math.inf:
            raise ConfigError(f"loss_ratio must be a finite number >= 1, got {self.loss_ratio}")
        for name in ("loss_alpha", "rate_alpha"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")
        if not 0.0 < self.rtt_alpha <= 0.5:
            raise ConfigError(
                f"rtt_alpha must be in (0, 0.5] (the deviation uses 2·rtt_alpha), "
                f"got {self.rtt_alpha}"
            )
        if not 0.0 <= self.suspect_share < 1.0:
            raise ConfigError(f"suspect_share must be in [0, 1), got {self.suspect_share}")


class PathSet:
    """Per-path estimates and state for the paths toward one peer, plus packet assignment.

    All updates take batches (``path`` and ``sizes`` arrays aligned per packet) and ``now`` in
    seconds. ``rng`` only seeds the interleaving offset of :meth:`assign`.
    """

    def __init__(self, n_paths: int, config: PathConfig | None, rng: np.random.Generator) -> None:
        if n_paths < 1:
            raise ConfigError(f"a path set needs at least one path, got {n_paths}")
        self.config = cfg = config if config is not None else PathConfig()
        self._rng = rng
        n = self.n_paths = n_paths
        # Estimates.
        self._rate = np.full(n, cfg.initial_rate_Bps)
        self._srtt = np.full(n, np.nan)
        self._rttvar = np.full(n, np.nan)
        self._min_rtt = np.full(n, np.inf)
        self._loss = np.zeros(n)
        # Accounting.
        self._outstanding = np.zeros(n)
        self._sent_total = np.zeros(n)
        self._acked_total = np.zeros(n)
        self._lost_total = np.zeros(n)
        # Delivery-rate window: start time (NaN = closed) and bytes acked since.
        self._win_t0 = np.full(n, np.nan)
        self._win_bytes = np.zeros(n)
        # Health.
        self._state = np.zeros(n, dtype=np.int8)  # PathState values
        self._went_down = np.zeros(n, dtype=np.int64)  # tick_update's output
        self._last_delivery = np.full(n, -np.inf)
        # Last progress: a delivery, or the moment an idle path got data again (an idle path is
        # not silent, so its silence clock starts when it has something to deliver).
        self._last_progress = np.zeros(n)
        self._next_probe = np.full(n, np.inf)
        # Scratch of assign(): main weights (row 0) and the SUSPECT-trickle weights (row 1).
        self._weights = np.zeros((2, n))

    # -- queries ------------------------------------------------------------------------------

    @property
    def states(self) -> np.ndarray:
        """Copy of the per-path :class:`PathState` values (``int8``)."""
        return self._state.copy()

    def state(self, path: int) -> PathState:
        """State of one path."""
        return PathState(int(self._state[path]))

    @property
    def rates(self) -> np.ndarray:
        """Copy of the per-path delivery-rate estimates (bytes/s)."""
        return self._rate.copy()

    @property
    def outstanding(self) -> np.ndarray:
        """Copy of the per-path outstanding bytes."""
        return self._outstanding.copy()

    def next_probe_time(self) -> float | None:
        """Earliest time a probe falls due on a SUSPECT or DOWN path, or None (all UP)."""
        due = self._next_probe[self._state != PathState.UP]
        return float(due.min()) if due.size else None

    def next_tick_time(self) -> float | None:
        """Earliest time :meth:`tick` may change a state without new feedback (``-inf``: at
        once, a loss EWMA passed ``loss_suspect``), or None.

        A driver re-arms its timer at :meth:`next_due`, which adds :meth:`next_probe_time`.
        """
        t = self._due(probes=False)
        return t if t < math.inf else None

    def rtt_estimate(self, path: int) -> float:
        """Smoothed RTT of a path (seconds), or NaN before its first sample."""
        return float(self._srtt[path])

    def min_rtts(self) -> np.ndarray:
        """Smallest RTT seen on every path (seconds; inf before the first sample): the path's
        own delay without the queueing and scheduling that inflate the smoothed RTT."""
        return self._min_rtt.copy()

    def rtt_bounds(self, deviations: float = 4.0) -> np.ndarray:
        """Per path: the smoothed RTT plus ``deviations`` mean deviations (four: RFC 6298's RTO
        before its floor and backoff), 0 before the first sample — how long a packet may take
        while the path's queue varies, where the smoothed RTT is its average and lags a queue
        that grows. ``deviations=0``: the smoothed RTT alone."""
        return np.nan_to_num(self._srtt + deviations * np.nan_to_num(self._rttvar), nan=0.0)

    def sampled(self) -> np.ndarray:
        """Per path: True once it has an RTT sample (``rtt_estimate`` is not NaN)."""
        return ~np.isnan(self._srtt)

    def rto(self, path: int) -> float:
        """Retransmission timeout of a path: ``srtt + 4·rttvar``, at least 1 ms."""
        return float(self.rtos()[path])

    def rtos(self) -> np.ndarray:
        """Retransmission timeout of every path (see :meth:`rto`)."""
        rto = self._srtt + 4.0 * self._rttvar
        rto = np.where(np.isnan(rto), self.config.initial_rto_s, rto)
        return np.maximum(rto, _RTO_FLOOR_S)

    def borrowed_rtos(
        self, fallback_srtt: float, fallback_rttvar: float, minimum: float
    ) -> np.ndarray:
        """:meth:`rtos`, where a path with no RTT sample yet borrows the largest RTO of the
        sampled paths, or, with none sampled, every path takes ``fallback_srtt + 4 ×
        fallback_rttvar`` (an estimate over other peers; NaN: none); at least ``minimum``.
        The initial RTO is for a peer nothing is known about. One compiled pass."""
        return borrowed_rtos(
            self._srtt, self._rttvar, self.config.initial_rto_s, _RTO_FLOOR_S,
            fallback_srtt, fallback_rttvar, minimum,
        )  # fmt: skip

    def snapshot(self) -> dict[str, list[float | None] | list[str]]:
        """Per-path statistics for reports: JSON-friendly lists, one entry per path.

        Numbers are floats, or None where not known yet (``srtt_s`` before an RTT sample,
        ``last_delivery_s`` before any delivery).
        """

        def floats(a: np.ndarray) -> list[float | None]:
            # None where unknown (no RTT sample yet, never delivered): strict JSON has no NaN.
            return [float(x) if np.isfinite(x) else None for x in a]

        return {
            "state": [PathState(int(s)).name for s in self._state],
            "rate_Bps": floats(self._rate),
            "srtt_s": floats(self._srtt),
            "rttvar_s": floats(self._rttvar),
            "min_rtt_s": floats(self._min_rtt),
            "rto_s": floats(self.rtos()),
            "loss": floats(self._loss),
            "outstanding_bytes": floats(self._outstanding),
            "sent_bytes": floats(self._sent_total),
            "acked_bytes": floats(self._acked_total),
            "lost_bytes": floats(self._lost_total),
            "last_delivery_s": floats(self._last_delivery),
        }

    # -- assignment -----------------------------------------------------------------------------

    def assign(self, *, now: float, sizes: np.ndarray, protected: np.ndarray) -> np.ndarray:
        """Choose a path for every packet of a batch (in send order, most urgent first).

        Returns an ``int64`` array of path indices, always valid. DOWN paths get nothing;
        SUSPECT paths get no protected packet and at most ``suspect_share`` of the other bytes;
        when no path is UP everything goes to the best SUSPECT path (or, with every path DOWN,
        the best DOWN path), because a path is always returned.
        """
        sizes_a = np.asarray(sizes, dtype=np.float64)
        prot = np.asarray(protected, dtype=bool)
        if sizes_a.ndim != 1 or prot.shape != sizes_a.shape:
            raise ValueError(
                f"sizes {sizes_a.shape} and protected {prot.shape} must be 1-D of equal length"
            )
        out = np.empty(sizes_a.shape[0], dtype=np.int64)
        if not out.shape[0]:
            return out
        # One compiled pass (``gradlane.scheduling._kernels.paths``; numpy reference in
        # tests/support/naive.py): states as of ``now`` (a path that fell silent since the driver's
        # last tick() must not get protected packets in the meantime; tick() itself still reports
        # the transition), the fallbacks, and the water level. The interleaving offset is drawn only
        # when the packets are spread, between the two kernels.
        cfg = self.config
        mode = assign_plan(
            sizes_a,
            prot,
            float(now),
            self._state,
            self._outstanding,
            self._last_progress,
            self._loss,
            self._rate,
            self._last_delivery,
            cfg.suspect_after_s,
            cfg.down_after_s,
            cfg.loss_suspect,
            cfg.loss_ratio,
            cfg.suspect_share,
            _MIN_RATE,
            _SMALL_BATCH,
            self._weights,
            out,
        )
        if mode != ASSIGNED:
            offset = float(self._rng.random())
            assign_spread(self._weights, prot, mode == SPREAD_SPLIT, offset, out)
        return out

    # -- feedback -------------------------------------------------------------------------------

    def on_sent(self, path: np.ndarray, sizes: np.ndarray, now: float) -> None:
        """Account packets handed to the network (one compiled pass)."""
        path_a = np.asarray(path, dtype=np.int64)
        sizes_a = np.asarray(sizes, dtype=np.float64)
        if path_a.shape != sizes_a.shape or path_a.ndim != 1:
            raise ValueError(f"path {path_a.shape} and sizes {sizes_a.shape} must be 1-D, equal")
        sent_update(
            path_a, sizes_a, float(now), self._outstanding, self._sent_total, self._last_progress
        )

    def on_acked(
        self,
        path: np.ndarray,
        sizes: np.ndarray,
        now: float,
        rtt: np.ndarray | None = None,
        counted: np.ndarray | None = None,
    ) -> None:
        """Account delivered packets; ``rtt`` (seconds per packet) feeds the RTT estimate.

        ``counted`` (bytes per packet, default ``sizes``) is what leaves the outstanding bytes:
        give 0 for a packet already taken out of them (declared lost, or released) whose ACK
        came anyway, so no byte is taken out twice.

        Updates outstanding bytes, delivery and progress times, the loss EWMA (each acked packet
        is a "no loss" sample), the RTT estimate (RFC 6298, one sample per path per batch: the
        batch's mean), the delivery-rate window, and lifts a SUSPECT/DOWN path that delivers
        unless its loss is still high. One compiled pass (``gradlane.scheduling._kernels.paths``).
        """
        cfg = self.config
        path_a = np.asarray(path, dtype=np.int64).reshape(-1)
        sizes_a = np.asarray(sizes, dtype=np.float64).reshape(-1)
        rtt_a = _NO_RTT if rtt is None else np.asarray(rtt, dtype=np.float64).reshape(-1)
        counted_a = sizes_a if counted is None else np.asarray(counted, np.float64).reshape(-1)
        ack_update(
            path_a,
            sizes_a,
            counted_a,
            rtt_a,
            rtt is not None,
            float(now),
            self._outstanding,
            self._acked_total,
            self._last_delivery,
            self._last_progress,
            self._loss,
            self._min_rtt,
            self._srtt,
            self._rttvar,
            self._win_t0,
            self._win_bytes,
            self._rate,
            self._state,
            self._next_probe,
            cfg.loss_alpha,
            cfg.rtt_alpha,
            cfg.rate_alpha,
            cfg.rate_window_s,
            cfg.loss_suspect,
            cfg.loss_ratio,
            _MIN_RATE,
        )

    def on_lost(self, path: np.ndarray, sizes: np.ndarray, now: float) -> None:
        """Account packets declared lost (by the transport's loss detection or a NACK)."""
        path_a = np.asarray(path, dtype=np.int64)
        lost = self._per_path(path_a, sizes)
        counts = np.bincount(path_a, minlength=self.n_paths)
        self._outstanding = np.maximum(self._outstanding - lost, 0.0)
        self._lost_total += lost
        keep = (1.0 - self.config.loss_alpha) ** counts
        self._loss = self._loss * keep + (1.0 - keep)
        cfg = self.config
        high = np.empty(self.n_paths, dtype=bool)
        lossy_paths(self._loss, self._state, cfg.loss_suspect, cfg.loss_ratio, high)
        self._set_state(high & (self._state == PathState.UP), PathState.SUSPECT, now)

    def on_released(self, path: np.ndarray, sizes: np.ndarray) -> None:
        """Take packets out of the outstanding bytes without evidence of delivery or loss.

        For packets the transport stops tracking while in flight: their transfer ended (the
        receiver completed) or a NACK queued them again. Without this, such bytes would stay
        outstanding for ever, the path would never look drained, and idle gaps would then pass
        for slow delivery in the rate estimate (see the theory of operation).
        """
        self._outstanding = np.maximum(self._outstanding - self._per_path(path, sizes), 0.0)

    def on_released_where(
        self, state: np.ndarray, value: int, path: np.ndarray, sizes: np.ndarray
    ) -> None:
        """:meth:`on_released` for the packets whose ``state`` is ``value`` (1-D arrays of one
        entry per packet): a sender retiring a transfer releases what it still has in flight
        without building the selection (one compiled pass)."""
        if not state.shape == path.shape == sizes.shape or state.ndim != 1:
            raise ValueError(
                f"state {state.shape}, path {path.shape} and sizes {sizes.shape} must be 1-D, equal"
            )
        if release_where(self._outstanding, state, value, path, sizes) < 0:
            raise ValueError(f"path indices must be in [0, {self.n_paths}) and sizes >= 0")

    def tick(self, now: float) -> list[int]:
        """Move silent paths UP → SUSPECT → DOWN; returns the paths that went DOWN just now.

        The caller re-queues whatever it had in flight on those paths: their outstanding bytes
        are written off here.
        """
        cfg = self.config
        # One compiled pass: it runs every tick for every peer, where NumPy would take a dozen
        # operations on arrays of n_paths elements.
        n_down = tick_update(
            float(now),
            self._state,
            self._last_progress,
            self._outstanding,
            self._loss,
            self._next_probe,
            self._win_t0,
            cfg.suspect_after_s,
            cfg.down_after_s,
            cfg.loss_suspect,
            cfg.loss_ratio,
            self._went_down,
        )
        return self._went_down[:n_down].tolist() if n_down else []

    def next_due(self) -> float:
        """When :meth:`tick` or :meth:`probes_due` will next have something to do, as the paths
        stand now (ACKs, sends and losses change that): a time, ``-inf`` for at once, or
        ``inf`` for never. The sender's tick waits for it instead of running every
        millisecond while it waits for peers."""
        return self._due(probes=True)

    def _due(self, probes: bool) -> float:
        cfg = self.config
        return float(
            tick_due(
                self._state,
                self._last_progress,
                self._outstanding,
                self._loss,
                self._next_probe,
                cfg.suspect_after_s,
                cfg.down_after_s,
                cfg.loss_suspect,
                cfg.loss_ratio,
                probes,
            )
        )

    def probes_due(self, now: float) -> list[int]:
        """SUSPECT or DOWN paths whose next probe is due; marks those probes as sent."""
        due = probe_due(float(now), self._state, self._next_probe, self.config.probe_interval_s)
        return [p for p in range(self.n_paths) if due >> p & 1] if due else []

    def on_probe_ack(self, path: int, now: float, rtt: float | None = None) -> None:
        """A probe came back: the path delivers again, so it is UP with a clean loss history."""
        if not 0 <= path < self.n_paths:
            raise ValueError(f"path {path} out of range [0, {self.n_paths})")
        self._loss[path] = 0.0
        self._last_delivery[path] = now
        self._last_progress[path] = now
        if rtt is not None:
            # A zero-byte "ack" carrying only the RTT sample: the same estimator as data acks.
            self.on_acked(np.array([path]), np.zeros(1), now, np.array([rtt], dtype=np.float64))
        mask = np.zeros(self.n_paths, dtype=bool)
        mask[path] = self._state[path] != PathState.UP
        self._set_state(mask, PathState.UP, now)

    # -- private ------------------------------------------------------------------------------

    def _per_path(self, path: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Bytes per path of a batch (validated)."""
        path_a = np.asarray(path, dtype=np.int64)
        sizes_a = np.asarray(sizes, dtype=np.float64)
        if path_a.shape != sizes_a.shape or path_a.ndim != 1:
            raise ValueError(f"path {path_a.shape} and sizes {sizes_a.shape} must be 1-D, equal")
        if path_a.size and (path_a.min() < 0 or path_a.max() >= self.n_paths):
            raise ValueError(f"path indices must be in [0, {self.n_paths})")
        if sizes_a.size and sizes_a.min() < 0:
            raise ValueError("sizes must be >= 0")
        return np.bincount(path_a, weights=sizes_a, minlength=self.n_paths)

    def _set_state(self, mask: np.ndarray, state: PathState, now: float) -> None:
        if not mask.any():
            return
        self._state[mask] = state
        if state == PathState.UP:
            self._next_probe[mask] = np.inf
        else:
            # Probe at once on entering SUSPECT/DOWN, unless a probe is already scheduled.
            self._next_probe[mask] = np.minimum(self._next_probe[mask], now)
