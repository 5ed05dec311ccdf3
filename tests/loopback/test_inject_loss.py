"""``UdpPlane(rx_tap=InjectedLoss(rate, seed))``: the opt-in, seeded drop of received datagrams
(tests, demos).

Loopback never loses a datagram; the demo and the DDP tests need loss that shows. The plane
drops the configured fraction of what it receives before the protocol sees it, so recovery and
the loss bound run exactly as they would after a lossy link.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.drivers.peers import StaticPeers
from gradlane.transport.drivers.plane import Plane
from gradlane.transport.drivers.udp.plane import InjectedLoss, UdpPlane
from gradlane.transport.errors import ConfigError

WAIT_S = 60.0


def _pair(config: TransportConfig, rate: float) -> list[UdpPlane]:
    tap = InjectedLoss(rate, seed=config.seed)
    engines = [UdpPlane(r, 2, config, rx_tap=tap) for r in range(2)]
    try:
        table = StaticPeers({r: e.start() for r, e in enumerate(engines)})
        for e in engines:
            e.set_peers(table)
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


@pytest.mark.timeout(120)
def test_reliable_allreduce_recovers_injected_loss_exactly():
    cfg = TransportConfig(
        n_paths=2,
        chunk_bytes=1408,
        loss=LossConfig(loss_bound=0.0, hard_deadline_s=30.0),
    )
    engines = _pair(cfg, 0.05)
    try:
        rng = np.random.default_rng(11)
        data = [rng.standard_normal(200_003).astype(np.float32) for _ in engines]
        for step in (1, 2):
            futs = [e.submit(step, 0, d) for e, d in zip(engines, data, strict=True)]
            for f in futs:
                res, rep = f.result(WAIT_S)
                np.testing.assert_array_equal(res, data[0] + data[1])
                assert rep.delivered_fraction == 1.0
        stats = [e.stats() for e in engines]
    finally:
        for e in engines:
            e.close()
    # ~5% of ~300 datagrams per rank and step: none dropped would mean the knob does nothing.
    assert all(s["injected_drops"] > 0 for s in stats), stats


def test_inject_loss_is_off_by_default_and_validated():
    assert not hasattr(TransportConfig(), "inject_loss")  # a test knob, not a transport setting
    plane = UdpPlane(0, 1, TransportConfig())  # not started: stats() are read in place
    try:
        assert isinstance(plane, Plane)
        assert plane.stats()["injected_drops"] == 0
    finally:
        plane.close()
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="inject_loss"):
            InjectedLoss(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2])
def test_bounded_allreduce_under_injected_loss_respects_and_reports_the_bound(seed: int):
    """Bounded mode over real sockets that lose 4% of datagrams (seeded): every sender's loss
    stays within the bound, and the report names exactly the elements that were filled in."""
    bound = 0.1
    cfg = TransportConfig(
        n_paths=2,
        chunk_bytes=1408,
        seed=seed,
        loss=LossConfig(
            loss_bound=bound,
            soft_deadline_max_s=0.05,
            hard_deadline_s=30.0,
            on_hard_deadline="raise",
        ),
    )
    engines = _pair(cfg, 0.04)
    n = 100_003
    try:
        rng = np.random.default_rng(seed)
        # Centred 6 apart, so a filled element (own value x 2) is never within isclose() of
        # the exact sum by chance: "wrong" below then counts exactly the filled elements.
        data = [(rng.standard_normal(n) + 3.0 - 6.0 * r).astype(np.float32) for r in range(2)]
        exact = data[0].astype(np.float64) + data[1]
        futs = [e.submit(1, 0, d) for e, d in zip(engines, data, strict=True)]
        results = [f.result(WAIT_S) for f in futs]
        drops = [e.stats()["injected_drops"] for e in engines]
    finally:
        for e in engines:
            e.close()
    assert all(d > 0 for d in drops)
    # The bound was used (some data given up on), else this would only test reliable recovery.
    assert sum(rep.reduce.missing_elems for _, rep in results) > 0
    half = n // 2  # rank 0 owns [0, half), rank 1 [half, n)
    shards = [slice(0, half), slice(half, n)]
    for r, (res, rep) in enumerate(results):
        assert not rep.degraded
        for phase in (rep.reduce, *rep.gather):
            assert all(f >= 1.0 - bound for f in phase.delivered.values()), phase
        wrong = ~np.isclose(res, exact, rtol=1e-5, atol=1e-5)
        # Own shard: exactly the reduce phase's missing elements were filled (own value × 2).
        assert int(wrong[shards[r]].sum()) == rep.reduce.missing_elems
        np.testing.assert_allclose(
            res[shards[r]][wrong[shards[r]]], 2 * data[r][shards[r]][wrong[shards[r]]]
        )
        # Peer's shard: what this rank's gather missed, plus what the peer's reduce missed.
        peer_reduce_missing = results[1 - r][1].reduce.missing_elems
        gather_missing = sum(g.missing_elems for g in rep.gather)
        n_wrong = int(wrong[shards[1 - r]].sum())
        assert gather_missing <= n_wrong <= gather_missing + peer_reduce_missing


@pytest.mark.timeout(180)
def test_in_place_keyed_collectives_under_loss_never_resend_overwritten_data():
    """In place, as DDP's hook runs them, each shard's gathered sums overwrite this rank's
    contribution to it: once the owner gathers, nothing of that contribution may be sent again
    (its tag would not match: with a job secret, counted as a forgery). Four keyed ranks,
    injected loss, several steps: exact results and no bad tag anywhere."""
    world = 4
    cfg = TransportConfig(n_paths=2, chunk_bytes=4096, secret="s3cret",
                          loss=LossConfig(loss_bound=0.0, hard_deadline_s=30.0))  # fmt: skip
    engines = [UdpPlane(r, world, cfg, rx_tap=InjectedLoss(0.05, seed=r)) for r in range(world)]
    try:
        table = StaticPeers({r: e.start() for r, e in enumerate(engines)})
        for e in engines:
            e.set_peers(table)
        rng = np.random.default_rng(3)
        for step in range(1, 9):
            data = [rng.standard_normal(100_000).astype(np.float32) for _ in engines]
            expect = np.sum(data, axis=0, dtype=np.float32)
            bufs = [d.copy() for d in data]
            futs = [e.submit(step, 0, b, out=b) for e, b in zip(engines, bufs, strict=True)]
            for f in futs:
                res, _ = f.result(WAIT_S)
                np.testing.assert_allclose(res, expect, rtol=1e-5, atol=1e-5)
        for e in engines:  # late resends (the senders' timers) land before the counters are read
            e.drain()
        stats = [e.stats() for e in engines]
        rejected = [s["rejected"] for s in stats]
    finally:
        for e in engines:
            e.close()
    # A failure names the packets: what each rejected one claimed to be (kind, phase, step,
    # shard, sender, chunk, flags) and when.
    recent = [s["rejected_recent"] for s in stats]
    assert all(rej.get("bad_tag", 0) == 0 for rej in rejected), (rejected, recent)
