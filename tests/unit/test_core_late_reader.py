"""A receiver that reads its sockets late (a loaded host), or a path with a deeper queue than
another, must not be sent its data again.

The sender's retransmission timeout probes before it resends (F-RTO, with the probe of
RACK-TLP): such a receiver gets one more datagram per path, not the whole shard, while data that was
really lost is still resent. The receiver's deadline NACK waits until it has read its sockets
empty since the deadline, so it does not ask for what is waiting in them."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.endpoint import Endpoint
from gradlane.transport.core.events import AllReduceComplete, DatagramRun
from gradlane.transport.core.outgoing import ACKED, INFLIGHT, LOST, OutKey
from gradlane.transport.wire.header import DType, Flags, Kind, Phase

from tests.support.cores import header_of, kind_of, make, random_datas, run_allreduce
from tests.support.wire import Wire

RTO = 0.02  # min_rto_s: on the in-memory wire's 50 us the RTO is this floor
NACK_AFTER = 0.2  # soft_deadline_min_s: the receivers' deadline NACKs come no sooner


def _setup(world: int = 2, n: int = 4000, bound: float = 0.0):
    eps = make(
        world,
        n_paths=2,
        min_rto_s=RTO,
        priority=PriorityConfig(policy="flat"),
        # The receiver's deadline NACKs wait past these tests: the timeouts are under test.
        loss=LossConfig(
            loss_bound=bound, soft_deadline_min_s=NACK_AFTER, soft_deadline_max_s=0.5,
            hard_deadline_s=5.0,
        ),
    )  # fmt: skip
    return eps, random_datas(world, n, 11)


def _lossless_then(eps, datas, wire: Wire, begin) -> tuple[dict, float]:
    """Three lossless steps (RTT samples, learned deadlines), then ``begin()`` and step 4:
    its outcome at every rank (all completed) and how long it took."""
    for step in range(1, 4):
        run_allreduce(eps, datas, wire, step=step)
    begin()
    t0 = wire.now
    out = run_allreduce(eps, datas, wire, step=4)
    assert all(isinstance(out[r], AllReduceComplete) for r in range(len(eps)))
    return out, wire.now - t0


def _rank0_reduce_data(src, dg) -> int | None:
    """The chunk of a reduce-phase DATA datagram of rank 0, else None."""
    if src != 0 or kind_of(dg) != Kind.DATA:
        return None
    h = header_of(dg)
    return int(h["chunk"]) if h["phase"] == Phase.REDUCE else None


@pytest.mark.parametrize("bound", [0.0, 0.05])
def test_a_receiver_reading_late_gets_one_probe_not_the_shard_again(bound):
    """Rank 1 reads everything rank 0 sends 1.5 RTOs late, in order (a busy host). The timeout
    sends one probe per path; the originals then arrive and are acknowledged, so nothing else
    is resent, and in bounded mode nothing is lost. (Resending every late chunk at the timeout
    doubled a slow receiver's queue: 40-100 chunks per timeout at 4 x 25 MB.)"""
    eps, datas = _setup(bound=bound)
    hold = {"until": -1.0}
    sent: Counter[int] = Counter()

    def drop(src, dg, q):
        if src != 0 or hold["until"] < 0:
            return False
        chunk = _rank0_reduce_data(src, dg)
        if chunk is not None:
            sent[chunk] += 1
        if wire.now >= hold["until"]:
            return False
        # Everything rank 0 sends waits in rank 1's socket, in order.
        wire.inject(dg.peer, dg.wire(), dg.path, delay=hold["until"] - wire.now)
        return True

    wire = Wire(eps, drop=drop)
    out, _ = _lossless_then(eps, datas, wire, lambda: hold.update(until=wire.now + 1.5 * RTO))
    for r in range(2):
        np.testing.assert_allclose(out[r].result, datas[0] + datas[1], rtol=1e-6, atol=1e-6)
    assert len(sent) > 20  # the shard is many chunks, all held back
    assert sum(sent.values()) - len(sent) == 2  # a probe per path; before: every chunk again
    assert out[1].report.reduce.delivered_fraction == 1.0


@pytest.mark.parametrize("bound", [0.0, 0.05])
def test_a_lost_burst_is_resent_after_the_probe_finds_it_missing(bound):
    """Every first transmission of rank 0's reduce-phase data is lost (its pass end too, so
    the receiver cannot NACK). The timeout's probe comes through, but no original is
    acknowledged after it: the next timeout resends the rest, and the result is exact."""
    eps, datas = _setup(bound=bound)
    on = {"on": False}
    sent: Counter[int] = Counter()

    def drop(src, dg, q):
        chunk = _rank0_reduce_data(src, dg)
        if chunk is None or not on["on"]:
            return False
        sent[chunk] += 1
        return sent[chunk] == 1

    out, took = _lossless_then(eps, datas, Wire(eps, drop=drop), lambda: on.update(on=True))
    if bound == 0.0:
        for r in range(2):
            np.testing.assert_allclose(out[r].result, datas[0] + datas[1], rtol=1e-6, atol=1e-6)
    else:  # whatever was given up is within the bound and reported
        assert out[1].report.reduce.delivered_fraction >= 1.0 - bound - 1e-9
    assert max(sent.values()) <= 3  # the probe's chunk at most thrice, the rest twice at most
    assert took < NACK_AFTER  # recovered by the timeouts, not the receiver's NACKs


def test_a_path_that_dies_mid_transfer_is_left_by_the_timeouts():
    """Everything rank 0 sends on path 1 is lost from step 4 on, probes included. The probe
    draws no acknowledgement of the late chunks, so the next timeout declares them lost, and
    their resends take the path that works — well before the receiver's NACK deadline."""
    eps, datas = _setup()
    assert eps[0].endpoint.sender.config.n_paths == 2
    on = {"on": False}

    def drop(src, dg, q):
        return on["on"] and src == 0 and kind_of(dg) == Kind.DATA and dg.path == 1

    out, took = _lossless_then(eps, datas, wire := Wire(eps, drop=drop), lambda: on.update(on=True))
    for r in range(2):
        np.testing.assert_allclose(out[r].result, datas[0] + datas[1], rtol=1e-6, atol=1e-6)
    assert wire.dropped > 0
    assert took < NACK_AFTER


@pytest.mark.parametrize("drains", [True, False])
def test_a_deadline_nack_waits_until_the_sockets_were_read_empty(drains):
    """Rank 0's pass-end chunk is lost once, so only the NACK deadline (50 ms, no history)
    or the sender's timeout (250 ms) can recover it. A driver that reads its sockets empty
    after the deadline NACKs then; one that never does (still reading a backlog) does not ask
    for what may be waiting in its sockets, and the sender's timeout recovers it instead."""
    eps = make(
        2,
        min_rto_s=0.25,
        priority=PriorityConfig(policy="flat"),
        loss=LossConfig(loss_bound=0.0, soft_deadline_min_s=0.05, soft_deadline_max_s=0.05),
    )
    datas = random_datas(2, 2000, 12)
    nacks: list[float] = []
    lost: list[int] = []

    def drop(src, dg, q):
        if src == 1 and kind_of(dg) == Kind.NACK:
            nacks.append(wire.now)
        if src != 0 or kind_of(dg) != Kind.DATA or not header_of(dg)["flags"] & Flags.PASS_END:
            return False
        lost.append(int(header_of(dg)["phase"]))
        return len(lost) == 1

    eps[1].note_drained(0.0)  # a driver that tracks drains: none since the start...
    if drains:  # ...or, like the engine, one after every read and every timer (an idle host)
        receive, on_timer = eps[1].receive_datagram, eps[1].handle_timer

        def read_and_drain(data, path, now):
            receive(data, path, now)
            eps[1].note_drained(now)

        def timer_and_drain(now):
            on_timer(now)
            eps[1].note_drained(now)

        eps[1].receive_datagram, eps[1].handle_timer = read_and_drain, timer_and_drain
    wire = Wire(eps, drop=drop)
    out = run_allreduce(eps, datas, wire)
    assert all(isinstance(out[r], AllReduceComplete) for r in range(2))
    np.testing.assert_allclose(out[1].result, datas[0] + datas[1], rtol=1e-6, atol=1e-6)
    assert lost[0] == Phase.REDUCE
    if drains:
        assert nacks and 0.05 <= nacks[0] < 0.06 and wire.now < 0.2
    else:
        assert not [t for t in nacks if t < 0.25] and wire.now > 0.25


def _data_out(ep: Endpoint, now: float) -> list[tuple[int, int]]:
    """(chunk, path) of each DATA datagram ``ep`` sends now, in order."""
    return [
        (int(c), int(q))
        for item in ep.datagrams_to_send(now)
        if isinstance(item, DatagramRun)
        for c, q in zip(item.chunks, item.paths, strict=True)
    ]


def _late_pair(also_missing: bool = False, reorder_window_s: float = 0.001):
    """Rank 0 sends a 3000-float shard over two paths at 0 s; at 1 ms its peer acknowledges all
    but the newest chunk and the newest chunk of the other path (and, ``also_missing``, the
    first chunk sent on that other path). Returns the endpoint, the transfer, the sends
    ``(chunk, path)`` in order, and the missing chunks: newest, the other path's newest, and
    that path's first (or -1)."""
    cfg = TransportConfig(
        chunk_bytes=256, n_paths=2, min_rto_s=RTO, reorder_window_s=reorder_window_s,
        priority=PriorityConfig(policy="flat"),
    )  # fmt: skip
    ep = Endpoint(0, 2, cfg)
    data = np.random.default_rng(13).standard_normal(3000).astype(np.float32)
    key = OutKey(1, 0, 1, Phase.REDUCE, 1)
    t = ep.sender.start(key, data, DType.F32, 0.5, 0.0)
    sent = _data_out(ep, 0.0)
    assert len(sent) == t.n_chunks and {q for _, q in sent} == {0, 1}
    newest, newest_path = sent[-1]
    other = next(c for c, q in reversed(sent) if q != newest_path)  # newest on its path
    assert sent.index((other, 1 - newest_path)) < len(sent) - 2  # later ones were acked
    first = next(c for c, q in sent if q != newest_path) if also_missing else -1
    bits = np.ones(t.n_chunks, dtype=bool)
    bits[[c for c in (newest, other, first) if c >= 0]] = False
    trigger = next(c for c, _ in sent if bits[c])
    ep.sender.on_ack(key, 0, bits, trigger=trigger, manifest=False, now=0.001)
    return ep, t, sent, newest, other, first


def test_a_late_chunk_overtaken_only_on_another_path_is_probed_not_resent():
    """At the first timeout, a late chunk that later chunks overtook only on the other path is
    not lost: that path's queue may be shorter. Each path's newest late chunk gets one probe on
    its own path, and both stay in flight until the ACKs tell."""
    ep, t, _sent, newest, other, _ = _late_pair()
    ep.sender.handle_timer(1.0)
    assert t.state[other] == INFLIGHT and t.state[newest] == INFLIGHT
    out = _data_out(ep, 1.0)
    assert sorted(out) == sorted([(newest, int(t.path[newest])), (other, int(t.path[other]))])


def test_a_late_chunk_overtaken_in_its_own_lane_is_resent_at_once():
    """A late chunk that a later first transmission on its own path overtook is lost at the
    first timeout (that lane is one queue: the peer acknowledged what came after it)."""
    # RACK's reorder window longer than the test: the timeout's own rule is what resends.
    ep, t, _sent, newest, other, before = _late_pair(also_missing=True, reorder_window_s=10.0)
    assert t.path[before] == t.path[other] and t.state[before] == INFLIGHT
    assert t.overtaken(np.array([before, other, newest]), 1).tolist() == [before]
    ep.sender.handle_timer(1.0)
    assert t.state[before] == LOST and t.state[other] == INFLIGHT


def _on_way(t, idx, newest, floor, bound, now):  # type: ignore[no-untyped-def]
    """Which chunks of ``idx`` (all sent at 0) a NACK at ``now`` finds still on their way."""
    return (now < t.sent_at[idx] + t.on_way_for(idx, newest, floor, bound, 1)).tolist()


def test_a_nack_resends_what_the_newest_arrival_overtook_in_its_lane_only():
    """What a NACK asks for is resent if lost: overtaken in its own lane by the newest chunk
    the receiver had, or older than its path's wait on another lane (that path's queue may be
    deeper: no evidence), or older than that without a newest chunk at all."""
    _ep, t, sent, newest, other, before = _late_pair(also_missing=True)
    p_new = int(t.path[newest])
    arrived = [c for c, q in sent if q == p_new][-2]  # the receiver's newest, on newest's path
    earlier = next(c for c, q in sent if q == p_new)  # sent before it on that path
    idx = np.array([earlier, newest, before, other])
    floor, bound = np.full(2, 0.001), np.full(2, 0.005)
    # earlier: overtaken in its lane; newest: sent after the arrival, but its lane's 1 ms floor
    # has passed; before, other: another lane, 3 ms < its path's 5 ms wait.
    assert _on_way(t, idx, arrived, floor, bound, 0.003) == [False, False, True, True]
    assert _on_way(t, idx, arrived, floor, bound, 0.0005) == [False, True, True, True]
    assert not any(_on_way(t, idx, arrived, floor, bound, 0.006))
    assert all(_on_way(t, idx, -1, floor, bound, 0.003))
    assert not any(_on_way(t, idx, -1, floor, bound, 0.006))


def test_a_nack_waits_for_another_paths_rtt_bound_not_its_average():
    """The receiver's pass end can come over a fast path while a congested one still queues
    the chunks sent before it: a NACK names them too soon. The sender holds a chunk on another
    lane for that path's RTT bound (smoothed RTT plus four deviations), not the smoothed RTT
    alone, which lags a growing queue."""
    ep, t, sent, _newest, other, _before = _late_pair(also_missing=True)
    p_other = int(t.path[other])
    p_arrived = 1 - p_other
    arrived = [c for c, q in sent if q == p_arrived][-1]
    ps = ep.sender.paths[int(t.key.dst)]
    ps._srtt[:] = 0.002  # 2 ms on average...
    ps._rttvar[:] = 0.001  # ...but varying: the bound is 6 ms
    ps._min_rtt[:] = 0.0002
    bits = np.zeros(t.n_chunks, dtype=bool)
    bits[other] = True
    age = float(t.sent_at[other])
    ep.sender.on_nack(t.key, 0, bits, age + 0.004, newest=arrived)
    assert t.state[other] == INFLIGHT  # older than the average, within the bound: on its way
    ep.sender.on_nack(t.key, 0, bits, age + 0.007, newest=arrived)
    assert t.state[other] == LOST


def test_a_nack_waits_only_the_average_on_a_path_with_nothing_else_of_ours_in_flight():
    """When every chunk of ours in flight on a path is one the NACK asks for, no queue of ours
    can be growing there for them to wait behind (what queue is left, others' traffic, the
    smoothed RTT covers): they are lost past the average, not the bound. On a loaded host the
    deviations are scheduling noise, and a lane's last chunk has nothing after it to overtake
    it, so waiting for the bound cost every tail loss several RTTs."""
    ep, t, sent, _newest, other, before = _late_pair(also_missing=True)
    p_other = int(t.path[other])
    arrived = [c for c, q in sent if q == 1 - p_other][-1]
    ps = ep.sender.paths[int(t.key.dst)]
    ps._srtt[:] = 0.002
    ps._rttvar[:] = 0.001  # the bound: 6 ms
    ps._min_rtt[:] = 0.0002
    assert ((t.state == INFLIGHT) & (t.path == p_other)).nonzero()[0].tolist() == sorted(
        [before, other]
    )
    bits = np.zeros(t.n_chunks, dtype=bool)
    bits[[before, other]] = True  # every chunk of ours in flight on that path
    age = float(max(t.sent_at[before], t.sent_at[other]))
    ep.sender.on_nack(t.key, 0, bits, age + 0.0015, newest=arrived)
    assert t.state[other] == INFLIGHT and t.state[before] == INFLIGHT  # within the average
    ep.sender.on_nack(t.key, 0, bits, age + 0.0025, newest=arrived)
    assert t.state[other] == LOST and t.state[before] == LOST


def test_a_chunk_asked_for_on_its_way_is_resent_when_its_wait_ends_without_another_nack():
    """A NACK that comes while the chunk may still be on its way is kept: the sender's timer
    resends the chunk when its wait ends without an ACK. (The receiver backs off its NACKs while
    they bring nothing, so waiting for the next one would cost more than the wait.) An ACK in
    between ends the request."""
    ep, t, sent, _newest, other, _before = _late_pair(also_missing=True)
    p_other = int(t.path[other])
    arrived = [c for c, q in sent if q == 1 - p_other][-1]
    ps = ep.sender.paths[int(t.key.dst)]
    ps._srtt[:] = 0.002
    ps._rttvar[:] = 0.001  # the bound: 6 ms (``before`` is in flight there too)
    ps._min_rtt[:] = 0.0002
    bits = np.zeros(t.n_chunks, dtype=bool)
    bits[other] = True
    sent_at = float(t.sent_at[other])
    ep.sender.on_nack(t.key, 0, bits, sent_at + 0.004, newest=arrived)
    assert t.state[other] == INFLIGHT
    due = ep.sender.get_timer()
    assert due is not None and due <= sent_at + 0.006 + ep.config.tick_s
    ep.sender.handle_timer(sent_at + 0.0059)
    assert t.state[other] == INFLIGHT  # not yet
    ep.sender.handle_timer(sent_at + 0.0061)
    assert t.state[other] == LOST  # no second NACK needed
    assert t.nack_wait is not None and np.isinf(t.nack_wait[other])  # the request is done


def test_an_ack_ends_a_kept_nack_request():
    """The chunk a NACK asked for too soon arrives after all: its ACK ends the request, and the
    timer resends nothing."""
    ep, t, sent, _newest, other, _before = _late_pair(also_missing=True)
    p_other = int(t.path[other])
    arrived = [c for c, q in sent if q == 1 - p_other][-1]
    ps = ep.sender.paths[int(t.key.dst)]
    ps._srtt[:] = 0.002
    ps._rttvar[:] = 0.001
    ps._min_rtt[:] = 0.0002
    bits = np.zeros(t.n_chunks, dtype=bool)
    bits[other] = True
    sent_at = float(t.sent_at[other])
    ep.sender.on_nack(t.key, 0, bits, sent_at + 0.004, newest=arrived)
    ep.sender.on_ack(t.key, 0, bits, trigger=other, manifest=False, now=sent_at + 0.005)
    assert t.state[other] == ACKED
    ep.sender.handle_timer(sent_at + 0.0061)
    assert t.state[other] == ACKED and not t.asked_lost(sent_at + 1.0).size
