"""The sans-I/O cores wired in memory: exactness, bounded loss, deadlines, bad input.

Every test is deterministic: a fake clock, seeded generators, explicit drop decisions.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce, from_f32, shard_bounds, to_f32
from gradlane.transport.core.events import AllReduceComplete, AllReduceFailed, flat
from gradlane.transport.core.outgoing import ABANDONED, ACKED, INFLIGHT, LOST
from gradlane.transport.errors import PeerTimeout
from gradlane.transport.wire.header import DType, Header, Kind, Reason, encode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cores import header_of, kind_of, make, run_allreduce
from tests.support.wire import Wire


# -- reliable mode ---------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 63, 1000, 4097])
def test_reliable_exact_f32_under_loss_reorder(world, n):
    rng = np.random.default_rng(world * 1000 + n)
    datas = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    eps = make(world)
    drop_rng = np.random.default_rng(7)
    wire = Wire(eps, jitter=200e-6, seed=n, drop=lambda src, dg, seq: drop_rng.random() < 0.15)
    out = run_allreduce(eps, datas, wire)
    expect = np.sum(datas, axis=0, dtype=np.float64)
    for r in range(world):
        ev = out[r]
        assert isinstance(ev, AllReduceComplete)
        np.testing.assert_allclose(ev.result, expect, rtol=1e-5, atol=1e-5)
        assert ev.report.delivered_fraction == 1.0
        assert not ev.report.degraded
    if n >= 1000:
        assert wire.dropped > 0


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16])
def test_reliable_16bit(dtype):
    world, n = 3, 777
    rng = np.random.default_rng(3)
    vals = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    words = []
    for v in vals:
        w = np.empty(n, dtype=np.uint16)
        from_f32(v, dtype, w)
        words.append(w if dtype == DType.BF16 else w.view(np.float16))
    eps = make(world)
    drop_rng = np.random.default_rng(1)
    wire = Wire(eps, jitter=100e-6, drop=lambda s, dg, q: drop_rng.random() < 0.1)
    out = run_allreduce(eps, words, wire, dtype=dtype)
    exact = sum(to_f32(w.view(np.uint16), dtype) for w in words)
    rounded = np.empty(n, dtype=np.uint16)
    from_f32(exact, dtype, rounded)
    for r in range(world):
        got = out[r].result.view(np.uint16)
        np.testing.assert_allclose(to_f32(got, dtype), to_f32(rounded, dtype), rtol=2e-2, atol=2e-2)


def test_duplicates_and_garbage_never_double_count():
    world, n = 3, 2000
    rng = np.random.default_rng(11)
    datas = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    eps = make(world)
    junk_rng = np.random.default_rng(5)
    forged = encode(
        Header(kind=Kind.DATA, job=1, step=1, bucket=0, shard=0, src=1, dst=0, chunk=0, count=64),
        np.ones(64, np.float32).tobytes(),
    )
    forged = forged[:-8] + b"\x00" * 8  # payload changed after tagging: bad tag

    def mangle(src, dg):
        data = dg.wire()
        out = [data, data]  # every datagram twice
        if junk_rng.random() < 0.05:
            out.append(junk_rng.bytes(int(junk_rng.integers(0, 400))))
            out.append(forged)
        return out

    wire = Wire(eps, jitter=100e-6, mangle=mangle)
    out = run_allreduce(eps, datas, wire)
    expect = np.sum(datas, axis=0, dtype=np.float64)
    for r in range(world):
        np.testing.assert_allclose(out[r].result, expect, rtol=1e-5, atol=1e-5)
    stats = [ep.endpoint.stats()["rejected"] for ep in eps]
    assert sum(s.get("duplicate", 0) for s in stats) > 0
    assert sum(sum(v for k, v in s.items() if k != "duplicate") for s in stats) > 0
    assert stats[0].get("bad_tag", 0) >= 1
    recent = eps[0].endpoint.stats()["rejected_recent"]
    assert any(e["reason"] == "bad_tag" for e in recent)
    assert all(e["reason"] != "duplicate" for e in recent)


def test_foreign_job_and_secret_rejected():
    world, n = 2, 500
    datas = [np.ones(n, np.float32), np.full(n, 2.0, np.float32)]
    eps = make(world, secret="s3cret")
    # A packet of the same job signed without the secret must be rejected (bad tag).
    unsigned = encode(
        Header(kind=Kind.DATA, job=1, step=1, bucket=0, shard=0, src=1, dst=0, chunk=0, count=64),
        np.full(64, 1e6, np.float32),
    )
    other_job = encode(
        Header(kind=Kind.DATA, job=2, step=1, bucket=0, shard=0, src=1, dst=0, chunk=0, count=64),
        np.full(64, 1e6, np.float32),
    )
    wire = Wire(eps)
    wire.inject(0, unsigned)
    wire.inject(0, other_job)
    out = run_allreduce(eps, datas, wire)
    np.testing.assert_array_equal(out[0].result, np.full(n, 3.0, np.float32))
    stats = eps[0].endpoint.stats()
    rej = stats["rejected"]
    assert rej.get("bad_tag", 0) >= 1 and rej.get("foreign_job", 0) == 1
    # Which packet the forgery was: what it claimed, as it arrived (a foreign job's packets
    # fail the framing checks, which only count them).
    (e,) = stats["rejected_recent"]
    assert e["reason"] == "bad_tag"
    assert (e["kind"], e["step"], e["bucket"], e["shard"], e["src"]) == (Kind.DATA, 1, 0, 0, 1)
    assert e["chunk"] == 0 and e["count"] == 64 and e["length"] == 48 + 64 * 4


def test_peer_starting_late_is_buffered():
    """A fast rank's packets for a bucket the slow rank has not started are held, not lost."""
    world, n = 2, 3000
    datas = [np.arange(n, dtype=np.float32), np.ones(n, np.float32)]
    eps = make(world)
    wire = Wire(eps)
    eps[0].start(1, 0, datas[0], 0.5, now=0.0)
    # Let rank 0 blast (and retransmit) for a while before rank 1 starts.
    wire.run(lambda: wire.now >= 0.003, max_time=1.0)
    eps[1].start(1, 0, datas[1], 0.5, now=wire.now)
    wire.run(lambda: sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == 2)
    for _, _, e in wire.events:
        np.testing.assert_array_equal(e.result, datas[0] + datas[1])


