"""Engines over real UDP on loopback: 127.0.0.1 and 127.0.0.2 are the two paths.

Every engine is closed by the ``cluster`` fixture, every wait is a Future with a timeout, and
every test has a pytest timeout, so a hang is a failure, never a stuck run.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.pacing import PacingConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import DatagramRun
from gradlane.transport.drivers.peers import Address, StaticPeers
from gradlane.transport.drivers.udp.plane import InjectedLoss, UdpPlane
from gradlane.transport.errors import ConfigError, PeerTimeout, TransferFailed
from gradlane.transport.wire.header import DType, Header, Kind, Phase, encode
from gradlane.transport.wire.tag import TagKey

from tests.support.checks import check_pinned_goes_in_class_0

WAIT_S = 60.0
# The default pacing on purpose: two engines in one process share the GIL (and this machine a
# benchmark), so RTT samples carry millisecond scheduling delays that no queue caused. With a
# 100 µs delay floor that read as congestion, pinned the rate at 1 MB/s and a 10 MB bucket hit the
# hard deadline; the 2 ms default floor absorbs it, and the repeated 10 MB test guards that.
PACING = PacingConfig()
CFG = TransportConfig(n_paths=2, chunk_bytes=65000, pacing=PACING)

MakeCluster = Callable[..., list[UdpPlane]]


@pytest.fixture
def cluster() -> Iterator[MakeCluster]:
    """Factory of started, connected engines; closes all of them (and dummy sockets) after."""
    engines: list[UdpPlane] = []
    socks: list[socket.socket] = []

    def make(
        world: int,
        config: TransportConfig = CFG,
        ranks: list[int] | None = None,
        rx_tap: InjectedLoss | None = None,
    ) -> list[UdpPlane]:
        """Start engines for ``ranks`` (default: all); absent ranks get a silent socket."""
        ranks = list(range(world)) if ranks is None else ranks
        addrs: dict[int, list[Address]] = {}
        started = []
        for r in range(world):
            if r in ranks:
                e = UdpPlane(r, world, config, rx_tap=rx_tap)
                engines.append(e)
                started.append(e)
                addrs[r] = e.start()
            else:  # a peer that never starts: its address exists but nobody answers
                addrs[r] = []
                for host in (f"127.0.0.{1 + p}" for p in range(config.n_paths)):
                    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    socks.append(s)
                    s.bind((host, 0))
                    addrs[r].append(s.getsockname())
        rdv = StaticPeers(addrs)
        for e in started:
            e.set_peers(rdv)
        return started

    try:
        yield make
    finally:
        for e in engines:
            e.close()
        for s in socks:
            s.close()


def allreduce(
    engines: list[UdpPlane], step: int, data: list[np.ndarray], dtype: int | None = None
) -> list:
    """Submit bucket 0 of ``step`` on every engine and wait for all results."""
    futs = [e.submit(step, 0, d, dtype=dtype) for e, d in zip(engines, data, strict=True)]
    return [f.result(WAIT_S) for f in futs]


def bf16_words(x: np.ndarray) -> np.ndarray:
    """float32 → bf16 words by truncation (exactly representable inputs for the reference)."""
    return (x.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def bf16_to_f32(w: np.ndarray) -> np.ndarray:
    return (w.astype(np.uint32) << np.uint32(16)).view(np.float32)


# -- correctness ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("kind", "n"),
    [
        ("f32", 1),
        ("f32", 1001),
        ("f32", 262_147),  # ~1 MB
        ("f32", 2_621_447),  # ~10 MB
        ("f16", 300_001),
        ("bf16", 300_001),
    ],
)
def test_reliable_allreduce_equals_sum(cluster: MakeCluster, world: int, kind: str, n: int):
    engines = cluster(world)
    rng = np.random.default_rng(world * 1000 + n)
    f32 = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    if kind == "f32":
        data = f32
        results = allreduce(engines, 1, data)
        ref = np.sum(np.stack(data), axis=0, dtype=np.float32)
        for res, rep in results:
            assert res.dtype == np.float32 and res.shape == (n,)
            assert not rep.degraded and rep.delivered_fraction == 1.0
            if world == 2:  # a + b is the same in either order
                np.testing.assert_array_equal(res, ref)
            else:  # arrival order sets the summation order
                np.testing.assert_allclose(res, ref, rtol=1e-5, atol=1e-5)
    elif kind == "f16":
        data = [x.astype(np.float16) for x in f32]
        results = allreduce(engines, 1, data)
        ref = np.sum(np.stack([d.astype(np.float32) for d in data]), axis=0).astype(np.float16)
        for res, _ in results:
            assert res.dtype == np.float16
            np.testing.assert_array_equal(res, ref)
    else:
        data = [bf16_words(x) for x in f32]
        results = allreduce(engines, 1, data, dtype=DType.BF16)
        ref = np.sum(np.stack([bf16_to_f32(d) for d in data]), axis=0)
        for res, _ in results:
            assert res.dtype == np.uint16
            # one bf16 rounding of the f32 sum: within half a bf16 ulp (2^-8 relative)
            np.testing.assert_allclose(bf16_to_f32(res), ref, rtol=2.0**-8, atol=1e-30)


def test_a_started_collective_sends_before_it_reads(cluster: MakeCluster):
    """A collective's first datagrams go on the wire before the engine reads its sockets: the
    peers wait on them, while reading first may mean processing a whole batch first."""
    engines = cluster(2)
    udp = engines[0]._udp
    assert udp is not None
    log: list[str] = []
    sent = threading.Event()
    send, poll = udp.send, udp.poll

    def spy_send(datagrams):  # the real send, noting when DATA goes out
        datagrams = list(datagrams)
        if any(isinstance(d, DatagramRun) for d in datagrams):
            log.append("data")
            sent.set()
        return send(datagrams)

    def spy_poll():
        log.append("poll")
        return poll()

    udp.send, udp.poll = spy_send, spy_poll  # type: ignore[method-assign]
    data = [np.ones(300_000, np.float32), np.ones(300_000, np.float32)]
    f0 = engines[0].submit(1, 0, data[0])
    assert sent.wait(WAIT_S)  # rank 1 starts only now: nothing of it can arrive first
    f1 = engines[1].submit(1, 0, data[1])
    for f in (f0, f1):
        np.testing.assert_array_equal(f.result(WAIT_S)[0], 2.0)
    assert log[0] == "data", log[:4]


def _hold_loop(engine: UdpPlane) -> threading.Event:
    """Block ``engine``'s loop thread until the returned event is set (at most WAIT_S)."""
    gate, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        gate.wait(WAIT_S)

    assert engine._loop is not None
    engine._loop.call_soon_threadsafe(hold)
    assert held.wait(WAIT_S)
    return gate


