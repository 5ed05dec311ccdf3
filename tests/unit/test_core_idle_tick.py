"""The sender's housekeeping tick runs when something can be due, not every ``tick_s``.

A sender waiting on a peer that has not started (or is slow to read) has nothing to do until a
timeout, a probe or a deadline falls due; ticking every ``tick_s`` regardless would wake it a
thousand times a second for nothing.
Deterministic: the in-memory wire and its fake clock.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.paths import PathSet
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.endpoint import Endpoint
from gradlane.transport.core.events import AllReduceComplete
from gradlane.transport.core.outgoing import OutKey
from gradlane.transport.wire.header import DType, Kind, Phase

from tests.support.cores import kind_of, make, random_datas, run_allreduce
from tests.support.wire import Wire


def count_ticks(ep) -> list[float]:
    """Record the times at which ``ep``'s sender really ticks (not an early timer call)."""
    sender = ep.endpoint.sender
    ticks: list[float] = []
    inner = sender.handle_timer

    def handle_timer(now: float) -> None:
        if now >= sender._tick_at:
            ticks.append(now)
        inner(now)

    sender.handle_timer = handle_timer
    return ticks


class Alarm:
    """A wire endpoint that only runs ``action(now)`` at ``at`` (a late rank's start at a set
    time, whatever else is happening on the wire then)."""

    def __init__(self, at: float, action) -> None:
        self.at: float | None = at
        self.action = action

    def get_timer(self) -> float | None:
        return self.at

    def handle_timer(self, now: float) -> None:
        if self.at is not None and now >= self.at:
            self.at = None
            self.action(now)

    def datagrams_to_send(self, now: float) -> list:
        return []

    def next_event(self) -> None:
        return None


def completed(wire: Wire, n: int) -> bool:
    return sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == n


def test_a_sender_waiting_for_a_peer_ticks_only_when_something_is_due():
    """Rank 0 sends everything; rank 1 starts 0.3 s later (held early data, no ACKs, so no
    timeouts). Rank 0 ticks a handful of times in that wait instead of ~300, and the
    collective still completes exactly once rank 1 starts."""
    world, n = 2, 3000
    eps = make(world, loss=LossConfig(hard_deadline_s=5.0))
    datas = random_datas(world, n, 1)
    ticks = count_ticks(eps[0])
    wire = Wire(eps)
    eps[0].start(1, 0, datas[0], 0.5, now=0.0)
    wire.run(lambda: wire.now >= 0.3, max_time=1.0)
    waiting = [t for t in ticks if 0.01 <= t < 0.3]
    assert len(waiting) < 30, waiting  # each tick_s (1 ms) would be ~290
    eps[1].start(1, 0, datas[1], 0.5, now=wire.now)
    wire.run(lambda: completed(wire, 2), max_time=2.0)
    for _, _, e in wire.events:
        np.testing.assert_array_equal(e.result, datas[0] + datas[1])


def test_a_timeout_fires_when_due_with_nothing_else_happening():
    """After a few lossless collectives (RTT samples: a short RTO), everything either rank
    sends is lost for 40 ms: no ACK or NACK wakes rank 0's tick. It must still resend on its
    own (retransmission timeout, well before a path turns SUSPECT at 50 ms), tick only a
    few times meanwhile, and the collective completes exactly."""
    world, n = 2, 3000
    eps = make(world, loss=LossConfig(hard_deadline_s=5.0))
    datas = random_datas(world, n, 2)
    blackout = {"from": np.inf, "to": np.inf}
    data_sent: list[float] = []

    def drop(src, dg, seq):
        if src == 0 and kind_of(dg) == Kind.DATA:
            data_sent.append(wire.now)
        return blackout["from"] <= wire.now < blackout["to"]

    wire = Wire(eps, drop=drop)
    for step in range(1, 6):
        run_allreduce(eps, datas, wire, step=step)
    t0 = wire.now
    blackout.update({"from": t0, "to": t0 + 0.04})
    ticks = count_ticks(eps[0])
    data_sent.clear()
    out = run_allreduce(eps, datas, wire, step=6, max_time=t0 + 3.0)
    for r in range(world):
        assert isinstance(out[r], AllReduceComplete)
        np.testing.assert_array_equal(out[r].result, datas[0] + datas[1])
    assert any(t0 + 0.001 < t < t0 + 0.04 for t in data_sent)  # resent unprompted, in time
    assert len([t for t in ticks if t0 + 0.001 <= t < t0 + 0.04]) < 20  # not one per ms


