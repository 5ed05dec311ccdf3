"""The array work of one ACK over one outgoing transfer, compiled (private; see
:func:`gradlane.transport.kernels.apply_ack`).

Theory of operation
-------------------
An ACK bitmap touches a few dozen chunks of one transfer, and RACK then scans the whole transfer
once. Written with numpy (``tests/support/naive.py`` keeps that formulation as the reference) it
takes some forty small-array operations per ACK, each paying interpreter and dispatch overhead;
here it is two passes over the bitmap and one over the transfer.

:func:`ack_scan` marks the newly acknowledged chunks (bit set, state INFLIGHT, LOST or
ABANDONED) ACKED and returns, for the caller's Python side, everything it passes on:

* the acknowledged chunk indices in ascending order, their datagram sizes, RTT samples (first
  transmissions only, Karn; NaN otherwise), paths and the bytes that leave the outstanding bytes
  (INFLIGHT ones only) — the arguments of ``PathSet.on_acked``;
* how many were LOST and INFLIGHT, and the elements of the ABANDONED ones (to subtract);
* whether the trigger chunk was among them as a first transmission (its clean RTT sample);
* acknowledged bytes per path, and which paths had any (the pacers' ``on_ack``);
* the RACK losses: per path × class lane, the newest send time acknowledged now less the
  reorder window; INFLIGHT chunks sent before that are lost.

:func:`timed_out` is the sender's retransmission-timeout scan of one transfer (every tick), and
:func:`rack_due` its RACK scan; :func:`next_due` is when either will next find a chunk (the
sender ticks then, not every millisecond while it waits).

Arithmetic is exactly the numpy formulation's: the same subtractions, ``np.maximum``'s NaN
propagation for the newest send time, integer sums. Exact IEEE (no fastmath).
"""

from __future__ import annotations

import math

import numpy as np
from gradlane.transport.kernels._common import EXACT
from numba import njit

# The chunk states of gradlane.transport.core.outgoing (tests check they agree).
INFLIGHT, LOST, ACKED, ABANDONED = 1, 2, 3, 4


@njit(inline="always", **EXACT)
def _ackable(s: np.uint8) -> bool:
    """A chunk an ACK changes: in flight, declared lost, or abandoned."""
    return s in (INFLIGHT, LOST, ABANDONED)


@njit(**EXACT)
def ack_scan(
    state: np.ndarray,
    tx: np.ndarray,
    sent_at: np.ndarray,
    path: np.ndarray,
    prio: np.ndarray,
    counts: np.ndarray,
    lengths: np.ndarray,
    bits: np.ndarray,
    base: int,
    trigger: int,
    now: float,
    n_paths: int,
    n_classes: int,
    reorder_window_s: float,
) -> tuple[
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    int,
    int,
    int,
    bool,
    np.ndarray,
    np.ndarray,
    np.ndarray,
]:
    """Apply ACK ``bits`` (chunks ``base ..``) to ``state``; see the module docstring.

    Returns ``(idx, sizes, rtt, paths, counted, n_lost, n_inflight, abandoned_elems,
    trigger_first, path_bytes, path_hit, lost)``. Nothing is written, and the RACK scan is
    skipped, when no chunk is newly acknowledged. Raises ValueError on a path or class outside
    ``n_paths`` × ``n_classes`` before writing anything.
    """
    n_chunks = state.shape[0]
    end = min(base + bits.shape[0], n_chunks)
    n = 0
    for i in range(base, end):
        if bits[i - base] and _ackable(state[i]):
            n += 1
    idx = np.empty(n, dtype=np.int64)
    sizes = np.empty(n, dtype=np.int64)
    rtt = np.empty(n, dtype=np.float64)
    paths = np.empty(n, dtype=np.int64)
    counted = np.empty(n, dtype=np.int64)
    path_bytes = np.zeros(n_paths, dtype=np.int64)
    path_hit = np.zeros(n_paths, dtype=np.bool_)
    n_lost = 0
    n_inflight = 0
    abandoned = 0
    trigger_first = False
    lost_buf = np.empty(n_chunks if n else 0, dtype=np.int64)
    m = 0
    if n == 0:  # nothing newly acknowledged: nothing written, no RACK scan
        return (
            idx, sizes, rtt, paths, counted, n_lost, n_inflight, abandoned, trigger_first,
            path_bytes, path_hit, lost_buf,
        )  # fmt: skip
    for i in range(n_chunks):  # every lane is checked first, as numpy's indexing would
        q = np.int64(path[i])
        c = np.int64(prio[i])
        if q < 0 or q >= n_paths or c >= n_classes:
            raise ValueError("chunk path or class out of range")
    newest = np.full(n_paths * n_classes, -np.inf)
    k = 0
    for i in range(base, end):
        if not bits[i - base]:
            continue
        s = state[i]
        if not _ackable(s):
            continue
        idx[k] = i
        if s == LOST:
            n_lost += 1
        elif s == INFLIGHT:
            n_inflight += 1
        else:
            abandoned += counts[i]
        state[i] = ACKED
        size = np.int64(lengths[i])
        sizes[k] = size
        first = tx[i] == 1
        rtt[k] = now - sent_at[i] if first else np.nan
        if i == trigger and first:
            trigger_first = True
        q = np.int64(path[i])
        paths[k] = q
        counted[k] = size if s == INFLIGHT else 0
        path_bytes[q] += size
        path_hit[q] = True
        # np.maximum: NaN wins, whichever side it is on.
        lane = q * n_classes + np.int64(prio[i])
        cur = newest[lane]
        v = sent_at[i]
        if not math.isnan(cur) and (math.isnan(v) or v > cur):
            newest[lane] = v
        k += 1
    for i in range(n_chunks):
        if state[i] == INFLIGHT:
            lane = np.int64(path[i]) * n_classes + np.int64(prio[i])
            if sent_at[i] < newest[lane] - reorder_window_s:
                lost_buf[m] = i
                m += 1
    return (
        idx, sizes, rtt, paths, counted, n_lost, n_inflight, abandoned, trigger_first,
        path_bytes, path_hit, lost_buf[:m],
    )  # fmt: skip


