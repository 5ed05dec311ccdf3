"""Unit tests of gradlane.scheduling.paths: splitting, rate estimation, failure and recovery."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.errors import ConfigError
from gradlane.scheduling.paths import PathConfig, PathSet, PathState
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import naive

DETERMINISTIC = settings(derandomize=True, deadline=None, max_examples=100)
PKT = 1000


def make(n: int = 2, seed: int = 0, **kw: float) -> PathSet:
    return PathSet(n, PathConfig(**kw), np.random.default_rng(seed))


class FluidNet:
    """Paths as FIFO queues drained at a fixed capacity, stepped in fixed time increments.

    Deliveries come back as one ack batch per path and step, with the queueing delay as RTT.
    """

    def __init__(self, caps: list[float], base_rtt: float = 0.0005) -> None:
        self.caps = np.array(caps, dtype=np.float64)
        self.queue = np.zeros(len(caps))
        self.base_rtt = base_rtt

    def send(self, paths: np.ndarray, sizes: np.ndarray) -> None:
        self.queue += np.bincount(paths, weights=sizes, minlength=len(self.caps))

    def step(self, ps: PathSet, now: float, dt: float) -> None:
        out = np.minimum(self.queue, self.caps * dt)
        rtt = self.base_rtt + self.queue / np.maximum(self.caps, 1.0)
        self.queue -= out
        got = np.flatnonzero(out > 0)
        if got.size:
            ps.on_acked(got, out[got], now, rtt[got])


def run_window_limited(
    ps: PathSet, net: FluidNet, *, steps: int, dt: float = 0.001, window: float = 60_000
) -> np.ndarray:
    """Keep ``window`` bytes outstanding; return bytes assigned per path in the second half."""
    assigned = np.zeros(ps.n_paths)
    for k in range(steps):
        now = k * dt
        room = window - ps.outstanding.sum()
        n = int(room // PKT)
        if n > 0:
            sizes = np.full(n, PKT)
            paths = ps.assign(now=now, sizes=sizes, protected=np.zeros(n, bool))
            ps.on_sent(paths, sizes, now)
            net.send(paths, sizes)
            if k >= steps // 2:
                assigned += np.bincount(paths, weights=sizes, minlength=ps.n_paths)
        net.step(ps, now + dt, dt)
        ps.tick(now + dt)
    return assigned


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"suspect_after_s": 0.0}, "suspect_after_s"),
        ({"down_after_s": 0.01}, "down_after_s"),
        ({"probe_interval_s": -1.0}, "probe_interval_s"),
        ({"loss_suspect": 0.0}, "loss_suspect"),
        ({"loss_ratio": 0.5}, "loss_ratio"),
        ({"loss_ratio": float("inf")}, "loss_ratio"),
        ({"loss_alpha": 2.0}, "loss_alpha"),
        ({"initial_rate_Bps": float("inf")}, "initial_rate_Bps"),
        ({"rtt_alpha": 0.6}, "rtt_alpha"),
        ({"rate_alpha": 0.0}, "rate_alpha"),
        ({"suspect_share": 1.0}, "suspect_share"),
    ],
)
def test_config_validation(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        PathConfig(**kwargs)


def test_needs_a_path() -> None:
    with pytest.raises(ConfigError):
        PathSet(0, None, np.random.default_rng(0))


# -- splitting -------------------------------------------------------------------------------------


def test_equal_paths_split_evenly() -> None:
    ps = make(2)
    sizes = np.full(10_000, PKT)
    paths = ps.assign(now=0.0, sizes=sizes, protected=np.zeros(10_000, bool))
    counts = np.bincount(paths, minlength=2)
    assert abs(counts[0] - counts[1]) <= 2
    # Every prefix is split too: the most urgent packets use both paths.
    assert abs(np.bincount(paths[:101], minlength=2)[0] - 50.5) <= 2


def test_assignment_spreads_every_prefix_over_four_paths() -> None:
    ps = make(4)
    paths = ps.assign(now=0.0, sizes=np.full(400, PKT), protected=np.zeros(400, bool))
    for end in (8, 40, 400):
        counts = np.bincount(paths[:end], minlength=4)
        assert counts.max() - counts.min() <= 2


def test_equal_paths_split_evenly_under_load() -> None:
    ps = make(2)
    net = FluidNet([2e6, 2e6])
    assigned = run_window_limited(ps, net, steps=2000)
    assert assigned[0] / assigned.sum() == pytest.approx(0.5, abs=0.03)


def test_one_to_three_rates_split_one_to_three() -> None:
    ps = make(2, initial_rate_Bps=2e6)
    net = FluidNet([1e6, 3e6])
    assigned = run_window_limited(ps, net, steps=4000)
    assert assigned[0] / assigned.sum() == pytest.approx(0.25, abs=0.03)
    # The estimates found the capacities, and the fast path was kept busy.
    assert ps.rates[0] == pytest.approx(1e6, rel=0.15)
    assert ps.rates[1] == pytest.approx(3e6, rel=0.15)
    assert assigned.sum() / 2.0 == pytest.approx(4e6, rel=0.05)  # bytes/s over 2 s


def test_outstanding_bytes_steer_the_split() -> None:
    ps = make(2)
    ps.on_sent(np.array([0]), np.array([50 * PKT]), 0.0)
    paths = ps.assign(now=0.0, sizes=np.full(100, PKT), protected=np.zeros(100, bool))
    counts = np.bincount(paths, minlength=2)
    # Water-filling: path 1 first takes the 50 packets path 0 has ahead, then both share.
    assert counts[1] == pytest.approx(75, abs=2)


def test_assign_is_deterministic_given_the_generator() -> None:
    a, b = make(3, seed=42), make(3, seed=42)
    sizes = np.full(500, PKT)
    prot = np.arange(500) % 7 == 0
    for now in (0.0, 0.001):
        pa = a.assign(now=now, sizes=sizes, protected=prot)
        pb = b.assign(now=now, sizes=sizes, protected=prot)
        assert np.array_equal(pa, pb)
    c = make(3, seed=43)
    assert not np.array_equal(c.assign(now=0.0, sizes=sizes, protected=prot), pa)


def test_empty_batch() -> None:
    out = make(2).assign(now=0.0, sizes=np.empty(0), protected=np.empty(0, bool))
    assert out.shape == (0,)
    assert out.dtype == np.int64


def test_assign_validates() -> None:
    with pytest.raises(ValueError):
        make(2).assign(now=0.0, sizes=np.ones(3), protected=np.ones(2, bool))


def test_large_batch() -> None:
    ps = make(8)
    n = 10_000
    paths = ps.assign(now=0.0, sizes=np.full(n, 8192), protected=np.arange(n) % 10 == 0)
    assert paths.shape == (n,)
    assert np.bincount(paths, minlength=8).min() >= n // 8 - 2


# -- failure and recovery --------------------------------------------------------------------------


def silent_path_setup() -> tuple[PathSet, np.ndarray]:
    """Two paths with data outstanding; path 1 never acks, path 0 always does."""
    ps = make(2, suspect_after_s=0.05, down_after_s=0.2, probe_interval_s=0.02)
    sizes = np.full(100, PKT)
    paths = ps.assign(now=0.0, sizes=sizes, protected=np.zeros(100, bool))
    ps.on_sent(paths, sizes, 0.0)
    return ps, paths


def ack_path0(ps: PathSet, now: float) -> None:
    ps.on_sent(np.array([0]), np.array([PKT]), now)
    ps.on_acked(np.array([0]), np.array([PKT]), now, np.array([0.001]))


def test_silent_path_becomes_suspect_then_down() -> None:
    ps, _ = silent_path_setup()
    assert ps.next_tick_time() == pytest.approx(0.05)
    for t in np.arange(0.0, 0.05, 0.01):
        ack_path0(ps, float(t))
        assert ps.tick(float(t)) == []
    ack_path0(ps, 0.05)
    assert ps.tick(0.05) == []
    assert ps.state(1) == PathState.SUSPECT
    assert ps.state(0) == PathState.UP
    # Path 0 still has unacked data but progressed at 0.05: its silence clock runs to 0.1.
    assert ps.next_tick_time() == pytest.approx(0.1)

    # SUSPECT: no protected packets, a trickle of the others.
    n = 10_000
    prot = np.arange(n) % 2 == 0
    paths = ps.assign(now=0.06, sizes=np.full(n, PKT), protected=prot)
    assert not (paths[prot] == 1).any()
    share = (paths[~prot] == 1).mean()
    assert 0.0 < share <= ps.config.suspect_share + 0.001

    assert ps.probes_due(0.06) == [1]
    assert ps.probes_due(0.07) == []
    assert ps.next_probe_time() == pytest.approx(0.08)
    assert ps.probes_due(0.08) == [1]

    ack_path0(ps, 0.19)
    assert ps.tick(0.19) == []
    ack_path0(ps, 0.2)
    assert ps.tick(0.2) == [1]
    assert ps.state(1) == PathState.DOWN
    assert ps.outstanding[1] == 0.0  # written off: the transport re-queues those chunks
    assert ps.tick(0.21) == []  # reported once

    # DOWN: nothing at all.
    paths = ps.assign(now=0.21, sizes=np.full(n, PKT), protected=prot)
    assert (paths == 0).all()

    # A probe ack brings it back.
    assert ps.probes_due(0.21) == [1]
    ps.on_probe_ack(1, 0.215, 0.002)
    assert ps.state(1) == PathState.UP
    assert ps.next_probe_time() is None
    paths = ps.assign(now=0.22, sizes=np.full(1000, PKT), protected=np.ones(1000, bool))
    assert (paths == 1).sum() > 300


def test_assign_sees_silence_before_tick() -> None:
    ps, _ = silent_path_setup()
    ack_path0(ps, 0.06)
    paths = ps.assign(now=0.06, sizes=np.full(100, PKT), protected=np.ones(100, bool))
    assert (paths == 0).all()
    assert ps.state(1) == PathState.UP  # the transition itself is tick()'s to report
    ps.tick(0.06)
    assert ps.state(1) == PathState.SUSPECT


def test_ack_on_suspect_path_lifts_it() -> None:
    ps, _ = silent_path_setup()
    ps.tick(0.06)
    assert ps.state(0) == ps.state(1) == PathState.SUSPECT
    ps.on_acked(np.array([1]), np.array([PKT]), 0.07)
    assert ps.state(1) == PathState.UP


def test_idle_path_is_never_suspect() -> None:
    ps = make(2)
    for t in (0.0, 0.1, 1.0, 100.0):
        assert ps.tick(t) == []
    assert ps.states.tolist() == [PathState.UP, PathState.UP]
    assert ps.next_tick_time() is None
    # Data sent after a long idle period starts the silence clock at the send.
    ps.on_sent(np.array([0]), np.array([PKT]), 100.0)
    assert ps.tick(100.04) == []
    assert ps.state(0) == PathState.UP
    ps.tick(100.06)
    assert ps.state(0) == PathState.SUSPECT


def test_lossy_path_becomes_suspect() -> None:
    ps = make(2, loss_suspect=0.3, loss_alpha=0.1)
    for t in range(20):
        ps.on_sent(np.array([0, 1, 1]), np.array([PKT, PKT, PKT]), t * 0.001)
        ps.on_acked(np.array([0, 1]), np.array([PKT, PKT]), t * 0.001)
        ps.on_lost(np.array([1]), np.array([PKT]), t * 0.001)
    assert ps.state(0) == PathState.UP
    assert ps.state(1) == PathState.SUSPECT
    snap = ps.snapshot()
    assert snap["loss"][1] > 0.3  # type: ignore[operator]
    assert snap["lost_bytes"] == [0.0, 20.0 * PKT]
    ps.on_probe_ack(1, 0.1)
    assert ps.state(1) == PathState.UP


def test_loss_every_path_shows_takes_none_out() -> None:
    """Loss that every path shows alike (random loss on the links, the ACKs it costs read as
    lost packets) keeps them all UP, however high it runs: moving traffic would only load one
    path with all of it. A path much lossier than the others still goes SUSPECT."""
    gen = np.random.default_rng(3)
    ps = make(2, loss_suspect=0.3, loss_alpha=0.1)
    both, sizes = np.array([0, 1]), np.array([PKT, PKT])
    peak = 0.0
    for t in range(400):
        now = t * 0.001
        ps.on_sent(both, sizes, now)
        if gen.random() < 0.4:
            ps.on_lost(both, sizes, now)
        else:
            ps.on_acked(both, sizes, now)
        ps.tick(now)
        assert ps.states.tolist() == [PathState.UP, PathState.UP], t
        peak = max(peak, *ps.snapshot()["loss"])  # type: ignore[misc]
    assert peak > 0.5  # far over loss_suspect, on both paths
    # Now path 1 alone loses everything: twice the other's loss and more.
    for t in range(400, 460):
        now = t * 0.001
        ps.on_sent(np.array([0, 1]), np.array([PKT, PKT]), now)
        ps.on_acked(np.array([0]), np.array([PKT]), now)
        ps.on_lost(np.array([1]), np.array([PKT]), now)
    assert ps.state(0) == PathState.UP and ps.state(1) == PathState.SUSPECT


def test_a_lone_lossy_path_stays_up() -> None:
    """With no other path to move to, loss alone does not take a path out (silence does)."""
    ps = make(1, loss_suspect=0.3, loss_alpha=0.1)
    for t in range(50):
        ps.on_sent(np.array([0, 0]), np.array([PKT, PKT]), t * 0.001)
        ps.on_acked(np.array([0]), np.array([PKT]), t * 0.001)
        ps.on_lost(np.array([0]), np.array([PKT]), t * 0.001)
        ps.tick(t * 0.001)
    assert ps.snapshot()["loss"][0] > 0.3  # type: ignore[index,operator]
    assert ps.state(0) == PathState.UP
    ps.on_sent(np.array([0]), np.array([PKT]), 1.0)
    ps.tick(1.0 + ps.config.suspect_after_s)
    assert ps.state(0) == PathState.SUSPECT


def test_no_up_path_uses_best_suspect() -> None:
    ps = make(3)
    sizes = np.full(30, PKT)
    ps.on_sent(np.array([0, 1, 2]), np.array([PKT, PKT, PKT]), 0.0)
    ps.on_acked(np.array([2]), np.array([PKT]), 0.01)  # path 2 delivered most recently
    ps.on_sent(np.array([2]), np.array([PKT]), 0.01)
    ps.tick(0.07)
    assert ps.states.tolist() == [PathState.SUSPECT] * 3
    assert (ps.assign(now=0.07, sizes=sizes, protected=np.ones(30, bool)) == 2).all()
    ps.tick(0.3)
    assert ps.states.tolist() == [PathState.DOWN] * 3
    # Every path down: still a path (the best), never "no path".
    assert (ps.assign(now=0.3, sizes=sizes, protected=np.zeros(30, bool)) == 2).all()


# -- estimates -------------------------------------------------------------------------------------


def test_rtt_and_rto() -> None:
    ps = make(2, rtt_alpha=0.125, initial_rto_s=0.2)
    assert np.isnan(ps.rtt_estimate(0))
    assert ps.rto(0) == pytest.approx(0.2)
    ps.on_sent(np.array([0, 0]), np.array([PKT, PKT]), 0.0)
    ps.on_acked(np.array([0, 0]), np.array([PKT, PKT]), 0.01, np.array([0.009, 0.011]))
    # One sample per path per batch (the mean): srtt = 10 ms, rttvar = 5 ms.
    assert ps.rtt_estimate(0) == pytest.approx(0.01)
    assert ps.rto(0) == pytest.approx(0.03)
    assert ps.snapshot()["min_rtt_s"][0] == pytest.approx(0.009)
    ps.on_probe_ack(1, 0.0, 1e-5)
    assert ps.rto(1) == pytest.approx(0.001)  # floor
    assert ps.rtos().shape == (2,)
    # The RTT bound: the RTO without its floor and initial value (0 before a sample).
    assert ps.rtt_bounds()[0] == pytest.approx(0.03)
    assert ps.rtt_bounds()[1] == pytest.approx(1e-5 * 3)  # srtt 10 us + 4 x 5 us
    assert make(2).rtt_bounds().tolist() == [0.0, 0.0]
    assert ps.rtt_bounds(0.0)[1] == pytest.approx(1e-5)  # no deviations: the smoothed RTT


def test_idle_gaps_do_not_lower_the_rate() -> None:
    ps = make(1, initial_rate_Bps=1e6, rate_window_s=0.001)
    net = FluidNet([1e6])
    for burst in range(5):
        t0 = burst * 1.0  # one second of idle between bursts
        for k in range(20):
            now = t0 + k * 0.001
            if k < 10:
                ps.on_sent(np.array([0]), np.array([2 * PKT]), now)
                net.send(np.array([0]), np.array([2 * PKT]))
            net.step(ps, now + 0.001, 0.001)
    assert ps.rates[0] >= 0.9e6


def test_snapshot_is_json_friendly() -> None:
    import json

    ps = make(2)
    ps.on_sent(np.array([0, 1]), np.array([PKT, 2 * PKT]), 0.0)
    snap = ps.snapshot()
    assert snap["state"] == ["UP", "UP"]
    assert snap["outstanding_bytes"] == [1000.0, 2000.0]
    assert snap["sent_bytes"] == [1000.0, 2000.0]
    assert snap["srtt_s"] == [None, None]
    json.dumps(snap, allow_nan=False)


def test_feedback_validates() -> None:
    ps = make(2)
    with pytest.raises(ValueError):
        ps.on_sent(np.array([2]), np.array([PKT]), 0.0)
    with pytest.raises(ValueError):
        ps.on_acked(np.array([-1]), np.array([PKT]), 0.0)
    with pytest.raises(ValueError):
        ps.on_lost(np.array([0]), np.array([-5]), 0.0)
    with pytest.raises(ValueError):
        ps.on_acked(np.array([0, 1]), np.array([PKT, PKT]), 0.0, np.array([0.1]))
    with pytest.raises(ValueError):
        ps.on_probe_ack(5, 0.0)


# -- property: always a valid path ---------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["sent", "acked", "lost", "tick", "probe", "probe_ack", "assign"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=20),
        st.floats(0.0, 0.1),
    ),
    max_size=40,
)


@DETERMINISTIC
@given(ops=ops, seed=st.integers(0, 2**32 - 1))
def test_assign_always_returns_valid_paths(
    ops: list[tuple[str, list[int], float]], seed: int
) -> None:
    ps = make(4, seed=seed)
    now = 0.0
    for op, idx, dt in ops:
        now += dt
        path = np.array(idx)
        sizes = np.full(len(idx), PKT)
        if op == "sent":
            ps.on_sent(path, sizes, now)
        elif op == "acked":
            ps.on_acked(path, sizes, now, np.full(len(idx), 0.001))
        elif op == "lost":
            ps.on_lost(path, sizes, now)
        elif op == "tick":
            ps.tick(now)
        elif op == "probe":
            ps.probes_due(now)
        elif op == "probe_ack":
            ps.on_probe_ack(idx[0], now, 0.001)
        n = 3 * len(idx)
        prot = np.arange(n) % 2 == 0
        paths = ps.assign(now=now, sizes=np.full(n, PKT), protected=prot)
        assert paths.dtype == np.int64
        assert ((paths >= 0) & (paths < 4)).all()
        ps.tick(now)  # assign() judges health as of ``now``; compare with the same view
        states = ps.states
        if (states == PathState.UP).any():
            assert (states[paths] != PathState.DOWN).all()
            assert (states[paths[prot]] == PathState.UP).all()
        assert (ps.outstanding >= 0).all()
        assert np.isfinite(ps.rates).all()
        assert (ps.rates > 0).all()


_STATE = (
    "_outstanding",
    "_acked_total",
    "_last_delivery",
    "_last_progress",
    "_loss",
    "_min_rtt",
    "_srtt",
    "_rttvar",
    "_win_t0",
    "_win_bytes",
    "_rate",
    "_state",
    "_next_probe",
)


@settings(max_examples=60)
@given(
    n_paths=st.integers(1, 5),
    batches=st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, 4), st.integers(0, 70_000)), max_size=40),
            st.floats(0.0, 0.004),  # time step
            st.booleans(),  # with RTT samples
            st.lists(st.sampled_from([-1.0, np.nan, 0.0, 1e-5, 2e-4, 3e-3]), max_size=40),
        ),
        max_size=12,
    ),
    lost_at=st.integers(0, 12),
)
def test_compiled_ack_update_matches_the_numpy_reference(
    n_paths: int, batches: list, lost_at: int
) -> None:
    """The compiled on_acked equals the whole-array numpy formulation, state for state."""
    fast = PathSet(n_paths, PathConfig(), np.random.default_rng(0))
    ref = PathSet(n_paths, PathConfig(), np.random.default_rng(0))
    now = 0.0
    for k, (pkts, dt, with_rtt, rtts) in enumerate(batches):
        now += dt
        path = np.array([p % n_paths for p, _ in pkts], dtype=np.int64)
        sizes = np.array([s for _, s in pkts], dtype=np.float64)
        for ps in (fast, ref):
            ps.on_sent(path, sizes * 2, now)
            if k == lost_at:  # a loss makes a path suspect, so acks must lift it
                ps.on_lost(path, sizes, now)
        rtt = None
        if with_rtt:
            rtt = np.resize(np.array(rtts or [1e-4]), path.shape)
        now += dt
        # Every third batch, some of its packets were already written off (counted 0).
        counted = np.where(np.arange(path.size) % 2 == 0, sizes, 0.0) if k % 3 == 2 else None
        fast.on_acked(path, sizes, now, rtt, counted)
        naive.path_ack_update(ref, path, sizes, now, rtt, counted)
        for name in _STATE:
            # Equal up to rounding (numba's pow and numpy's may differ in the last bit).
            np.testing.assert_allclose(
                getattr(fast, name), getattr(ref, name), rtol=1e-12, atol=0.0, err_msg=name
            )


def test_released_and_written_off_bytes_leave_outstanding_once() -> None:
    """Bytes released (transfer over, or queued again) leave the outstanding bytes, and an ACK
    of a packet already written off takes nothing out a second time: a path whose packets were
    all accounted for is drained, so an idle gap cannot pass for slow delivery."""
    ps = PathSet(2, PathConfig(), np.random.default_rng(0))
    path = np.array([0, 0, 1, 1])
    sizes = np.full(4, float(PKT))
    ps.on_sent(path, sizes, 0.0)
    ps.on_lost(path[:1], sizes[:1], 0.001)  # packet 0 declared lost...
    ps.on_released(path[2:3], sizes[2:3])  # ...packet 2 queued again by a NACK
    # ACKs for all four: packets 0 and 2 were already taken out.
    ps.on_acked(path, sizes, 0.002, None, np.array([0.0, PKT, 0.0, PKT]))
    np.testing.assert_array_equal(ps.outstanding, [0.0, 0.0])
    with pytest.raises(ValueError):
        ps.on_released(np.array([2]), np.array([1.0]))


@settings(derandomize=True, deadline=None, max_examples=150)
@given(
    n=st.integers(0, 40),
    n_paths=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_release_where_equals_release_of_the_selection(n: int, n_paths: int, seed: int) -> None:
    """on_released_where(state, v, path, sizes) takes out exactly what on_released of the
    packets whose state is v does (the same per-path sums, clamped at 0); bad paths raise and
    change nothing."""
    rng = np.random.default_rng(seed)
    state = rng.integers(0, 4, n).astype(np.uint8)
    path = rng.integers(0, n_paths, n).astype(np.int16)
    sizes = rng.integers(0, 65536, n).astype(np.int32)
    a = PathSet(n_paths, PathConfig(), np.random.default_rng(0))
    b = PathSet(n_paths, PathConfig(), np.random.default_rng(0))
    sent_path = rng.integers(0, n_paths, 3 * n + 1)
    sent = rng.integers(0, 65536, 3 * n + 1).astype(np.float64)
    for ps in (a, b):
        ps.on_sent(sent_path, sent, 0.0)
    a.on_released_where(state, 1, path, sizes)
    sel = state == 1
    b.on_released(path[sel].astype(np.int64), sizes[sel])
    np.testing.assert_array_equal(a.outstanding, b.outstanding)
    if n:
        bad = path.copy()
        bad[rng.integers(0, n)] = n_paths
        state[:] = 1
        with pytest.raises(ValueError):
            a.on_released_where(state, 1, bad, sizes)
        np.testing.assert_array_equal(a.outstanding, b.outstanding)


_PATH = st.tuples(
    st.sampled_from([PathState.UP, PathState.UP, PathState.SUSPECT, PathState.DOWN]),
    st.sampled_from([0.0, 0.0, 1.0, 999.5, 8192.0, 5e4, 3e6]),  # outstanding
    st.sampled_from([1e-6, 0.5, 1.0, 3.0, 1e3, 1e6, 1.25e8, 7.3e8]),  # rate (incl. tiny)
    st.sampled_from([0.0, 0.01, 0.05, 0.07, 0.2, 0.5]),  # silent for (thresholds 0.05, 0.2)
    st.sampled_from([0.0, 0.1, 0.3, 0.31, 0.9]),  # loss EWMA (threshold 0.3)
    st.sampled_from([-np.inf, 0.0, 0.5, 0.9, 1.0]),  # last delivery
)


@settings(max_examples=300, deadline=None)
@given(
    paths=st.lists(_PATH, min_size=1, max_size=10),
    batches=st.lists(
        st.tuples(
            st.one_of(st.integers(0, 6), st.integers(0, 300)),  # packets (greedy branch: <= 4)
            st.sampled_from(["const", "int", "float", "zero", "mixed"]),  # sizes
            st.sampled_from(["all", "none", "alternate", "random"]),  # protected
            st.floats(0.0, 0.1),  # time step
        ),
        min_size=1,
        max_size=4,
    ),
    suspect_share=st.sampled_from([0.0, 0.02, 0.5]),
    seed=st.integers(0, 2**32 - 1),
)
def test_compiled_assign_matches_the_numpy_reference(
    paths: list, batches: list, suspect_share: float, seed: int
) -> None:
    """The compiled assign (and on_sent) equal the numpy formulation index for index, and draw
    the same numbers from the generator (same branch, same stream)."""
    n = len(paths)
    now = 1.0
    fast = PathSet(n, PathConfig(suspect_share=suspect_share), np.random.default_rng(seed))
    ref = PathSet(n, PathConfig(suspect_share=suspect_share), np.random.default_rng(seed))
    for ps in (fast, ref):
        ps._state[:] = [s for s, *_ in paths]
        ps._outstanding[:] = [o for _, o, *_ in paths]
        ps._rate[:] = [r for _, _, r, *_ in paths]
        ps._last_progress[:] = [now - t for *_, t, _, _ in paths]
        ps._loss[:] = [x for *_, x, _ in paths]
        ps._last_delivery[:] = [d for *_, d in paths]
    gen = np.random.default_rng(seed)
    for n_pkt, size_kind, prot_kind, dt in batches:
        sizes = {
            "const": np.full(n_pkt, 8192.0),
            "int": gen.integers(1, 9000, n_pkt).astype(np.float64),
            "float": gen.uniform(0.0, 1e5, n_pkt),
            "zero": np.zeros(n_pkt),
            "mixed": np.where(gen.random(n_pkt) < 0.3, 0.0, gen.uniform(1.0, 1e4, n_pkt)),
        }[size_kind]
        prot = {
            "all": np.ones(n_pkt, bool),
            "none": np.zeros(n_pkt, bool),
            "alternate": np.arange(n_pkt) % 2 == 0,
            "random": gen.random(n_pkt) < 0.4,
        }[prot_kind]
        got = fast.assign(now=now, sizes=sizes, protected=prot)
        want = naive.path_assign(ref, now, sizes, prot)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
        fast.on_sent(got, sizes, now)
        naive.path_on_sent(ref, want, sizes, now)
        for name in ("_outstanding", "_sent_total", "_last_progress", "_state"):
            np.testing.assert_array_equal(getattr(fast, name), getattr(ref, name), err_msg=name)
        now += dt
    assert fast._rng.random() == ref._rng.random()  # the same number of offsets drawn


def test_kernel_sum_is_numpys_pairwise_sum() -> None:
    """The kernels' batch and weight sums round exactly as ``ndarray.sum`` (pairwise) does."""
    from gradlane.scheduling._kernels.paths import _np_sum

    gen = np.random.default_rng(7)
    for n in [*range(0, 300), 1000, 4097, 10_000]:
        a = gen.uniform(0.0, 1e5, n) * gen.choice([1e-9, 1.0, 1e9], n)
        assert _np_sum(a, 0, n) == a.sum(), n