def test_many_buckets_and_steps_interleaved():
    world = 3
    eps = make(world)
    wire = Wire(eps, jitter=50e-6, drop=lambda s, dg, q: q % 13 == 0)
    rng = np.random.default_rng(0)
    expect = {}
    for step in range(1, 4):
        for bucket in range(3):
            datas = [
                rng.standard_normal(300 + 100 * bucket).astype(np.float32) for _ in range(world)
            ]
            expect[(step, bucket)] = np.sum(datas, axis=0)
            for r, ep in enumerate(eps):
                ep.start(step, bucket, datas[r], layer_position=1 - bucket / 2, now=wire.now)
    wire.run(lambda: sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == 27)
    for _, _, e in wire.events:
        np.testing.assert_allclose(e.result, expect[(e.step, e.bucket)], rtol=1e-5, atol=1e-5)


# -- bounded loss ------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), p=st.floats(0.0, 0.3), world=st.integers(2, 4))
def test_bounded_never_exceeds_bound_nor_misses_protected(seed, p, world):
    bound = 0.02
    cfg = dict(
        loss=LossConfig(
            loss_bound=bound,
            soft_deadline_min_s=0.001,
            soft_deadline_max_s=0.01,
            hard_deadline_s=2.0,
        )
    )
    eps = make(world, **cfg)
    rng = np.random.default_rng(seed)
    datas = [rng.standard_normal(2500).astype(np.float32) for _ in range(world)]
    drop_rng = np.random.default_rng(seed + 1)
    wire = Wire(
        eps,
        jitter=100e-6,
        seed=seed,
        drop=lambda s, dg, q: kind_of(dg) == Kind.DATA and drop_rng.random() < p,
    )
    out = run_allreduce(eps, datas, wire)
    gather_bound = bound / 2
    for r in range(world):
        ev = out[r]
        assert isinstance(ev, AllReduceComplete)
        rep = ev.report
        if not rep.reduce.degraded:
            assert rep.reduce.protected_missing == 0
            assert all(f >= 1 - bound - 1e-12 for f in rep.reduce.delivered.values())
        for g in rep.gather:
            if not g.degraded:
                assert g.protected_missing == 0
                assert all(f >= 1 - gather_bound - 1e-12 for f in g.delivered.values())


def test_bounded_lossless_network_is_exact():
    world = 4
    eps = make(world, loss=LossConfig(loss_bound=0.05))
    rng = np.random.default_rng(2)
    datas = [rng.standard_normal(5000).astype(np.float32) for _ in range(world)]
    out = run_allreduce(eps, datas, Wire(eps))
    for r in range(world):
        np.testing.assert_allclose(out[r].result, np.sum(datas, axis=0), rtol=1e-5, atol=1e-5)
        assert out[r].report.delivered_fraction == 1.0


def test_bounded_drops_only_unprotected_and_fills_unbiased():
    """Drop every first transmission of droppable chunks: the sender tolerates (FIN), the
    receiver completes without waiting for the deadline, protected chunks all arrive."""
    world, n = 2, 20000
    bound = 0.3
    cfg = dict(
        loss=LossConfig(
            loss_bound=bound, gather_loss_bound=bound, soft_deadline_max_s=1.0, hard_deadline_s=5.0
        ),
        priority=PriorityConfig(protected_fraction=0.1, droppable_fraction=0.25),
    )
    eps = make(world, **cfg)
    rng = np.random.default_rng(4)
    datas = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]

    def drop(src, dg, q):
        if kind_of(dg) != Kind.DATA:
            return False
        return bool(header_of(dg)["flags"] & 16)  # DROPPABLE

    wire = Wire(eps, drop=drop)
    out = run_allreduce(eps, datas, wire)
    for r in range(world):
        rep = out[r].report
        assert not rep.degraded
        assert rep.reduce.protected_missing == 0
        assert rep.delivered_fraction < 1.0
        assert rep.duration < 0.5  # completed on FIN, long before the 1 s soft deadline
        assert sum(rep.sender.dropped) > 0
    # Unbiased fill: a chunk missing rank 1's part is rank 0's part times two.
    res = out[0].result
    exact = datas[0] + datas[1]
    lost = ~np.isclose(res, exact, rtol=1e-5, atol=1e-5)
    assert lost.any()
    own_half = res[lost]
    assert np.all(
        np.isclose(own_half, 2 * datas[0][lost], rtol=1e-5, atol=1e-5)
        | np.isclose(own_half, 2 * datas[1][lost], rtol=1e-5, atol=1e-5)
    )


# -- deadlines ----------------------------------------------------------------------------------
def _silent(rank):
    return lambda src, dg, q: src == rank


