"""Compiled per-batch updates and packet assignment of a
:class:`~gradlane.scheduling.paths.PathSet`.

An ACK touches a handful of per-path numbers (a few paths, a few dozen packets). Written with
numpy, that update takes some sixty small-array operations per ACK, each paying interpreter and
dispatch overhead, which would make it the largest protocol cost of a fast transfer; one compiled
pass over the packets and paths does the same. Assignment (``assign_plan`` then
``assign_spread``) and the send accounting (``sent_update``) likewise replace dozens of
small-array calls per sending batch.

The arithmetic is exactly that of the numpy formulations kept in ``tests/support/naive.py`` (tests
compare them): same operation order, numpy's pairwise summation where numpy sums (``_np_sum``),
sequential cumulative sums, ``searchsorted(side="right")`` and the same clipping, so assignments
are identical index for index.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = [
    "ASSIGNED",
    "SPREAD_ALL",
    "SPREAD_SPLIT",
    "ack_update",
    "assign_plan",
    "assign_spread",
    "probe_due",
    "release_where",
    "sent_update",
    "tick_due",
    "tick_update",
]

_UP, _SUSPECT, _DOWN = 0, 1, 2
# Frac part of the golden ratio: the Weyl sequence frac(offset + k·φ) is the most evenly
# spread of its kind (three-distance theorem), so every prefix of a batch is split in proportion.
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_PW_BLOCKSIZE = 128  # numpy's pairwise-summation block (PW_BLOCKSIZE in its umath loops)

#: :func:`assign_plan` results: the paths are written; or draw an offset and call
#: :func:`assign_spread` for every packet with the main weights; or split protected/unprotected.
ASSIGNED, SPREAD_ALL, SPREAD_SPLIT = 0, 1, 2


@njit(cache=True, nogil=True)
def lossy_paths(
    loss: np.ndarray, state: np.ndarray, loss_suspect: float, loss_ratio: float, out: np.ndarray
) -> None:
    """``out[p]``: path ``p``'s loss EWMA marks it SUSPECT — above ``loss_suspect``, and above
    ``loss_ratio`` times the lowest loss EWMA of the *other* UP paths. Loss that every path
    shows (random loss on the links, lost acknowledgements read as lost data) is no reason to
    move traffic off one of them, and with no other UP path there is nowhere better to move it:
    either way only silence takes a path out."""
    n = loss.shape[0]
    for p in range(n):
        best = np.inf
        for q in range(n):
            if q != p and state[q] == _UP and loss[q] < best:
                best = loss[q]
        out[p] = best < np.inf and loss[p] > loss_suspect and loss[p] > loss_ratio * best


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
    loss_ratio: float,
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
    # Evidence of delivery lifts a SUSPECT/DOWN path unless its loss is still high (judged on
    # every path's updated loss and the states before any lift).
    high = np.empty(n_paths, dtype=np.bool_)
    lossy_paths(loss, state, loss_suspect, loss_ratio, high)
    for p in range(n_paths):
        if acked[p] > 0.0 and not high[p] and state[p] != _UP:
            state[p] = _UP
            next_probe[p] = np.inf


@njit(cache=True, nogil=True)
def _np_block_sum(a: np.ndarray, lo: int, n: int) -> float:
    """numpy's pairwise-sum leaf (``n <= 128``): sequential below 8, else 8 accumulators."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    stop = n - n % 8
    while i < stop:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(cache=True, nogil=True)
