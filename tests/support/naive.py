"""Plain-NumPy references for every kernel in :mod:`gradlane.transport.kernels`.

Each one is written for obviousness, not speed: packets are built with :func:`packet.encode`,
received ones judged with :func:`packet.validate`, norms taken in float64, the Hadamard transform
as an explicit matrix product. The kernel tests hold the numba kernels to these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from gradlane.transport.wire.header import (
    HEADER_SIZE,
    N_REASONS,
    DType,
    Header,
    Kind,
    Reason,
    SessionSpec,
    TransferSpec,
    decode_header,
    encode,
    validate,
)
from gradlane.transport.wire.tag import TagKey

from tests.support.codec_ref import E4M3_TABLE_REF

__all__ = [
    "after_sent",
    "apply_ack",
    "as_float32",
    "chunk_norms",
    "fit_chunks",
    "hadamard_forward",
    "hadamard_inverse",
    "local_sum",
    "pack",
    "path_ack_update",
    "path_assign",
    "path_lossy",
    "path_on_sent",
    "pick_chunks",
    "place",
    "reduce",
    "signs",
    "wire_bits",
]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def wire_bits(src: np.ndarray, dtype: DType) -> np.ndarray:
    """The raw wire words of a shard: uint32 for F32, uint16 for F16/BF16."""
    return np.ascontiguousarray(src).view(np.uint32 if dtype == DType.F32 else np.uint16)


def as_float32(bits: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 values of wire words (f16 converted by NumPy, bf16 as the high half of f32)."""
    if dtype == DType.F32:
        return bits.view(np.float32).copy()
    if dtype == DType.F16:
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def chunk_norms(src: np.ndarray, dtype: DType, chunk_elems: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-chunk (L2 norm, max |x|) in float32, computed in float64."""
    values = as_float32(wire_bits(src, dtype), dtype).astype(np.float64)
    n_chunks = -(-values.shape[0] // chunk_elems)
    norms = np.empty(n_chunks, dtype=np.float32)
    maxabs = np.empty(n_chunks, dtype=np.float32)
    for c in range(n_chunks):
        part = values[c * chunk_elems : (c + 1) * chunk_elems]
        norms[c] = np.float32(np.sqrt(np.sum(part * part)))
        maxabs[c] = np.float32(np.max(np.abs(part)))
    return norms, maxabs


def pack(
    src: np.ndarray,
    *,
    dtype: DType,
    header: Header,
    chunk_elems: int,
    key: TagKey,
    prio: np.ndarray | int = 0,
    flags: np.ndarray | int = 0,
    first_chunk: int = 0,
    norms: np.ndarray | None = None,
) -> list[bytes]:
    """The datagrams :func:`gradlane.transport.kernels.pack` must produce, built with
    ``packet.encode``.

    ``norms`` overrides the header norms (the kernel's float32 sum of squares may differ from
    this float64 one in the last bits, and the tag covers the norm).
    """
    bits = wire_bits(src, dtype)
    ref_norms, _ = chunk_norms(src, dtype, chunk_elems)
    if norms is not None:
        ref_norms = norms
    out = []
    for c in range(-(-bits.shape[0] // chunk_elems)):
        part = bits[c * chunk_elems : (c + 1) * chunk_elems]
        h = header.with_(
            chunk=first_chunk + c,
            count=part.shape[0],
            dtype=int(dtype),
            prio=int(prio[c]) if isinstance(prio, np.ndarray) else int(prio),
            flags=int(flags[c]) if isinstance(flags, np.ndarray) else int(flags),
            norm=float(ref_norms[c]),
            aux=0,
        )
        out.append(encode(h, part, key))
    return out


def _verdict(
    data: bytes, session: SessionSpec, transfer: TransferSpec, received: np.ndarray
) -> tuple[Reason, Header | None]:
    reason = validate(data, session, transfer)
    if reason != Reason.OK:
        return reason, None
    h = decode_header(data)
    if h.kind != Kind.DATA:
        return Reason.BAD_KIND, None
    if received[h.src - transfer.src_lo, h.chunk]:
        return Reason.DUPLICATE, None
    return Reason.OK, h


def reduce(
    datagrams: Sequence[bytes],
    accum: np.ndarray,
    contrib: np.ndarray,
    received: np.ndarray,
    *,
    session: SessionSpec,
    transfer: TransferSpec,
    counters: np.ndarray,
) -> list[Reason]:
    """``reduce_into`` on a list of datagrams, one ``validate`` at a time; returns the verdicts."""
    verdicts = []
    for data in datagrams:
        reason, h = _verdict(data, session, transfer, received)
        if h is not None:
            off = h.chunk * transfer.chunk_elems
            accum[off : off + h.count] += payload_values(data, h)
            contrib[h.chunk] += 1
            received[h.src - transfer.src_lo, h.chunk] = 1
        counters[reason] += 1
        verdicts.append(reason)
    return verdicts


def place(
    datagrams: Sequence[bytes],
    out: np.ndarray,
    received: np.ndarray,
    *,
    session: SessionSpec,
    transfer: TransferSpec,
    counters: np.ndarray,
    contrib: np.ndarray | None = None,
) -> list[Reason]:
    """``place_into`` on a list of datagrams; ``out`` holds raw wire words."""
    verdicts = []
    bits: np.ndarray = out.view(_wire_type(transfer.dtype))
    for data in datagrams:
        reason, h = _verdict(data, session, transfer, received)
        if h is not None:
            off = h.chunk * transfer.chunk_elems
            if h.dtype == transfer.dtype:
                bits[off : off + h.count] = np.frombuffer(
                    data[HEADER_SIZE:], dtype=_wire_type(transfer.dtype)
                )
            else:  # a lossy-format chunk of a float32 transfer: its float32 values
                bits[off : off + h.count] = payload_values(data, h).view(np.uint32)
            if contrib is not None:
                contrib[h.chunk] += 1
            received[h.src - transfer.src_lo, h.chunk] = 1
        counters[reason] += 1
        verdicts.append(reason)
    return verdicts


def payload_values(data: bytes, h: Header) -> np.ndarray:
    """The float32 values of a valid DATA packet's payload, in whatever format it carries
    (E4M3: the code's value times the scale in ``aux``)."""
    raw = data[HEADER_SIZE:]
    if h.dtype == DType.E4M3:
        scale = np.uint32(h.aux).view(np.float32)
        return (E4M3_TABLE_REF[np.frombuffer(raw, dtype=np.uint8)] * scale).astype(np.float32)
    return as_float32(np.frombuffer(raw, dtype=_wire_type(h.dtype)), DType(h.dtype))


def _wire_type(dtype: int) -> type:
    return np.uint32 if dtype == DType.F32 else np.uint16


def empty_counters() -> np.ndarray:
    """A fresh counter array, one int64 per Reason."""
    return np.zeros(N_REASONS, dtype=np.int64)


def _splitmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def signs(n: int, seed: int) -> np.ndarray:
    """The ±1 diagonal of ``D`` for elements 0..n-1 (ARCHITECTURE: counter hash of seed, index)."""
    key = _splitmix64(seed)
    out = np.empty(n, dtype=np.float64)
    for g in range(-(-n // 64)):
        h = _splitmix64((key + (g + 1) * _GAMMA) & _MASK64)
        for i in range(g * 64, min(n, g * 64 + 64)):
            out[i] = -1.0 if (h >> (i & 63)) & 1 else 1.0
    return out


def _hadamard_matrix(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def _blocks(n: int, block: int) -> list[tuple[int, int]]:
    out = []
    pos = 0
    size = block
    while pos < n:
        while size > n - pos:
            size //= 2
        out.append((pos, size))
        pos += size
    return out


def hadamard_forward(x: np.ndarray, *, seed: int, block: int = 1024) -> np.ndarray:
    """``H·D·x`` blockwise in float64 (a new array)."""
    d = signs(x.shape[0], seed)
    y = np.empty(x.shape[0], dtype=np.float64)
    for pos, size in _blocks(x.shape[0], block):
        seg = slice(pos, pos + size)
        y[seg] = _hadamard_matrix(size) @ (d[seg] * x[seg].astype(np.float64))
    return y


def hadamard_inverse(y: np.ndarray, *, seed: int, block: int = 1024) -> np.ndarray:
    """``D·H·y`` blockwise in float64 (a new array)."""
    d = signs(y.shape[0], seed)
    x = np.empty(y.shape[0], dtype=np.float64)
    for pos, size in _blocks(y.shape[0], block):
        seg = slice(pos, pos + size)
        x[seg] = d[seg] * (_hadamard_matrix(size) @ y[seg].astype(np.float64))
    return x


# -- PathSet acknowledgement update: the numpy formulation the compiled kernel must match ---------
def path_lossy(loss: np.ndarray, state: np.ndarray, cfg: Any) -> np.ndarray:
    """Per path: its loss EWMA is above ``loss_suspect`` and above ``loss_ratio`` times the
    lowest loss EWMA of the other UP paths (False with no other UP path)."""
    up_loss = np.where(state == 0, loss, np.inf)
    best_other = np.array(
        [np.min(np.delete(up_loss, p), initial=np.inf) for p in range(loss.shape[0])]
    )
    with np.errstate(invalid="ignore"):
        return (
            np.isfinite(best_other)
            & (loss > cfg.loss_suspect)
            & (loss > cfg.loss_ratio * best_other)
        )


def path_ack_update(
    ps: Any, path: np.ndarray, sizes: np.ndarray, now: float, rtt: Any, counted: Any = None
) -> None:
    """Reference of ``PathSet.on_acked``: whole-array numpy over the paths, on ``ps``'s arrays."""
    cfg = ps.config
    n = ps.n_paths
    path_a = np.asarray(path, dtype=np.int64)
    acked = np.bincount(path_a, weights=np.asarray(sizes, dtype=np.float64), minlength=n)
    leaving = (
        acked
        if counted is None
        else np.bincount(path_a, weights=np.asarray(counted, dtype=np.float64), minlength=n)
    )
    got = acked > 0
    counts = np.bincount(path_a, minlength=n)
    ps._outstanding[:] = np.maximum(ps._outstanding - leaving, 0.0)
    ps._acked_total += acked
    ps._last_delivery[:] = np.where(got, now, ps._last_delivery)
    ps._last_progress[:] = np.where(got, now, ps._last_progress)
    ps._loss *= (1.0 - cfg.loss_alpha) ** counts
    if rtt is not None:
        r = np.asarray(rtt, dtype=np.float64)
        ok = np.isfinite(r) & (r >= 0.0)
        p, r = path_a[ok], r[ok]
        if p.size:
            cnt = np.bincount(p, minlength=n)
            has = cnt > 0
            mean = np.bincount(p, weights=r, minlength=n)[has] / cnt[has]
            np.minimum.at(ps._min_rtt, p, r)
            a = cfg.rtt_alpha
            srtt, var = ps._srtt[has], ps._rttvar[has]
            first = np.isnan(srtt)
            new_var = np.where(first, mean / 2.0, (1 - 2 * a) * var + 2 * a * np.abs(srtt - mean))
            ps._srtt[has] = np.where(first, mean, (1.0 - a) * srtt + a * mean)
            ps._rttvar[has] = new_var
    open_ = ~np.isnan(ps._win_t0)
    ps._win_bytes += np.where(open_, acked, 0.0)
    elapsed = np.where(open_, now - np.nan_to_num(ps._win_t0), 0.0)
    window = np.maximum(cfg.rate_window_s, np.nan_to_num(ps._srtt, nan=0.0))
    drained = ps._outstanding <= 0.0
    close = open_ & got & ((elapsed >= window) | drained)
    sample_ok = close & (elapsed > 0.0)
    if sample_ok.any():
        sample = np.divide(ps._win_bytes, elapsed, out=np.zeros(n), where=sample_ok)
        smoothed = (1.0 - cfg.rate_alpha) * ps._rate + cfg.rate_alpha * sample
        smoothed = np.where(drained, np.maximum(ps._rate, smoothed), smoothed)
        ps._rate[:] = np.where(sample_ok, np.maximum(smoothed, 1.0), ps._rate)
    restart = got & ~drained & (close | ~open_)
    ps._win_t0[:] = np.where(restart, now, np.where(close, np.nan, ps._win_t0))
    ps._win_bytes[:] = np.where(close | restart, 0.0, ps._win_bytes)
    lift = got & ~path_lossy(ps._loss, ps._state, cfg) & (ps._state != 0)
    ps._state[lift] = 0
    ps._next_probe[lift] = np.inf


def local_sum(srcs: Sequence[np.ndarray], dtype: DType) -> np.ndarray:
    """float32 sum of wire-word buckets, added one by one in list order (as the kernel does)."""
    out = as_float32(wire_bits(srcs[0], dtype), dtype)
    for s in srcs[1:]:
        out = (out + as_float32(wire_bits(s, dtype), dtype)).astype(np.float32)
    return out


# -- PathSet assignment and send accounting: the numpy formulations the kernels must match --------
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_SMALL_BATCH = 4


def path_assign(ps: Any, now: float, sizes: np.ndarray, protected: np.ndarray) -> np.ndarray:
    """Reference of ``PathSet.assign`` on ``ps``'s arrays (drawing its offset from ``ps._rng``).

    Effective states as of ``now``, the all-down / no-UP fallback to the best path, the greedy
    small-batch branch, then water-filling and golden-ratio interleaving, with a separate
    sequence for unprotected packets when SUSPECT paths take a trickle.
    """
    cfg = ps.config
    sizes_a = np.asarray(sizes, dtype=np.float64)
    prot = np.asarray(protected, dtype=bool)
    n_pkt = sizes_a.shape[0]
    out = np.empty(n_pkt, dtype=np.int64)
    if n_pkt == 0:
        return out
    to_suspect, to_down = _path_transitions(ps, now)
    state = ps._state.copy()
    state[to_suspect] = 1
    state[to_down] = 2
    up = state == 0
    suspect = state == 1
    if not up.any():
        out.fill(_path_best(ps, suspect if suspect.any() else np.ones(ps.n_paths, bool)))
        return out

    rate = np.maximum(ps._rate, 1.0)
    if n_pkt <= _SMALL_BATCH and not suspect.any():
        backlog = ps._outstanding.tolist()
        rates = rate.tolist()
        usable = np.flatnonzero(up).tolist()
        for i, size in enumerate(sizes_a.tolist()):
            q = min(usable, key=lambda p: (backlog[p] + size) / rates[p])
            out[i] = q
            backlog[q] += size
        return out
    batch = float(sizes_a.sum())
    share = _water_fill(rate[up], ps._outstanding[up], batch)
    main = np.zeros(ps.n_paths)
    main[up] = share
    if main.sum() <= 0.0:  # zero-byte batch: plain proportional split
        main[up] = rate[up]
    main /= main.sum()

    offset = float(ps._rng.random())
    if prot.all() or not suspect.any() or cfg.suspect_share == 0.0:
        out[:] = _interleave(main, n_pkt, offset)
        return out
    other = main * (1.0 - cfg.suspect_share)
    other[suspect] = cfg.suspect_share * rate[suspect] / rate[suspect].sum()
    p_idx = np.flatnonzero(prot)
    u_idx = np.flatnonzero(~prot)
    out[p_idx] = _interleave(main, p_idx.shape[0], offset)
    out[u_idx] = _interleave(other, u_idx.shape[0], offset)
    return out


def path_on_sent(ps: Any, path: np.ndarray, sizes: np.ndarray, now: float) -> None:
    """Reference of ``PathSet.on_sent``."""
    sent = np.bincount(
        np.asarray(path, dtype=np.int64),
        weights=np.asarray(sizes, dtype=np.float64),
        minlength=ps.n_paths,
    )
    was_idle = ps._outstanding <= 0.0
    got = sent > 0
    ps._outstanding += sent
    ps._sent_total += sent
    ps._last_progress[:] = np.where(got & was_idle, now, ps._last_progress)


def _path_transitions(ps: Any, now: float) -> tuple[np.ndarray, np.ndarray]:
    cfg = ps.config
    silent_for = now - ps._last_progress
    busy = ps._outstanding > 0.0
    up = ps._state == 0
    suspect = ps._state == 1
    to_down = (busy | suspect) & (ps._state != 2) & (silent_for >= cfg.down_after_s)
    to_suspect = (
        up
        & ~to_down
        & ((busy & (silent_for >= cfg.suspect_after_s)) | path_lossy(ps._loss, ps._state, cfg))
    )
    return to_suspect, to_down


def _path_best(ps: Any, candidates: np.ndarray) -> int:
    """Most recent delivery, then highest rate."""
    idx = np.flatnonzero(candidates)
    order = np.lexsort((-ps._rate[idx], -ps._last_delivery[idx]))
    return int(idx[order[0]])


def _water_fill(rate: np.ndarray, outstanding: np.ndarray, batch: float) -> np.ndarray:
    """Bytes per path so that ``(outstanding + x) / rate`` is equal on every path that gets any."""
    drain = outstanding / rate
    order = np.argsort(drain, kind="stable")
    cum_out = np.cumsum(outstanding[order])
    cum_rate = np.cumsum(rate[order])
    level = (batch + cum_out) / cum_rate
    active = int(np.flatnonzero(level >= drain[order])[-1])
    return np.maximum(level[active] * rate - outstanding, 0.0)


def _interleave(weights: np.ndarray, n: int, offset: float) -> np.ndarray:
    """``n`` path indices in proportion to ``weights``, evenly spread along the sequence."""
    cum = np.cumsum(weights)
    cum /= cum[-1]
    u = np.modf(offset + _GOLDEN * np.arange(n, dtype=np.float64))[0]
    idx = np.searchsorted(cum, u, side="right")
    return np.minimum(idx, weights.shape[0] - 1).astype(np.int64)


# -- SenderCore.on_ack's array work, in NumPy: what gradlane.transport.kernels._ack matches --
_INFLIGHT, _LOST, _ACKED, _ABANDONED = 1, 2, 3, 4


def apply_ack(
    state: np.ndarray,
    tx: np.ndarray,
    sent_at: np.ndarray,
    path: np.ndarray,
    prio: np.ndarray,
    counts: np.ndarray,
    lengths: np.ndarray,
    bits: np.ndarray,
    *,
    base: int,
    trigger: int,
    now: float,
    n_paths: int,
    n_classes: int,
    reorder_window_s: float,
) -> dict[str, Any]:
    """Reference of ``kernels.apply_ack``, in whole-array NumPy (``state`` written in place);
    returns :class:`~gradlane.transport.kernels.AckResult`'s fields by name."""
    end = max(min(base + bits.shape[0], state.shape[0]), base)  # on_ack never gets base >= end
    st = state[base:end]
    newly = bits[: end - base] & ((st == _INFLIGHT) | (st == _LOST) | (st == _ABANDONED))
    idx = np.flatnonzero(newly) + base
    was = state[idx]
    n_lost = int(np.count_nonzero(was == _LOST))
    n_inflight = int(np.count_nonzero(was == _INFLIGHT))
    abandoned = int(counts[idx[was == _ABANDONED]].sum())
    state[idx] = _ACKED
    sizes = lengths[idx].astype(np.int64)
    first_tx = tx[idx] == 1
    rtt = np.where(first_tx, now - sent_at[idx], np.nan)
    trigger_first = bool(base <= trigger < end and newly[trigger - base] and tx[trigger] == 1)
    paths = path[idx].astype(np.int64)
    counted = np.where(was == _INFLIGHT, sizes, 0)
    path_bytes = np.zeros(n_paths, dtype=np.int64)
    path_hit = np.zeros(n_paths, dtype=bool)
    for q in np.unique(paths).tolist():
        path_bytes[q] = int(sizes[paths == q].sum())
        path_hit[q] = True
    lost = np.empty(0, dtype=np.int64)
    if idx.size:
        lane = path.astype(np.int64) * n_classes + prio
        newest = np.full(n_paths * n_classes, -np.inf)
        with np.errstate(invalid="ignore"):  # NaN send times (only in the tests) win
            np.maximum.at(newest, lane[idx], sent_at[idx])
        limit = newest[lane] - reorder_window_s
        lost = np.flatnonzero((state == _INFLIGHT) & (sent_at < limit))
    return {
        "idx": idx,
        "sizes": sizes,
        "rtt": rtt,
        "paths": paths,
        "counted": counted,
        "n_lost": n_lost,
        "n_inflight": n_inflight,
        "abandoned_elems": abandoned,
        "trigger_first": trigger_first,
        "path_bytes": path_bytes,
        "path_hit": path_hit,
        "lost": lost,
    }


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
    """NumPy reference of ``kernels._ack.note_lanes``: acknowledged chunks advance their lanes'
    newest delivered sequence (and stamp the lanes that advance)."""
    lanes = path[acked].astype(np.int64) * n_classes + prio[acked]
    newest = np.full(lane_seq.shape[0], -1, dtype=np.int64)
    np.maximum.at(newest, lanes, tx_seq[acked])
    ahead = newest > lane_seq
    lane_seq[ahead] = newest[ahead]
    lane_at[ahead] = now


def pick_chunks(
    state: np.ndarray,
    prio: np.ndarray,
    order: np.ndarray,
    cursor: int,
    n_lost: int,
    cls: int,
    last: int,
    budget: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The sender's choice of a batch (``kernels._pick.pick_chunks``): the LOST chunks of class
    ``cls`` (index order, at most ``budget``), then new chunks of ``order[cursor:]`` up to the
    first outside ``cls .. last``, ``budget`` in all. Returns (retransmissions, new chunks)."""
    lost = 2  # outgoing.LOST
    retx = np.empty(0, dtype=np.int64)
    if n_lost:
        retx = ((state == lost) & (prio == cls)).nonzero()[0][:budget]
    fresh = np.empty(0, dtype=np.int64)
    if retx.size < budget and cursor < order.shape[0]:
        window = order[cursor : cursor + (budget - retx.size)]
        other = ((prio[window] < cls) | (prio[window] > last)).nonzero()[0]
        fresh = window[: other[0]] if other.size else window
    return retx, fresh


def fit_chunks(lengths: np.ndarray, chunks: np.ndarray, avail: int) -> int:
    """How many of ``chunks`` fit in ``avail`` bytes, at least one (``kernels._pick``)."""
    if not chunks.size:
        return 0
    cum = np.cumsum(lengths[chunks].astype(np.int64))
    if cum[-1] <= avail:
        return int(cum.shape[0])
    return max(int(np.searchsorted(cum, int(avail), side="right")), 1)


def after_sent(
    state: np.ndarray,
    order: np.ndarray,
    cursor: int,
    tx_seq: np.ndarray,
    next_seq: int,
    chunks: np.ndarray,
    lengths: np.ndarray,
    chunk_bytes: int,
) -> tuple[int, np.ndarray, np.ndarray]:
    """Sequence numbers into ``tx_seq``; returns the cursor past what is no longer PENDING,
    and each chunk's payload offset and size (``kernels._pick.after_sent``)."""
    tx_seq[chunks] = np.arange(next_seq, next_seq + chunks.shape[0])
    pending = (state[order[cursor:]] == 0).nonzero()[0]
    cursor = cursor + int(pending[0]) if pending.size else order.shape[0]
    starts = chunks.astype(np.int64) * chunk_bytes
    sizes = lengths[chunks].astype(np.int64) - HEADER_SIZE
    return cursor, starts, sizes