def _tick_reference(state, last_progress, outstanding, loss, next_probe, win_t0, now, cfg):
    """PathSet.tick as it was written in NumPy (before the compiled pass)."""
    up, suspect, down = int(PathState.UP), int(PathState.SUSPECT), int(PathState.DOWN)
    silent_for = now - last_progress
    busy = outstanding > 0.0
    to_down = (busy | (state == suspect)) & (state != down) & (silent_for >= cfg.down_after_s)
    to_suspect = (
        (state == up)
        & ~to_down
        & ((busy & (silent_for >= cfg.suspect_after_s)) | naive.path_lossy(loss, state, cfg))
    )
    for mask, new in ((to_suspect, suspect), (to_down, down)):
        state[mask] = new
        next_probe[mask] = np.minimum(next_probe[mask], now)
    outstanding[to_down] = 0.0
    win_t0[to_down] = np.nan
    return [int(i) for i in np.flatnonzero(to_down)]


@DETERMINISTIC
@given(
    paths=st.lists(
        st.tuples(
            st.sampled_from([int(s) for s in PathState]),
            st.floats(0.0, 1.0),  # last progress
            st.sampled_from([0.0, 1000.0]),  # outstanding bytes
            st.floats(0.0, 1.0),  # loss EWMA
            st.sampled_from([np.inf, 0.2, 0.9]),  # next probe
        ),
        min_size=1,
        max_size=6,
    ),
    now=st.floats(0.0, 1.5),
)
def test_tick_equals_the_numpy_it_replaced(paths, now) -> None:
    """The compiled tick moves exactly the paths the NumPy version moved, with the same probe
    times, written-off bytes and rate windows, and reports the same paths gone DOWN; so do the
    probes it then finds due."""
    cfg = PathConfig(suspect_after_s=0.2, down_after_s=0.6, loss_suspect=0.5)
    ps = PathSet(len(paths), cfg, np.random.default_rng(0))
    cols = [np.array(c) for c in zip(*paths, strict=True)]
    ps._state[:] = cols[0]
    ps._last_progress[:] = cols[1]
    ps._outstanding[:] = cols[2]
    ps._loss[:] = cols[3]
    ps._next_probe[:] = cols[4]
    ps._win_t0[:] = 0.5
    ref = [a.copy() for a in (ps._state, ps._last_progress, ps._outstanding, ps._loss,
                              ps._next_probe, ps._win_t0)]  # fmt: skip
    want = _tick_reference(*ref, now, cfg)
    assert ps.tick(now) == want
    got_state = (ps._state, ps._outstanding, ps._next_probe, ps._win_t0)
    for got, exp in zip(got_state, (ref[0], ref[2], ref[4], ref[5]), strict=True):
        np.testing.assert_array_equal(got, exp)
    due = (ref[0] != int(PathState.UP)) & (now >= ref[4])
    assert ps.probes_due(now) == [int(i) for i in np.flatnonzero(due)]
    assert (ps._next_probe[due] == now + cfg.probe_interval_s).all()