def _np_sum(a: np.ndarray, lo: int, n: int) -> float:
    """``a[lo:lo + n].sum()`` exactly as numpy computes it: pairwise, halves rounded down to a
    multiple of 8, leaves of at most 128. The recursion is unrolled onto a stack: numba's
    cache does not reliably reload a recursive kernel."""
    if n <= _PW_BLOCKSIZE:
        return _np_block_sum(a, lo, n)
    f_lo = np.empty(64, dtype=np.int64)
    f_n = np.empty(64, dtype=np.int64)
    f_stage = np.empty(64, dtype=np.int64)
    vals = np.empty(64)
    sp = 0
    vp = 0
    f_lo[0], f_n[0], f_stage[0] = lo, n, 0
    sp = 1
    while sp > 0:
        top = sp - 1
        m = f_n[top]
        if m <= _PW_BLOCKSIZE:
            vals[vp] = _np_block_sum(a, f_lo[top], m)
            vp += 1
            sp -= 1
            continue
        n2 = m // 2
        n2 -= n2 % 8
        if f_stage[top] == 0:  # left half first
            f_stage[top] = 1
            f_lo[sp], f_n[sp], f_stage[sp] = f_lo[top], n2, 0
            sp += 1
        elif f_stage[top] == 1:  # then the right half
            f_stage[top] = 2
            f_lo[sp], f_n[sp], f_stage[sp] = f_lo[top] + n2, m - n2, 0
            sp += 1
        else:  # left + right
            vals[vp - 2] = vals[vp - 2] + vals[vp - 1]
            vp -= 1
            sp -= 1
    return vals[0]


@njit(cache=True, nogil=True)
def assign_plan(
    sizes: np.ndarray,
    protected: np.ndarray,
    now: float,
    state: np.ndarray,
    outstanding: np.ndarray,
    last_progress: np.ndarray,
    loss: np.ndarray,
    rate: np.ndarray,
    last_delivery: np.ndarray,
    suspect_after_s: float,
    down_after_s: float,
    loss_suspect: float,
    loss_ratio: float,
    suspect_share: float,
    min_rate: float,
    small_batch: int,
    weights: np.ndarray,
    out: np.ndarray,
) -> int:
    """First half of ``PathSet.assign`` for a non-empty batch: health, fallbacks, water level.

    Judges the paths' states as of ``now`` (the silence/loss transitions ``tick`` would make,
    without making them). With no UP path, or a small batch and no SUSPECT path, writes every
    packet's path into ``out`` and returns ``ASSIGNED``. Otherwise writes the water-filled main
    weights into ``weights[0]`` (and the SUSPECT trickle weights into ``weights[1]``) and returns
    ``SPREAD_ALL`` or ``SPREAD_SPLIT``: the caller then draws the interleaving offset and calls
    :func:`assign_spread` (the offset is drawn only then, so the generator's stream is that of
    the numpy formulation).
    """
    n_paths = state.shape[0]
    n_pkt = sizes.shape[0]
    eff = np.empty(n_paths, dtype=np.int64)
    high = np.empty(n_paths, dtype=np.bool_)
    lossy_paths(loss, state, loss_suspect, loss_ratio, high)
    n_up = 0
    n_suspect = 0
    for p in range(n_paths):
        s = np.int64(state[p])
        silent_for = now - last_progress[p]
        busy = outstanding[p] > 0.0
        to_down = (busy or s == _SUSPECT) and s != _DOWN and silent_for >= down_after_s
        to_suspect = (
            s == _UP and not to_down and ((busy and silent_for >= suspect_after_s) or high[p])
        )
        if to_down:
            s = _DOWN
        elif to_suspect:
            s = _SUSPECT
        eff[p] = s
        if s == _UP:
            n_up += 1
        elif s == _SUSPECT:
            n_suspect += 1

    if n_up == 0:
        # Best candidate: most recent delivery, then highest rate, then lowest index.
        want = _SUSPECT if n_suspect > 0 else -1
        best = -1
        for p in range(n_paths):
            if want >= 0 and eff[p] != want:
                continue
            if (
                best < 0
                or -last_delivery[p] < -last_delivery[best]
                or (-last_delivery[p] == -last_delivery[best] and -rate[p] < -rate[best])
            ):
                best = p
        for i in range(n_pkt):
            out[i] = best
        return ASSIGNED

    rates = np.empty(n_paths)
    for p in range(n_paths):
        rates[p] = max(rate[p], min_rate)

    if n_pkt <= small_batch and n_suspect == 0:
        # Tiny batches (a paced sender's usual case): each packet to the UP path whose backlog
        # would drain first — what water-filling converges to (the first such path on ties).
        backlog = outstanding.copy()
        for i in range(n_pkt):
            size = sizes[i]
            q = -1
            best_key = 0.0
            for p in range(n_paths):
                if eff[p] != _UP:
                    continue
                key = (backlog[p] + size) / rates[p]
                if q < 0 or key < best_key:
                    q = p
                    best_key = key
            out[i] = q
            backlog[q] += size
        return ASSIGNED

    # Water-fill the batch's bytes over the UP paths: the level L with
    # Σ max(0, L·rate - outstanding) = batch. With the paths sorted by drain time
    # outstanding / rate and the j fastest-draining active, L_j = (batch + Σ outstanding) / Σ rate;
    # the right j is the last whose L_j reaches its own drain time.
    batch = _np_sum(sizes, 0, n_pkt)
    up_idx = np.empty(n_up, dtype=np.int64)
    k = 0
    for p in range(n_paths):
        if eff[p] == _UP:
            up_idx[k] = p
            k += 1
    drain = np.empty(n_up)
    for j in range(n_up):
        drain[j] = outstanding[up_idx[j]] / rates[up_idx[j]]
    # Stable insertion sort by drain time (few paths); NaN-free since rates >= min_rate > 0.
    order = np.arange(n_up)
    for j in range(1, n_up):
        v = order[j]
        m = j - 1
        while m >= 0 and drain[order[m]] > drain[v]:
            order[m + 1] = order[m]
            m -= 1
        order[m + 1] = v
    cum_out = 0.0
    cum_rate = 0.0
    active = -1
    level_active = 0.0
    for j in range(n_up):
        q = up_idx[order[j]]
        cum_out += outstanding[q]
        cum_rate += rates[q]
        level = (batch + cum_out) / cum_rate
        if level >= drain[order[j]]:
            active = j
            level_active = level
    if active < 0:
        raise ValueError("no water level for this batch (negative or non-finite sizes?)")
    main = weights[0]
    main[:] = 0.0
    for j in range(n_up):
        q = up_idx[j]
        main[q] = max(level_active * rates[q] - outstanding[q], 0.0)
    if _np_sum(main, 0, n_paths) <= 0.0:  # zero-byte batch: plain proportional split
        for j in range(n_up):
            main[up_idx[j]] = rates[up_idx[j]]
    total = _np_sum(main, 0, n_paths)
    for p in range(n_paths):
        main[p] /= total

    all_protected = True
    for i in range(n_pkt):
        if not protected[i]:
            all_protected = False
            break
    if all_protected or n_suspect == 0 or suspect_share == 0.0:
        return SPREAD_ALL
    # Unprotected packets may also use SUSPECT paths, at a trickle split by their rates.
    other = weights[1]
    sus_rates = np.empty(n_suspect)
    k = 0
    for p in range(n_paths):
        other[p] = main[p] * (1.0 - suspect_share)
        if eff[p] == _SUSPECT:
            sus_rates[k] = rates[p]
            k += 1
    sus_total = _np_sum(sus_rates, 0, n_suspect)
    for p in range(n_paths):
        if eff[p] == _SUSPECT:
            other[p] = suspect_share * rates[p] / sus_total
    return SPREAD_SPLIT


