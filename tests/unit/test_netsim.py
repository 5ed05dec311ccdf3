"""Unit tests of gradlane.bench.sim.simulator: timing, queues, priorities, impairments, cross
traffic, the driver.

The endpoints here are toys written for the tests (the real protocol cores have their own
tests): a sender that hands out scheduled datagrams, a recorder, and a reliable sender/ACKer
pair with a retransmission timer. Payloads carry a sequence number, a class and a send time.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass

import numpy as np
import pytest
from gradlane.bench.sim.simulator import (
    Network,
    Simulation,
    SimulationError,
    dumbbell,
    leafspine,
    measure_event_rate,
    pair,
    star,
)
from gradlane.scheduling.errors import ConfigError
from gradlane.transport.core.events import Datagram
from hypothesis import given, settings
from hypothesis import strategies as st

_HDR = struct.Struct("<BIIdB")  # kind, src, seq, send time, class
DATA, ACK = 0, 1
TOS = {0: 46 << 2, 1: 34 << 2, 2: 0, 3: 8 << 2}  # class -> TOS under the default DSCP map


def packet(kind: int, src: int, seq: int, sent: float, cls: int, *, size: int = 1000) -> bytes:
    return _HDR.pack(kind, src, seq, sent, cls).ljust(size, b"\0")


class Toy:
    """Base toy endpoint: nothing to send, no timer, no events."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.out: list[Datagram] = []

    def receive_datagram(self, data: bytes | memoryview, path: int, now: float) -> None:
        pass

    def datagrams_to_send(self, now: float) -> list[Datagram]:
        out, self.out = self.out, []
        return out

    def get_timer(self) -> float | None:
        return None

    def handle_timer(self, now: float) -> None:
        pass

    def next_event(self) -> object | None:
        return self.events.pop(0) if self.events else None


class Scheduled(Toy):
    """Sends each datagram at its scheduled time (drives itself with its timer)."""

    def __init__(self, schedule: list[tuple[float, Datagram]]) -> None:
        super().__init__()
        self.schedule = sorted(schedule, key=lambda x: x[0])
        self.i = 0

    def datagrams_to_send(self, now: float) -> list[Datagram]:
        out = []
        while self.i < len(self.schedule) and self.schedule[self.i][0] <= now:
            out.append(self.schedule[self.i][1])
            self.i += 1
        return out

    def get_timer(self) -> float | None:
        return self.schedule[self.i][0] if self.i < len(self.schedule) else None