@pytest.mark.timeout(60)
def test_requests_that_wait_together_start_most_urgent_first(cluster: MakeCluster):
    """Buckets submitted while the loop is busy start together, pinned first, then by layer
    position (front first), then in submission order: a protected bucket submitted last does
    not wait behind the start of each bucket submitted before it."""
    engines = cluster(2)
    started: list[int] = []
    start = engines[0]._pending.start

    def spy_start(core, fut, req, now):  # the real start, noting the order
        started.append(req.bucket)
        return start(core, fut, req, now)

    engines[0]._pending.start = spy_start  # type: ignore[method-assign]
    rng = np.random.default_rng(9)
    data = {b: rng.standard_normal(50_000).astype(np.float32) for b in range(4)}
    asks = ((0, 0.9, False), (1, 0.5, False), (2, 0.5, False), (3, 0.95, True))
    gate = _hold_loop(engines[0])
    futs = [engines[0].submit(1, b, data[b], pos, pinned=p) for b, pos, p in asks]
    gate.set()
    futs += [engines[1].submit(1, b, data[b], pos, pinned=p) for b, pos, p in asks]
    for f in futs:
        np.testing.assert_allclose(f.result(WAIT_S)[0], 2 * data[f.result()[1].bucket])
    assert started == [3, 1, 2, 0]


