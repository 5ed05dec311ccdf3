"""The all-reduce core's result scale (``start(..., scale=)``) and the gather's statistics:
scale × the sum on every path, the shard read for its statistics only when the reduce kernel
could not take them from the finished sums."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport import kernels
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import AllReduceComplete
from gradlane.transport.wire.header import Flags, Kind, Phase

from tests.support.cores import header_of, kind_of, make, run_allreduce
from tests.support.wire import Wire


@pytest.mark.parametrize(
    ("dtype", "bound", "gather_reads"),
    [(np.float32, 0.0, 0), (np.float16, 0.0, 1), (np.float32, 0.3, 1)],
    ids=["f32-reliable", "f16", "f32-filled"],
)
def test_gather_reads_the_shard_for_its_statistics_only_when_the_reduce_could_not(
    monkeypatch, dtype, bound, gather_reads
):
    """A float32 shard whose every chunk got all contributions is sent with the statistics the
    reduce kernel took from the finished sums: the gather does not read it again. A 16-bit
    shard, or one whose chunks the fill rescaled, is read once. Either way every gather
    datagram passes its receivers' tag check (the collective completes, exact when lossless)."""
    world, n = 3, 6000
    calls: list[int] = []
    real = kernels.chunk_stats

    def spy(src, **kw):
        calls.append(int(src.shape[0]))
        return real(src, **kw)

    monkeypatch.setattr(kernels, "chunk_stats", spy)
    eps = make(
        world,
        loss=LossConfig(loss_bound=bound, soft_deadline_max_s=1.0, hard_deadline_s=5.0),
        priority=PriorityConfig(protected_fraction=0.1, droppable_fraction=0.25),
    )
    rng = np.random.default_rng(11)
    datas = [rng.standard_normal(n).astype(dtype) for _ in range(world)]

    def drop(src, dg, q):  # bounded: every droppable chunk of the reduce phase is lost
        if not bound or kind_of(dg) != Kind.DATA:
            return False
        h = header_of(dg)
        return h["phase"] == Phase.REDUCE and bool(h["flags"] & Flags.DROPPABLE)

    out = run_allreduce(eps, datas, Wire(eps, drop=drop))
    expect = np.sum([d.astype(np.float64) for d in datas], axis=0)
    tol = 1e-5 if dtype == np.float32 else 5e-3 * world
    for r in range(world):
        assert isinstance(out[r], AllReduceComplete)
        assert not out[r].report.degraded
        if not bound:
            np.testing.assert_allclose(out[r].result.astype(np.float64), expect, rtol=tol, atol=tol)
        else:
            assert out[r].report.reduce.missing_elems > 0  # the fill did rescale chunks
    scatter = world * (world - 1)  # every rank reads each peer's shard of its input once
    assert len(calls) == scatter + world * gather_reads


@pytest.mark.parametrize(
    ("world", "dtype", "bound"),
    [(1, np.float32, 0.0), (2, np.float32, 0.0), (3, np.float32, 0.0), (4, np.float16, 0.0),
     (3, np.float32, 0.3), (2, np.float16, 0.3)],
)  # fmt: skip
def test_scale_multiplies_the_result_once_whatever_the_path(world, dtype, bound):
    """``scale`` (DDP's 1 / world) gives scale × the sum on every rank: float32 chunks finished
    in the reduce kernel, 16-bit shards and chunks the fill rescales at the gather's start,
    lost gather chunks filled at the end, and a world of one. With loss, every rank's result
    is its reliable counterpart's fill times the scale (same bytes dropped both times)."""
    n, scale = 5000, 1.0 / world
    rng = np.random.default_rng(world * 7 + int(bound * 10))
    datas = [rng.standard_normal(n).astype(dtype) for _ in range(world)]
    cfg = dict(
        loss=LossConfig(
            loss_bound=bound, gather_loss_bound=bound, soft_deadline_max_s=1.0, hard_deadline_s=5.0
        ),
        priority=PriorityConfig(protected_fraction=0.1, droppable_fraction=0.25),
    )

    def drop(src, dg, q):  # bounded: droppable chunks of both phases are lost for good
        return (
            bool(bound)
            and kind_of(dg) == Kind.DATA
            and bool(header_of(dg)["flags"] & Flags.DROPPABLE)
        )

    results = {}
    for s in (1.0, scale):
        eps = make(world, **cfg)
        bufs = [d.copy() for d in datas]
        wire = Wire(eps, drop=drop)
        for r, ep in enumerate(eps):
            ep.start(1, 0, bufs[r], 0.5, wire.now, out=bufs[r], scale=s)
        wire.run(lambda eps=eps, wire=wire: sum(
            isinstance(e, AllReduceComplete) for _, _, e in wire.events) == world)  # fmt: skip
        results[s] = [b.astype(np.float64) for b in bufs]
    tol = 1e-6 if dtype == np.float32 else 2e-3
    for r in range(world):
        np.testing.assert_allclose(results[scale][r], results[1.0][r] * scale, rtol=tol, atol=tol)
    if not bound:
        expect = np.sum([d.astype(np.float64) for d in datas], axis=0) * scale
        tol = 1e-5 if dtype == np.float32 else 5e-3 * world
        for r in range(world):
            np.testing.assert_allclose(results[scale][r], expect, rtol=tol, atol=tol)


def test_scale_must_be_finite():
    ep = TransposeAllReduce(0, 2, TransportConfig())
    with pytest.raises(ValueError, match="finite"):
        ep.start(1, 0, np.ones(10, np.float32), 0.5, 0.0, scale=float("inf"))
