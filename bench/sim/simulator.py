"""A deterministic discrete-event network that drives real sans-I/O endpoints (netsim).

Theory of operation
-------------------
A :class:`~gradlane.bench.sim.network.Network` describes hosts, switches and directional links; a
:class:`Simulation` runs it with one :class:`gradlane.transport.core.events.SansIOCore` per host
(host ``i`` runs rank ``i``) on a simulated clock. Everything happens in one heap of
``(time, seq, kind, a, b)`` tuples; ``seq`` is a global counter, so equal times resolve in the
order events were scheduled and a run is a pure function of the network, the endpoints and the
seed.

*Packets* are tuples ``(wire_size, class, route, path, data)``; ``route`` is the tuple of link
ids the datagram takes (from the network's router, cached per ``(src, dst, path)``) ending with
``~dst``. A queued packet is ``(packet, hop)``. Nothing else is allocated per packet.

*Links* are store-and-forward with a non-preemptive server: a packet that starts serialising
at ``s`` occupies the link until ``s + size / rate`` and arrives at the next node
``delay`` later; switches forward instantly to the next link of the route. Each link egress has
one strict-priority queue per class (``priority=False``: a single FIFO). ``queue_bytes`` bounds
the bytes *waiting* (not the one being serialised). On overflow a priority-aware egress pushes
out the newest waiting packets of the lowest classes strictly below the arriving one's class if
that frees enough room, else drops the arriving packet; a FIFO egress drops the arriving packet
(tail drop). Drops are counted per link and per class; drops on a host's uplink are *local*.

*Impairments*: ``loss`` (a serialised packet is lost on the wire with that probability, drawn
from the link's own seeded stream), ``jitter`` (extra delay uniform in ``[0, jitter)``, may
reorder), failure windows (:meth:`Network.fail_link`: a packet whose time on the link overlaps
the window is lost; while down the link serves nothing and flushes its queue), and cross traffic
(:class:`~gradlane.bench.sim.network.CrossTraffic`: real packets that follow a route and vanish at
its end, or a fluid share of the service).

*Driving endpoints* (the aioquic pattern): at start, and whenever an endpoint received a
datagram, its timer fired or a :meth:`Simulation.call_at` callback named it, the driver calls
``datagrams_to_send(now)`` and puts every datagram on the host's uplink queue at ``now``
(memoryviews are copied: the packet lives on after the call), re-arms the host's single timer
from ``get_timer()`` (a changed value bumps the host's timer generation, so a superseded timer
event is ignored when it pops) and drains ``next_event()`` into ``on_event(host, event, now)``.

*Cross traffic models*: ``"fluid"`` (default) costs nothing per packet and takes its share of
the service from every packet of its class or below; ``"packets"`` is exact and costs one heap
event per cross packet per hop (two where it queues). They differ for a flow in the *same* class as
the cross traffic: packets share a FIFO class in proportion to arrival rates (an unresponsive
flow offering the line rate against 70% cross traffic gets 1/1.7 of the link while both are
backlogged), fluid gives the flow only the leftover 30% (what a congestion-controlled flow
converges to).

*Counting*: a **packet event** is one of: an arrival at a link egress (one per hop, whether it
waits, starts at once or is dropped), a transmission start (dequeue; a packet flushed by a
failed link counts here too), a delivery (to a host or, for cross traffic, to the end of its
route), a drop (queue overflow, push-out, random loss, failure). ``stats()["events"]`` reports
them, the heap events, and the wall time spent in :meth:`Simulation.run`.

Usage::

    net = leafspine(64, n_spines=2, hosts_per_leaf=8)           # 100 Gb/s, non-blocking
    net.add_cross_traffic(0.7, link="spine0>leaf1")                       # fluid, steady
    net.add_cross_traffic(0.5, between=(3, 9, 1), on_s=1e-3, off_s=4e-3)  # fluid bursts
    net.add_cross_traffic(0.3, link="h7>leaf0", model="packets", end=0.05)  # real packets
    net.fail_link("leaf0>spine1", 0.010, 0.020)
    sim = Simulation(net, endpoints, seed=1, on_event=lambda host, ev, now: ...)
    sim.call_at(0.002, lambda now: endpoints[5].submit(...), host=5)   # new work, then send
    sim.run(until=0.1, stop=lambda: finished == 64)
    report = sim.stats()                                          # JSON-able
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from gradlane.bench.sim.cross import (
    CROSS_STREAM,
    LINK_STREAM,
    FluidLink,
    PacketSource,
    Periods,
    Uniforms,
)
from gradlane.bench.sim.cross import stream as _stream
from gradlane.bench.sim.network import DEFAULT_DSCP_CLASSES, CrossTraffic, LinkSpec, Network, Router
from gradlane.bench.sim.topology import GBPS, dumbbell, leafspine, pair, star
from gradlane.scheduling.errors import ConfigError, GradlaneError
from gradlane.transport.core.events import Datagram, DatagramRun, Event, SansIOCore, flat

__all__ = [
    "DEFAULT_DSCP_CLASSES",
    "GBPS",
    "CrossTraffic",
    "LinkSpec",
    "Network",
    "OnEvent",
    "Router",
    "Simulation",
    "SimulationError",
    "dumbbell",
    "leafspine",
    "measure_event_rate",
    "pair",
    "star",
]

OnEvent = Callable[[int, Event, float], None]
"""``on_event(host, event, now)``: receives every event an endpoint emits."""

# Heap event kinds. ARRIVE: (t, seq, ARRIVE, packet, hop); FREE: (t, seq, FREE, link, 0) —
# the link finished a packet and has more waiting; TIMER: (t, seq, TIMER, host, generation);
# CALL: (t, seq, CALL, fn or None, host or -1).
_ARRIVE, _FREE, _TIMER, _CALL = 0, 1, 2, 3
_GEN = -(1 << 41)  # first route element of a cross-traffic packet: generate the next one
_SINK = -(1 << 40)  # last route element of a cross-traffic packet
_MAX_TIMERS_AT_ONE_TIME = 10_000


class SimulationError(GradlaneError):
    """An endpoint misbehaved under the simulator (e.g. a timer that never moves forward)."""


class Simulation:
    """Runs a :class:`Network` with one endpoint per host on a simulated clock.

    ``endpoints[i]`` is host ``i``'s endpoint, or None for a host that runs nothing (datagrams
    to it are counted as undeliverable). ``seed`` seeds every random stream (link loss and
    jitter, cross traffic). Every endpoint is serviced once at ``start``.
    """

    def __init__(
        self,
        network: Network,
        endpoints: Sequence[SansIOCore | None],
        *,
        seed: int = 0,
        on_event: OnEvent | None = None,
        start: float = 0.0,
    ) -> None:
        net = network
        if len(endpoints) != net.n_hosts:
            raise ConfigError(f"{len(endpoints)} endpoints for a network of {net.n_hosts} hosts")
        self.network = net
        self.now = float(start)
        self.start = self.now
        self.seed = seed
        self.on_event = on_event
        self._eps = list(endpoints)
        self._heap: list[tuple[Any, ...]] = []
        self._nx = itertools.count().__next__
        k = net.n_classes
        links = net.links
        n_links = len(links)
        # Per-link state in parallel lists (indexed by link id): cheapest to reach in the loop.
        self._inv_rate = [1.0 / s.rate for s in links]
        self._delay = [s.delay for s in links]
        self._qlim = [s.queue_bytes for s in links]
        self._prio = [s.priority for s in links]
        self._queues: list[list[deque[tuple[Any, int]]]] = [
            [deque() for _ in range(k if s.priority else 1)] for s in links
        ]
        self._qbytes = [0] * n_links
        self._cbytes = [[0] * k for _ in links]
        self._busy = [self.now] * n_links
        self._txb = [0] * n_links
        self._txp = [0] * n_links
        self._drops = [[0] * k for _ in links]
        self._lost = [0] * n_links
        self._failed = [0] * n_links
        self._maxq = [0] * n_links
        self._lossp = [s.loss for s in links]
        self._jit = [s.jitter for s in links]
        self._fail: list[list[tuple[float, float]] | None] = [None] * n_links
        for lid, windows in net.failures.items():
            self._fail[lid] = sorted(windows)
        self._rnd: list[Uniforms | None] = [
            Uniforms(_stream(seed, LINK_STREAM, s.id)) if s.loss or s.jitter else None
            for s in links
        ]
        self._fluid: list[FluidLink | None] = [None] * n_links
        # Cross traffic: packet sources start generating now; fluid ones attach to their links.
        n_cross = len(net.cross)
        self._xsrc: list[PacketSource] = [None] * n_cross  # type: ignore[list-item]
        self._xgen = [0] * n_cross
        self._xdel = [0] * n_cross
        self._xdrop = [0] * n_cross
        self._endless = False
        for i, ct in enumerate(net.cross):
            cls = net.tos_class[(ct.dscp << 2) & 0xFF]
            rate = net.cross_rate(ct)
            if ct.model == "fluid":
                for lid in ct.links:
                    fl = self._fluid[lid] or FluidLink(links[lid].priority)
                    # Same seed on every link of the route: the same on/off pattern everywhere.
                    per = Periods(ct, Uniforms(_stream(seed, CROSS_STREAM, i)))
                    fl.sources.append((cls, rate / links[lid].rate, per))
                    self._fluid[lid] = fl
                continue
            src = self._xsrc[i] = PacketSource(ct, rate, _stream(seed, CROSS_STREAM, i))
            first = src.first()
            if first is not None:
                pkt = (ct.packet_bytes, cls, (_GEN, *ct.links, _SINK), i, None)
                heapq.heappush(self._heap, (first, self._nx(), _ARRIVE, pkt, 0))
            self._endless = self._endless or ct.end is None
        self._special = [
            self._fluid[i] is not None or self._fail[i] is not None or bool(s.loss or s.jitter)
            for i, s in enumerate(links)
        ]
        # Endpoint side.
        n = net.n_hosts
        self._routes: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._tos_class = net.tos_class
        self._overhead = net.overhead
        self._armed: list[float | None] = [None] * n
        self._tgen = [0] * n
        self._last_fire = [-math.inf] * n
        self._same_fire = [0] * n
        self._path_tx: dict[int, int] = {}
        self._path_rx: dict[int, int] = {}
        # Counters (the run loop adds its local counts at the end of every run).
        self._n_heap = self._n_arr = self._n_tx = self._n_del = self._n_drop = 0
        self._n_timer = self._n_stale = self._n_out = self._n_undeliverable = 0
        self._inj_pkts = self._inj_bytes = self._rx_pkts = 0
        self._wall = 0.0
        for h in range(n):
            if self._eps[h] is not None:
                heapq.heappush(self._heap, (self.now, self._nx(), _CALL, None, h))

    # -- scheduling from outside ----------------------------------------------------------
    def call_at(
        self, t: float, fn: Callable[[float], None] | None = None, *, host: int = -1
    ) -> None:
        """At simulated time ``t`` call ``fn(t)`` (if given), then service endpoint ``host``
        (if given): send what it has, re-arm its timer, drain its events."""
        if t < self.now:
            raise ConfigError(f"call_at({t}) is in the past (now={self.now})")
        if host >= 0 and (host >= self.network.n_hosts or self._eps[host] is None):
            raise ConfigError(f"host {host} has no endpoint")
        heapq.heappush(self._heap, (float(t), self._nx(), _CALL, fn, host))

    def poke(self, host: int, at: float | None = None) -> None:
        """Service ``host`` at ``at`` (default: now) — call after handing it new work."""
        self.call_at(self.now if at is None else at, host=host)

    # -- the event loop -------------------------------------------------------------------
    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> float:
        """Process events in time order until none are left, the next is after ``until``,
        or ``stop()`` (checked after every endpoint call) returns True. Returns the time
        reached: ``until`` when given and not stopped early, else the time of the last event
        popped (a superseded timer counts). With endless cross traffic, ``until`` is required
        unless ``stop`` is given (then give both if the endpoints might never satisfy it)."""
        if until is None and stop is None and self._endless:
            raise ConfigError("cross traffic without an end never runs dry: pass until= or stop=")
        if until is not None and until < self.now:
            raise ConfigError(f"run(until={until}) is before now={self.now}")
        heap = self._heap
        pop = heapq.heappop
        push = heapq.heappush
        nx = self._nx
        limit = math.inf if until is None else float(until)
        inv_rate, delay, qlim, prio = self._inv_rate, self._delay, self._qlim, self._prio
        queues, qbytes, cbytes, busy = self._queues, self._qbytes, self._cbytes, self._busy
        txb, txp, drops, maxq, special = (
            self._txb,
            self._txp,
            self._drops,
            self._maxq,
            self._special,
        )
        tx_special, push_out, service = self._tx_special, self._push_out, self._service
        eps, tgen, path_rx = self._eps, self._tgen, self._path_rx
        xsrc, xgen, xdel, xdrop = self._xsrc, self._xgen, self._xdel, self._xdrop
        n_heap = n_arr = n_tx = n_del = n_drop = n_rx = n_stale = 0
        t = self.now
        stopped = False
        wall0 = time.perf_counter()
        # The dispatch is an if-chain on purpose (not a table): kinds are tested in order of
        # frequency, and an arrival at an idle link and a FREE both fall through into the
        # shared transmission code below without a function call per event.
        try:
            while heap:
                if heap[0][0] > limit:
                    break
                t, _, kind, a, hop = pop(heap)
                n_heap += 1
                if kind == _ARRIVE:
                    pkt = a
                    link = pkt[2][hop]
                    if link < 0:
                        if link == _GEN:  # a cross packet is born: schedule its successor
                            gid = pkt[3]
                            xgen[gid] += 1
                            nt = xsrc[gid].next(t)
                            if nt is not None:
                                push(heap, (nt, nx(), _ARRIVE, pkt, 0))
                            hop = 1
                            link = pkt[2][1]
                        else:  # delivery
                            n_del += 1
                            data = pkt[4]
                            if data is None:
                                xdel[pkt[3]] += 1
                                continue
                            h = ~link
                            ep = eps[h]
                            if ep is None:
                                self._n_undeliverable += 1
                                continue
                            n_rx += 1
                            p = pkt[3]
                            path_rx[p] = path_rx.get(p, 0) + pkt[0]
                            self.now = t
                            ep.receive_datagram(data, p, t)
                            service(h, t)
                            if stop is not None and stop():
                                stopped = True
                                break
                            continue
                    n_arr += 1
                    if busy[link] > t or qbytes[link]:  # busy: wait (or be dropped)
                        size = pkt[0]
                        cls = pkt[1]
                        was_empty = not qbytes[link]
                        qb = qbytes[link] + size
                        if qb > qlim[link]:
                            k = push_out(link, cls, qb - qlim[link]) if prio[link] else 0
                            if not k:
                                drops[link][cls] += 1
                                n_drop += 1
                                if pkt[4] is None:
                                    xdrop[pkt[3]] += 1
                                continue
                            n_drop += k
                            qb = qbytes[link] + size
                        if was_empty:
                            push(heap, (busy[link], nx(), _FREE, link, 0))
                        qbytes[link] = qb
                        if qb > maxq[link]:  # noqa: PLR1730 - cheaper than max() here
                            maxq[link] = qb
                        if prio[link]:
                            queues[link][cls].append((pkt, hop))
                            cbytes[link][cls] += size
                        else:
                            queues[link][0].append((pkt, hop))
                        continue
                elif kind == _FREE:
                    link = a
                    for q in queues[link]:
                        if q:
                            break
                    else:
                        continue  # pragma: no cover - a FREE is only pending with a queue
                    pkt, hop = q.popleft()
                    qbytes[link] -= pkt[0]
                    if prio[link]:
                        cbytes[link][pkt[1]] -= pkt[0]
                elif kind == _TIMER:
                    h = a
                    if hop != tgen[h]:
                        n_stale += 1
                        continue
                    self._fire_timer(h, t)
                    if stop is not None and stop():
                        stopped = True
                        break
                    continue
                else:  # _CALL
                    self.now = t
                    if a is not None:
                        a(t)
                    if hop >= 0:
                        service(hop, t)
                    if stop is not None and stop():
                        stopped = True
                        break
                    continue
                # Transmission of `pkt` on `link`, starting at t (the link is free).
                n_tx += 1
                if special[link]:
                    tx_special(link, pkt, hop, t)
                    continue
                size = pkt[0]
                end = t + size * inv_rate[link]
                busy[link] = end
                txb[link] += size
                txp[link] += 1
                if qbytes[link]:
                    push(heap, (end, nx(), _FREE, link, 0))
                push(heap, (end + delay[link], nx(), _ARRIVE, pkt, hop + 1))
        finally:
            self._wall += time.perf_counter() - wall0
            self._n_heap += n_heap
            self._n_arr += n_arr
            self._n_tx += n_tx
            self._n_del += n_del
            self._n_drop += n_drop
            self._rx_pkts += n_rx
            self._n_stale += n_stale
            self.now = max(self.now, t)
        if not stopped and until is not None:
            self.now = max(self.now, float(until))
        return self.now

    def _fire_timer(self, h: int, t: float) -> None:
        """Run host ``h``'s timer at ``t`` (guarding against a timer that never advances)."""
        if t == self._last_fire[h]:
            self._same_fire[h] += 1
            if self._same_fire[h] > _MAX_TIMERS_AT_ONE_TIME:
                raise SimulationError(
                    f"host {h}: timer fired {self._same_fire[h]} times at t={t}; get_timer() "
                    "must move past now once handle_timer(now) has run"
                )
        else:
            self._last_fire[h] = t
            self._same_fire[h] = 0
        self._n_timer += 1
        self._armed[h] = None
        self.now = t
        self._eps[h].handle_timer(t)  # type: ignore[union-attr]
        self._service(h, t)

    def _service(self, h: int, now: float) -> None:
        """Send what endpoint ``h`` has, re-arm its timer, drain its events."""
        ep = self._eps[h]
        assert ep is not None
        dgs = ep.datagrams_to_send(now)
        if dgs:
            self._inject(h, dgs, now)
        tm = ep.get_timer()
        if tm != self._armed[h]:
            self._armed[h] = tm
            g = self._tgen[h] = self._tgen[h] + 1
            if tm is not None:
                heapq.heappush(self._heap, (tm if tm > now else now, self._nx(), _TIMER, h, g))
        ev = ep.next_event()
        while ev is not None:
            self._n_out += 1
            if self.on_event is not None:
                self.on_event(h, ev, now)
            ev = ep.next_event()

    def _inject(self, h: int, dgs: Sequence[Datagram | DatagramRun], now: float) -> None:
        """Put host ``h``'s datagrams on its uplink at ``now`` (no heap event per datagram)."""
        routes, tcls, ov = self._routes, self._tos_class, self._overhead
        busy, qbytes, qlim, prio = self._busy, self._qbytes, self._qlim, self._prio
        queues, cbytes, maxq = self._queues, self._cbytes, self._maxq
        heap, nx, path_tx = self._heap, self._nx, self._path_tx
        nbytes = n_arr = 0
        for dg in flat(dgs):
            # Owned bytes: the endpoint may reuse its buffers, and a payload is a view.
            data, peer, path, tos = dg.wire(), dg.peer, dg.path, dg.tos
            r = routes.get((h, peer, path))
            if r is None:
                r = self._route(h, peer, path)
            size = len(data) + ov or 1
            nbytes += size
            cls = tcls[tos & 0xFF]
            pkt = (size, cls, r, path, data)
            path_tx[path] = path_tx.get(path, 0) + size
            link = r[0]
            if link < 0:  # to itself: delivered at once
                heapq.heappush(heap, (now, nx(), _ARRIVE, pkt, 0))
                continue
            n_arr += 1
            if busy[link] <= now and not qbytes[link]:
                self._n_tx += 1
                self._tx_special(link, pkt, 0, now)
                continue
            qb = qbytes[link] + size
            if qb > qlim[link]:
                k = self._push_out(link, cls, qb - qlim[link]) if prio[link] else 0
                if not k:
                    self._drops[link][cls] += 1
                    self._n_drop += 1
                    continue
                self._n_drop += k
                qb = qbytes[link] + size
            if not qbytes[link]:
                heapq.heappush(heap, (busy[link], nx(), _FREE, link, 0))
            qbytes[link] = qb
            if qb > maxq[link]:  # noqa: PLR1730 - cheaper than max() here
                maxq[link] = qb
            if prio[link]:
                queues[link][cls].append((pkt, 0))
                cbytes[link][cls] += size
            else:
                queues[link][0].append((pkt, 0))
        self._n_arr += n_arr
        self._inj_pkts += len(dgs)
        self._inj_bytes += nbytes

    def _route(self, src: int, dst: int, path: int) -> tuple[int, ...]:
        """The cached route of a datagram: the network's links, then ``~dst``."""
        n = self.network.n_hosts
        if not 0 <= dst < n:
            raise SimulationError(f"host {src} sent a datagram to rank {dst}; ranks are 0..{n - 1}")
        r = (*self.network.route(src, dst, path, cache=False), ~dst)
        self._routes[(src, dst, path)] = r
        return r

    def _tx_special(self, link: int, pkt: tuple[Any, ...], hop: int, t: float) -> None:
        """Transmission start with everything a link may have: fluid cross traffic, failure
        windows, random loss, jitter (also used for a datagram that finds its uplink idle)."""
        size = pkt[0]
        ser = size * self._inv_rate[link]
        fl = self._fluid[link]
        if fl is not None:
            ser = fl.stretch(ser, t, pkt[1])
        end = t + ser
        arr = end + self._delay[link]
        heap = self._heap
        windows = self._fail[link]
        lost = False
        if windows is not None:
            for a, b in windows:
                if a <= t < b:  # down: serve nothing; keep flushing the queue
                    self._drop(link, pkt, self._failed)
                    if self._qbytes[link]:
                        heapq.heappush(heap, (t, self._nx(), _FREE, link, 0))
                    return
                if a < arr and b > t:
                    lost = True
        self._busy[link] = end
        self._txb[link] += size
        self._txp[link] += 1
        if self._qbytes[link]:
            heapq.heappush(heap, (end, self._nx(), _FREE, link, 0))
        if lost:
            self._drop(link, pkt, self._failed)
            return
        lp = self._lossp[link]
        if lp and self._rnd[link]() < lp:  # type: ignore[misc]
            self._drop(link, pkt, self._lost)
            return
        jt = self._jit[link]
        if jt:
            arr += jt * self._rnd[link]()  # type: ignore[misc]
        heapq.heappush(heap, (arr, self._nx(), _ARRIVE, pkt, hop + 1))

    def _drop(self, link: int, pkt: tuple[Any, ...], counter: list[int]) -> None:
        counter[link] += 1
        self._n_drop += 1
        if pkt[4] is None:
            self._xdrop[pkt[3]] += 1

    def _push_out(self, link: int, cls: int, excess: int) -> int:
        """Make ``excess`` bytes of room by dropping the newest waiting packets of the lowest
        classes below ``cls``; returns how many were dropped (0: not possible, nothing done)."""
        cb = self._cbytes[link]
        if sum(cb[cls + 1 :]) < excess:
            return 0
        qs = self._queues[link]
        drops = self._drops[link]
        j = len(qs) - 1
        n = 0
        while excess > 0:
            q = qs[j]
            if not q:
                j -= 1
                continue
            victim = q.pop()[0]
            vs = victim[0]
            excess -= vs
            cb[j] -= vs
            self._qbytes[link] -= vs
            drops[victim[1]] += 1
            if victim[4] is None:
                self._xdrop[victim[3]] += 1
            n += 1
        return n

    # -- results --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters as a JSON-able dict.

        ``time`` (simulated s), ``wall_s`` (spent in :meth:`run`);
        ``events``: ``packet`` (= arrivals + transmissions + deliveries + drops, see the module
        docstring), ``heap``, each part, ``timers`` fired, ``stale_timers`` ignored,
        ``endpoint_events`` drained, ``packet_per_s`` and ``heap_per_s`` (per wall second);
        ``packets``: endpoint datagrams ``injected`` / ``injected_bytes``, ``delivered`` /
        ``delivered_bytes`` (to endpoints), ``undeliverable`` (to hosts without one),
        ``queue_drops`` (switch egresses) and ``local_drops`` (host uplinks), ``lost`` (random),
        ``failed`` (link down); ``paths``: ``sent_bytes`` and ``delivered_bytes`` by path index
        (string keys); ``links``: one dict per link id with ``name``, ``kind``, ``bytes`` and
        ``packets`` serialised (all traffic, cross included), ``drops`` (queue overflow, a list
        per class), ``lost``, ``failed``, ``max_queue_bytes``, ``queued_bytes``, ``utilisation``
        (bytes / (rate × time)); ``cross``: per source ``offered_bytes``, and for packet sources
        ``packets`` generated, ``delivered`` (reached the end of their route), ``dropped``.
        """
        net = self.network
        now = self.now
        span = now - self.start if now > self.start else math.inf
        links = []
        local = queue = 0
        for spec in net.links:
            i = spec.id
            d = sum(self._drops[i])
            if spec.kind == "host":
                local += d
            else:
                queue += d
            links.append(
                {
                    "id": i,
                    "name": spec.name,
                    "kind": spec.kind,
                    "bytes": self._txb[i],
                    "packets": self._txp[i],
                    "drops": list(self._drops[i]),
                    "lost": self._lost[i],
                    "failed": self._failed[i],
                    "max_queue_bytes": self._maxq[i],
                    "queued_bytes": self._qbytes[i],
                    "utilisation": self._txb[i] / (spec.rate * span),
                }
            )
        cross = []
        for i, ct in enumerate(net.cross):
            rate = net.cross_rate(ct)
            if ct.model == "fluid":
                per = Periods(ct, Uniforms(_stream(self.seed, CROSS_STREAM, i)))
                offered = rate * per.on_time(now)
            else:
                offered = float(self._xgen[i] * ct.packet_bytes)
            cross.append(
                {
                    "name": ct.name or f"cross{i}",
                    "model": ct.model,
                    "class": net.tos_class[(ct.dscp << 2) & 0xFF],
                    "links": [net.links[x].name for x in ct.links],
                    "offered_bytes": offered,
                    "packets": self._xgen[i],
                    "delivered": self._xdel[i],
                    "dropped": self._xdrop[i],
                }
            )
        ev_packet = self._n_arr + self._n_tx + self._n_del + self._n_drop
        wall = self._wall
        return {
            "time": now,
            "wall_s": wall,
            "events": {
                "packet": ev_packet,
                "heap": self._n_heap,
                "arrivals": self._n_arr,
                "transmissions": self._n_tx,
                "deliveries": self._n_del,
                "drops": self._n_drop,
                "timers": self._n_timer,
                "stale_timers": self._n_stale,
                "endpoint_events": self._n_out,
                "packet_per_s": ev_packet / wall if wall > 0 else 0.0,
                "heap_per_s": self._n_heap / wall if wall > 0 else 0.0,
            },
            "packets": {
                "injected": self._inj_pkts,
                "injected_bytes": self._inj_bytes,
                "delivered": self._rx_pkts,
                "delivered_bytes": sum(self._path_rx.values()),
                "undeliverable": self._n_undeliverable,
                "queue_drops": queue,
                "local_drops": local,
                "lost": sum(self._lost),
                "failed": sum(self._failed),
            },
            "paths": {
                "sent_bytes": {str(p): b for p, b in sorted(self._path_tx.items())},
                "delivered_bytes": {str(p): b for p, b in sorted(self._path_rx.items())},
            },
            "links": links,
            "cross": cross,
        }


def measure_event_rate(
    n_hosts: int = 64, packets_per_host: int = 1000, size: int = 1500, seed: int = 0
) -> float:
    """Packet events per second of wall time, simulator alone (the endpoints do no work).

    The traffic of a transpose all-reduce's first phase: every host hands the simulator all
    its datagrams at once, round-robin over all peers, sprayed over two spines, in four classes,
    on a non-blocking 100 Gb/s leaf-spine with 8 hosts per leaf. Transient incast at the
    downlinks drops a few percent. ``stats()["events"]`` of such a run has the breakdown.
    """
    if n_hosts < 2:
        raise ConfigError("measure_event_rate needs at least 2 hosts")
    net = leafspine(n_hosts, 2, min(8, n_hosts))
    tos = (46 << 2, 34 << 2, 0, 8 << 2)
    payload = bytes(size)
    eps: list[SansIOCore | None] = []
    for h in range(n_hosts):
        dgs = [
            Datagram(payload, (h + 1 + i % (n_hosts - 1)) % n_hosts, i & 1, tos[(i >> 1) & 3])
            for i in range(packets_per_host)
        ]
        eps.append(_Blaster(dgs))
    sim = Simulation(net, eps, seed=seed)
    sim.run()
    return float(sim.stats()["events"]["packet_per_s"])


class _Blaster:
    """Hands out a fixed list of datagrams once; ignores everything it receives."""

    def __init__(self, dgs: list[Datagram]) -> None:
        self._dgs = dgs

    def receive_datagram(self, data: bytes | memoryview, path: int, now: float) -> None:
        pass

    def datagrams_to_send(self, now: float) -> list[Datagram | DatagramRun]:
        out: list[Datagram | DatagramRun] = list(self._dgs)
        self._dgs = []
        return out

    def get_timer(self) -> float | None:
        return None

    def handle_timer(self, now: float) -> None:
        pass

    def next_event(self) -> Event | None:
        return None


if __name__ == "__main__":  # python -m gradlane.bench.sim.simulator: the all-reduce scenarios
    from gradlane.bench.sim.scenarios import main as _main

    raise SystemExit(_main())
