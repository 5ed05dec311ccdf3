"""The real cores on the simulated network: priority order, multipath speed-up, a dying path.

Simulated time only: deterministic, and no wall-clock timing anywhere.
"""

from __future__ import annotations

import numpy as np
from gradlane.bench.sim.simulator import GBPS, Network, Simulation, pair
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.pacing import PacingConfig
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import AllReduceComplete
from gradlane.transport.wire.header import HEADER_DTYPE, Flags, Kind

RATE = 10 * GBPS


def config(n_paths: int = 1, **kw) -> TransportConfig:
    base = dict(
        chunk_bytes=4096,
        n_paths=n_paths,
        nic_rate_Bps=4 * RATE,
        pacing=PacingConfig(initial_rate_Bps=RATE, max_rate_Bps=4 * RATE),
    )
    return TransportConfig(**{**base, **kw})


class Recorder:
    """Wraps an endpoint and records the arrival time and flags of every DATA packet."""

    def __init__(self, inner: TransposeAllReduce) -> None:
        self.inner = inner
        self.arrivals: list[tuple[float, ...]] = []  # (time, flags, bucket, prio, phase)

    def receive_datagram(self, data, path, now):
        if len(data) >= 48:
            h = np.frombuffer(bytes(data[:48]), dtype=HEADER_DTYPE)[0]
            if int(h["kind"]) == Kind.DATA and int(h["magic"]) == 0x474C:
                self.arrivals.append(
                    (now, int(h["flags"]), int(h["bucket"]), int(h["prio"]), int(h["phase"]))
                )
        self.inner.receive_datagram(data, path, now)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_sim(net: Network, eps, jobs, until: float = 5.0):
    """jobs: list of (time, rank, bucket, data, layer_position). Returns completion times."""
    done: dict[tuple[int, int], float] = {}
    results = {}

    def on_event(host, ev, now):
        if isinstance(ev, AllReduceComplete):
            done[(host, ev.bucket)] = now
            results[(host, ev.bucket)] = ev

    sim = Simulation(net, eps, seed=3, on_event=on_event)

    def submit(r: int, b: int, data: np.ndarray, pos: float):
        return lambda now: eps[r].start(1, b, data, pos, now)

    for t, r, b, data, pos in jobs:
        sim.call_at(t, submit(r, b, data, pos), host=r)
    sim.run(stop=lambda: len(done) == len(jobs), until=until)
    assert len(done) == len(jobs), f"only {len(done)} of {len(jobs)} collectives completed"
    return done, results, sim


def test_protected_and_front_layers_arrive_first_on_a_bottleneck():
    """One 10 Gb/s link, two buckets submitted together: protected chunks and the front-layer
    bucket arrive earlier than droppable chunks and the back-layer bucket."""
    net = pair(rate=RATE, queue_bytes=64 << 20)
    cfg = config(
        priority=PriorityConfig(protected_fraction=0.1, droppable_fraction=0.25),
        loss=LossConfig(loss_bound=0.0),
    )
    eps = [Recorder(TransposeAllReduce(r, 2, cfg)) for r in range(2)]
    rng = np.random.default_rng(0)
    n = 200_000
    jobs = []
    for b, pos in ((0, 1.0), (1, 0.0)):  # bucket 0: last layers; bucket 1: front layers
        for r in range(2):
            scale = np.repeat(rng.lognormal(0, 1.5, size=n // 1024 + 1), 1024)[:n]
            jobs.append((0.0, r, b, (rng.standard_normal(n) * scale).astype(np.float32), pos))
    done, _, _ = run_sim(net, eps, jobs)
    arr = np.array(eps[1].arrivals, dtype=np.float64)
    arr = arr[arr[:, 4] == 0]  # the reduce phase: every chunk is queued at the same moment
    t, flags, bucket, prio = arr[:, 0], arr[:, 1].astype(int), arr[:, 2], arr[:, 3]
    protected = (flags & Flags.PROTECTED) != 0
    droppable = (flags & Flags.DROPPABLE) != 0
    assert protected.any() and droppable.any()
    assert np.median(t[protected]) < np.median(t[droppable])
    assert t[protected].max() < np.median(t[droppable])
    # Normal chunks of the front-layer bucket go before those of the back-layer bucket.
    normal = ~protected & ~droppable
    assert np.median(t[normal & (bucket == 1)]) < np.median(t[normal & (bucket == 0)])
    assert done[(1, 1)] < done[(1, 0)]
    assert set(np.unique(prio[protected]).tolist()) == {0}


def two_path_network(fail_at: float | None = None) -> Network:
    """h0 and h1 behind their ToR switches, joined by two independent 10 Gb/s paths (through
    switches a and b); everything else runs at 40 Gb/s, so the two paths are the bottleneck."""
    net = Network(2)
    tor = [net.add_switch("t0"), net.add_switch("t1")]
    mid = {"a": net.add_switch("a"), "b": net.add_switch("b")}
    links: dict[tuple[object, object], int] = {}

    def link(x: object, y: object, node_x: int, node_y: int, rate: float) -> None:
        links[(x, y)] = net.add_link(node_x, node_y, rate=rate, delay=2e-6, queue_bytes=4 << 20)

    for h in (0, 1):
        link(h, "t", h, tor[h], 4 * RATE)
        link("t", h, tor[h], h, 4 * RATE)
        for name, sw in mid.items():
            link((h, "up"), name, tor[h], sw, RATE)
            link(name, (h, "down"), sw, tor[h], 4 * RATE)

    def router(src: int, dst: int, path: int) -> tuple[int, ...]:
        name = "a" if path % 2 == 0 else "b"
        return (
            links[(src, "t")],
            links[((src, "up"), name)],
            links[(name, (dst, "down"))],
            links[("t", dst)],
        )

    net.set_router(router, 2, check=False)
    if fail_at is not None:
        net.fail_link(links[((0, "up"), "b")], fail_at, 1e9)
    return net


def _one_allreduce(n_paths: int, fail_at: float | None = None, n: int = 1_000_000):
    eps = [TransposeAllReduce(r, 2, config(n_paths)) for r in range(2)]
    rng = np.random.default_rng(1)
    datas = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    jobs = [(0.0, r, 0, datas[r], 0.5) for r in range(2)]
    done, results, sim = run_sim(two_path_network(fail_at), eps, jobs)
    return max(done.values()), results, datas, sim


def test_two_paths_nearly_halve_the_transfer_time():
    one, _, _, _ = _one_allreduce(1)
    two, results, datas, sim = _one_allreduce(2)
    assert two <= 0.55 * one, (two, one)
    per_path = sim.stats()["paths"]["delivered_bytes"]
    assert min(per_path.values()) > 0.35 * sum(per_path.values())
    np.testing.assert_allclose(results[(0, 0)].result, datas[0] + datas[1], rtol=1e-5, atol=1e-5)


def test_a_path_that_dies_mid_transfer_loses_nothing():
    clean, _, _, _ = _one_allreduce(2)
    t_end, results, datas, _ = _one_allreduce(2, fail_at=clean / 3)
    for r in range(2):
        ev = results[(r, 0)]
        assert ev.report.delivered_fraction == 1.0 and not ev.report.degraded
        np.testing.assert_allclose(ev.result, datas[0] + datas[1], rtol=1e-5, atol=1e-5)
    assert t_end > clean  # it noticed and moved the rest to the surviving path