@njit(**EXACT)
def timed_out(
    state: np.ndarray,
    sent_at: np.ndarray,
    path: np.ndarray,
    rtos: np.ndarray,
    backoff: float,
    since: float,
    now: float,
    out: np.ndarray,
) -> int:
    """The INFLIGHT chunks whose timeout ``rtos[path] * backoff`` has run since the later of
    their send and ``since`` (when the clock restarted for the whole transfer), in index order,
    into ``out`` (room for every chunk in flight); returns how many."""
    n = 0
    for c in range(state.shape[0]):
        if state[c] != INFLIGHT:
            continue
        p = path[c]
        if p < 0 or p >= rtos.shape[0]:
            raise ValueError("timed_out: a chunk's path is outside the RTO table")
        if max(sent_at[c], since) + rtos[p] * backoff <= now:
            if n >= out.shape[0]:
                raise ValueError("timed_out: more chunks in flight than out holds")
            out[n] = c
            n += 1
    return n


@njit(**EXACT)
def rack_due(
    state: np.ndarray,
    tx_seq: np.ndarray,
    path: np.ndarray,
    prio: np.ndarray,
    n_classes: int,
    lane_seq: np.ndarray,
    lane_at: np.ndarray,
    deadline_shift: float,
    now: float,
    out: np.ndarray,
) -> int:
    """The INFLIGHT chunks transmitted before the newest acknowledged chunk of their lane
    (path × class, ``lane_seq``) when that acknowledgement is ``deadline_shift`` old
    (``lane_at + deadline_shift <= now``), in index order, into ``out``; returns how many."""
    n = 0
    for c in range(state.shape[0]):
        if state[c] != INFLIGHT:
            continue
        lane = np.int64(path[c]) * n_classes + np.int64(prio[c])
        if lane < 0 or lane >= lane_seq.shape[0]:
            raise ValueError("rack_due: a chunk's lane is outside the lane tables")
        if tx_seq[c] < lane_seq[lane] and lane_at[lane] + deadline_shift <= now:
            out[n] = c
            n += 1
    return n


