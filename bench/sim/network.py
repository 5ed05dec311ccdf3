"""The static description of a simulated network: nodes, links, routes, impairments.

A :class:`Network` says *what* the network is; :class:`gradlane.bench.sim.simulator.Simulation`
runs it. One
network can back many simulations (several seeds, several transports): nothing here changes
while a simulation runs.

Nodes are hosts (ids ``0 .. n_hosts-1``, named ``h0``, ``h1``, …; host ``i`` runs rank ``i``)
and switches (added with :meth:`Network.add_switch`). Links are directional and store-and-forward:
a packet of ``size`` bytes that starts serialising at ``s`` on a link of rate ``rate`` reaches the
far node at ``s + size / rate + delay``. A link whose source is a host is that host's *uplink*
(its NIC and socket buffer): its drops are *local* drops, reported apart from network drops.

Routes are tuples of link ids, computed once per ``(src, dst, path)`` by the router a topology
installs (:meth:`Network.set_router`; the default is a shortest path with one path index) and
cached; every route is checked to be a connected chain from ``src`` to ``dst`` when first used.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from gradlane.scheduling.errors import ConfigError

__all__ = [
    "DEFAULT_DSCP_CLASSES",
    "CrossTraffic",
    "LinkSpec",
    "Network",
    "Router",
]

#: DSCP → priority class: EF → 0, AF41 → 1, AF31 and best effort → 2, CS1 (scavenger) → 3.
DEFAULT_DSCP_CLASSES: Mapping[int, int] = {46: 0, 34: 1, 26: 2, 0: 2, 8: 3}

#: ``router(src, dst, path) -> tuple of link ids`` from host ``src`` to host ``dst``.
Router = Callable[[int, int, int], tuple[int, ...]]


@dataclass(frozen=True)
class LinkSpec:
    """One directional link and its egress queue.

    ``queue_bytes`` bounds the bytes *waiting* at the egress (the packet being serialised has
    left the queue). ``priority=False`` makes the egress one FIFO with tail drop; otherwise it
    has one strict-priority queue per class and drops the lowest class first (see
    :mod:`gradlane.bench.sim.simulator`).
    """

    id: int
    name: str
    src: int
    dst: int
    rate: float
    """Bytes per second."""
    delay: float
    """Propagation delay in seconds."""
    queue_bytes: int
    priority: bool = True
    loss: float = 0.0
    """Probability that a serialised packet is lost on the wire (seeded, per link)."""
    jitter: float = 0.0
    """Extra propagation delay, uniform in ``[0, jitter)`` seconds per packet (may reorder)."""
    kind: str = "fabric"
    """``"host"`` (a host's uplink: drops are local), ``"down"`` (to a host) or ``"fabric"``."""

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ConfigError(f"link {self.name}: rate must be > 0 bytes/s, got {self.rate}")
        if self.delay < 0 or self.jitter < 0:
            raise ConfigError(f"link {self.name}: delay and jitter must be >= 0")
        if self.queue_bytes < 0:
            raise ConfigError(f"link {self.name}: queue_bytes must be >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise ConfigError(f"link {self.name}: loss must be in [0, 1), got {self.loss}")


@dataclass(frozen=True)
class CrossTraffic:
    """Competing traffic on a link or along a route; counted, delivered nowhere.

    ``fraction`` is its rate while *on*, as a fraction of the slowest link of its route.
    It is steady when ``on_s`` is None (paced: each gap is the mean gap × ``1 ± jitter·U``),
    otherwise it alternates on and off periods of mean ``on_s`` / ``off_s`` seconds
    (exponential when ``random_periods``, else fixed), starting *on* at ``start``.

    ``model="fluid"`` (the default: cheap): no packets; while on, the source takes ``fraction``
    of each link's service from every packet of its class or a lower priority one (all packets
    on a priority-unaware link) — that packet's serialisation time is divided by
    ``1 - sum of such fractions`` (evaluated when it starts). Fluid costs nothing per cross
    packet but models no cross-traffic queue occupancy or drops, and the pacing ``jitter`` and
    ``packet_bytes`` do not apply (fluid fractions on one link must sum below 1).
    ``model="packets"``: real packets of ``packet_bytes`` that queue, get dropped and take
    service like any other. Exact, but each costs one or two heap events per hop: at 70% of a
    400 Gb/s link that is 23 M packets per simulated second, which would dwarf the gradient
    traffic; use it where the cross packet rate is comparable with the flows under test, or
    raise ``packet_bytes`` (coarser bursts) to trade fidelity for speed.
    """

    links: tuple[int, ...]
    fraction: float
    dscp: int = 0
    model: str = "fluid"
    packet_bytes: int = 1500
    jitter: float = 0.1
    on_s: float | None = None
    off_s: float | None = None
    random_periods: bool = True
    start: float = 0.0
    end: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not self.links:
            raise ConfigError("cross traffic needs at least one link")
        if self.model not in ("packets", "fluid"):
            raise ConfigError(
                f"cross traffic model must be 'packets' or 'fluid', not {self.model!r}"
            )
        if not self.fraction > 0:
            raise ConfigError(f"cross traffic fraction must be > 0, got {self.fraction}")
        if self.model == "fluid" and self.fraction >= 1:
            raise ConfigError("fluid cross traffic fraction must be < 1 (it would starve the link)")
        if self.packet_bytes < 1:
            raise ConfigError("cross traffic packet_bytes must be >= 1")
        if not 0 <= self.jitter < 1:
            raise ConfigError(f"cross traffic jitter must be in [0, 1), got {self.jitter}")
        if (self.on_s is None) != (self.off_s is None):
            raise ConfigError("give both on_s and off_s for on/off cross traffic, or neither")
        if self.on_s is not None and not (
            self.on_s > 0 and self.off_s is not None and self.off_s >= 0
        ):
            raise ConfigError("on_s must be > 0 and off_s >= 0")
        if self.end is not None and self.end <= self.start:
            raise ConfigError("cross traffic end must be after its start")


class Network:
    """Hosts, switches, directional links, routes, failures and cross traffic.

    ``dscp_classes`` maps DSCP (the upper six bits of a datagram's TOS) to a priority class in
    ``0 .. n_classes-1``; unknown DSCPs get ``default_class``. ``overhead`` bytes are added to
    every datagram on the wire (e.g. 28 for IPv4+UDP, 66 with Ethernet framing; 0 by default so
    that timings are exactly ``len(data) / rate``).
    """

    def __init__(
        self,
        n_hosts: int,
        *,
        n_classes: int = 4,
        dscp_classes: Mapping[int, int] | None = None,
        default_class: int = 2,
        overhead: int = 0,
    ) -> None:
        if n_hosts < 1:
            raise ConfigError(f"n_hosts must be >= 1, got {n_hosts}")
        if not 1 <= n_classes <= 16:
            raise ConfigError(f"n_classes must be in 1..16, got {n_classes}")
        dmap = dict(DEFAULT_DSCP_CLASSES if dscp_classes is None else dscp_classes)
        for d, c in [*dmap.items(), (-1, default_class)]:
            if not 0 <= c < n_classes:
                raise ConfigError(f"DSCP {d} maps to class {c}, outside 0..{n_classes - 1}")
        if overhead < 0:
            raise ConfigError("overhead must be >= 0 bytes")
        self.n_hosts = n_hosts
        self.n_classes = n_classes
        self.overhead = overhead
        #: Priority class of each TOS byte value (index 0..255).
        self.tos_class: tuple[int, ...] = tuple(dmap.get(t >> 2, default_class) for t in range(256))
        self.nodes: list[str] = [f"h{i}" for i in range(n_hosts)]
        self.links: list[LinkSpec] = []
        self.failures: dict[int, list[tuple[float, float]]] = {}
        self.cross: list[CrossTraffic] = []
        self.n_paths = 1
        #: Facts the topology builder records (kind, leaf of each host, …); JSON-able.
        self.topology: dict[str, object] = {"kind": "custom"}
        self._node_ids = {name: i for i, name in enumerate(self.nodes)}
        self._uplink = [-1] * n_hosts
        self._downlink = [-1] * n_hosts
        self._by_ends: dict[tuple[int, int], int] = {}
        self._out: list[list[int]] = [[] for _ in range(n_hosts)]
        self._router: Router = self._shortest_path
        self._check_routes = True
        self._routes: dict[tuple[int, int, int], tuple[int, ...]] = {}

    # -- building -------------------------------------------------------------------------
    def add_switch(self, name: str) -> int:
        """Add a switch node; returns its node id."""
        if name in self._node_ids:
            raise ConfigError(f"node name {name!r} is taken")
        self._node_ids[name] = len(self.nodes)
        self.nodes.append(name)
        self._out.append([])
        return len(self.nodes) - 1

    def node(self, name_or_id: str | int) -> int:
        """Node id of a node name (``"h3"``, ``"leaf0"``) or id."""
        if isinstance(name_or_id, str):
            try:
                return self._node_ids[name_or_id]
            except KeyError:
                raise ConfigError(f"no node named {name_or_id!r}") from None
        if not 0 <= name_or_id < len(self.nodes):
            raise ConfigError(f"no node {name_or_id}")
        return name_or_id

    def add_link(
        self,
        src: str | int,
        dst: str | int,
        *,
        rate: float,
        delay: float,
        queue_bytes: int,
        priority: bool = True,
        loss: float = 0.0,
        jitter: float = 0.0,
    ) -> int:
        """Add a directional link ``src → dst``; returns its link id.

        A host has exactly one uplink (the first link out of it) and one downlink.
        """
        s, d = self.node(src), self.node(dst)
        if s == d:
            raise ConfigError(f"link {self.nodes[s]}>{self.nodes[d]} is a loop")
        if (s, d) in self._by_ends:
            raise ConfigError(f"link {self.nodes[s]}>{self.nodes[d]} exists already")
        n = self.n_hosts
        if s < n and self._uplink[s] >= 0:
            raise ConfigError(f"host {self.nodes[s]} has an uplink already")
        if d < n and self._downlink[d] >= 0:
            raise ConfigError(f"host {self.nodes[d]} has a downlink already")
        kind = "host" if s < n else "down" if d < n else "fabric"
        lid = len(self.links)
        spec = LinkSpec(
            id=lid,
            name=f"{self.nodes[s]}>{self.nodes[d]}",
            src=s,
            dst=d,
            rate=float(rate),
            delay=float(delay),
            queue_bytes=int(queue_bytes),
            priority=priority,
            loss=float(loss),
            jitter=float(jitter),
            kind=kind,
        )
        self.links.append(spec)
        self._by_ends[(s, d)] = lid
        self._out[s].append(lid)
        if s < n:
            self._uplink[s] = lid
        if d < n:
            self._downlink[d] = lid
        return lid

    def configure_link(self, link: int | str, **changes: object) -> LinkSpec:
        """Change fields of a link (``rate``, ``delay``, ``queue_bytes``, ``priority``,
        ``loss``, ``jitter``) before a simulation is built; returns the new spec."""
        lid = self.link_id(link)
        bad = set(changes) - {"rate", "delay", "queue_bytes", "priority", "loss", "jitter"}
        if bad:
            raise ConfigError(f"cannot configure {sorted(bad)} of a link")
        self.links[lid] = replace(self.links[lid], **changes)  # type: ignore[arg-type]
        return self.links[lid]

    def set_router(self, router: Router, n_paths: int, *, check: bool = True) -> None:
        """Install the topology's router and the number of distinct paths between hosts.

        ``check=False`` skips checking that each route is a connected chain (for the
        built-in topologies, whose routers are tested; the check costs more than the route).
        """
        if n_paths < 1:
            raise ConfigError("n_paths must be >= 1")
        self._router = router
        self.n_paths = n_paths
        self._check_routes = check
        self._routes.clear()

    def fail_link(self, link: int | str, start: float, end: float) -> None:
        """Take a link down during ``[start, end)``: a packet whose time on the link
        (serialisation and propagation) overlaps the window is lost; while down, the link
        serves nothing and its queue is flushed (each flushed packet counts as ``failed``)."""
        lid = self.link_id(link)
        if not end > start:
            raise ConfigError(f"failure window must have end > start, got [{start}, {end})")
        self.failures.setdefault(lid, []).append((float(start), float(end)))

    def fail_node(self, node: str | int, start: float, end: float) -> list[int]:
        """Fail every link into and out of a node (a switch or host) during ``[start, end)``."""
        nid = self.node(node)
        lids = [spec.id for spec in self.links if nid in (spec.src, spec.dst)]
        for lid in lids:
            self.fail_link(lid, start, end)
        return lids

    def add_cross_traffic(
        self,
        fraction: float,
        *,
        link: int | str | None = None,
        between: tuple[int, int, int] | None = None,
        **options: object,
    ) -> int:
        """Attach cross traffic to one ``link`` or to the route ``between=(src, dst, path)``;
        ``options`` are the other :class:`CrossTraffic` fields. Returns its index."""
        if (link is None) == (between is None):
            raise ConfigError("give exactly one of link= or between=(src, dst, path)")
        links = (self.link_id(link),) if link is not None else self.route(*between)  # type: ignore[misc]
        ct = CrossTraffic(links, fraction, **options)  # type: ignore[arg-type]
        if ct.model == "fluid":
            for lid in links:
                rate = self.cross_rate(ct) / self.links[lid].rate
                total = rate + sum(
                    self.cross_rate(c) / self.links[lid].rate
                    for c in self.cross
                    if c.model == "fluid" and lid in c.links
                )
                if total >= 1:
                    raise ConfigError(f"fluid cross traffic on {self.links[lid].name} sums to >= 1")
        self.cross.append(ct)
        return len(self.cross) - 1

    def cross_rate(self, ct: CrossTraffic) -> float:
        """Bytes per second of a cross source while on (``fraction`` × its slowest link)."""
        return ct.fraction * min(self.links[lid].rate for lid in ct.links)

    # -- queries --------------------------------------------------------------------------
    def link_id(self, link: int | str) -> int:
        """Link id of a link id or name (``"leaf0>spine1"``)."""
        if isinstance(link, str):
            a, _, b = link.partition(">")
            lid = self._by_ends.get((self.node(a), self.node(b)))
            if lid is None:
                raise ConfigError(f"no link {link!r}")
            return lid
        if not 0 <= link < len(self.links):
            raise ConfigError(f"no link {link}")
        return link

    def link_between(self, src: str | int, dst: str | int) -> int:
        """Link id of the link ``src → dst``."""
        lid = self._by_ends.get((self.node(src), self.node(dst)))
        if lid is None:
            raise ConfigError(f"no link {src}>{dst}")
        return lid

    def uplink(self, host: int) -> int:
        """Link id of a host's uplink."""
        return self._uplink[host]

    def downlink(self, host: int) -> int:
        """Link id of the link into a host."""
        return self._downlink[host]

    def links_of(self, node: str | int) -> list[int]:
        """Ids of the links leaving a node."""
        return list(self._out[self.node(node)])

    def route(self, src: int, dst: int, path: int = 0, *, cache: bool = True) -> tuple[int, ...]:
        """Links from host ``src`` to host ``dst`` on path index ``path`` (checked, cached)."""
        key = (src, dst, path)
        r = self._routes.get(key)
        if r is not None:
            return r
        n = self.n_hosts
        if not (0 <= src < n and 0 <= dst < n):
            raise ConfigError(f"route {src}->{dst}: hosts are 0..{n - 1}")
        if src == dst:
            return ()
        r = tuple(self._router(src, dst, path))
        if self._check_routes:
            at = src
            for lid in r:
                if not 0 <= lid < len(self.links) or self.links[lid].src != at:
                    raise ConfigError(f"route {src}->{dst} path {path} is broken at link {lid}")
                at = self.links[lid].dst
            if at != dst:
                raise ConfigError(f"route {src}->{dst} path {path} ends at {self.nodes[at]}")
        if cache:
            self._routes[key] = r
        return r

    def precompute_routes(self, pairs: Iterable[tuple[int, int]] | None = None) -> int:
        """Compute and cache the routes of ``pairs`` (default: all) on every path; returns count."""
        n = self.n_hosts
        todo = pairs if pairs is not None else ((a, b) for a in range(n) for b in range(n))
        count = 0
        for a, b in todo:
            if a != b:
                for p in range(self.n_paths):
                    self.route(a, b, p)
                    count += 1
        return count

    def _shortest_path(self, src: int, dst: int, path: int) -> tuple[int, ...]:
        """Fewest-hop route (breadth first); the path index is ignored."""
        prev: dict[int, int] = {src: -1}
        todo = deque([src])
        while todo:
            at = todo.popleft()
            if at == dst:
                break
            for lid in self._out[at]:
                nxt = self.links[lid].dst
                if nxt not in prev and (nxt >= self.n_hosts or nxt == dst):
                    prev[nxt] = lid
                    todo.append(nxt)
        if dst not in prev:
            raise ConfigError(f"no route from {self.nodes[src]} to {self.nodes[dst]}")
        out: list[int] = []
        at = dst
        while at != src:
            lid = prev[at]
            out.append(lid)
            at = self.links[lid].src
        return tuple(reversed(out))

    def describe(self) -> dict[str, object]:
        """JSON-able summary of the topology."""
        return {
            "hosts": self.n_hosts,
            "switches": len(self.nodes) - self.n_hosts,
            "links": len(self.links),
            "paths": self.n_paths,
            "classes": self.n_classes,
            "failures": {self.links[k].name: v for k, v in self.failures.items()},
            "cross": [
                {"name": c.name, "links": [self.links[x].name for x in c.links], "model": c.model}
                for c in self.cross
            ],
        }