@pytest.mark.timeout(60)
def test_requests_still_waiting_at_close_fail(cluster: MakeCluster):
    engines = cluster(2)
    gate = _hold_loop(engines[0])
    fut = engines[0].submit(1, 0, np.ones(1000, np.float32))
    closer = threading.Thread(target=engines[0].close)
    closer.start()
    deadline = time.monotonic() + WAIT_S  # close() marks the plane closed before it waits
    while not engines[0]._closed and time.monotonic() < deadline:
        time.sleep(0.001)
    gate.set()  # the loop now finds the request still waiting, on a closed plane
    closer.join(WAIT_S)
    with pytest.raises(TransferFailed, match="closed"):
        fut.result(WAIT_S)


@pytest.mark.timeout(60)
def test_both_loopback_paths_carry_traffic(cluster: MakeCluster):
    engines = cluster(2)
    rng = np.random.default_rng(7)
    data = [rng.standard_normal(1_000_003).astype(np.float32) for _ in engines]
    for _, rep in allreduce(engines, 1, data):
        assert len(rep.sender.per_path_bytes) == 2
        assert all(b > 0 for b in rep.sender.per_path_bytes), rep.sender.per_path_bytes


@pytest.mark.timeout(60)
def test_pinned_bucket_sends_every_chunk_in_class_0(cluster: MakeCluster):
    engines = cluster(2, TransportConfig(n_paths=2, chunk_bytes=4096, pacing=PACING))
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(100_003).astype(np.float32) for _ in engines]
    check_pinned_goes_in_class_0(engines, data, WAIT_S)


