"""The ZeroMQ control plane (HELLO, stats) and reliable data plane, over ipc:// on one host.

Every socket, context, server and plane is closed by a fixture even when a test fails; every
wait has a timeout (pytest-timeout on each test, ``Future.result(timeout=...)``), so a hang is a
failure. Nothing synchronises by sleeping: ZeroMQ queues messages until the peer binds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import zmq
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.drivers.zmq import frames as zmq_batch
from gradlane.transport.drivers.zmq.handshake import (
    Announcement,
    ControlServer,
    HandshakeError,
    HandshakeTimeout,
    hello,
    request_stats,
)
from gradlane.transport.drivers.zmq.plane import ZmqPlane, zmq_config
from gradlane.transport.errors import ConfigError, PeerTimeout, TransferFailed

from tests.support.checks import check_pinned_goes_in_class_0

pytestmark = pytest.mark.timeout(90)

RESULT_TIMEOUT_S = 60.0


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    """A short directory for ipc:// sockets (their paths are limited to ~100 bytes)."""
    path = tempfile.mkdtemp(prefix="gl-zmq-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """Register servers and planes; all are closed at teardown (reverse order), pass or fail."""
    opened: list[Any] = []

    def track(obj: Any) -> Any:
        opened.append(obj)
        return obj

    yield track
    for obj in reversed(opened):
        obj.close()
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("gl-")]
    assert leaked == [], f"threads left running: {leaked}"


def _servers(ipc_dir: str, world: int, closing: Callable[[Any], Any], **cfg: Any):
    config = zmq_config(**cfg)
    anns = [
        Announcement(r, world, config.job, (f"ipc://{ipc_dir}/data-{r}",), {"pid": os.getpid()})
        for r in range(world)
    ]
    servers = [closing(ControlServer(config, a, f"ipc://{ipc_dir}/ctl-{a.rank}")) for a in anns]
    return config, anns, servers


def _planes(ipc_dir: str, world: int, closing: Callable[[Any], Any], **cfg: Any):
    config = zmq_config(**cfg)
    eps = [f"ipc://{ipc_dir}/data-{r}" for r in range(world)]
    return [closing(ZmqPlane(r, world, config, eps).start()) for r in range(world)]


def _allreduce(planes: list[ZmqPlane], step: int, bucket: int, xs: list[np.ndarray]):
    futs = [p.submit(step, bucket, x) for p, x in zip(planes, xs, strict=True)]
    return [f.result(timeout=RESULT_TIMEOUT_S) for f in futs]


# -- control plane ------------------------------------------------------------------------------
def test_hello_among_three_ranks_then_stats(ipc_dir, closing):
    config, anns, servers = _servers(ipc_dir, 3, closing, job=77, secret="s3cret")
    ctl = [s.endpoint for s in servers]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda a: hello(config, a, ctl, timeout_s=30), anns))
    for r, peers in enumerate(got):
        assert peers == {j: anns[j] for j in range(3) if j != r}
    for r, s in enumerate(servers):
        assert sorted(s.peers) == [j for j in range(3) if j != r]
        assert list(s.rejected) == [] and s.n_rejected == 0
    servers[1].stats_source = lambda: {"answer": 42}
    stats = request_stats(servers[1].endpoint, timeout_s=30)
    assert stats == {"answer": 42, "control": {"rank": 1, "peers": [0, 2], "hello_rejected": 0}}


def test_hello_waits_for_a_peer_that_binds_late(ipc_dir, closing):
    config, anns, servers = _servers(ipc_dir, 2, closing)
    ctl = [servers[0].endpoint, f"ipc://{ipc_dir}/ctl-late"]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(hello, config, anns[0], ctl, timeout_s=30)
        closing(ControlServer(config, anns[1], ctl[1]))  # whenever it binds, the HELLO is queued
        assert pending.result(timeout=RESULT_TIMEOUT_S) == {1: anns[1]}


@pytest.mark.parametrize(
    ("ours", "match"),
    [
        (
            {"job": 2},
            r"rank 1 \(ipc://.*\) refused our HELLO: foreign job: the HELLO is of job 2, expected",
        ),
        ({"secret": "wrong"}, r"rank 1 \(ipc://.*\) refused our HELLO: bad integrity tag"),
    ],
    ids=["foreign-job", "wrong-secret"],
)
def test_a_foreign_or_forged_hello_is_refused_naming_the_peer(ipc_dir, closing, ours, match):
    _, _, servers = _servers(ipc_dir, 2, closing, job=1, secret="right")
    intruder = zmq_config(**{"job": 1, "secret": "right", **ours})
    me = Announcement(0, 2, intruder.job, (f"ipc://{ipc_dir}/x",))
    with pytest.raises(HandshakeError, match=match):
        hello(intruder, me, [s.endpoint for s in servers], timeout_s=30)
    assert len(servers[1].rejected) == servers[1].n_rejected == 1
    assert servers[1].peers == {}


def test_a_world_size_mismatch_is_refused_naming_the_peer(ipc_dir, closing):
    config, anns, servers = _servers(ipc_dir, 2, closing)
    assert hello(config, anns[0], [s.endpoint for s in servers], timeout_s=30) == {1: anns[1]}
    confused = Announcement(0, 3, config.job, ("ipc://unused",))
    eps = [s.endpoint for s in servers] + [f"ipc://{ipc_dir}/none"]
    with pytest.raises(
        HandshakeError, match=r"rank 1 .* world size mismatch: the HELLO says 3, expected 2"
    ):
        hello(config, confused, eps, timeout_s=30)


def test_a_missing_rank_times_out_naming_it(ipc_dir, closing):
    config, anns, servers = _servers(ipc_dir, 3, closing)
    ctl = [servers[0].endpoint, servers[1].endpoint, f"ipc://{ipc_dir}/nobody-home"]
    with pytest.raises(HandshakeTimeout, match=r"rank\(s\) 2 \(ipc://.*nobody-home\)") as err:
        hello(config, anns[0], ctl, timeout_s=0.3)
    assert err.value.ranks == (2,)
    assert isinstance(err.value, PeerTimeout)


# -- data plane ---------------------------------------------------------------------------------
CASES = [
    pytest.param(np.float32, 1, id="f32-1"),
    pytest.param(np.float32, 16_253, id="f32-odd"),
    pytest.param(np.float32, 2 * 1024 * 1024 + 7, id="f32-8MB"),
    pytest.param(np.float16, 100_003, id="f16-odd"),
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("dtype", "n"), CASES)
def test_allreduce_equals_the_numpy_sum(ipc_dir, closing, world, dtype, n):
    planes = _planes(ipc_dir, world, closing)
    rng = np.random.default_rng([world, n])
    xs = [rng.standard_normal(n).astype(dtype) for _ in range(world)]
    expect = np.sum([x.astype(np.float64) for x in xs], axis=0)
    copies = [x.copy() for x in xs]
    for result, report in _allreduce(planes, 3, 1, xs):
        assert result.dtype == dtype and result.shape == (n,)
        tol = 1e-5 if dtype == np.float32 else 2e-3
        np.testing.assert_allclose(result.astype(np.float64), expect, rtol=tol, atol=tol * world)
        assert not report.degraded and report.delivered_fraction == 1.0
    for x, x0 in zip(xs, copies, strict=True):
        np.testing.assert_array_equal(x, x0)  # the caller's buckets are left untouched


def test_parameter_server_push_pull_is_exact(ipc_dir, closing):
    planes = _planes(ipc_dir, 3, closing)
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal(100_003).astype(np.float32) for _ in planes]
    futs = [p.submit(2, 0, x, servers=(1,)) for p, x in zip(planes, xs, strict=True)]
    expect = np.sum(xs, axis=0)
    for f in futs:
        result, report = f.result(timeout=RESULT_TIMEOUT_S)
        np.testing.assert_allclose(result, expect, rtol=1e-5, atol=1e-5)
        assert report.delivered_fraction == 1.0


def test_handshake_then_allreduce_with_concurrent_buckets_and_stats(ipc_dir, closing):
    config, anns, servers = _servers(ipc_dir, 3, closing, job=9, secret="k")
    ctl = [s.endpoint for s in servers]
    with ThreadPoolExecutor(3) as pool:
        views = list(pool.map(lambda a: hello(config, a, ctl, timeout_s=30), anns))
    planes = []
    for r, peers in enumerate(views):
        eps = [anns[r].data if j == r else peers[j].data for j in range(3)]
        planes.append(closing(ZmqPlane(r, 3, config, eps).start()))
        servers[r].stats_source = planes[r].stats
    rng = np.random.default_rng(7)
    buckets = [[rng.standard_normal(5000 + b).astype(np.float32) for _ in planes] for b in range(4)]
    # Submit every bucket from a different thread per rank before waiting on any.
    with ThreadPoolExecutor(3) as pool:
        futs = list(
            pool.map(lambda r: [planes[r].submit(0, b, buckets[b][r]) for b in range(4)], range(3))
        )
    for b in range(4):
        expect = np.sum(buckets[b], axis=0, dtype=np.float64)
        for r in range(3):
            result, _ = futs[r][b].result(timeout=RESULT_TIMEOUT_S)
            np.testing.assert_allclose(result, expect, rtol=1e-5, atol=3e-5)
    stats = request_stats(servers[2].endpoint, timeout_s=30)
    assert stats["rank"] == 2 and stats["completed"] == 4 and stats["failed"] == 0
    assert stats["frames_in"] > 0 and stats["endpoint"]["accepted"] > 0
    # Nothing is malformed; a duplicate could only come from a spurious timer on a loaded host.
    assert set(stats["endpoint"]["rejected"]) <= {"duplicate"}
    assert stats["control"] == {"rank": 2, "peers": [0, 1], "hello_rejected": 0}


def test_close_mid_collective_fails_the_future_clearly(ipc_dir, closing):
    # A long hard deadline: the collective can only end by close(), never by degrading.
    planes = _planes(ipc_dir, 2, closing, loss=LossConfig(loss_bound=0.0, hard_deadline_s=60.0))
    fut = planes[0].submit(0, 0, np.ones(70_001, dtype=np.float32))  # rank 1 never joins
    assert not fut.done()
    planes[0].close()
    with pytest.raises(TransferFailed, match=r"rank 0: .*step 0 bucket 0.*closed"):
        fut.result(timeout=RESULT_TIMEOUT_S)
    late = planes[0].submit(1, 0, np.ones(3, dtype=np.float32))
    with pytest.raises(TransferFailed, match="closed"):
        late.result(timeout=RESULT_TIMEOUT_S)


def test_a_silent_peer_fails_the_future_with_peer_timeout(ipc_dir, closing):
    loss = LossConfig(
        loss_bound=0.0,
        soft_deadline_min_s=0.05,
        soft_deadline_max_s=0.1,
        hard_deadline_s=0.2,
        on_hard_deadline="raise",
    )
    planes = _planes(ipc_dir, 2, closing, loss=loss)
    fut = planes[0].submit(4, 2, np.ones(1000, dtype=np.float32))  # rank 1 never joins
    with pytest.raises(PeerTimeout, match=r"rank\(s\) 1 did not deliver step 4 bucket 2"):
        fut.result(timeout=RESULT_TIMEOUT_S)
    assert planes[0].stats()["failed"] == 1


def test_submit_before_start_fails_clearly(ipc_dir, closing):
    plane = closing(ZmqPlane(0, 2, zmq_config(), [f"ipc://{ipc_dir}/a", f"ipc://{ipc_dir}/b"]))
    with pytest.raises(TransferFailed, match="not started"):
        plane.submit(0, 0, np.ones(3, dtype=np.float32)).result(timeout=RESULT_TIMEOUT_S)


def _zmq_threads() -> int:
    """Native ZeroMQ threads (I/O, reaper). Python threads are counted by ``threading``:
    a joined Python thread's OS task may linger a moment, so /proc task counts would flake."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read())
        except OSError:  # the task exited while we listed it
            continue
    return sum(name.startswith("ZMQbg") for name in names)


def _resources() -> tuple[int, int, int]:
    return len(os.listdir("/proc/self/fd")), _zmq_threads(), threading.active_count()


def test_no_fd_or_thread_growth_over_30_collectives(ipc_dir, closing):
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(40_000).astype(np.float32) for _ in range(2)]
    with ZmqPlane(0, 2, zmq_config(), [f"ipc://{ipc_dir}/w0", f"ipc://{ipc_dir}/w1"]) as a:
        b = closing(ZmqPlane(1, 2, zmq_config(), [f"ipc://{ipc_dir}/w0", f"ipc://{ipc_dir}/w1"]))
        b.start()
        # Warm up: connections, JIT, and pyzmq's process-wide zero-copy GC thread come up once.
        _allreduce([a, b], 0, 0, xs)
        before = _resources()
        for step in range(1, 31):
            _allreduce([a, b], step, 0, xs)
        assert _resources() == before
        b.close()
    # Everything a pair of planes opened is released on close.
    base = _resources()
    eps = [f"ipc://{ipc_dir}/v0", f"ipc://{ipc_dir}/v1"]
    with ZmqPlane(0, 2, zmq_config(), eps) as c, ZmqPlane(1, 2, zmq_config(), eps) as d:
        _allreduce([c, d], 0, 0, xs)
    assert _resources() == base


