"""The end of a sender's first pass (Flags.PASS_END) and NACKs that name the newest arrival:
the receiver settles a tolerable gap, or NACKs any other, a reorder window after the pass
ended — not at the sender's FIN or the soft deadline — and the sender resends what the newest
arrival overtook even while its smoothed RTT says the chunk may still be on its way."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.endpoint import Endpoint
from gradlane.transport.core.events import AllReduceComplete, DatagramRun
from gradlane.transport.core.outgoing import INFLIGHT, LOST, OutKey
from gradlane.transport.wire.header import DType, Flags, Kind, Phase

from tests.support.cores import (
    header_of,
    kind_of,
    lose_first_transmission,
    make,
    random_datas,
    run_allreduce,
)
from tests.support.wire import Wire

# No history: the soft (and NACK) deadline is its maximum, 0.5 s; the sender's own loss
# detection is slow too. What completes a collective within 50 ms is the pass end.
_SLOW = {
    "min_rto_s": 0.25,
    "priority": PriorityConfig(policy="flat"),  # one class: nothing protected, one send order
}


def _lose_fins_and_first(chunk: int):
    """Drop rule: rank 0's FINs, and the first transmission of its reduce ``chunk``; the list
    of that chunk's transmissions."""
    first, sent = lose_first_transmission(chunk)

    def drop(src, dg, q):
        return (src == 0 and kind_of(dg) == Kind.FIN) or first(src, dg, q)

    return drop, sent


@pytest.mark.parametrize("policy", ["flat", "layer+magnitude"])
def test_one_chunk_per_transfer_ends_the_first_pass_the_last_one_sent(policy):
    cfg = TransportConfig(chunk_bytes=256, priority=PriorityConfig(policy=policy))
    ep = Endpoint(0, 2, cfg)
    data = np.random.default_rng(1).standard_normal(3000).astype(np.float32)
    t = ep.sender.start(OutKey(1, 0, 1, Phase.REDUCE, 1), data, DType.F32, 0.5, 0.0)
    ends = ((t.hdr[:, 4] & int(Flags.PASS_END)) != 0).nonzero()[0]
    assert ends.tolist() == [int(t.order[-1])]
    sent: list[int] = []
    for item in ep.datagrams_to_send(0.0):  # this endpoint's only transfer
        if isinstance(item, DatagramRun):
            sent.extend(int(c) for c in item.chunks)
    assert sent[-1] == int(t.order[-1])  # the first pass really ends with it


def test_a_tolerable_gap_settles_when_the_pass_ends_without_fin_or_deadline():
    """Bounded: rank 0 loses one reduce chunk and every FIN. Rank 1 learns nothing from the
    sender, yet completes a reorder window after rank 0's pass ended, short of that chunk."""
    world, n = 2, 2000
    eps = make(world, **_SLOW, loss=LossConfig(loss_bound=0.3, soft_deadline_max_s=0.5))
    datas = random_datas(world, n, 5)
    drop, _ = _lose_fins_and_first(chunk=3)
    wire = Wire(eps, drop=drop)
    out = run_allreduce(eps, datas, wire)
    assert all(isinstance(out[r], AllReduceComplete) for r in range(world))
    assert wire.now < 0.05  # the soft deadline (0.5 s) and the RTO (0.25 s) never came
    reduce = out[1].report.reduce
    assert reduce.missing_elems == 64 and not reduce.degraded  # the gap, within the bound


def test_a_reliable_tail_gap_is_nacked_when_the_pass_ends():
    """Reliable: the sender never hears an ACK (all lost), so only the receiver can find the
    gap. It NACKs a reorder window after the pass ended, not at the NACK deadline (0.5 s)."""
    world, n = 2, 2000
    eps = make(world, **_SLOW, loss=LossConfig(loss_bound=0.0, soft_deadline_max_s=0.5))
    datas = random_datas(world, n, 6)
    lost, sent = _lose_fins_and_first(chunk=14)  # second to last of the shard's 16
    nacks: list[tuple[float, int]] = []

    def drop(src, dg, q):
        if src == 1 and kind_of(dg) == Kind.NACK:
            nacks.append((wire.now, int(header_of(dg)["aux"])))
        if src == 1 and kind_of(dg) == Kind.ACK:
            return True
        return lost(src, dg, q)

    wire = Wire(eps, drop=drop)
    out = run_allreduce(eps, datas, wire)
    assert all(isinstance(out[r], AllReduceComplete) for r in range(world))
    np.testing.assert_allclose(out[1].result, datas[0] + datas[1], rtol=1e-6, atol=1e-6)
    assert sent == [1, 2] and nacks and nacks[0][0] < 0.01
    assert nacks[0][1] == 15 + 1  # names the newest arrival: the pass's last chunk
    assert wire.now < 0.05