def test_sampled_marks_the_paths_with_an_rtt_sample() -> None:
    ps = make(3)
    assert ps.sampled().tolist() == [False, False, False]
    ps.on_sent(np.array([1]), np.array([100.0]), 0.0)
    ps.on_acked(np.array([1]), np.array([100.0]), 0.002, rtt=np.array([0.002]))
    assert ps.sampled().tolist() == [False, True, False]
    assert np.isnan(ps.rtt_estimate(0)) and not np.isnan(ps.rtt_estimate(1))


@DETERMINISTIC
@given(
    paths=st.lists(
        st.tuples(
            st.sampled_from([int(s) for s in PathState]),
            st.sampled_from([0.0, 0.1, 0.35, 0.5]),  # last progress
            st.sampled_from([0.0, 1000.0]),  # outstanding bytes
            st.sampled_from([0.0, 0.2, 0.5, 0.7]),  # loss EWMA
            st.sampled_from([np.inf, 0.2, 0.9]),  # next probe
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_next_due_is_when_tick_or_a_probe_first_acts(paths) -> None:
    """Just before next_due, tick moves no path and no probe is due; at it, one of them acts
    (``-inf``: a tick now would; ``inf``: nothing ever will without feedback). next_tick_time
    is the same without the probes."""
    cfg = PathConfig(suspect_after_s=0.2, down_after_s=0.6, loss_suspect=0.5)

    def fresh() -> PathSet:
        ps = PathSet(len(paths), cfg, np.random.default_rng(0))
        for a, col in zip((ps._state, ps._last_progress, ps._outstanding, ps._loss,
                           ps._next_probe), zip(*paths, strict=True), strict=True):  # fmt: skip
            a[:] = col
        return ps

    def acts(now: float, probes: bool = True) -> bool:
        ps = fresh()
        before = ps._state.copy()
        ps.tick(now)
        return bool((ps._state != before).any() or (probes and ps.probes_due(now)))

    due = fresh().next_due()
    tick = fresh().next_tick_time()
    for when, probes in ((due, True), (np.inf if tick is None else tick, False)):
        if when == np.inf:
            assert not acts(1e9, probes)
        elif when == -np.inf:
            assert acts(0.0, probes)
        else:
            assert acts(when, probes) and not acts(np.nextafter(when, -np.inf), probes)


def _borrowed_rtos_numpy(ps: PathSet, fb_srtt: float, fb_var: float, minimum: float) -> np.ndarray:
    """PeerPaths.rtos as it was written in NumPy, on PathSet.rtos and sampled."""
    rtos = ps.rtos()
    sampled = ps.sampled()
    if sampled.any() and not sampled.all():
        rtos = np.where(sampled, rtos, rtos[sampled].max())
    elif not sampled.any() and not np.isnan(fb_srtt):
        rtos = np.full(rtos.shape[0], fb_srtt + 4.0 * fb_var)
    return np.maximum(rtos, minimum)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
    st.sampled_from([np.nan, 0.0005, 0.004]),
    st.sampled_from([0.0, 0.002, 0.01]),
)
def test_borrowed_rtos_equal_the_numpy_they_replaced(n, seed, fb_srtt, minimum):
    rng = np.random.default_rng(seed)
    ps = PathSet(n, PathConfig(), np.random.default_rng(0))
    ps._srtt = np.where(rng.random(n) < 0.5, np.nan, rng.uniform(0.0, 0.01, n))
    ps._rttvar = np.where(np.isnan(ps._srtt), np.nan, rng.uniform(0.0, 0.005, n))
    fb_var = fb_srtt / 2.0
    np.testing.assert_array_equal(
        ps.borrowed_rtos(fb_srtt, fb_var, minimum),
        _borrowed_rtos_numpy(ps, fb_srtt, fb_var, minimum),
    )