@njit(cache=True, nogil=True)
def _cum_weights(w: np.ndarray) -> np.ndarray:
    cum = np.empty(w.shape[0])
    acc = 0.0
    for p in range(w.shape[0]):
        acc += w[p]
        cum[p] = acc
    last = cum[-1]
    for p in range(w.shape[0]):
        cum[p] /= last
    return cum


@njit(cache=True, nogil=True)
def _pick(cum: np.ndarray, u: float) -> int:
    """``min(searchsorted(cum, u, side="right"), len(cum) - 1)``."""
    lo = 0
    hi = cum.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if u < cum[mid]:
            hi = mid
        else:
            lo = mid + 1
    return min(lo, cum.shape[0] - 1)


@njit(cache=True, nogil=True)
def assign_spread(
    weights: np.ndarray, protected: np.ndarray, split: bool, offset: float, out: np.ndarray
) -> None:
    """Second half of ``PathSet.assign``: interleave the packets over the paths by weight.

    Packet ``i`` of a sequence takes the path where ``frac(offset + i·φ)`` falls in the
    normalised cumulative weights. Without ``split`` every packet follows ``weights[0]``;
    with it protected packets follow ``weights[0]`` and the others ``weights[1]``, each group
    its own sequence (numbered within the group), so both stay evenly spread in order.
    """
    n_pkt = out.shape[0]
    main = _cum_weights(weights[0])
    if not split:
        for i in range(n_pkt):
            x = offset + _GOLDEN * np.float64(i)
            out[i] = _pick(main, x - math.floor(x))  # exact frac part: x >= 0
        return
    other = _cum_weights(weights[1])
    k_p = 0
    k_u = 0
    for i in range(n_pkt):
        if protected[i]:
            x = offset + _GOLDEN * np.float64(k_p)
            out[i] = _pick(main, x - math.floor(x))
            k_p += 1
        else:
            x = offset + _GOLDEN * np.float64(k_u)
            out[i] = _pick(other, x - math.floor(x))
            k_u += 1


