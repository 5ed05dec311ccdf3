"""The receive path's bookkeeping kernels (transport/_kernels_batch: note_arrivals, the pass-end
gaps) against the NumPy they replaced, on random inputs."""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels.batch import note_arrivals, pass_end_gaps
from gradlane.transport.wire.header import Flags, Reason
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_OK, _DUP = int(Reason.OK), int(Reason.DUPLICATE)


def reference(arena, lengths, rows, verdicts, paths, src_lo, now, ack_at, state):
    """receiver.on_data's ACK bookkeeping as it was written in NumPy (plus the pass end)."""
    new_since_ack, trigger, trigger_at, path, ack_due, pass_end = state
    judged = rows[(verdicts == _OK) | (verdicts == _DUP)]
    hdr = arena[judged, :48]
    src = hdr[:, 20].astype(np.int64) | (hdr[:, 21].astype(np.int64) << 8)
    r = src - src_lo
    flagged = ((hdr[:, 4] & int(Flags.PASS_END)) != 0) & (r >= 0) & (r < pass_end.shape[0])
    fresh = np.unique(r[flagged])
    fresh = fresh[np.isinf(pass_end[fresh])]
    pass_end[fresh] = now
    ok = rows[verdicts == _OK]
    hdr = arena[ok, :48]
    src = hdr[:, 20].astype(np.int64) | (hdr[:, 21].astype(np.int64) << 8)
    chunk = (hdr[:, 24:28].astype(np.int64) << np.array([0, 8, 16, 24])).sum(axis=1)
    r = src - src_lo
    np.add.at(new_since_ack, r, 1)
    trigger[r] = chunk
    trigger_at[r] = now
    path[r] = paths[ok]
    first = np.isinf(ack_due[r])
    ack_due[r[first]] = ack_at
    dup = rows[verdicts == _DUP]
    hdr = arena[dup, :48]
    src = hdr[:, 20].astype(np.int64) | (hdr[:, 21].astype(np.int64) << 8)
    r = src - src_lo
    valid = (r >= 0) & (r < new_since_ack.shape[0])
    ack_due[r[valid]] = np.minimum(ack_due[r[valid]], ack_at)
    return int(ok.size), int(dup.size), int(lengths[ok].sum()), int(fresh.size)


@settings(max_examples=150, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    items=st.lists(
        st.tuples(
            st.integers(0, 3),  # sender row
            st.integers(0, 2**32 - 1),  # chunk
            st.sampled_from([_OK, _OK, _DUP, int(Reason.BAD_TAG), int(Reason.CHUNK_RANGE)]),
            st.integers(0, 1),  # path
            st.integers(48, 200),  # length
            st.booleans(),  # flagged PASS_END
        ),
        min_size=0,
        max_size=40,
    ),
    due=st.lists(st.sampled_from([np.inf, 0.5, 2.0]), min_size=4, max_size=4),
    ended=st.lists(st.sampled_from([np.inf, 0.25]), min_size=4, max_size=4),
    subset=st.booleans(),
)
def test_note_arrivals_equals_the_numpy_it_replaced(items, due, ended, subset):
    src_lo = 3
    n = len(items)
    arena = np.zeros((n + 2, 64), dtype=np.uint8)
    lengths = np.zeros(n + 2, dtype=np.int32)
    paths = np.zeros(n + 2, dtype=np.int64)
    verdicts = np.zeros(n, dtype=np.uint8)
    for i, (r, chunk, v, q, ln, end) in enumerate(items):
        arena[i, 4] = int(Flags.PASS_END | Flags.PROTECTED) if end else int(Flags.PROTECTED)
        arena[i, 20:22] = np.frombuffer((r + src_lo).to_bytes(2, "little"), np.uint8)
        arena[i, 24:28] = np.frombuffer(chunk.to_bytes(4, "little"), np.uint8)
        verdicts[i], paths[i], lengths[i] = v, q, ln
    rows = np.arange(n, dtype=np.int64)
    if subset:  # rows of an arena, not all of them, in any order
        rows = rows[::-1].copy()
        verdicts = verdicts[::-1].copy()

    def state():
        return (np.zeros(4, np.int64), np.full(4, -1, np.int64), np.zeros(4), np.full(4, 9),
                np.array(due, dtype=np.float64), np.array(ended, dtype=np.float64))  # fmt: skip

    want_state, got_state = state(), state()
    want = reference(arena, lengths, rows, verdicts, paths, src_lo, 1.0, 1.25, want_state)
    got = note_arrivals(arena, lengths, rows, verdicts, paths, src_lo, 1.0, 1.25, *got_state)
    assert tuple(got) == want
    for w, g in zip(want_state, got_state, strict=True):
        np.testing.assert_array_equal(g, w)


def gaps_reference(received, rows, pass_end, trigger_at, fin, drained_at):
    """receiver._read_to_pass_end and _refresh_check's earliest gap as written in NumPy."""
    complete_rows = (received[rows] != 0).all(axis=1)
    ended = pass_end[rows]
    ready = drained_at >= np.maximum(ended, trigger_at[rows])
    gap = ready & np.isfinite(ended) & ~complete_rows & ~fin[rows]
    first = float(pass_end[rows][gap].min()) if gap.any() else np.inf
    return gap, first


@settings(max_examples=400, derandomize=True, deadline=None)
@given(
    st.integers(0, 6),
    st.integers(0, 12),
    st.integers(0, 2**32 - 1),
    st.sampled_from([-np.inf, 0.0, 0.5, 1.0, 2.0, np.inf]),
)
def test_pass_end_gaps_equal_the_numpy_they_replaced(n_src, n, seed, drained_at):
    rng = np.random.default_rng(seed)
    received = (rng.random((n_src, n)) < 0.8).astype(np.uint8)
    rows = rng.permutation(n_src)[: rng.integers(0, n_src + 1)].astype(np.int64)
    times = np.array([0.0, 0.5, 1.0, 1.5, np.inf])
    pass_end = rng.choice(times, n_src)
    trigger_at = rng.choice(times[:-1], n_src)
    fin = rng.random(n_src) < 0.2
    want_gap, want_first = gaps_reference(received, rows, pass_end, trigger_at, fin, drained_at)
    gap = np.empty(rows.shape[0], dtype=bool)
    first = pass_end_gaps(received, rows, pass_end, trigger_at, fin, drained_at, gap)
    np.testing.assert_array_equal(gap, want_gap)
    assert first == want_first