class Recorder(Toy):
    """Records (now, path, seq, class, send time, size) of every arrival."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[tuple[float, int, int, int, float, int]] = []

    def receive_datagram(self, data: bytes | memoryview, path: int, now: float) -> None:
        _, _, seq, sent, cls = _HDR.unpack_from(data)
        self.got.append((now, path, seq, cls, sent, len(data)))


def burst(dst: int, n: int, *, size: int = 1000, cls: int = 2, paths: int = 1, t: float = 0.0):
    """``n`` numbered datagrams to ``dst``, all scheduled at ``t``, sprayed over ``paths``."""
    return [
        (t, Datagram(packet(DATA, 0, i, t, cls, size=size), dst, i % paths, TOS[cls]))
        for i in range(n)
    ]


@dataclass(frozen=True)
class Done:
    at: float
    retransmits: int


class ReliableSender(Toy):
    """Sends ``n`` chunks to ``peer`` over two paths; resends unACKed ones every ``rto``."""

    def __init__(self, me: int, peer: int, n: int, rto: float, size: int = 1200) -> None:
        super().__init__()
        self.me, self.peer, self.n, self.rto, self.size = me, peer, n, rto, size
        self.acked = [False] * n
        self.left = n
        self.sent_at = [0.0] * n
        self.retransmits = 0
        self.pending = list(range(n))

    def receive_datagram(self, data: bytes | memoryview, path: int, now: float) -> None:
        kind, _, seq, _, _ = _HDR.unpack_from(data)
        if kind == ACK and not self.acked[seq]:
            self.acked[seq] = True
            self.left -= 1
            if self.left == 0:
                self.events.append(Done(now, self.retransmits))

    def datagrams_to_send(self, now: float) -> list[Datagram]:
        out = []
        for seq in self.pending:
            self.sent_at[seq] = now
            data = memoryview(packet(DATA, self.me, seq, now, 2, size=self.size))
            out.append(Datagram(data, self.peer, seq & 1, 0))
        self.pending = []
        return out

    def get_timer(self) -> float | None:
        if self.left == 0:
            return None
        return min(t for t, a in zip(self.sent_at, self.acked, strict=True) if not a) + self.rto

    def handle_timer(self, now: float) -> None:
        for seq in range(self.n):
            if not self.acked[seq] and self.sent_at[seq] + self.rto <= now:
                self.pending.append(seq)
                self.retransmits += 1


class Acker(Recorder):
    """Records DATA and answers each with an ACK on the path it came on."""

    def __init__(self, me: int) -> None:
        super().__init__()
        self.me = me

    def receive_datagram(self, data: bytes | memoryview, path: int, now: float) -> None:
        super().receive_datagram(data, path, now)
        _, src, seq, _, _ = _HDR.unpack_from(data)
        self.out.append(Datagram(packet(ACK, self.me, seq, now, 0, size=64), src, path, TOS[0]))


def link_stats(sim: Simulation, name: str) -> dict:
    return next(x for x in sim.stats()["links"] if x["name"] == name)


# -- timing and queues ----------------------------------------------------------------------
def test_serialisation_and_propagation_are_exact_on_one_link() -> None:
    net = pair(rate=1e6, delay=1e-3)
    rec = Recorder()
    sim = Simulation(net, [Scheduled(burst(1, 3) + burst(1, 1, size=500, t=0.01)), rec])
    sim.run()
    arrivals = [g[0] for g in rec.got]
    # 1000 B at 1 MB/s = 1 ms each, back to back, plus 1 ms of propagation.
    assert arrivals == pytest.approx([0.002, 0.003, 0.004, 0.0115], rel=1e-12, abs=1e-15)
    assert [g[2] for g in rec.got] == [0, 1, 2, 0]
    st = link_stats(sim, "h0>h1")
    assert (st["bytes"], st["packets"]) == (3500, 4)
    assert sim.now == pytest.approx(0.0115)


def test_store_and_forward_through_a_switch() -> None:
    net = star(3, rate=1e6, delay=1e-4)
    rec = Recorder()
    sim = Simulation(net, [Scheduled(burst(2, 2)), Toy(), rec])
    sim.run()
    # Two hops of (1 ms + 0.1 ms); the second packet follows one serialisation later.
    assert [g[0] for g in rec.got] == pytest.approx([0.0022, 0.0032], rel=1e-12)


def test_byte_limit_drops_at_the_bottleneck() -> None:
    net = dumbbell(2, host_rate=1e12, bottleneck_rate=1e6, delay=0.0, queue_bytes=5000)
    rec = Recorder()
    sim = Simulation(net, [Scheduled(burst(1, 20)), rec])
    sim.run()
    # One in service, five waiting (5000 B), the other fourteen dropped on arrival.
    assert [g[2] for g in rec.got] == [0, 1, 2, 3, 4, 5]
    st = link_stats(sim, "left>right")
    assert st["drops"] == [0, 0, 14, 0]
    assert st["max_queue_bytes"] == 5000
    s = sim.stats()["packets"]
    assert (s["queue_drops"], s["local_drops"], s["injected"], s["delivered"]) == (14, 0, 20, 6)


def test_host_queue_overflow_is_a_local_drop() -> None:
    net = leafspine(4, 2, 2, host_rate=1e6, fabric_rate=1e6, host_queue_bytes=3000)
    rec = Recorder()
    sim = Simulation(net, [Scheduled(burst(3, 10)), Toy(), Toy(), rec])
    sim.run()
    s = sim.stats()["packets"]
    assert (s["local_drops"], s["queue_drops"], s["delivered"]) == (6, 0, 4)


def _priority_run(priority: bool) -> tuple[Recorder, Simulation]:
    """Classes 0 and 3 alternate at about twice the bottleneck rate into a 20 kB queue."""
    rate = 1e6
    net = dumbbell(2, host_rate=1e9, bottleneck_rate=rate, delay=1e-5, queue_bytes=20_000)
    net.configure_link("left>right", priority=priority)
    sched = []
    rng = np.random.default_rng(0)  # arrival phases vary, so tail drop hits both classes
    for i in range(400):
        t = (i * 500 + rng.uniform(0, 400)) / rate
        cls = 0 if i % 2 == 0 else 3
        sched.append((t, Datagram(packet(DATA, 0, i, t, cls, size=1000), 1, 0, TOS[cls])))
    rec = Recorder()
    sim = Simulation(net, [Scheduled(sched), rec])
    sim.run()
    return rec, sim


def test_strict_priority_serves_class_0_first_and_drops_class_3_first() -> None:
    rec, sim = _priority_run(priority=True)
    delay = {c: [g[0] - g[4] for g in rec.got if g[3] == c] for c in (0, 3)}
    assert len(delay[0]) == 200  # every class-0 packet arrived
    assert max(delay[0]) < 0.0025  # at most one class-3 packet in service ahead of it
    assert sum(delay[3]) / len(delay[3]) > 5 * sum(delay[0]) / len(delay[0])
    drops = link_stats(sim, "left>right")["drops"]
    assert drops[0] == 0 and drops[3] > 0


def test_priority_unaware_switch_is_one_fifo() -> None:
    rec, sim = _priority_run(priority=False)
    seqs = [g[2] for g in rec.got]
    assert seqs == sorted(seqs)  # FIFO: arrival order is send order
    drops = link_stats(sim, "left>right")["drops"]
    assert drops[0] > 0 and drops[3] > 0  # tail drop does not look at classes
    assert abs(drops[0] - drops[3]) < 0.3 * (drops[0] + drops[3])


def test_higher_class_pushes_out_the_newest_lowest_class_packet() -> None:
    net = dumbbell(2, host_rate=1e12, bottleneck_rate=1e6, delay=0.0, queue_bytes=3000)
    sched = [(0.0, Datagram(packet(DATA, 0, i, 0.0, c, size=1000), 1, 0, TOS[c])) for i, c in
             enumerate([3, 3, 2, 3, 1, 0])]  # fmt: skip
    rec = Recorder()
    sim = Simulation(net, [Scheduled(sched), rec])
    sim.run()
    # seq 0 in service; 1, 2, 3 fill the queue; seq 4 (class 1) pushes out 3 (newest class 3),
    # seq 5 (class 0) pushes out 1; strict priority then serves 5, 4, 2.
    assert [g[2] for g in rec.got] == [0, 5, 4, 2]
    assert link_stats(sim, "left>right")["drops"] == [0, 0, 0, 2]


# -- impairments ----------------------------------------------------------------------------
def test_random_loss_rate_is_within_tolerance_and_seeded() -> None:
    def run(seed: int) -> tuple[int, list[int]]:
        net = pair(rate=1e9, delay=1e-6)
        net.configure_link("h0>h1", loss=0.1)
        rec = Recorder()
        sim = Simulation(net, [Scheduled(burst(1, 5000, size=100)), rec], seed=seed)
        sim.run()
        assert sim.stats()["packets"]["lost"] == 5000 - len(rec.got)
        return len(rec.got), [g[2] for g in rec.got]

    n, seqs = run(1)
    assert abs(n / 5000 - 0.9) < 0.015  # ~3.5 standard deviations
    assert run(1) == (n, seqs)
    assert run(2)[1] != seqs


def test_failure_window_loses_exactly_the_packets_on_the_link() -> None:
    net = pair(rate=1e6, delay=1e-3)
    net.fail_link("h0>h1", 0.0105, 0.0205)
    sched = [
        (0.002 * k, Datagram(packet(DATA, 0, k, 0.0, 2, size=1000), 1, 0, 0)) for k in range(20)
    ]
    rec = Recorder()
    sim = Simulation(net, [Scheduled(sched), rec])
    sim.run()
    # Packet k occupies the link during [0.002k, 0.002k + 2 ms]: k = 5 .. 10 overlap the window.
    assert sorted(g[2] for g in rec.got) == [k for k in range(20) if not 5 <= k <= 10]
    assert link_stats(sim, "h0>h1")["failed"] == 6


def test_failed_link_forwards_nothing_and_flushes_its_queue() -> None:
    net = pair(rate=1e6, delay=1e-3)
    net.fail_link("h0>h1", 0.0035, 0.0055)
    rec = Recorder()
    sim = Simulation(net, [Scheduled(burst(1, 10) + burst(1, 1, t=0.006)), rec])
    sim.run()
    # 0 and 1 land before the failure, 2 and 3 are on the wire when it starts, 4..9 wait and
    # are flushed at 4 ms; the packet sent after the window gets through.
    assert [g[2] for g in rec.got] == [0, 1, 0]
    assert [g[0] for g in rec.got] == pytest.approx([0.002, 0.003, 0.008])
    st = link_stats(sim, "h0>h1")
    assert st["failed"] == 8 and st["packets"] == 5


def test_jitter_delays_within_bounds() -> None:
    net = pair(rate=1e9, delay=1e-3)
    net.configure_link("h0>h1", jitter=1e-4)
    rec = Recorder()
    sim = Simulation(net, [Scheduled(burst(1, 200, size=100)), rec], seed=3)
    sim.run()
    extra = [g[0] - (g[2] + 1) * 100 / 1e9 - 1e-3 for g in rec.got]
    assert min(extra) >= 0 and max(extra) < 1e-4
    assert max(extra) - min(extra) > 5e-5


# -- leaf-spine paths ---------------------------------------------------------------------------
def test_two_paths_cross_different_spines() -> None:
    net = leafspine(8, 2, 4, host_rate=1e9, fabric_rate=1e9)
    for src, dst in ((0, 5), (0, 1), (6, 2)):  # across leaves and under one leaf
        r0, r1 = net.route(src, dst, 0), net.route(src, dst, 1)
        assert len(r0) == len(r1) == 4
        assert r0[0] == r1[0] == net.uplink(src) and r0[3] == r1[3] == net.downlink(dst)
        names = [net.links[x].name for x in (*r0[1:3], *r1[1:3])]
        assert "spine0" in names[0] and "spine0" in names[1]
        assert "spine1" in names[2] and "spine1" in names[3]
        assert net.route(src, dst, 2) == r0  # path p uses spine p mod n_spines
    recs = [Recorder() for _ in range(8)]
    sched = burst(5, 6, paths=2) + burst(1, 4, paths=2, t=0.001)
    sim = Simulation(net, [Scheduled(sched), *recs[1:]])
    sim.run()
    assert sorted(g[1] for g in recs[5].got) == [0, 0, 0, 1, 1, 1]
    assert sorted(g[1] for g in recs[1].got) == [0, 0, 1, 1]
    assert link_stats(sim, "leaf0>spine0")["bytes"] == 5000
    assert link_stats(sim, "leaf0>spine1")["bytes"] == 5000
    assert link_stats(sim, "spine1>leaf1")["bytes"] == 3000
    assert sim.stats()["paths"]["delivered_bytes"] == {"0": 5000, "1": 5000}


def test_a_failed_spine_loses_only_its_path() -> None:
    net = leafspine(4, 2, 2, host_rate=1e9)
    assert len(net.fail_node("spine1", 0.0, 1.0)) == 4  # two leaves, both directions
    assert net.links_of("spine1") == [net.link_between("spine1", f"leaf{i}") for i in (0, 1)]
    rec = Recorder()
    sim = Simulation(net, [Scheduled(burst(3, 10, paths=2)), Toy(), Toy(), rec])
    sim.run()
    assert sorted(g[2] for g in rec.got) == [0, 2, 4, 6, 8]
    assert sim.stats()["packets"]["failed"] == 5
    assert json.loads(json.dumps(net.describe()))["failures"]["leaf0>spine1"] == [[0.0, 1.0]]


def test_256_hosts_construct_and_route() -> None:
    net = leafspine(256, 4)
    assert net.precompute_routes() == 256 * 255 * 4
    assert len({net.route(0, 255, p)[1] for p in range(4)}) == 4
    recs = [Recorder() for _ in range(256)]
    eps = [Scheduled(burst((h + 1) % 256, 4, paths=4)) for h in range(256)]
    for h in range(256):
        eps[h].got = recs[h].got  # type: ignore[attr-defined]
        eps[h].receive_datagram = recs[h].receive_datagram  # type: ignore[method-assign]
    sim = Simulation(net, eps)
    sim.run()
    assert all(len(r.got) == 4 for r in recs)
    assert sim.stats()["packets"]["delivered"] == 1024


# -- cross traffic --------------------------------------------------------------------------
def _transfer_time(model: str | None, cls: int, fraction: float = 0.7) -> float:
    """Time to push 2000 × 1000 B through a 1e8 B/s bottleneck fed at its own rate."""
    rate = 1e8
    net = dumbbell(2, host_rate=rate, bottleneck_rate=rate, delay=1e-6, queue_bytes=1 << 30)
    if model is not None:
        net.add_cross_traffic(fraction, link="left>right", model=model, packet_bytes=1500)
    rec = Recorder()
    sim = Simulation(net, [Scheduled(burst(1, 2000, cls=cls)), rec], seed=5)
    sim.run(stop=lambda: len(rec.got) == 2000)
    assert len(rec.got) == 2000
    return rec.got[-1][0]


@pytest.mark.parametrize(
    ("model", "cls", "slowdown"),
    [
        ("packets", 3, 1 / 0.3),  # cross traffic (class 2) strictly above us: we get 30%
        ("packets", 2, 1.7),  # one FIFO class: the backlog drains at the line rate
        ("packets", 0, 1.0),  # we are strictly above the cross traffic
        ("fluid", 3, 1 / 0.3),
        ("fluid", 2, 1 / 0.3),  # fluid takes its share of its own class too
        ("fluid", 0, 1.0),
    ],
)
def test_cross_traffic_at_70_percent_slows_a_flow_as_fluid_math_says(
    model: str, cls: int, slowdown: float
) -> None:
    base = _transfer_time(None, cls)
    # 20 ms at the bottleneck + one packet's serialisation on the two other hops + 3 delays.
    assert base == pytest.approx(0.02 + 2e-5 + 3e-6, rel=1e-9)
    assert _transfer_time(model, cls) / base == pytest.approx(slowdown, rel=0.03)


def test_cross_traffic_is_counted_and_delivered_nowhere() -> None:
    net = leafspine(4, 2, 2, host_rate=1e8)
    net.add_cross_traffic(0.5, between=(0, 3, 1), model="packets", end=0.01, name="bg")
    net.add_cross_traffic(0.5, link="leaf0>spine0", on_s=1e-3, off_s=1e-3, random_periods=False)
    rec = Recorder()
    sim = Simulation(net, [Toy(), Toy(), Toy(), rec], seed=1)
    sim.run(until=0.02)
    assert rec.got == []
    bg, onoff = sim.stats()["cross"]
    assert bg["name"] == "bg" and bg["links"] == ["h0>leaf0", "leaf0>spine1", "spine1>leaf1",
                                                   "leaf1>h3"]  # fmt: skip
    assert bg["packets"] == pytest.approx(0.5 * 1e8 * 0.01 / 1500, rel=0.02)
    assert bg["delivered"] == bg["packets"] and bg["dropped"] == 0
    assert onoff["offered_bytes"] == pytest.approx(0.5 * 1e8 * 0.01, rel=0.02)  # on half the time
    assert link_stats(sim, "h0>leaf0")["bytes"] == bg["packets"] * 1500
    assert sim.now == 0.02


def test_endless_cross_traffic_needs_a_bound() -> None:
    net = pair()
    net.add_cross_traffic(0.5, link=0, model="packets")
    sim = Simulation(net, [Toy(), Toy()])
    with pytest.raises(ConfigError, match="until"):
        sim.run()
    assert sim.run(until=1e-4) == 1e-4
    net = pair()
    net.add_cross_traffic(0.5, link=0)  # fluid: no events of its own, so nothing to bound
    Simulation(net, [Toy(), Toy()]).run()


# -- the driver -----------------------------------------------------------------------------
class TimerProbe(Toy):
    def __init__(self, timer: float | None) -> None:
        super().__init__()
        self.timer = timer
        self.fired: list[float] = []

    def get_timer(self) -> float | None:
        return self.timer

    def handle_timer(self, now: float) -> None:
        self.fired.append(now)
        self.timer = None


def test_timer_fires_at_its_time_and_stale_timers_are_ignored() -> None:
    probe = TimerProbe(1.0)
    sim = Simulation(pair(), [probe, Toy()])

    def rearm(now: float) -> None:
        probe.timer = 0.5

    sim.call_at(0.1, rearm, host=0)
    sim.run()
    assert probe.fired == [0.5]
    ev = sim.stats()["events"]
    assert (ev["timers"], ev["stale_timers"]) == (1, 1)
    assert sim.now == 1.0  # the stale event still advanced the clock when it popped


def test_a_timer_in_the_past_fires_now_and_a_stuck_timer_is_an_error() -> None:
    probe = TimerProbe(-5.0)
    sim = Simulation(pair(), [probe, Toy()], start=2.0)
    sim.run()
    assert probe.fired == [2.0]

    class Stuck(TimerProbe):
        def handle_timer(self, now: float) -> None:
            self.fired.append(now)

    sim = Simulation(pair(), [Stuck(1.0), Toy()])
    with pytest.raises(SimulationError, match="host 0"):
        sim.run()


def _reliable_digest(seed: int) -> tuple[str, list[tuple[int, Done]]]:
    net = leafspine(8, 2, 4, host_rate=1e8, delay=5e-6, queue_bytes=20_000)
    for name in ("spine0>leaf1", "leaf0>spine1"):
        net.configure_link(name, loss=0.02, jitter=2e-6)
    net.add_cross_traffic(0.4, link="spine1>leaf1", model="packets", on_s=2e-4, off_s=2e-4,
                          end=0.02)  # fmt: skip
    net.add_cross_traffic(0.3, between=(1, 6, 0), on_s=1e-4, off_s=3e-4)  # fluid
    eps: list = [ReliableSender(h, h + 4, 300, rto=2e-3) for h in range(4)]
    eps += [Acker(h) for h in range(4, 8)]
    done: list[tuple[int, Done]] = []
    sim = Simulation(net, eps, seed=seed, on_event=lambda h, ev, now: done.append((h, ev)))
    sim.run()
    log = sorted((g[0], h, g[2], g[5]) for h in range(4, 8) for g in eps[h].got)
    return hashlib.sha256(repr(log).encode()).hexdigest(), done


def test_reliable_toy_completes_and_runs_are_deterministic() -> None:
    d1, done = _reliable_digest(7)
    assert sorted(h for h, _ in done) == [0, 1, 2, 3]
    assert all(isinstance(ev, Done) for _, ev in done)
    assert sum(ev.retransmits for _, ev in done) > 0  # the lossy links cost retransmits
    d2, done2 = _reliable_digest(7)
    assert (d1, done) == (d2, done2)
    assert _reliable_digest(8)[0] != d1


def test_driver_edge_cases() -> None:
    net = star(3, rate=1e6, delay=0.0)
    loop = Scheduled([(0.0, Datagram(memoryview(packet(DATA, 0, 9, 0.0, 2, size=100)), 0, 0, 0))])
    got: list = []
    loop.receive_datagram = lambda d, p, n: got.append((type(d), n))  # type: ignore[method-assign]
    sim = Simulation(net, [loop, Scheduled(burst(2, 1)), None])
    sim.run()
    assert got == [(bytes, 0.0)]  # to itself: delivered at once, as a copy
    assert sim.stats()["packets"]["undeliverable"] == 1
    bad = Simulation(net, [Scheduled(burst(7, 1)), Toy(), Toy()])
    with pytest.raises(SimulationError, match="rank 7"):
        bad.run()
    with pytest.raises(ConfigError):
        Simulation(net, [Toy()])
    with pytest.raises(ConfigError):
        sim.call_at(-1.0)


def test_stop_and_until_and_stats_are_json() -> None:
    net = pair(rate=1e6, delay=1e-3)
    rec = Recorder()
    sim = Simulation(net, [Scheduled(burst(1, 10)), rec])
    assert sim.run(until=0.0045) == 0.0045
    assert len(rec.got) == 3
    sim.run(stop=lambda: len(rec.got) == 5)
    assert len(rec.got) == 5 and sim.now == pytest.approx(0.006)
    sim.run()
    s = json.loads(json.dumps(sim.stats()))
    ev = s["events"]
    assert ev["packet"] == ev["arrivals"] + ev["transmissions"] + ev["deliveries"] + ev["drops"]
    assert (ev["arrivals"], ev["transmissions"], ev["deliveries"]) == (10, 10, 10)
    assert s["links"][0]["utilisation"] == pytest.approx(10_000 / 1e6 / 0.011)


def test_network_validation() -> None:
    net = Network(2)
    sw = net.add_switch("sw")
    net.add_link(0, sw, rate=1e6, delay=0, queue_bytes=1)
    with pytest.raises(ConfigError):
        net.add_link(0, "sw", rate=1e6, delay=0, queue_bytes=1)
    with pytest.raises(ConfigError):
        net.add_link("sw", "nowhere", rate=1e6, delay=0, queue_bytes=1)
    with pytest.raises(ConfigError):
        net.route(0, 1)  # no link into h1 yet
    net.add_link("sw", 1, rate=1e6, delay=0, queue_bytes=1)
    assert [net.links[x].name for x in net.route(0, 1)] == ["h0>sw", "sw>h1"]
    net.set_router(lambda s, d, p: (net.link_id("sw>h1"),), 1)
    with pytest.raises(ConfigError, match="broken"):
        net.route(0, 1)
    with pytest.raises(ConfigError):
        net.add_cross_traffic(1.0, link=0, model="fluid")
    with pytest.raises(ConfigError):
        Network(2, dscp_classes={46: 9})


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    priority=st.booleans(),
    loss=st.sampled_from([0.0, 0.05]),
    queue=st.integers(0, 20_000),
    fail=st.one_of(st.none(), st.tuples(st.floats(0, 2e-3), st.floats(1e-5, 2e-3))),
    cross=st.sampled_from([None, "packets", "fluid"]),
)
def test_every_packet_is_delivered_or_counted_as_dropped(
    *,
    seed: int,
    priority: bool,
    loss: float,
    queue: int,
    fail: tuple[float, float] | None,
    cross: str | None,
) -> None:
    net = leafspine(6, 2, 3, host_rate=1e8, fabric_rate=5e7, queue_bytes=queue, priority=priority)
    net.configure_link("spine0>leaf1", loss=loss, jitter=1e-6)
    if fail is not None:
        net.fail_link("leaf0>spine1", fail[0], fail[0] + fail[1])
    if cross is not None:
        net.add_cross_traffic(0.5, link="spine1>leaf1", model=cross, end=3e-3)
    rng = np.random.default_rng(seed)
    recs = [Recorder() for _ in range(6)]
    eps = []
    for h in range(6):
        sched = [
            (float(rng.uniform(0, 1e-3)), Datagram(packet(DATA, h, i, 0.0, c, size=int(n)),
                                                   int(d), int(p), TOS[int(c)]))
            for i, (d, p, c, n) in enumerate(
                zip(rng.integers(0, 6, 40), rng.integers(0, 4, 40), rng.integers(0, 4, 40),
                    rng.integers(64, 1500, 40), strict=True)
            )
        ]  # fmt: skip
        ep = Scheduled(sched)
        ep.receive_datagram = recs[h].receive_datagram  # type: ignore[method-assign]
        eps.append(ep)
    sim = Simulation(net, eps, seed=seed)
    sim.run()
    s = sim.stats()
    p = s["packets"]
    counted = p["delivered"] + p["queue_drops"] + p["local_drops"] + p["lost"] + p["failed"]
    xdropped = sum(c["dropped"] for c in s["cross"])
    assert p["injected"] == 240 and counted - xdropped == 240
    assert p["delivered"] == sum(len(r.got) for r in recs)
    assert all(x["queued_bytes"] == 0 for x in s["links"])
    assert all(x["max_queue_bytes"] <= queue for x in s["links"] if x["kind"] != "host")
    for x in s["cross"]:
        assert x["packets"] == x["delivered"] + x["dropped"]


def test_measure_event_rate_is_positive() -> None:
    rate = measure_event_rate(n_hosts=8, packets_per_host=50)
    assert rate > 0 and math.isfinite(rate)
