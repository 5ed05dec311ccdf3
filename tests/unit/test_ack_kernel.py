"""The compiled ACK pass (kernels.apply_ack) against the numpy on_ack it replaced (naive.py).

Deterministic: derandomized Hypothesis draws the shape of a transfer and a seed, a seeded
generator fills its arrays. Every output and the state array are compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.transport import kernels
from gradlane.transport.core import outgoing
from gradlane.transport.kernels import _ack as _kernels_ack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import naive

SETTINGS = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
#: Send times on a coarse grid, so lanes tie and chunks sit exactly at the RACK limit.
_GRID = np.array([0.0, -0.0, 1e-4, 2e-4, 3e-4, 5e-4, 1e-3, 1.5e-3, 2e-3])
#: Transfers of (chunks, paths, classes, seed) the kernel property tests draw.
TRANSFER_SHAPES = given(
    st.integers(1, 60),  # chunks in the transfer
    st.integers(1, 3),  # paths
    st.integers(1, 4),  # classes
    st.integers(0, 2**31),  # seed
)


def transfer(seed: int, n: int, n_paths: int, n_classes: int, nan_times: bool) -> dict:
    rng = np.random.default_rng(seed)
    if rng.random() < 0.5:
        sent_at = rng.choice(_GRID, n)
    else:
        sent_at = rng.uniform(0.0, 2e-3, n)
    if nan_times:
        sent_at[rng.random(n) < 0.1] = np.nan
    return {
        "state": rng.integers(0, 5, n).astype(np.uint8),
        "tx": rng.integers(0, 4, n).astype(np.uint8),
        "sent_at": sent_at,
        "path": rng.integers(0, n_paths, n).astype(np.int16),
        "prio": rng.integers(0, n_classes, n).astype(np.uint8),
        "counts": rng.integers(1, 2048, n).astype(np.int64),
        "lengths": rng.integers(48, 9000, max(n, 1)).astype(np.int32),
    }


def same(a: object, b: object, name: str) -> None:
    if isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype, name
        assert a.shape == b.shape, name
        if a.dtype == np.float64:  # bit for bit: NaN and the sign of zero included
            a, b = a.view(np.uint64), b.view(np.uint64)
        np.testing.assert_array_equal(a, b, err_msg=name)
    else:
        assert type(a) is type(b) or isinstance(a, int | bool), name
        assert a == b, name


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 160),
    n_paths=st.integers(1, 4),
    n_classes=st.integers(1, 4),
    nan_times=st.booleans(),
    density=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    span=st.integers(0, 200),
    base_frac=st.floats(0.0, 1.1),
    trigger_off=st.integers(-3, 200),
    window=st.sampled_from([0.0, 1e-4, 5e-4, 2.5e-4, 1e-2]),
)
def test_apply_ack_matches_the_numpy_on_ack(
    seed: int,
    n: int,
    n_paths: int,
    n_classes: int,
    nan_times: bool,
    density: float,
    span: int,
    base_frac: float,
    trigger_off: int,
    window: float,
) -> None:
    fast = transfer(seed, n, n_paths, n_classes, nan_times)
    ref = {k: v.copy() for k, v in fast.items()}
    bits = np.random.default_rng(seed + 1).random(span) < density
    base = int(base_frac * n)
    kw = {
        "base": base,
        "trigger": base + trigger_off,
        "now": 3e-3,
        "n_paths": n_paths,
        "n_classes": n_classes,
        "reorder_window_s": window,
    }
    got = kernels.apply_ack(kernels.SentChunks(**fast), bits, **kw)
    want = naive.apply_ack(**ref, bits=bits, **kw)
    for name, value in want.items():
        same(getattr(got, name), value, name)
    for name in fast:  # only state is written, exactly as the reference writes it
        same(fast[name], ref[name], name)


def test_chunk_states_agree_with_outgoing() -> None:
    assert (_kernels_ack.INFLIGHT, _kernels_ack.LOST) == (outgoing.INFLIGHT, outgoing.LOST)
    assert (_kernels_ack.ACKED, _kernels_ack.ABANDONED) == (outgoing.ACKED, outgoing.ABANDONED)


def test_nothing_newly_acknowledged_writes_nothing_and_skips_rack() -> None:
    a = transfer(3, 20, 2, 2, False)
    a["state"][:] = outgoing.ACKED
    a["state"][10:] = outgoing.INFLIGHT
    before = a["state"].copy()
    r = kernels.apply_ack(kernels.SentChunks(**a), np.ones(10, bool), base=0, trigger=0, now=1.0,
                          n_paths=2, n_classes=2, reorder_window_s=0.0)  # fmt: skip
    assert r.idx.size == 0 and r.lost.size == 0 and not r.path_hit.any()
    np.testing.assert_array_equal(a["state"], before)


def test_apply_ack_rejects_bad_arguments() -> None:
    good = transfer(0, 8, 2, 2, False)
    kw = {"base": 0, "trigger": 0, "now": 1.0, "n_paths": 2, "n_classes": 2,
          "reorder_window_s": 1e-3}  # fmt: skip
    bits = np.ones(4, bool)
    cases = [
        ({"state": good["state"].astype(np.int64)}, "state must be"),
        ({"tx": good["tx"][:4]}, "tx must be"),
        ({"sent_at": good["sent_at"][::-1][::2]}, "sent_at must be"),
        ({"path": list(good["path"])}, "path must be"),
        ({"lengths": good["lengths"][:3]}, "lengths must be"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            kernels.apply_ack(kernels.SentChunks(**{**good, **change}), bits, **kw)
    with pytest.raises(ValueError, match="bits must be"):
        kernels.apply_ack(kernels.SentChunks(**good), bits.astype(np.uint8), **kw)
    with pytest.raises(ValueError, match="base"):
        kernels.apply_ack(kernels.SentChunks(**good), bits, **{**kw, "base": -1})
    ro = good["state"].copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernels.apply_ack(kernels.SentChunks(**{**good, "state": ro}), bits, **kw)
    with pytest.raises(ValueError, match="out of range"):
        kernels.apply_ack(kernels.SentChunks(**good), bits, **{**kw, "n_paths": 1})


@SETTINGS
@given(
    chunks=st.lists(
        st.tuples(
            st.integers(0, 4),  # state
            st.floats(0.0, 0.05),  # sent at
            st.integers(0, 2),  # path
        ),
        max_size=60,
    ),
    rtos=st.lists(st.floats(0.001, 0.03), min_size=3, max_size=3),
    backoff=st.sampled_from([1.0, 2.0, 64.0]),
    since=st.sampled_from([-np.inf, 0.0, 0.02, 0.06]),
    now=st.floats(0.0, 0.1),
)
def test_timed_out_equals_the_numpy_scan(chunks, rtos, backoff, since, now) -> None:
    """The sender's retransmission-timeout scan, compiled, against the NumPy it replaced (the
    clock of every chunk restarted at ``since``)."""
    state = np.array([c[0] for c in chunks], dtype=np.uint8)
    sent_at = np.array([c[1] for c in chunks], dtype=np.float64)
    path = np.array([c[2] for c in chunks], dtype=np.int16)
    rto = np.array(rtos)
    inflight = np.flatnonzero(state == outgoing.INFLIGHT)
    start = np.maximum(sent_at[inflight], since)
    want = inflight[start + (rto * backoff)[path[inflight]] <= now]
    out = np.full(len(chunks), -1, dtype=np.int64)
    n = _kernels_ack.timed_out(state, sent_at, path, rto, backoff, since, now, out)
    assert out[:n].tolist() == want.tolist()


def test_timed_out_refuses_a_path_outside_the_rto_table() -> None:
    state = np.array([outgoing.INFLIGHT], dtype=np.uint8)
    out, path = np.empty(1, dtype=np.int64), np.array([2], np.int16)
    with pytest.raises(ValueError, match="outside the RTO table"):
        _kernels_ack.timed_out(state, np.zeros(1), path, np.ones(2), 1.0, -np.inf, 0.0, out)


@SETTINGS
@TRANSFER_SHAPES
def test_note_sent_equals_the_numpy_bookkeeping(n, n_paths, n_classes, seed) -> None:
    """One sending batch's bookkeeping, compiled, against the NumPy it replaced in
    SenderCore._send_batch: chunk state, send time, path and (saturating) transmission count,
    per-class sent and retransmitted counts, per-path bytes, and the class stretches."""
    rng = np.random.default_rng(seed)
    t = transfer(seed, n, n_paths, n_classes, nan_times=False)
    t["tx"][rng.random(n) < 0.2] = 255
    lengths = rng.integers(48, 65000, n).astype(np.int32)
    k = int(rng.integers(1, n + 1))
    chunks = rng.permutation(n)[:k].astype(np.int64)
    paths = rng.integers(0, n_paths, k).astype(np.int64)
    n_retx = int(rng.integers(0, k + 1))
    now = float(rng.uniform(0, 5))
    want = {name: a.copy() for name, a in t.items()}
    want["state"][chunks] = outgoing.INFLIGHT
    want["sent_at"][chunks] = now
    want["path"][chunks] = paths
    want["tx"][chunks] = np.minimum(want["tx"][chunks].astype(np.int64) + 1, 255).astype(np.uint8)
    prio = t["prio"][chunks]
    want_sent = np.bincount(prio, minlength=n_classes)
    want_retx = np.bincount(prio[:n_retx], minlength=n_classes)
    sizes = lengths[chunks].astype(np.int64)
    want_path = np.bincount(paths, weights=sizes, minlength=n_paths).astype(np.int64)
    cut = np.flatnonzero(prio[1:] != prio[:-1]) + 1
    want_bounds = [0, *cut.tolist(), k]
    sent, retx = np.zeros(n_classes, np.int64), np.zeros(n_classes, np.int64)
    per_path, bounds = np.zeros(n_paths, np.int64), np.empty(k + 1, np.int64)
    total, runs = _kernels_ack.note_sent(
        t["state"], t["sent_at"], t["path"], t["tx"], t["prio"], lengths, chunks, paths, n_retx,
        now, sent, retx, per_path, bounds,
    )  # fmt: skip
    for name in ("state", "sent_at", "path", "tx"):
        assert t[name].tobytes() == want[name].tobytes(), name
    assert sent.tolist() == want_sent.tolist() and retx.tolist() == want_retx.tolist()
    assert per_path.tolist() == want_path.tolist() and total == int(sizes.sum())
    assert bounds[: runs + 1].tolist() == want_bounds


def test_note_sent_refuses_a_path_outside_the_counters() -> None:
    t = transfer(1, 4, 2, 2, nan_times=False)
    before = {name: a.copy() for name, a in t.items()}
    with pytest.raises(ValueError, match="outside the counters"):
        _kernels_ack.note_sent(
            t["state"], t["sent_at"], t["path"], t["tx"], t["prio"], np.full(4, 100, np.int32),
            np.array([0, 1]), np.array([0, 2]), 0, 1.0, np.zeros(2, np.int64),
            np.zeros(2, np.int64), np.zeros(2, np.int64), np.empty(3, np.int64),
        )  # fmt: skip
    assert all(t[name].tobytes() == before[name].tobytes() for name in t)


@SETTINGS
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(0, 300),
    n_paths=st.integers(1, 4),
    n_classes=st.integers(1, 5),
    window=st.sampled_from([0.0, 5e-4, 1e-3]),
)
def test_rack_due_matches_its_numpy_statement(
    seed: int, n: int, n_paths: int, n_classes: int, window: float
) -> None:
    """rack_due is: in flight, transmitted before its lane's newest acknowledged chunk, and
    that acknowledgement at least the window old — in index order."""
    rng = np.random.default_rng(seed)
    state = rng.integers(0, 5, n).astype(np.uint8)
    tx_seq = rng.permutation(n).astype(np.int64)
    path = rng.integers(0, n_paths, n).astype(np.int16)
    prio = rng.integers(0, n_classes, n).astype(np.uint8)
    lanes = n_paths * n_classes
    lane_seq = rng.integers(-1, max(n, 1), lanes).astype(np.int64)
    lane_at = rng.choice(np.array([np.inf, 0.0, 1e-3, 1.5e-3, 2e-3]), lanes)
    now = 2e-3
    out = np.empty(n, dtype=np.int64)
    got = out[: _kernels_ack.rack_due(state, tx_seq, path, prio, n_classes, lane_seq, lane_at,
                                      window, now, out)]  # fmt: skip
    lane = path.astype(np.int64) * n_classes + prio
    want = np.flatnonzero(
        (state == outgoing.INFLIGHT) & (tx_seq < lane_seq[lane]) & (lane_at[lane] + window <= now)
    )
    assert got.tolist() == want.tolist()


@SETTINGS
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(0, 120),
    n_paths=st.integers(1, 3),
    n_classes=st.integers(1, 4),
    window=st.sampled_from([0.0, 5e-4, 1e-3]),
    backoff=st.sampled_from([1.0, 2.0, 64.0]),
    since=st.sampled_from([-np.inf, 0.0, 1e-3, 3e-3]),
    timeouts=st.booleans(),
)
def test_next_due_is_when_a_scan_first_finds_a_chunk(
    seed, n, n_paths, n_classes, window, backoff, since, timeouts
) -> None:
    """Just before next_due neither the RACK scan nor (with ``timeouts``) the timeout scan
    returns a chunk; at it, one of them does; ``inf`` only when neither ever will."""
    rng = np.random.default_rng(seed)
    t = transfer(seed, n, n_paths, n_classes, nan_times=False)
    tx_seq = rng.permutation(n).astype(np.int64)
    lanes = n_paths * n_classes
    lane_seq = rng.integers(-1, max(n, 1), lanes).astype(np.int64)
    lane_at = rng.choice(np.array([np.inf, 0.0, 1e-3, 1.5e-3, 2e-3]), lanes)
    rtos = rng.choice(np.array([1e-3, 2e-3, 0.2]), n_paths)
    due = _kernels_ack.next_due(
        t["state"], t["sent_at"], tx_seq, t["path"], t["prio"], n_classes, lane_seq, lane_at,
        window, rtos, backoff, since, timeouts,
    )  # fmt: skip

    def found(now: float) -> int:
        out = np.empty(n, dtype=np.int64)
        k = _kernels_ack.rack_due(t["state"], tx_seq, t["path"], t["prio"], n_classes,
                                  lane_seq, lane_at, window, now, out)  # fmt: skip
        if timeouts:
            k += _kernels_ack.timed_out(t["state"], t["sent_at"], t["path"], rtos, backoff,
                                        since, now, out)  # fmt: skip
        return k

    if due == np.inf:
        assert found(1e300) == 0
    else:
        assert found(due) > 0
        assert found(np.nextafter(due, -np.inf)) == 0


def test_next_due_refuses_chunks_outside_its_tables() -> None:
    state = np.array([outgoing.INFLIGHT], dtype=np.uint8)
    args = (state, np.zeros(1), np.zeros(1, np.int64), np.array([2], np.int16),
            np.zeros(1, np.uint8), 1)  # fmt: skip
    with pytest.raises(ValueError, match="lane tables"):
        _kernels_ack.next_due(*args, np.zeros(2, np.int64), np.zeros(2), 0.0, np.ones(3), 1.0,
                              -np.inf, True)  # fmt: skip
    with pytest.raises(ValueError, match="RTO table"):
        _kernels_ack.next_due(*args, np.zeros(3, np.int64), np.zeros(3), 0.0, np.ones(2), 1.0,
                              -np.inf, True)  # fmt: skip


@SETTINGS
@TRANSFER_SHAPES
def test_note_lanes_equals_the_numpy_reference(n, n_paths, n_classes, seed) -> None:
    """Acknowledged chunks advance their lanes (path x class) exactly as the NumPy formulation
    the sender used: the newest transmission sequence per lane, stamped now where it advanced."""
    rng = np.random.default_rng(seed)
    path = rng.integers(0, n_paths, n).astype(np.int16)
    prio = rng.integers(0, n_classes, n).astype(np.uint8)
    tx_seq = rng.integers(0, 10 * n, n).astype(np.int64)
    acked = np.sort(rng.permutation(n)[: int(rng.integers(0, n + 1))]).astype(np.int64)
    lanes = n_paths * n_classes
    seq = rng.integers(-1, 10 * n, lanes).astype(np.int64)
    at = rng.uniform(0, 1, lanes)
    want_seq, want_at = seq.copy(), at.copy()
    naive.note_lanes(path, prio, tx_seq, acked, n_classes, want_seq, want_at, 2.5)
    _kernels_ack.note_lanes(path, prio, tx_seq, acked, n_classes, seq, at, 2.5)
    assert seq.tolist() == want_seq.tolist() and at.tolist() == want_at.tolist()


def test_note_lanes_refuses_a_lane_outside_the_arrays() -> None:
    seq, at = np.full(2, -1, np.int64), np.zeros(2)
    path, prio = np.array([0, 3], np.int16), np.zeros(2, np.uint8)
    with pytest.raises(ValueError, match="outside the arrays"):
        _kernels_ack.note_lanes(path, prio, np.arange(2), np.arange(2), 1, seq, at, 1.0)
    assert seq.tolist() == [-1, -1]  # nothing written