def test_hard_deadline_degrades_with_exact_report():
    world, n = 3, 1500
    cfg = dict(
        loss=LossConfig(
            loss_bound=0.01,
            soft_deadline_max_s=0.05,
            hard_deadline_s=0.2,
            on_hard_deadline="degrade",
        )
    )
    eps = make(world, **cfg)
    datas = [np.full(n, r + 1, np.float32) for r in range(world)]
    wire = Wire(eps, drop=_silent(2))
    for r in (0, 1):
        eps[r].start(1, 0, datas[r], 0.5, now=0.0)
    wire.run(
        lambda: sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == 1, max_time=5.0
    )
    r, _, ev = wire.events[0]
    assert r == 0 and isinstance(ev, AllReduceComplete)
    rep = ev.report
    assert rep.degraded and rep.reduce.degraded
    assert rep.reduce.delivered[2] == 0.0 and rep.reduce.delivered[1] == 1.0
    assert rep.reduce.missing_elems == n // world
    assert 0.2 <= rep.reduce.duration < 0.25
    # Shard 0 averaged over ranks 0 and 1 and scaled to the world: (1 + 2) / 2 * 3.
    np.testing.assert_allclose(ev.result[: n // world], 4.5)


def test_hard_deadline_raise_names_the_silent_rank():
    world = 3
    cfg = dict(
        loss=LossConfig(
            loss_bound=0.0, hard_deadline_s=0.1, soft_deadline_max_s=0.05, on_hard_deadline="raise"
        )
    )
    eps = make(world, **cfg)
    wire = Wire(eps, drop=_silent(1))
    for r in (0, 2):
        eps[r].start(7, 3, np.ones(900, np.float32), 0.5, now=0.0)
    wire.run(lambda: any(isinstance(e, AllReduceFailed) for _, _, e in wire.events), max_time=5.0)
    fails = [e for _, _, e in wire.events if isinstance(e, AllReduceFailed)]
    err = fails[0].error
    assert isinstance(err, PeerTimeout)
    assert 1 in err.ranks and err.step == 7 and err.bucket == 3
    assert "rank(s) 1" in str(err)


def test_reliable_mode_recovers_from_burst_loss():
    """Bound 0: a 100% loss window on one sender only delays, never loses."""
    world, n = 2, 8000
    eps = make(world)
    wire = Wire(eps)
    wire.drop = lambda src, dg, q: src == 0 and q > 3 and wire.now <= 0.02
    datas = [np.arange(n, dtype=np.float32), np.ones(n, np.float32)]
    out = run_allreduce(eps, datas, wire)
    for r in range(world):
        np.testing.assert_array_equal(out[r].result, datas[0] + datas[1])
    assert wire.dropped > 0


def test_world_of_one_and_empty_bucket():
    ep = TransposeAllReduce(0, 1, TransportConfig())
    ep.start(1, 0, np.arange(10, dtype=np.float32), 0.0, now=0.0)
    ev = ep.next_event()
    np.testing.assert_array_equal(ev.result, np.arange(10, dtype=np.float32))
    eps = make(3)
    out = run_allreduce(eps, [np.zeros(2, np.float32)] * 3, Wire(eps))
    assert all(isinstance(e, AllReduceComplete) for e in out.values())


def test_rotation_commutes_with_the_sum():
    world, n = 2, 4096
    eps = make(world, rotate=True, rotate_block=256)
    rng = np.random.default_rng(9)
    datas = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    out = run_allreduce(eps, datas, Wire(eps))
    for r in range(world):
        np.testing.assert_allclose(out[r].result, datas[0] + datas[1], rtol=1e-4, atol=1e-4)


def test_bad_config_is_a_clear_error():
    from gradlane.transport.errors import ConfigError

    with pytest.raises(ConfigError, match="chunk_bytes"):
        TransportConfig(chunk_bytes=3)
    with pytest.raises(ConfigError, match="unknown setting"):
        TransportConfig.from_mapping({"chunk_byte": 8})
    with pytest.raises(ConfigError, match="pacing must be a PacingConfig"):
        TransportConfig(pacing={"controller": "fixed"})  # a dict: only from_mapping builds it
    with pytest.raises(ConfigError, match="socket_buffer_bytes"):
        TransportConfig(socket_buffer_bytes=0)
    with pytest.raises(ConfigError, match="ack_wait_s"):
        TransportConfig(ack_wait_s=-0.001)
    assert TransportConfig.from_mapping({"pacing": {"controller": "fixed"}}).pacing.controller == (
        "fixed"
    )
    cfg = TransportConfig.from_env({"GRADLANE_LOSS__LOSS_BOUND": "0.02", "GRADLANE_N_PATHS": "2"})
    assert cfg.loss.loss_bound == 0.02 and cfg.n_paths == 2
    # List settings: a comma-separated value, or a single one.
    env = {"GRADLANE_PRIORITY__PINNED_LAYERS": "0,2", "GRADLANE_PRIORITY__DSCP": "46, 0, 0, 8"}
    cfg = TransportConfig.from_env(env)
    assert cfg.priority.pinned_layers == (0, 2) and cfg.priority.dscp == (46, 0, 0, 8)
    cfg = TransportConfig.from_env({"GRADLANE_PRIORITY__PINNED_LAYERS": "3"})
    assert cfg.priority.pinned_layers == (3,)
    with pytest.raises(ConfigError, match="pinned_layers must be a tuple of layer indices"):
        TransportConfig.from_env({"GRADLANE_PRIORITY__PINNED_LAYERS": "embedding"})


def test_reject_counters_by_reason():
    eps = make(2)
    ep = eps[0].endpoint
    ep.receive_datagram(b"\x00" * 10, 0, 0.0)
    ep.receive_datagram(b"\x00" * 60, 0, 0.0)
    ep.handle_timer(0.0)
    c = ep.stats()["rejected"]
    assert c == {"truncated": 1, "bad_magic": 1}
    assert Reason.TRUNCATED.name.lower() in c


def test_sender_report_counts_this_collective_only():
    """Per-path bytes belong to the (step, bucket) reported, not to the rank's lifetime."""
    world = 2
    eps = make(world, n_paths=2)
    wire = Wire(eps)
    reports = {}
    for step in (1, 2):
        datas = [np.ones(3000, np.float32)] * world
        out = run_allreduce(eps, datas, wire, step=step)
        reports[step] = out[0].report.sender
    for rep in reports.values():
        assert sum(rep.per_path_bytes) == rep.bytes_sent > 0
        assert all(b > 0 for b in rep.per_path_bytes)
    assert reports[2].bytes_sent < 2 * reports[1].bytes_sent  # not cumulative


class _Receiving:
    """An endpoint on the wire whose datagrams go in through ``deliver(core, data, path,
    now)``: another of the core's ways in, as a socket driver uses it."""

    def __init__(self, core, deliver):
        self.core, self.deliver = core, deliver

    def receive_datagram(self, data, path, now):
        self.deliver(self.core, data, path, now)

    def __getattr__(self, name):
        return getattr(self.core, name)


def test_zero_copy_receive_matches_receive_datagram():
    """rx_arena + commit_datagrams (the socket drivers' path) behaves as receive_datagram."""
    eps = make(2)
    wire = Wire(eps)
    datas = [np.arange(1000, dtype=np.float32) * (r + 1) for r in range(2)]

    def zero_copy(core, data, path, now):
        row = core.rx_arena[core.rx_free]
        row[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        core.commit_datagrams(np.array([len(data)]), path, now)

    wire.endpoints = [_Receiving(eps[0], zero_copy), eps[1]]
    out = run_allreduce(eps, datas, wire)
    for r in range(2):
        np.testing.assert_array_equal(out[r].result, datas[0] + datas[1])
    # A datagram longer than the row (truncated by the socket) is counted, not processed.
    before = int(eps[0].endpoint.counters[Reason.OVERSIZED])
    eps[0].commit_datagrams(np.array([eps[0].rx_arena.shape[1] + 1]), 0, wire.now)
    eps[0].datagrams_to_send(wire.now)  # processes the batch, as every driver pass does
    assert int(eps[0].endpoint.counters[Reason.OVERSIZED]) == before + 1


def test_rows_received_in_place_match_receive_datagram():
    """receive_rows (a driver's own buffer, as the ZeroMQ plane's batch frames) gives the same
    all-reduce as receive_datagram; rows wider than a slot are cut and a datagram longer than
    the slot is counted as oversized; arrays it cannot read are refused."""
    eps = make(2)
    wire = Wire(eps)
    datas = [np.arange(1000, dtype=np.float32) * (r + 1) for r in range(2)]

    def in_rows(core, data, path, now):
        rows = np.zeros((1, (len(data) + 7) & ~7), dtype=np.uint8)  # a fresh buffer each
        rows[0, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        core.receive_rows(rows, np.array([len(data)]), path, now)

    wire.endpoints = [_Receiving(eps[0], in_rows), eps[1]]
    out = run_allreduce(eps, datas, wire)
    for r in range(2):
        np.testing.assert_array_equal(out[r].result, datas[0] + datas[1])
    width = eps[0].rx_arena.shape[1]
    before = int(eps[0].endpoint.counters[Reason.OVERSIZED])
    wide = np.zeros((2, width + 64), dtype=np.uint8)
    eps[0].receive_rows(wide, np.array([width + 8, 10]), 0, wire.now)
    assert int(eps[0].endpoint.counters[Reason.OVERSIZED]) == before + 1
    with pytest.raises(ValueError, match="rows"):
        eps[0].receive_rows(np.zeros((1, 60), np.uint8), np.array([10]), 0, wire.now)
    with pytest.raises(ValueError, match="lengths"):
        eps[0].receive_rows(np.zeros((2, 64), np.uint8), np.array([10], np.int32), 0, wire.now)


@pytest.mark.parametrize("servers", [(0,), (3,), (1, 2), (0, 1, 2, 3)])
@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_parameter_server_push_pull_is_exact(servers, n):
    """Pushes go only to the servers, pulls only come from them, and every rank gets the sum."""
    world = 4
    eps = make(world)
    data_between = set()

    def watch(src, dg, seq):
        if kind_of(dg) == Kind.DATA:
            data_between.add((src, dg.peer))
        return False

    wire = Wire(eps, drop=watch)
    rng = np.random.default_rng(n)
    datas = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    for r, ep in enumerate(eps):
        ep.start(1, 0, datas[r], layer_position=0.5, now=0.0, servers=servers)
    wire.run(lambda: sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == world)
    expect = np.sum(datas, axis=0)
    for _, _, e in wire.events:
        np.testing.assert_allclose(e.result, expect, rtol=1e-5, atol=1e-5)
    # Every DATA packet has a server at one end (non-servers never talk to each other), and a
    # bucket big enough for every server to own a chunk is pushed to each of them.
    assert all(a in servers or b in servers for a, b in data_between)
    if n >= 4 * 64:
        pushers = {a for a, b in data_between if b in servers}
        assert pushers >= set(range(world)) - (set(servers) if len(servers) == 1 else set())


def test_parameter_server_list_is_validated():
    eps = make(2)
    for bad in ((), (0, 0), (2,), (-1,)):
        with pytest.raises(ValueError, match="servers"):
            eps[0].start(1, 0, np.ones(8, np.float32), 0.5, 0.0, servers=bad)


def test_fin_for_a_finished_transfer_is_answered_with_stop():
    """The receiver's STOP is lost after it completed within the bound: the sender's repeated
    FIN must be answered with STOP again, or the sender holds the transfer until its hard
    deadline (and an engine closing then waits out its drain)."""
    world, n = 2, 20000
    cfg = dict(
        loss=LossConfig(
            loss_bound=0.3, gather_loss_bound=0.3, soft_deadline_max_s=1.0, hard_deadline_s=5.0
        ),
        priority=PriorityConfig(protected_fraction=0.1, droppable_fraction=0.25),
    )
    eps = make(world, **cfg)
    rng = np.random.default_rng(4)
    datas = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    stops_dropped: set[int] = set()

    def drop(src, dg, q):
        kind = kind_of(dg)
        if kind == Kind.STOP and src not in stops_dropped:
            stops_dropped.add(src)  # each receiver's first STOP
            return True
        return kind == Kind.DATA and bool(header_of(dg)["flags"] & 16)  # DROPPABLE, always

    wire = Wire(eps, drop=drop)
    out = run_allreduce(eps, datas, wire)
    assert all(out[r].report.delivered_fraction < 1.0 for r in range(world))
    assert stops_dropped
    t_done = wire.now
    wire.run(lambda: all(not ep.endpoint.sender.transfers for ep in eps), max_time=10.0)
    assert wire.now - t_done < 1.0, f"senders retired {wire.now - t_done:.3f}s after completion"


def test_a_finished_transfer_is_remembered_until_its_senders_hard_deadline():
    """The receiver's STOPs and ACKs are lost for longer than ``linger_s`` after it completed
    within the bound: the sender's backed-off probes and FINs then come after ``linger_s``. They
    must still be answered with STOP, not held as early data of an unknown transfer (answered
    HELD), or the sender keeps the transfer until its hard deadline and a closing plane warns
    that it leaves data unacknowledged."""
    world, n, silent_s = 2, 20000, 3.0
    cfg = dict(
        linger_s=2.0,
        loss=LossConfig(
            loss_bound=0.3, gather_loss_bound=0.3, soft_deadline_max_s=1.0, hard_deadline_s=20.0
        ),
        priority=PriorityConfig(protected_fraction=0.1, droppable_fraction=0.25),
    )
    eps = make(world, **cfg)
    assert silent_s > eps[0].config.linger_s  # the case: silence outlasts the configured linger
    rng = np.random.default_rng(5)
    datas = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    quiet_until: dict[int, float] = {}

    def drop(src, dg, q):
        kind = kind_of(dg)
        if kind == Kind.STOP and src not in quiet_until:
            quiet_until[src] = wire.now + silent_s  # from the first STOP on, for silent_s
        if kind in (Kind.STOP, Kind.ACK) and wire.now < quiet_until.get(src, -1.0):
            return True
        return kind == Kind.DATA and bool(header_of(dg)["flags"] & 16)  # DROPPABLE, always

    wire = Wire(eps, drop=drop)
    out = run_allreduce(eps, datas, wire)
    assert all(out[r].report.delivered_fraction < 1.0 for r in range(world))
    assert quiet_until
    t_done = wire.now
    wire.run(lambda: all(not ep.owed() for ep in eps), max_time=30.0)
    # Settled by a STOP after the silence (a few backed-off RTOs), not by the 20 s deadline.
    assert wire.now - t_done < 10.0, f"senders retired {wire.now - t_done:.3f}s after completion"
    assert all(ep.endpoint.receiver.tombstones for ep in eps)  # still remembered then


def test_buffers_are_released_at_completion_despite_zero_copy():
    """Payloads are sent straight from the caller's buffers, but once a rank's collective
    completes its input and result belong to the caller again: overwriting them must not change
    what its peers still receive."""
    from gradlane.scheduling.pacing import PacingConfig

    slow = PacingConfig(controller="fixed", initial_rate_Bps=2e5, min_rate_Bps=1e5, burst_bytes=600)
    flat = PriorityConfig(policy="flat")  # one class: rank 0 sends its reduce shard, then gather
    eps = [
        TransposeAllReduce(0, 2, TransportConfig(chunk_bytes=256, pacing=slow, priority=flat)),
        TransposeAllReduce(1, 2, TransportConfig(chunk_bytes=256, priority=flat)),
    ]
    wire = Wire(eps)
    rng = np.random.default_rng(3)
    datas = [rng.standard_normal(4000).astype(np.float32) for _ in range(2)]
    expect = datas[0] + datas[1]
    for r, ep in enumerate(eps):
        ep.start(1, 0, datas[r], layer_position=0.5, now=0.0)

    def finished(rank):
        return any(r == rank and isinstance(e, AllReduceComplete) for r, _, e in wire.events)

    wire.run(lambda: finished(0) or finished(1))
    assert finished(0) and not finished(1)  # rank 0 is done; its gather is still on its way
    (res0,) = [e.result for r, _, e in wire.events if r == 0]
    np.testing.assert_allclose(res0, expect, rtol=1e-6)
    datas[0][:] = np.nan  # the caller reuses both buffers at once
    res0[:] = np.nan
    wire.run(lambda: finished(1))
    (res1,) = [e.result for r, _, e in wire.events if r == 1]
    np.testing.assert_allclose(res1, expect, rtol=1e-6)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("world", [2, 3])
def test_in_place_result_is_exact(world, dtype, rotate):
    """``out=data``: the sum lands in the caller's buffer, as dist.all_reduce does, even over a
    lossy, reordering wire (retransmissions must not read already-overwritten shards)."""
    eps = make(world, rotate=rotate, rotate_block=64)
    rng = np.random.default_rng(world)
    datas = [rng.standard_normal(5003).astype(dtype) for _ in range(world)]
    expect = np.sum([d.astype(np.float64) for d in datas], axis=0)
    bufs = [d.copy() for d in datas]
    wire = Wire(eps, jitter=2e-4, seed=7, drop=lambda src, dg, q: q % 5 == 2)
    for r, ep in enumerate(eps):
        ep.start(1, 0, bufs[r], layer_position=0.5, now=0.0, out=bufs[r])
    wire.run(lambda: sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == world)
    tol = 1e-4 if dtype == np.float32 else 5e-3 * world
    for r, _, e in wire.events:
        assert e.result is bufs[r]
        np.testing.assert_allclose(bufs[r].astype(np.float64), expect, rtol=tol, atol=tol)


def test_out_buffer_is_validated():
    ep = make(2)[0]
    x = np.ones(8, np.float32)
    for bad in (np.ones(9, np.float32), np.ones(8, np.float16), np.ones(16, np.float32)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            ep.start(1, 0, x, 0.5, 0.0, out=bad)


def test_data_payloads_are_views_of_the_callers_buffer_until_detached():
    """Zero-copy: a DATA datagram's payload is the caller's memory, never copied by the core;
    once the collective ends (detach), the payloads still owed are copied out, so the caller
    may reuse its buffer while peers still need retransmissions."""
    eps = make(2)
    x = np.arange(1000, dtype=np.float32)
    eps[0].start(1, 0, x, 0.5, 0.0)
    dgs = [d for d in flat(eps[0].datagrams_to_send(0.0)) if d.payload is not None]
    assert dgs
    assert all(np.shares_memory(np.frombuffer(d.payload, np.uint8), x) for d in dgs)
    sender = eps[0].endpoint.sender
    (t,) = sender.transfers.values()
    every = np.arange(t.n_chunks)

    def wires(chunks: np.ndarray) -> list[bytes]:
        run = t.run(chunks, np.zeros_like(chunks), 0)
        # The addresses a driver's sendmmsg table points at are those of the run's buffers.
        assert run.hdr_addr == np.frombuffer(run.hdr, np.uint8).ctypes.data
        assert run.payload_addr == np.frombuffer(run.payload, np.uint8).ctypes.data
        return [d.wire() for d in run]

    before = wires(every)
    assert before[0] == dgs[0].wire() or any(d.wire() == before[0] for d in dgs)
    # Every state but ACKED may be sent again: an ABANDONED chunk when a NACK asks for it.
    t.state[:] = ACKED
    t.state[1] = ABANDONED
    t.state[2] = LOST
    t.state[-1] = INFLIGHT  # the last chunk is the short one (copied on its own)
    assert t.n_chunks == 8 and t.lengths[-1] - 48 < t.chunk_bytes
    sender.detach(1, 0)
    before = [b for c, b in enumerate(before) if t.state[c] != ACKED]
    x[:] = -1.0  # the caller reuses its buffer
    owed = np.flatnonzero(t.state != ACKED)
    after = wires(owed)
    assert after == before and len(after) == 3
    assert not any(
        np.shares_memory(np.frombuffer(d.payload, np.uint8), x)
        for d in t.run(every, np.zeros_like(every), 0)
    )


def _count_copies(monkeypatch) -> list[int]:
    """Patch ``OutTransfer.release_source`` to record how many chunks each call copies."""
    from gradlane.transport.core.outgoing import OutTransfer

    copied: list[int] = []
    release = OutTransfer.release_source

    def counting(self, spares=None):
        if self._owned is None:
            copied.append(int(np.count_nonzero(self.state != ACKED)))
        release(self, spares)

    monkeypatch.setattr(OutTransfer, "release_source", counting)
    return copied


@pytest.mark.parametrize("world", [2, 4])
def test_completion_waits_for_the_last_acks_instead_of_copying(monkeypatch, world):
    """A rank whose shards are all in while its own gather data is still unacknowledged waits
    (at most ack_wait_s) for the acknowledgements, so no payload is copied out of the caller's
    buffer; with ack_wait_s = 0 the same run copies them (the test can fail)."""
    rng = np.random.default_rng(world)
    datas = [rng.standard_normal(20_000).astype(np.float32) for _ in range(world)]
    expect = np.sum(datas, axis=0, dtype=np.float64)
    for wait, copies in ((0.01, False), (0.0, True)):
        copied = _count_copies(monkeypatch)
        eps = make(world, ack_wait_s=wait)
        out = run_allreduce(eps, datas, Wire(eps, latency=50e-6, jitter=20e-6, seed=world))
        for e in out.values():
            np.testing.assert_allclose(e.result, expect, rtol=1e-5, atol=1e-5)
        assert (sum(copied) > 0) == copies, (wait, copied)


def test_copied_out_payload_buffers_are_recycled_without_corrupting_retransmissions(monkeypatch):
    """With no ack wait, payloads are copied out at every completion; the copies' buffers go back
    to the sender's spares when their transfers end and serve later collectives, while a lossy,
    reordering wire keeps retransmitting from them: every step stays exact."""
    from gradlane.transport.core.outgoing import SparePayloads

    reused = []
    take = SparePayloads.take

    def counting_take(self, nbytes):
        reused.append(bool(self._free.get(nbytes)))
        return take(self, nbytes)

    monkeypatch.setattr(SparePayloads, "take", counting_take)
    eps = make(2, ack_wait_s=0.0)
    wire = Wire(eps, jitter=2e-4, seed=11, drop=lambda src, dg, q: q % 5 == 2)
    rng = np.random.default_rng(11)
    for step in range(1, 7):
        datas = [rng.standard_normal(2000).astype(np.float32) for _ in range(2)]
        out = run_allreduce(eps, datas, wire, step=step)
        for e in out.values():
            np.testing.assert_allclose(e.result, datas[0] + datas[1], rtol=1e-6)
    assert any(reused) and len(reused) > 2


def test_spare_payloads_keep_a_bounded_number_of_buffers():
    from gradlane.transport.core.outgoing import SparePayloads

    spares = SparePayloads(max_bytes=300, per_size=2)
    a, b, c = (np.empty(100, np.uint8) for _ in range(3))
    for buf in (a, b, c):
        spares.give(buf)
    assert spares.bytes == 200  # two of a size
    spares.give(np.empty(150, np.uint8))  # over max_bytes: dropped
    assert spares.bytes == 200
    assert {id(spares.take(100)), id(spares.take(100))} == {id(a), id(b)}
    assert spares.bytes == 0 and spares.take(100).shape == (100,)  # empty: a new one


def test_runs_toward_a_peer_follow_the_global_priority_order():
    """A transfer's classes may leave in one sending batch (one run per class and TOS), but
    never ahead of another transfer's more urgent chunks to the same peer: toward each peer
    the runs come in (class, layer position) order, each run one class with that class's TOS."""
    from gradlane.transport.core.events import DatagramRun
    from gradlane.transport.wire.header import HEADER_SIZE

    eps = make(2, chunk_bytes=256)
    rng = np.random.default_rng(8)
    tos = {eps[0].config.priority.tos(c): c for c in range(eps[0].config.priority.n_classes)}
    order = []
    for bucket, pos in ((0, 0.9), (1, 0.1)):  # a back layer's bucket first, then a front one's
        x = rng.standard_normal(6000).astype(np.float32)
        eps[0].start(1, bucket, x, layer_position=pos, now=0.0)
    for item in eps[0].datagrams_to_send(0.0):
        if not isinstance(item, DatagramRun):
            continue
        hdr = np.frombuffer(item.hdr, np.uint8).reshape(-1, HEADER_SIZE)[item.chunks]
        classes = set(hdr[:, 5].tolist())  # the prio byte of each header
        assert classes == {tos[item.tos]}
        bucket = int(hdr[0, 16])
        order.append((tos[item.tos], 0.9 if bucket == 0 else 0.1))
    assert len({c for c, _ in order}) >= 3  # several classes went out in this one pass
    assert order == sorted(order)


def test_the_wait_for_acks_is_bounded_by_ack_wait_s():
    """Acknowledgements that never come (all of rank 1's ACKs and STOPs are lost) hold rank 0's
    completion back by ack_wait_s exactly, then what is owed is copied out; the result is
    unchanged."""

    def no_acks_from_1(src, dg, q):
        return src == 1 and kind_of(dg) in (Kind.ACK, Kind.STOP)

    rng = np.random.default_rng(5)
    datas = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    done_at = {}
    for wait in (0.0, 0.004):
        eps = make(2, ack_wait_s=wait)
        wire = Wire(eps, drop=no_acks_from_1)
        out = run_allreduce(eps, datas, wire)
        np.testing.assert_allclose(out[0].result, datas[0] + datas[1], rtol=1e-6)
        done_at[wait] = [t for r, t, e in wire.events if r == 0 and e.step == 1]
    assert done_at[0.004][0] - done_at[0.0][0] == pytest.approx(0.004, abs=1e-9)


def test_the_wait_for_acks_counts_from_the_drivers_next_time_not_the_completing_call(monkeypatch):
    """The call that completes a result began before its batch was processed, which can take
    longer than the whole ACK wait (~4 ms for 128 datagrams of 64 KB). The wait counts from the
    next time the driver passes in (``get_timer`` asks for one at once), so a driver that comes
    back 5 ms later still waits ``ack_wait_s`` from then. Counted from the completing call, the
    wait would always have run out already and the whole gather shard be copied out at once."""
    copied = _count_copies(monkeypatch)
    eps = make(2, ack_wait_s=0.002)

    def no_acks_from_1(src, dg, q):
        return src == 1 and kind_of(dg) in (Kind.ACK, Kind.STOP)

    wire = Wire(eps, drop=no_acks_from_1)
    rng = np.random.default_rng(6)
    datas = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    for r, ep in enumerate(eps):
        ep.start(1, 0, datas[r], layer_position=0.5, now=0.0)
    wire.run(lambda: bool(eps[0]._waiting))  # rank 0's result is in; its data is unacked
    completed_at = wire.now
    timer = eps[0].get_timer()
    assert timer is not None and timer <= completed_at  # "now": start the wait's clock
    later = completed_at + 0.005  # the driver is back after processing for 5 ms
    eps[0].handle_timer(later)
    assert eps[0].next_event() is None and not copied  # still waiting, nothing copied
    assert eps[0].get_timer() == pytest.approx(later + 0.002)
    eps[0].handle_timer(later + 0.002)
    done = eps[0].next_event()
    assert isinstance(done, AllReduceComplete)  # the ACKs never came: owed data copied out
    assert copied and all(n > 0 for n in copied)  # its reduce and gather data
    np.testing.assert_allclose(done.result, datas[0] + datas[1], rtol=1e-6)


def test_payload_changed_under_a_live_transfer_is_rejected_not_applied():
    """The tag in a header is computed from the payload at start, so a buffer the caller
    rewrites mid-collective cannot deliver wrong values: the receiver counts bad tags."""
    eps = make(2)
    x = np.ones(1000, dtype=np.float32)
    y = np.ones(1000, dtype=np.float32)
    eps[0].start(1, 0, x, 0.5, 0.0)
    eps[1].start(1, 0, y, 0.5, 0.0)
    dgs = [d for d in flat(eps[0].datagrams_to_send(0.0)) if d.payload is not None]
    x += 1.0  # against the API contract: the caller writes its buffer mid-collective
    for d in dgs:
        eps[1].receive_datagram(d.wire(), d.path, 0.0)
    eps[1].datagrams_to_send(0.0)
    assert eps[1].endpoint.stats()["rejected"].get("bad_tag") == len(dgs)
    assert np.all(y == 1.0)  # nothing was added to the receiver's shard


@pytest.mark.parametrize("loss_bound", [0.0, 0.05])
def test_path_accounting_drains_when_transfers_end(loss_bound):
    """After collectives over a lossy, reordering wire (RACK losses, NACK resends, STOPs that
    overtake the last ACKs), every path's outstanding bytes return to zero once the senders'
    transfers are over: bytes in flight at the end are released, written-off ones are not
    taken out twice. A leak here kept paths from ever looking drained, so idle gaps between
    steps read as slow delivery and the rate estimates of all but one path collapsed."""
    from gradlane.scheduling.loss import LossConfig

    world, n = 3, 6000
    eps = make(world, n_paths=2, loss=LossConfig(loss_bound=loss_bound))
    rng = np.random.default_rng(11)
    wire = Wire(eps, jitter=300e-6, seed=5, drop=lambda src, dg, seq: rng.random() < 0.1)
    for step in range(1, 5):
        datas = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
        out = run_allreduce(eps, datas, wire, step=step)
        assert all(isinstance(out[r], AllReduceComplete) for r in range(world))
    senders = [ep.endpoint.sender for ep in eps]
    wire.run(lambda: not any(s.transfers for s in senders), max_time=wire.now + 30.0)
    assert not any(s.transfers for s in senders)
    for s in senders:
        for peer, ps in s.paths.items():
            np.testing.assert_array_equal(ps.outstanding, 0.0, err_msg=f"peer {peer}")


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_nonfinite_values_are_reported_by_every_rank(dtype: DType) -> None:
    """A NaN in one rank's contribution and an infinity in another's make their chunks of the
    sum non-finite: the owner of each such shard sees it in its reduce report (from the chunk
    norms), every other rank in its gather reports (from the place kernel); a clean collective
    reports none."""
    world, n = 3, 6000
    rng = np.random.default_rng(3)
    clean = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    dirty = [d.copy() for d in clean]
    dirty[1][10] = np.nan  # shard 0 (rank 0 owns elements [0, 2000))
    dirty[2][4500] = np.inf  # shard 2

    def words(xs: list[np.ndarray]) -> list[np.ndarray]:
        if dtype == DType.F32:
            return xs
        out = []
        for x in xs:
            w = np.empty(n, dtype=np.uint16)
            from_f32(x, dtype, w)
            out.append(w)
        return out

    for datas, bad in ((clean, 0), (dirty, 2)):
        eps = make(world)
        out = run_allreduce(eps, words(datas), Wire(eps), dtype=dtype)
        for r in range(world):
            rep = out[r].report
            assert rep.nonfinite_chunks == bad, (r, rep)
            own = 1 if bad and r in (0, 2) else 0
            assert rep.reduce.nonfinite_chunks == own


@pytest.mark.parametrize("world", [3, 4])
def test_deterministic_sums_are_the_same_bits_whatever_the_arrival_order(world: int) -> None:
    """Each shard's owner adds its own contribution, then the others in rank order, however
    the network reorders and loses them; with the order off, arrival order decides."""
    n = 5000
    rng = np.random.default_rng(world)
    datas = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
             for _ in range(world)]  # fmt: skip
    bounds = np.linspace(0, n, world + 1).astype(int)
    ref = np.empty(n, dtype=np.float32)
    for owner in range(world):
        part = slice(bounds[owner], bounds[owner + 1])
        acc = datas[owner][part].copy()
        for r in range(world):
            if r != owner:
                acc = (acc + datas[r][part]).astype(np.float32)
        ref[part] = acc
    results = {}
    for det in (True, False):
        for seed in range(3):
            eps = make(world, deterministic_sum=det)
            drop_rng = np.random.default_rng(100 + seed)
            wire = Wire(eps, jitter=200e-6, seed=seed, drop=lambda *_, g=drop_rng: g.random() < 0.1)
            out = run_allreduce(eps, datas, wire)
            for r in range(world):
                assert isinstance(out[r], AllReduceComplete)
                results[(det, seed, r)] = out[r].result.view(np.uint32).copy()
    assert bounds.tolist() == [int(b) for b in shard_bounds(n, world)]
    for seed in range(3):
        for r in range(world):
            assert np.array_equal(results[(True, seed, r)], ref.view(np.uint32))
    # Arrival order decides without it (the test's data makes float32 addition order matter).
    assert any(
        not np.array_equal(results[(False, seed, r)], ref.view(np.uint32))
        for seed in range(3)
        for r in range(world)
    )
