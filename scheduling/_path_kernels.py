"""Compiled per-acknowledgement update of a :class:`~scheduling.paths.PathSet`.

An ACK touches a handful of per-path numbers (a few paths, a few dozen packets). Written with
numpy, that update was ~60 small-array operations, ~150 µs per ACK: the largest protocol cost of a
fast transfer. One compiled pass over the packets and paths does the same in about a microsecond.
The arithmetic is exactly that of the numpy formulation kept in ``tests/unit/naive.py`` (tests
compare them).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["ack_update"]

_UP = 0


@njit(cache=True, nogil=True)
def ack_update(
    path: np.ndarray,
    sizes: np.ndarray,
    counted: np.ndarray,
    rtt: np.ndarray,
    has_rtt: bool,
    now: float,
    outstanding: np.ndarray,
    acked_total: np.ndarray,
    last_delivery: np.ndarray,
    last_progress: np.ndarray,
    loss: np.ndarray,
    min_rtt: np.ndarray,
    srtt: np.ndarray,
    rttvar: np.ndarray,
    win_t0: np.ndarray,
    win_bytes: np.ndarray,
    rate: np.ndarray,
    state: np.ndarray,
    next_probe: np.ndarray,
    loss_alpha: float,
    rtt_alpha: float,
    rate_alpha: float,
    rate_window_s: float,
    loss_suspect: float,
    min_rate: float,
) -> None:
    """Apply one batch of acknowledged packets (``path``, ``sizes``, optional ``rtt`` each).

    ``counted`` (bytes per packet, usually ``sizes``) is what leaves the outstanding bytes: 0 for
    a packet already written off (declared lost, or released) whose ACK came anyway.
    Raises ValueError on a path index out of range, a negative size or misaligned arrays, before
    any state changes.
    """
    n_paths = outstanding.shape[0]
    n = path.shape[0]
    if sizes.shape[0] != n or counted.shape[0] != n or (has_rtt and rtt.shape[0] != n):
        raise ValueError("path, sizes, counted and rtt must be 1-D and of equal length")
    acked = np.zeros(n_paths)
    leaving = np.zeros(n_paths)
    counts = np.zeros(n_paths, dtype=np.int64)
    rtt_sum = np.zeros(n_paths)
    rtt_n = np.zeros(n_paths, dtype=np.int64)
    for i in range(n):
        p = path[i]
        if p < 0 or p >= n_paths:
            raise ValueError("path index out of range")
        if sizes[i] < 0 or counted[i] < 0:
            raise ValueError("sizes must be >= 0")
    for i in range(n):
        p = path[i]
        acked[p] += sizes[i]
        leaving[p] += counted[i]
        counts[p] += 1
        if has_rtt:
            r = rtt[i]
            if math.isfinite(r) and r >= 0.0:
                rtt_sum[p] += r
                rtt_n[p] += 1
                min_rtt[p] = min(min_rtt[p], r)
    keep = 1.0 - loss_alpha
    for p in range(n_paths):
        got = acked[p] > 0.0
        outstanding[p] = max(outstanding[p] - leaving[p], 0.0)
        acked_total[p] += acked[p]
        if got:
            last_delivery[p] = now
            last_progress[p] = now
        loss[p] *= keep ** counts[p]
        # RFC 6298 with one sample per path per batch: the batch's mean RTT there.
        if rtt_n[p] > 0:
            mean = rtt_sum[p] / rtt_n[p]
            if math.isnan(srtt[p]):
                rttvar[p] = mean / 2.0
                srtt[p] = mean
            else:
                rttvar[p] = (1.0 - 2.0 * rtt_alpha) * rttvar[p] + 2.0 * rtt_alpha * abs(
                    srtt[p] - mean
                )
                srtt[p] = (1.0 - rtt_alpha) * srtt[p] + rtt_alpha * mean
        # Delivery-rate window (see PathSet's theory of operation).
        is_open = not math.isnan(win_t0[p])
        elapsed = 0.0
        if is_open:
            win_bytes[p] += acked[p]
            elapsed = now - win_t0[p]
        window = max(rate_window_s, 0.0 if math.isnan(srtt[p]) else srtt[p])
        drained = outstanding[p] <= 0.0
        close = is_open and got and (elapsed >= window or drained)
        if close and elapsed > 0.0:
            smoothed = (1.0 - rate_alpha) * rate[p] + rate_alpha * (win_bytes[p] / elapsed)
            if drained:  # application-limited: may only raise the estimate
                smoothed = max(rate[p], smoothed)
            rate[p] = max(smoothed, min_rate)
        restart = got and not drained and (close or not is_open)
        if restart:
            win_t0[p] = now
        elif close:
            win_t0[p] = np.nan
        if close or restart:
            win_bytes[p] = 0.0
        # Evidence of delivery lifts a SUSPECT/DOWN path unless its loss is still high.
        if got and loss[p] <= loss_suspect and state[p] != _UP:
            state[p] = _UP
            next_probe[p] = np.inf