def test_a_pinned_bucket_goes_in_class_0(ipc_dir, closing):
    planes = _planes(ipc_dir, 2, closing)
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(100_000).astype(np.float32) for _ in range(2)]
    check_pinned_goes_in_class_0(planes, xs, RESULT_TIMEOUT_S)


def test_scale_multiplies_the_sum(ipc_dir, closing):
    planes = _planes(ipc_dir, 2, closing)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(70_001).astype(np.float32) for _ in range(2)]
    futs = [p.submit(4, 0, x, scale=0.5) for p, x in zip(planes, xs, strict=True)]
    for f in futs:
        result, _ = f.result(timeout=RESULT_TIMEOUT_S)
        np.testing.assert_allclose(result, (xs[0] + xs[1]) * 0.5, rtol=1e-6, atol=1e-6)


def _batch(count: int, *records: bytes) -> bytes:
    """A batch frame (gradlane.transport.drivers.zmq.frames's layout) declaring ``count``
    records, in rows as wide as the longest."""
    stride = max((len(r) + 7) & ~7 for r in records)
    out = zmq_batch.BATCH_MAGIC + count.to_bytes(4, "little") + stride.to_bytes(4, "little")
    out += bytes(4) + b"".join(len(r).to_bytes(4, "little") for r in records)
    out += bytes(-len(out) % 8)
    return out + b"".join(r + bytes(stride - len(r)) for r in records)