@njit(**EXACT)
def next_due(
    state: np.ndarray,
    sent_at: np.ndarray,
    tx_seq: np.ndarray,
    path: np.ndarray,
    prio: np.ndarray,
    n_classes: int,
    lane_seq: np.ndarray,
    lane_at: np.ndarray,
    deadline_shift: float,
    rtos: np.ndarray,
    backoff: float,
    since: float,
    timeouts: bool,
) -> float:
    """The earliest time at which :func:`rack_due` (with ``deadline_shift``) or, with
    ``timeouts``, :func:`timed_out` (with ``rtos``, ``backoff``, ``since``) would return an
    INFLIGHT chunk of this transfer, unless an ACK or a send changes its state first; ``inf``
    when neither ever will. The same sums as the scans, so at that time they find the chunk."""
    best = np.inf
    for c in range(state.shape[0]):
        if state[c] != INFLIGHT:
            continue
        p = np.int64(path[c])
        lane = p * n_classes + np.int64(prio[c])
        if lane < 0 or lane >= lane_seq.shape[0]:
            raise ValueError("next_due: a chunk's lane is outside the lane tables")
        if tx_seq[c] < lane_seq[lane]:
            best = min(best, lane_at[lane] + deadline_shift)
        if timeouts:
            if p < 0 or p >= rtos.shape[0]:
                raise ValueError("next_due: a chunk's path is outside the RTO table")
            best = min(best, max(sent_at[c], since) + rtos[p] * backoff)
    return best


@njit(**EXACT)
def note_lanes(
    path: np.ndarray,
    prio: np.ndarray,
    tx_seq: np.ndarray,
    acked: np.ndarray,
    n_classes: int,
    lane_seq: np.ndarray,
    lane_at: np.ndarray,
    now: float,
) -> None:
    """Newly acknowledged chunks ``acked`` advance their lanes (path × ``n_classes`` + class):
    a lane's newest delivered transmission sequence becomes the largest of theirs, and a lane
    that advances is stamped ``now`` (RACK's reference, see :func:`rack_due`). Raises
    ValueError for a lane outside the arrays (nothing is written then)."""
    n_lanes = lane_seq.shape[0]
    for i in range(acked.shape[0]):
        c = acked[i]
        lane = np.int64(path[c]) * n_classes + np.int64(prio[c])
        if lane < 0 or lane >= n_lanes:
            raise ValueError("note_lanes: a lane outside the arrays")
    for i in range(acked.shape[0]):
        c = acked[i]
        lane = np.int64(path[c]) * n_classes + np.int64(prio[c])
        if tx_seq[c] > lane_seq[lane]:
            lane_seq[lane] = tx_seq[c]
            lane_at[lane] = now


@njit(**EXACT)
def note_sent(
    state: np.ndarray,
    sent_at: np.ndarray,
    path: np.ndarray,
    tx: np.ndarray,
    prio: np.ndarray,
    lengths: np.ndarray,
    chunks: np.ndarray,
    paths: np.ndarray,
    n_retx: int,
    now: float,
    sent: np.ndarray,
    retransmitted: np.ndarray,
    path_bytes: np.ndarray,
    bounds: np.ndarray,
) -> tuple[int, int]:
    """The sender's bookkeeping of one sending batch: ``chunks`` (the first ``n_retx`` of them
    retransmissions) go out on ``paths`` now.

    Marks them INFLIGHT with their send time and path, counts a transmission each (``tx``,
    saturating at 255), adds one per chunk to its class in ``sent`` (and ``retransmitted``),
    and its datagram bytes to its path in ``path_bytes``. Writes into ``bounds`` where each
    stretch of one class starts (then the end): the batch goes out as one run per class.
    Returns the batch's bytes and its number of runs. Raises ValueError for a path or class
    outside the arrays it counts into (nothing is written then).
    """
    n = chunks.shape[0]
    for i in range(n):
        q = paths[i]
        p = prio[chunks[i]]
        if q < 0 or q >= path_bytes.shape[0] or p >= sent.shape[0]:
            raise ValueError("note_sent: a path or class outside the counters")
    total = 0
    runs = 0
    for i in range(n):
        c = chunks[i]
        q = paths[i]
        state[c] = INFLIGHT
        sent_at[c] = now
        path[c] = q
        if tx[c] < 255:
            tx[c] += 1
        p = prio[c]
        sent[p] += 1
        if i < n_retx:
            retransmitted[p] += 1
        nb = lengths[c]
        path_bytes[q] += nb
        total += nb
        if i == 0 or p != prio[chunks[i - 1]]:
            bounds[runs] = i
            runs += 1
    bounds[runs] = n
    return total, runs