@njit(cache=True, nogil=True)
def sent_update(
    path: np.ndarray,
    sizes: np.ndarray,
    now: float,
    outstanding: np.ndarray,
    sent_total: np.ndarray,
    last_progress: np.ndarray,
) -> None:
    """Account packets handed to the network (``PathSet.on_sent``).

    A path that was idle (nothing outstanding) and gets bytes starts its silence clock now.
    Raises ValueError on a path index out of range, a negative size or misaligned arrays, before
    any state changes.
    """
    n_paths = outstanding.shape[0]
    n = path.shape[0]
    if sizes.shape[0] != n:
        raise ValueError("path and sizes must be 1-D and of equal length")
    for i in range(n):
        p = path[i]
        if p < 0 or p >= n_paths:
            raise ValueError("path indices out of range")
        if sizes[i] < 0:
            raise ValueError("sizes must be >= 0")
    sent = np.zeros(n_paths)
    for i in range(n):
        sent[path[i]] += sizes[i]
    for p in range(n_paths):
        was_idle = outstanding[p] <= 0.0
        outstanding[p] += sent[p]
        sent_total[p] += sent[p]
        if sent[p] > 0 and was_idle:
            last_progress[p] = now


@njit(cache=True, nogil=True)
def tick_update(
    now: float,
    state: np.ndarray,
    last_progress: np.ndarray,
    outstanding: np.ndarray,
    loss: np.ndarray,
    next_probe: np.ndarray,
    win_t0: np.ndarray,
    suspect_after_s: float,
    down_after_s: float,
    loss_suspect: float,
    loss_ratio: float,
    went_down: np.ndarray,
) -> int:
    """Silence and loss moves of ``PathSet.tick``: a path with bytes out (or already SUSPECT)
    and no progress for ``down_after_s`` goes DOWN (its outstanding bytes written off); an UP
    path silent for ``suspect_after_s`` with bytes out, or whose loss EWMA passed
    ``loss_suspect`` (:func:`lossy_paths`, judged on the states before this tick), goes
    SUSPECT. Either is probed at once unless a probe is scheduled. Writes the paths that went
    DOWN to ``went_down`` and returns how many."""
    high = np.empty(state.shape[0], dtype=np.bool_)
    lossy_paths(loss, state, loss_suspect, loss_ratio, high)
    n_down = 0
    for p in range(state.shape[0]):
        s = state[p]
        silent_for = now - last_progress[p]
        busy = outstanding[p] > 0.0
        if (busy or s == _SUSPECT) and s != _DOWN and silent_for >= down_after_s:
            state[p] = _DOWN
            next_probe[p] = min(next_probe[p], now)
            outstanding[p] = 0.0
            win_t0[p] = np.nan
            went_down[n_down] = p
            n_down += 1
        elif s == _UP and ((busy and silent_for >= suspect_after_s) or high[p]):
            state[p] = _SUSPECT
            next_probe[p] = min(next_probe[p], now)
    return n_down


@njit(cache=True, nogil=True)
def _silent_until(since: float, span: float) -> float:
    """The first time ``now`` with ``now - since >= span`` (tick_update's test): ``since +
    span`` rounded may fall one ulp short of it."""
    at = since + span
    while at - since < span:
        at = np.nextafter(at, np.inf)
    return at