def test_runs_travel_batched_and_broken_batch_frames_are_counted_not_trusted(ipc_dir, closing):
    planes = _planes(ipc_dir, 2, closing)
    rng = np.random.default_rng(11)
    junk = rng.integers(0, 256, 200, dtype=np.uint8).tobytes()  # no gradlane magic: rejected
    broken = [
        _batch(1, junk)[:-40],  # its row runs past the end
        _batch(5, junk),  # declares five records, holds one
        (zmq_batch.BATCH_MAGIC[:3] + b"\x01")  # another layout version
        + _batch(1, junk)[4:],
    ]
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUSH)
    raw.linger = 0
    try:
        raw.connect(f"ipc://{ipc_dir}/data-0")
        for frame in [*broken, _batch(1, junk)]:  # the last is well-framed garbage
            raw.send(frame)
        xs = [rng.standard_normal(1_000_003).astype(np.float32) for _ in range(2)]
        expect = xs[0].astype(np.float64) + xs[1]
        # Each collective is a sync point; the forged frames arrive within a few of them.
        for step in range(20):
            for result, report in _allreduce(planes, step, 0, xs):
                np.testing.assert_allclose(result, expect, rtol=1e-5, atol=1e-5)
                assert report.delivered_fraction == 1.0
            stats = planes[0].stats()
            if stats["bad_frames"] == len(broken):
                break
    finally:
        raw.close()
    assert stats["bad_frames"] == len(broken)
    # A broken frame is dropped whole; the well-framed junk packet reaches the core, which
    # rejects it.
    assert stats["endpoint"]["rejected"].get("bad_magic", 0) == 1
    # A 4 MB shard's runs went as batch frames: many packets per ZeroMQ message.
    b = planes[1].stats()
    assert b["bad_frames"] == 0 and b["packets_in"] >= 2 * b["frames_in"]


