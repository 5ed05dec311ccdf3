"""A receiver that reads its sockets late (a loaded host) must not be sent its data again.

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
from gradlane.transport.core.outgoing import INFLIGHT, LOST, OutKey
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


def test_a_late_chunk_a_later_one_overtook_is_resent_at_once_the_rest_probed():
    """At the first timeout, a late chunk that a later first transmission overtook (on another
    path, so RACK's per-lane rule cannot tell) is lost: the peer acknowledged what came after
    it. It is resent at once; the newest chunk, which nothing overtook, is only probed."""
    cfg = TransportConfig(
        chunk_bytes=256, n_paths=2, min_rto_s=RTO, priority=PriorityConfig(policy="flat")
    )
    ep = Endpoint(0, 2, cfg)
    data = np.random.default_rng(13).standard_normal(3000).astype(np.float32)
    key = OutKey(1, 0, 1, Phase.REDUCE, 1)
    t = ep.sender.start(key, data, DType.F32, 0.5, 0.0)
    sent = _data_out(ep, 0.0)
    assert len(sent) == t.n_chunks and {q for _, q in sent} == {0, 1}
    newest, newest_path = sent[-1]
    overtaken = next(c for c, q in reversed(sent) if q != newest_path)  # newest on its path
    assert sent.index((overtaken, 1 - newest_path)) < len(sent) - 2  # later ones were acked
    bits = np.ones(t.n_chunks, dtype=bool)
    bits[[newest, overtaken]] = False
    ep.sender.on_ack(key, 0, bits, trigger=sent[0][0], manifest=False, now=0.001)
    assert t.state[overtaken] == INFLIGHT  # RACK's lanes cannot tell
    ep.sender.handle_timer(1.0)
    assert t.state[overtaken] == LOST and t.state[newest] == INFLIGHT
    out = _data_out(ep, 1.0)
    assert sorted(c for c, _ in out) == sorted([newest, overtaken])  # a probe and a resend
    assert (newest, newest_path) in out  # the probe takes the chunk's own path