@pytest.mark.timeout(60)
def test_sequential_steps_and_buckets(cluster: MakeCluster):
    engines = cluster(2)
    rng = np.random.default_rng(3)
    for step in range(1, 4):
        futs = {}
        for bucket, n in enumerate((5000, 70_001)):
            data = [rng.standard_normal(n).astype(np.float32) for _ in engines]
            futs[bucket] = (
                data,
                [e.submit(step, bucket, d) for e, d in zip(engines, data, strict=True)],
            )
        for data, fs in futs.values():
            for f in fs:
                np.testing.assert_array_equal(f.result(WAIT_S)[0], data[0] + data[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n_paths", [1, 2])
def test_repeated_10mb_collectives_stay_exact(cluster: MakeCluster, n_paths: int):
    """The same engines, step after step: the pacing state carries over between collectives."""
    engines = cluster(2, TransportConfig(n_paths=n_paths, chunk_bytes=65000, pacing=PACING))
    rng = np.random.default_rng(9)
    data = [rng.standard_normal(2_621_440).astype(np.float32) for _ in engines]
    for step in range(1, 7):
        for res, rep in allreduce(engines, step, data):
            assert not rep.degraded
            np.testing.assert_array_equal(res, data[0] + data[1])


def _free_ports(n: int) -> list[int]:
    """Ports the kernel just handed out (closed again): free unless someone races us."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.timeout(60)
def test_static_peer_list_with_fixed_ports():
    """A config-file style peer list: every engine binds its listed address and looks up the
    others in ``start()``; one path per rank here."""
    ports = _free_ports(2)
    table = StaticPeers({r: [("127.0.0.1", ports[r])] for r in range(2)})
    cfg = TransportConfig(chunk_bytes=65000, pacing=PACING)
    data = [np.arange(10_001, dtype=np.float32), np.ones(10_001, dtype=np.float32)]
    with (
        UdpPlane(0, 2, cfg, table, [("127.0.0.1", ports[0])]) as e0,
        UdpPlane(1, 2, cfg, table, [("127.0.0.1", ports[1])]) as e1,
    ):
        assert e0.bound == [("127.0.0.1", ports[0])]
        for res, _ in allreduce([e0, e1], 1, data):
            np.testing.assert_array_equal(res, data[0] + data[1])


# -- hostile input ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_garbage_and_forged_datagrams_are_counted_not_harmful(cluster: MakeCluster):
    e0, e1 = cluster(2)
    rng = np.random.default_rng(11)
    n, step = 2_621_447, 5
    data = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    before = e0.stats()
    f0 = e0.submit(step, 0, data[0])
    # While rank 0 waits for rank 1, junk lands on both of its paths ahead of rank 1's data.
    forged = encode(
        Header(
            kind=Kind.DATA,
            job=CFG.job,
            step=step,
            bucket=0,
            shard=0,
            src=1,
            dst=0,
            chunk=0,
            count=16,
            dtype=DType.F32,
            phase=Phase.REDUCE,
        ),
        np.full(16, 1e9, dtype=np.float32),
        TagKey.from_secret("not the job's key"),
    )
    n_junk = n_forged = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for addr in e0.bound:
            for size in (1, 7, 47, 48, 100, 1500, 65000, 65507):  # the last: over a slot
                s.sendto(rng.integers(0, 256, size, dtype=np.uint8).tobytes(), addr)
                n_junk += 1
            for _ in range(3):
                s.sendto(forged, addr)
                n_forged += 1
    f1 = e1.submit(step, 0, data[1])
    for res, rep in (f0.result(WAIT_S), f1.result(WAIT_S)):
        np.testing.assert_array_equal(res, data[0] + data[1])
        assert not rep.degraded
    after = e0.stats()
    rejected = after["rejected"]
    assert rejected.get("bad_tag", 0) - before["rejected"].get("bad_tag", 0) >= n_forged
    assert sum(rejected.values()) - sum(before["rejected"].values()) >= n_junk + n_forged
    assert rejected.get("truncated", 0) >= 4  # 1, 7, 47 bytes and the empty-payload header
    # Longer than a receive slot (65000-byte chunks): truncated by the socket, counted as such.
    assert rejected.get("oversized", 0) - before["rejected"].get("oversized", 0) >= 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("coalesce_s", [0.0, 0.002])
def test_coalesced_input_waits_for_its_window_without_a_pass_per_wakeup(
    cluster: MakeCluster, coalesce_s: float
):
    """With rx_coalesce_s, a socket wakeup that only reads datagrams (their window still
    open, nothing processed since the last pass, nothing else due) runs no service pass: the
    timer at the window's end does. Results stay exact; without coalescing every wakeup
    serves."""
    cfg = replace(CFG, rx_coalesce_s=coalesce_s, chunk_bytes=8192)
    engines = cluster(3, cfg)
    rng = np.random.default_rng(5)
    for step in range(1, 6):
        data = [rng.standard_normal(300_001).astype(np.float32) for _ in engines]
        for res, rep in allreduce(engines, step, [d.copy() for d in data]):
            np.testing.assert_allclose(res, sum(data), rtol=1e-5, atol=1e-5)
            assert not rep.degraded
    held = [e.stats()["loop"]["held_wakeups"] for e in engines]
    if coalesce_s:
        assert sum(held) > 0, held
    else:
        assert held == [0, 0, 0]


# -- failures --------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_rank_waiting_for_a_late_peer_does_not_wake_every_millisecond(cluster: MakeCluster):
    """Rank 0 sends its share; rank 1 starts 0.3 s later (the scenario: a slow peer). The
    engine's timer used to fire every millisecond meanwhile (~300 service passes, each with
    the sender's housekeeping); it now wakes only when something falls due. The collective
    then completes exactly, and the counters are in stats()."""
    e0, e1 = cluster(2)
    data = [np.arange(1_000_000, dtype=np.float32), np.ones(1_000_000, np.float32)]
    allreduce([e0, e1], 1, [d.copy() for d in data])  # warm: RTT samples, buffers
    before = e0.stats()["loop"]
    f0 = e0.submit(2, 0, data[0].copy())
    time.sleep(0.3)  # rank 1 is late: this wait is what is measured, not a synchronisation
    during = e0.stats()["loop"]
    f1 = e1.submit(2, 0, data[1].copy())
    for f in (f0, f1):
        np.testing.assert_array_equal(f.result(WAIT_S)[0], data[0] + data[1])
    assert during["timer_passes"] - before["timer_passes"] < 100, (before, during)
    assert 0.0 <= during["timer_cpu_s"] <= during["cpu_s"]


@pytest.mark.timeout(60)
def test_peer_that_never_starts_fails_with_peer_timeout(cluster: MakeCluster):
    cfg = TransportConfig(
        n_paths=2,
        chunk_bytes=65000,
        pacing=PACING,
        loss=LossConfig(hard_deadline_s=0.5, soft_deadline_max_s=0.2, on_hard_deadline="raise"),
    )
    engines = cluster(3, cfg, ranks=[0, 1])
    futs = [e.submit(1, 0, np.ones(10_000, dtype=np.float32)) for e in engines]
    for f in futs:
        with pytest.raises(PeerTimeout) as info:
            f.result(WAIT_S)
        assert 2 in info.value.ranks
        assert "rank(s) 2" in str(info.value) and "step 1 bucket 0" in str(info.value)


@pytest.mark.timeout(60)
def test_close_mid_collective_fails_the_future(cluster: MakeCluster):
    (e0,) = cluster(2, ranks=[0])
    fut = e0.submit(1, 0, np.ones(100_000, dtype=np.float32))
    assert e0.stats()["in_flight"] == 1  # stats runs on the loop after the submit did
    e0.close()
    with pytest.raises(TransferFailed, match="engine closed"):
        fut.result(WAIT_S)
    late = e0.submit(2, 0, np.ones(10, dtype=np.float32))
    with pytest.raises(TransferFailed, match="engine closed"):
        late.result(WAIT_S)


@pytest.mark.timeout(120)
def test_drain_then_close_leaves_nothing_owed(cluster: MakeCluster, caplog):
    """Under loss a rank ends its last collective owing peers what they still miss (a lost
    datagram, a lost ACK or STOP). ``drain`` on every rank while all still answer, then close:
    nothing is owed and no close has to wait or warn."""
    cfg = TransportConfig(n_paths=2, chunk_bytes=8192, pacing=PACING, seed=3)
    engines = cluster(2, cfg, rx_tap=InjectedLoss(0.2, seed=3))
    rng = np.random.default_rng(0)
    for step in range(1, 6):
        data = [rng.standard_normal(50_000).astype(np.float32) for _ in engines]
        got = allreduce(engines, step, data)
        np.testing.assert_array_equal(got[0][0], data[0] + data[1])
    assert all(e.drain(WAIT_S) for e in engines)
    assert not any(e._core.endpoint.sender.transfers for e in engines)
    with caplog.at_level("WARNING", logger="gradlane.transport.drivers.udp.plane"):
        t0 = time.monotonic()
        for e in engines:
            e.close()
    assert "unacknowledged" not in caplog.text
    assert time.monotonic() - t0 < 2.0  # neither close waited out its drain bound
    assert all(e.drain(0.0) for e in engines)  # closed: nothing left to owe


@pytest.mark.timeout(60)
def test_drain_on_the_loop_thread_is_refused(cluster: MakeCluster):
    e0, e1 = cluster(2)
    data = [np.arange(1000, dtype=np.float32)] * 2
    seen: list[BaseException] = []

    def on_done(_: object) -> None:  # runs on e0's loop thread
        try:
            e0.drain(0.1)
        except RuntimeError as err:
            seen.append(err)

    f0 = e0.submit(1, 0, data[0])
    f0.add_done_callback(on_done)
    e1.submit(1, 0, data[1])
    f0.result(WAIT_S)
    assert e0.drain(WAIT_S)  # from this thread it waits
    assert seen and "not from its thread" in str(seen[0])


@pytest.mark.timeout(60)
def test_close_from_a_done_callback_does_not_deadlock(cluster: MakeCluster):
    e0, e1 = cluster(2)
    data = [np.arange(1000, dtype=np.float32)] * 2
    closed = threading.Event()
    f0 = e0.submit(1, 0, data[0])
    f0.add_done_callback(lambda _: (e0.close(), closed.set()))  # runs on e0's loop thread
    e1.submit(1, 0, data[1])
    np.testing.assert_array_equal(f0.result(WAIT_S)[0], data[0] * 2)
    assert closed.wait(WAIT_S)
    e0.close()  # from this thread: joins the loop thread
    with pytest.raises(TransferFailed, match="engine closed"):
        e0.submit(2, 0, data[0]).result(WAIT_S)


@pytest.mark.timeout(60)
def test_port_in_use_is_a_clear_error():
    threads = threading.active_count()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        engine = UdpPlane(0, 2, TransportConfig(), local_addrs=[("127.0.0.1", port)])
        try:
            with pytest.raises(ConfigError, match=f"127.0.0.1:{port}.*already in use"):
                engine.start()
        finally:
            engine.close()
    assert threading.active_count() == threads


def test_wrong_number_of_local_addresses_is_a_config_error():
    with pytest.raises(ConfigError, match="one address per path"):
        UdpPlane(0, 2, TransportConfig(n_paths=2), local_addrs=["127.0.0.1"])


# -- resources -------------------------------------------------------------------------------------
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(120)
def test_no_thread_or_fd_growth_after_100_collectives(cluster: MakeCluster):
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(20_001).astype(np.float32) for _ in range(2)]
    warm = cluster(2)  # imports, numba caches and loop machinery, once
    allreduce(warm, 1, data)
    for e in warm:
        e.close()
    threads, fds = threading.active_count(), _fds()
    engines = cluster(2)
    for step in range(1, 101):
        for res, _ in allreduce(engines, step, data):
            np.testing.assert_array_equal(res, data[0] + data[1])
    for e in engines:
        e.close()
    assert threading.active_count() == threads
    assert _fds() == fds


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers", [(0,), (1, 3)])
def test_parameter_server_over_udp_is_exact(cluster: MakeCluster, servers: tuple[int, ...]):
    engines = cluster(4)
    rng = np.random.default_rng(len(servers))
    data = [rng.standard_normal(300_001).astype(np.float32) for _ in engines]
    futs = [e.submit(1, 0, d, servers=servers) for e, d in zip(engines, data, strict=True)]
    expect = np.sum(data, axis=0)
    for f in futs:
        res, rep = f.result(WAIT_S)
        np.testing.assert_allclose(res, expect, rtol=1e-5, atol=1e-5)
        assert rep.delivered_fraction == 1.0


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_scale_gives_the_mean_in_place(cluster: MakeCluster, world: int, dtype: type):
    """``scale=1/world`` over real sockets: every rank's buffer ends as the mean (DDP's hook
    passes exactly this instead of dividing its bucket first)."""
    engines = cluster(world)
    rng = np.random.default_rng(world)
    data = [rng.standard_normal(300_007).astype(dtype) for _ in range(world)]
    expect = np.mean([d.astype(np.float64) for d in data], axis=0)
    bufs = [d.copy() for d in data]
    futs = [e.submit(1, 0, b, out=b, scale=1.0 / world) for e, b in zip(engines, bufs, strict=True)]
    tol = 1e-6 if dtype == np.float32 else 2e-3
    for f, b in zip(futs, bufs, strict=True):
        res, _ = f.result(WAIT_S)
        assert res is b
        np.testing.assert_allclose(b.astype(np.float64), expect, rtol=tol, atol=tol)