#: The defaults (one path, no rate cap), and the simulator's kind of host: two paths sprayed,
#: a paced NIC, received datagrams coalesced for 20 µs.
PATHS_AND_PACING = {"n_paths": 2, "nic_rate_Bps": 2e7, "rx_coalesce_s": 20e-6}


@pytest.mark.parametrize("bound", [0.0, 0.05])
@pytest.mark.parametrize("cfg", [{}, PATHS_AND_PACING], ids=["defaults", "paths+pacing"])
def test_skipped_ticks_change_nothing_on_the_wire(monkeypatch, bound, cfg):
    """The same lossy, reordering run twice (three collectives, then one whose last rank
    starts late): once with the ticks skipped, once ticking every ``tick_s`` (a path set
    that always says 'due now'). Every datagram leaves at the same
    time with the same bytes: the skipped ticks would have found nothing to do."""

    def run() -> tuple[list[tuple[float, int, bytes]], int]:
        world, n = 3, 5000
        eps = make(world, loss=LossConfig(loss_bound=bound, hard_deadline_s=5.0), **cfg)
        datas = random_datas(world, n, 4)
        rng = np.random.default_rng(9)
        sent: list[tuple[float, int, bytes]] = []

        def drop(src, dg, seq):
            sent.append((wire.now, src, bytes(dg.wire())))
            return rng.random() < 0.08

        wire = Wire(eps, jitter=300e-6, seed=5, drop=drop)
        for step in range(1, 4):
            run_allreduce(eps, datas, wire, step=step)
        ticks = [count_ticks(ep) for ep in eps]  # every rank's: which skips depends on the run
        t0 = wire.now
        for r in range(world - 1):  # the last rank starts 20 ms late: the others wait
            eps[r].start(4, 0, datas[r], 0.5, now=t0)
        late = eps[-1]

        def start_late(now: float) -> None:
            late.start(4, 0, datas[-1], 0.5, now=now)
            wire._collect(world - 1)  # what it sends at once

        wire.endpoints.append(Alarm(t0 + 0.02, start_late))
        wire.run(lambda: completed(wire, 4 * world))
        return sent, sum(len(t) for t in ticks)

    skipped, n_skipped = run()
    monkeypatch.setattr(PathSet, "next_due", lambda self: -np.inf)
    every, n_every = run()
    assert n_skipped < n_every  # ticks were skipped ...
    assert skipped == every  # ... and nothing on the wire changed


def test_a_late_tick_keeps_the_grid():
    """A driver may run the tick late (input held for coalescing is processed first): the
    tick acts then, but the grid stays where it was, so later ticks fall where ticking every
    ``tick_s`` would put them."""
    ep = Endpoint(0, 2, TransportConfig(chunk_bytes=256, tick_s=0.001))
    data = np.arange(3000, dtype=np.float32)
    ep.sender.start(OutKey(1, 0, 1, Phase.REDUCE, 1), data, DType.F32, 0.5, 0.0)
    ep.datagrams_to_send(0.0)
    assert ep.sender._tick_at == pytest.approx(0.001)
    ep.sender.handle_timer(0.00137)  # 0.37 ms late
    ep.sender._wake(0.0015)  # something happens: tick at the grid's next point
    assert ep.sender._tick_at == pytest.approx(0.002)
    ep.sender.handle_timer(0.0057)  # several points late
    ep.sender._wake(0.0058)
    assert ep.sender._tick_at == pytest.approx(0.006)
