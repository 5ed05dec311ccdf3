"""Loss recovery in the all-reduce core: gather deadlines that wait for the sender's gather,
RACK by transmission order, and the congestion signal of a reliable transfer's loss."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.core.events import AllReduceComplete
from gradlane.transport.wire.header import Kind, Phase

from tests.support.cores import (
    header_of,
    lose_first_transmission,
    make,
    random_datas,
    run_allreduce,
)
from tests.support.wire import Wire


@pytest.mark.parametrize("bound", [0.0, 0.05])
def test_no_gather_nack_before_the_peer_sends_its_gather(bound):
    """A peer whose reduce phase is slow starts its gather late. This rank's gather transfer
    from it must not NACK before its first gather datagram: its deadline clock runs from that
    datagram. (Timed from this rank's own gather start, a learned near-zero gather duration
    would make it NACK the whole shard every few milliseconds while the peer still reduces.)"""
    world, n = 2, 20000
    eps = make(world, loss=LossConfig(loss_bound=bound, hard_deadline_s=5.0))
    datas = random_datas(world, n, 3)
    log: list[tuple[float, int, int, int]] = []  # (time, src, kind, phase) of what was sent
    slow = {"on": False}

    def watch(src, dg, q):
        h = header_of(dg)
        log.append((wire.now, src, int(h["kind"]), int(h["phase"])))
        # Rank 0's reduce-phase data for rank 1 is lost for a while: rank 1 reduces late.
        return (
            slow["on"] and src == 0 and int(h["kind"]) == Kind.DATA
            and int(h["phase"]) == Phase.REDUCE and wire.now < slow["until"]
        )  # fmt: skip

    wire = Wire(eps, drop=watch)
    for step in range(1, 6):  # lossless history: the deadlines learn short transfers
        run_allreduce(eps, datas, wire, step=step)
    log.clear()
    slow.update(on=True, until=wire.now + 0.05)
    out = run_allreduce(eps, datas, wire, step=6)
    assert all(isinstance(out[r], AllReduceComplete) for r in range(world))
    first_gather = min(
        t for t, src, k, ph in log if src == 1 and k == Kind.DATA and ph == Phase.GATHER
    )
    early_nacks = [
        t for t, src, k, ph in log
        if src == 0 and k == Kind.NACK and ph == Phase.GATHER and t < first_gather
    ]  # fmt: skip
    assert first_gather > slow["until"] - 0.01  # the peer's gather really started late
    assert early_nacks == []


def test_a_chunk_lost_mid_batch_is_resent_after_the_reorder_window_not_the_rto():
    """A batch leaves at one timestamp, so send times cannot order its chunks: a chunk lost
    from its middle is found by transmission order (RACK) — a later chunk of its lane was
    acknowledged reorder_window_s ago — long before the retransmission timeout."""
    world, n = 2, 2000
    eps = make(
        world,
        min_rto_s=0.25,
        priority=PriorityConfig(policy="flat"),  # one class: the shard is one lane
        loss=LossConfig(loss_bound=0.0, soft_deadline_max_s=0.5, hard_deadline_s=5.0),
    )
    datas = random_datas(world, n, 8)
    drop, sent = lose_first_transmission(chunk=3)
    wire = Wire(eps, drop=drop)
    out = run_allreduce(eps, datas, wire)
    assert all(isinstance(out[r], AllReduceComplete) for r in range(world))
    np.testing.assert_allclose(out[1].result, datas[0] + datas[1], rtol=1e-6, atol=1e-6)
    assert sent == [1, 2]  # resent once
    assert wire.now < 0.05  # the RTO (0.25 s) and the NACK deadline (0.5 s) never came


@pytest.mark.parametrize(("bound", "decreases"), [(0.0, True), (0.3, False)])
def test_a_reliable_transfer_s_loss_is_congestion_a_tolerated_one_is_not(bound, decreases):
    """The loss-tolerant controller slows down for losses that must be resent: any chunk of a
    reliable transfer, a protected one of a bounded transfer — not for a chunk the bound lets
    go (here nothing is protected: the flat policy)."""
    world, n = 2, 2000
    eps = make(
        world,
        priority=PriorityConfig(policy="flat"),
        loss=LossConfig(loss_bound=bound, soft_deadline_max_s=0.5, hard_deadline_s=5.0),
    )
    datas = random_datas(world, n, 9)
    drop, _ = lose_first_transmission(chunk=2)
    out = run_allreduce(eps, datas, Wire(eps, drop=drop))
    assert all(isinstance(out[r], AllReduceComplete) for r in range(world))
    sender = eps[0].endpoint.sender
    n_dec = sum(p.controller.decreases for (peer, _), p in sender.pacers.items() if peer == 1)
    assert (n_dec > 0) == decreases