@njit(cache=True, nogil=True)
def tick_due(
    state: np.ndarray,
    last_progress: np.ndarray,
    outstanding: np.ndarray,
    loss: np.ndarray,
    next_probe: np.ndarray,
    suspect_after_s: float,
    down_after_s: float,
    loss_suspect: float,
    loss_ratio: float,
    probes: bool,
) -> float:
    """The earliest time at which :func:`tick_update` would move a path or, with ``probes``,
    :func:`probe_due` find a probe due, as the paths stand (an ACK, a send or a loss changes
    them); ``-inf``: now (a loss EWMA past ``loss_suspect``), ``inf``: never. The same sums as
    those two, so at that time they act."""
    high = np.empty(state.shape[0], dtype=np.bool_)
    lossy_paths(loss, state, loss_suspect, loss_ratio, high)
    best = np.inf
    for p in range(state.shape[0]):
        s = state[p]
        busy = outstanding[p] > 0.0
        if (busy or s == _SUSPECT) and s != _DOWN:
            best = min(best, _silent_until(last_progress[p], down_after_s))
        if s == _UP:
            if high[p]:
                return -np.inf
            if busy:
                best = min(best, _silent_until(last_progress[p], suspect_after_s))
        elif probes:
            best = min(best, next_probe[p])
    return best


@njit(cache=True, nogil=True)
def probe_due(now: float, state: np.ndarray, next_probe: np.ndarray, interval_s: float) -> int:
    """Bit ``p`` set for every SUSPECT or DOWN path ``p`` whose next probe is due (and that
    probe rescheduled ``interval_s`` later): ``PathSet.probes_due``."""
    due = 0
    for p in range(state.shape[0]):
        if state[p] != _UP and now >= next_probe[p]:
            next_probe[p] = now + interval_s
            due |= 1 << p
    return due


@njit(cache=True, nogil=True)
def borrowed_rtos(
    srtt: np.ndarray,
    rttvar: np.ndarray,
    initial_rto: float,
    floor: float,
    fallback_srtt: float,
    fallback_rttvar: float,
    minimum: float,
) -> np.ndarray:
    """Per path ``srtt + 4·rttvar`` (``initial_rto`` before a sample), at least ``floor``; a
    path with no sample borrows the largest RTO of the sampled ones, and with none sampled
    every path takes ``fallback_srtt + 4·fallback_rttvar`` unless that is NaN; then at least
    ``minimum``. :meth:`PathSet.rtos` and ``PeerPaths.rtos``'s NumPy in one pass: a sender asks
    once per peer and tick, and for every control repeat."""
    n = srtt.shape[0]
    out = np.empty(n, dtype=np.float64)
    n_sampled = 0
    best = -np.inf
    for p in range(n):
        r = srtt[p] + 4.0 * rttvar[p]
        if math.isnan(r):
            r = initial_rto
        out[p] = max(r, floor)
        if not math.isnan(srtt[p]):
            n_sampled += 1
            best = max(best, out[p])
    if 0 < n_sampled < n:
        for p in range(n):
            if math.isnan(srtt[p]):
                out[p] = best
    elif n_sampled == 0 and not math.isnan(fallback_srtt):
        for p in range(n):
            out[p] = fallback_srtt + 4.0 * fallback_rttvar
    for p in range(n):
        out[p] = max(out[p], minimum)
    return out


@njit(cache=True, nogil=True)
def release_where(
    outstanding: np.ndarray, state: np.ndarray, value: int, path: np.ndarray, sizes: np.ndarray
) -> int:
    """``PathSet.on_released(path[state == value], sizes[state == value])`` in one pass: the
    packets' bytes summed per path in packet order (``np.bincount``'s sums), then taken out of
    ``outstanding`` (in place), never below 0. Returns 0, or -1 for a path index out of range
    or a negative size (``outstanding`` is then left as it was)."""
    n_paths = outstanding.shape[0]
    per = np.zeros(n_paths)
    for i in range(state.shape[0]):
        if state[i] == value:
            q = path[i]
            if q < 0 or q >= n_paths or sizes[i] < 0:
                return -1
            per[q] += sizes[i]
    for q in range(n_paths):
        outstanding[q] = max(outstanding[q] - per[q], 0.0)
    return 0