def test_batch_bytes_zero_sends_one_packet_per_frame_and_a_negative_one_is_refused(
    ipc_dir, closing
):
    eps = [f"ipc://{ipc_dir}/u0", f"ipc://{ipc_dir}/u1"]
    with pytest.raises(ConfigError, match="batch_bytes"):
        ZmqPlane(0, 2, zmq_config(), eps, batch_bytes=-1)
    planes = [closing(ZmqPlane(r, 2, zmq_config(), eps, batch_bytes=0).start()) for r in (0, 1)]
    rng = np.random.default_rng(12)
    xs = [rng.standard_normal(300_001).astype(np.float32) for _ in range(2)]
    for result, _ in _allreduce(planes, 0, 0, xs):
        np.testing.assert_allclose(result, xs[0] + xs[1], rtol=1e-5, atol=1e-5)
    for p in planes:
        s = p.stats()
        assert s["packets_out"] == s["frames_out"] and s["packets_in"] == s["frames_in"] > 0


def test_batch_frame_buffers_are_reused_not_made_per_frame(ipc_dir, closing):
    """Send buffers go back to a pool once ZeroMQ has sent them: over many collectives the
    plane stops making new ones, and no reused buffer was overwritten while still in flight
    (a packet changed underneath would fail its tag: nothing is rejected)."""
    planes = _planes(ipc_dir, 2, closing)
    rng = np.random.default_rng(13)
    xs = [rng.standard_normal(2_000_003).astype(np.float32) for _ in range(2)]
    expect = xs[0].astype(np.float64) + xs[1]

    def rounds(steps: range) -> None:
        for step in steps:
            for result, _ in _allreduce(planes, step, 0, xs):
                np.testing.assert_allclose(result, expect, rtol=1e-5, atol=1e-5)

    rounds(range(0, 5))
    made = [p.stats()["send_buffers"] for p in planes]
    frames = [p.stats()["frames_out"] for p in planes]
    rounds(range(5, 25))
    for p, m, f in zip(planes, made, frames, strict=True):
        s = p.stats()
        # 8 MB: 4 MB out in each phase, over two paths: at least two frames a round.
        assert 0 < m <= 40 and s["frames_out"] - f >= 20 * 2
        assert s["send_buffers"] <= m + 8  # a few more in flight at most, not one per frame
        assert not set(s["endpoint"]["rejected"]) - {"duplicate"}