def test_a_nack_naming_a_newer_arrival_resends_what_it_overtook():
    """The path's RTT bound says a chunk sent 3 ms ago may still be on its way (a loaded host's
    scheduling delay), but the receiver already has a chunk sent after it: it is lost."""
    cfg = TransportConfig(chunk_bytes=256, priority=PriorityConfig(policy="flat"))
    ep = Endpoint(0, 2, cfg)
    data = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    key = OutKey(1, 0, 1, Phase.REDUCE, 1)
    t = ep.sender.start(key, data, DType.F32, 0.5, 0.0)
    ep.datagrams_to_send(0.0)
    assert (t.state == INFLIGHT).all()
    paths = ep.sender.paths[1]
    paths._srtt[:] = 0.05  # a loaded host: 50 ms of smoothed RTT
    paths._min_rtt[:] = 0.0002
    bits = np.zeros(t.n_chunks, dtype=bool)
    bits[[3, 15]] = True
    newest = int(t.order[10])  # sent after chunk 3, before chunk 15
    ep.sender.on_nack(key, 0, bits, 0.003, newest=newest)
    assert t.state[3] == LOST  # overtaken by the newest arrival: resent
    assert t.state[15] == LOST  # sent after it, but longer ago than the path's own RTT
    bits[:] = False
    bits[[4]] = True
    t.state[4] = INFLIGHT
    t.sent_at[4] = 0.003
    t.tx_seq[4] = t.next_tx_seq + 1  # resent after the newest arrival, 0.1 ms ago
    ep.sender.on_nack(key, 0, bits, 0.0031, newest=newest)
    assert t.state[4] == INFLIGHT  # may be on its way: no duplicate
    ep.sender.on_nack(key, 0, bits, 0.0031)  # no evidence: the RTT bound's rule
    assert t.state[4] == INFLIGHT


@pytest.mark.parametrize("drains", [False, True])
def test_a_pass_end_counts_only_once_the_driver_has_read_past_it(drains):
    """A socket driver may read a sender's pass end from one path while the other path's
    socket still holds that sender's earlier packets, unread: its gaps are not loss until the
    driver says it read every socket empty (note_drained) after the pass end came."""
    world, n = 2, 2000
    eps = make(world, **_SLOW, loss=LossConfig(loss_bound=0.0, soft_deadline_max_s=0.5))
    datas = random_datas(world, n, 6)
    lost, _ = _lose_fins_and_first(chunk=14)
    nacks: list[float] = []

    def drop(src, dg, q):
        if src == 1 and kind_of(dg) == Kind.NACK:
            nacks.append(wire.now)
        return (src == 1 and kind_of(dg) == Kind.ACK) or lost(src, dg, q)

    eps[1].note_drained(0.0)  # a driver that tracks drains: none since the start...
    if drains:  # ...or one after every datagram it reads
        receive = eps[1].receive_datagram

        def read_and_drain(data, path, now):
            receive(data, path, now)
            eps[1].note_drained(now)

        eps[1].receive_datagram = read_and_drain
    wire = Wire(eps, drop=drop)
    out = run_allreduce(eps, datas, wire)
    assert all(isinstance(out[r], AllReduceComplete) for r in range(world))
    if drains:
        assert nacks and nacks[0] < 0.01 and wire.now < 0.05
    else:  # the sender's timeout (0.25 s) recovers it, no NACK before
        assert all(t > 0.2 for t in nacks) and wire.now > 0.2


def test_a_peer_late_to_the_collective_holds_the_data_and_nothing_is_resent():
    """Rank 1 starts 0.2 s after rank 0, whose data it holds meanwhile: its HELD ACKs keep rank
    0's retransmission timeout (10 ms here) from resending the shard again and again."""
    world, n = 2, 4000
    eps = make(world, min_rto_s=0.01, loss=LossConfig(loss_bound=0.0, hard_deadline_s=5.0))
    datas = random_datas(world, n, 11)
    held: list[float] = []
    sent: list[int] = []  # rank 0's reduce-phase chunks, each time one goes out

    def watch(src, dg, q):
        if src == 1 and kind_of(dg) == Kind.ACK and header_of(dg)["flags"] & Flags.HELD:
            held.append(wire.now)
        if src == 0 and kind_of(dg) == Kind.DATA and header_of(dg)["phase"] == Phase.REDUCE:
            sent.append(int(header_of(dg)["chunk"]))
        return False

    wire = Wire(eps, drop=watch)
    eps[0].start(1, 0, datas[0], layer_position=0.5, now=0.0)
    wire.run(lambda: wire.now >= 0.2, max_time=1.0)
    eps[1].start(1, 0, datas[1], layer_position=0.5, now=wire.now)

    def done():
        return sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == world

    wire.run(done, max_time=5.0)
    for _, _, e in wire.events:
        np.testing.assert_allclose(e.result, datas[0] + datas[1], rtol=1e-6, atol=1e-6)
    assert held and held[0] < 0.01  # the first early datagrams were answered at once
    assert sorted(sent) == list(range(32))  # each chunk of the shard went out once
