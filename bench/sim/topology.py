"""Topologies for the simulator: leaf-spine for scale, dumbbell, star and a pair for small tests.

Every builder returns a :class:`gradlane.bench.sim.network.Network` with its router installed and
``network.topology`` describing the shape. Rates are bytes per second (12.5e9 = 100 Gb/s),
delays seconds, queues bytes. Host uplinks get a large queue by default (``host_queue_bytes``,
like a socket buffer plus NIC ring): a sender that hands out many datagrams at once sees them
serialised at its line rate, not dropped.
"""

from __future__ import annotations

from typing import Any

from gradlane.bench.sim.network import Network
from gradlane.scheduling.errors import ConfigError

__all__ = ["dumbbell", "leafspine", "pair", "star"]

GBPS = 1e9 / 8
"""Bytes per second in one Gb/s."""


def leafspine(
    n_hosts: int,
    n_spines: int = 2,
    hosts_per_leaf: int | None = None,
    *,
    host_rate: float = 100 * GBPS,
    fabric_rate: float | None = None,
    delay: float = 1e-6,
    queue_bytes: int = 512 * 1024,
    host_queue_bytes: int = 16 << 20,
    priority: bool = True,
    host_priority: bool = True,
    **network_options: Any,
) -> Network:
    """A two-tier Clos: hosts under leaves, every leaf wired to every spine.

    Each host has one uplink to its leaf and one downlink from it; each leaf has a link to and
    from every spine. A datagram on path ``p`` goes host → leaf → spine ``p mod n_spines`` →
    leaf → host, *also between hosts under the same leaf* (a real leaf would turn such traffic
    around itself; here every pair has ``n_spines`` disjoint fabric paths, which is what a
    multipath transport is tested on). ``fabric_rate`` defaults to a non-blocking fabric:
    ``host_rate × hosts_per_leaf / n_spines``. ``hosts_per_leaf`` defaults to
    ``min(n_hosts, 16)``. ``priority`` applies to switch ports, ``host_priority`` to uplinks.
    ``network_options`` go to :class:`Network` (``dscp_classes``, ``overhead``, …).
    """
    if n_spines < 1:
        raise ConfigError("n_spines must be >= 1")
    hpl = min(n_hosts, 16) if hosts_per_leaf is None else hosts_per_leaf
    if hpl < 1:
        raise ConfigError("hosts_per_leaf must be >= 1")
    n_leaves = -(-n_hosts // hpl)
    frate = host_rate * hpl / n_spines if fabric_rate is None else fabric_rate
    net = Network(n_hosts, **network_options)
    leaves = [net.add_switch(f"leaf{i}") for i in range(n_leaves)]
    spines = [net.add_switch(f"spine{s}") for s in range(n_spines)]
    leaf_of = [h // hpl for h in range(n_hosts)]
    up = [0] * n_hosts
    down = [0] * n_hosts
    for h in range(n_hosts):
        leaf = leaves[leaf_of[h]]
        up[h] = net.add_link(
            h,
            leaf,
            rate=host_rate,
            delay=delay,
            queue_bytes=host_queue_bytes,
            priority=host_priority,
        )
        down[h] = net.add_link(
            leaf, h, rate=host_rate, delay=delay, queue_bytes=queue_bytes, priority=priority
        )

    def fabric(a: int, b: int) -> int:
        return net.add_link(
            a, b, rate=frate, delay=delay, queue_bytes=queue_bytes, priority=priority
        )

    to_spine = [[fabric(leaf, sp) for sp in spines] for leaf in leaves]
    from_spine = [[fabric(sp, leaf) for leaf in leaves] for sp in spines]

    def router(src: int, dst: int, path: int) -> tuple[int, ...]:
        s = path % n_spines
        return (up[src], to_spine[leaf_of[src]][s], from_spine[s][leaf_of[dst]], down[dst])

    net.set_router(router, n_spines, check=False)
    net.topology = {
        "kind": "leafspine",
        "leaves": n_leaves,
        "spines": n_spines,
        "hosts_per_leaf": hpl,
        "leaf_of": leaf_of,
        "host_rate": host_rate,
        "fabric_rate": frate,
    }
    return net


def dumbbell(
    n_hosts: int,
    *,
    host_rate: float = 100 * GBPS,
    bottleneck_rate: float = 10 * GBPS,
    delay: float = 1e-6,
    queue_bytes: int = 256 * 1024,
    host_queue_bytes: int = 16 << 20,
    priority: bool = True,
    **network_options: Any,
) -> Network:
    """Hosts ``0 .. n/2-1`` on switch ``left``, the rest on ``right``, joined by one
    bottleneck link each way (``left>right``, ``right>left``); one path between any pair."""
    if n_hosts < 2:
        raise ConfigError("a dumbbell needs at least 2 hosts")
    net = Network(n_hosts, **network_options)
    left, right = net.add_switch("left"), net.add_switch("right")
    half = n_hosts // 2
    for h in range(n_hosts):
        sw = left if h < half else right
        net.add_link(
            h, sw, rate=host_rate, delay=delay, queue_bytes=host_queue_bytes, priority=priority
        )
        net.add_link(sw, h, rate=host_rate, delay=delay, queue_bytes=queue_bytes, priority=priority)
    for a, b in ((left, right), (right, left)):
        net.add_link(
            a, b, rate=bottleneck_rate, delay=delay, queue_bytes=queue_bytes, priority=priority
        )
    net.topology = {"kind": "dumbbell", "left": list(range(half)), "bottleneck": bottleneck_rate}
    return net


def star(
    n_hosts: int,
    *,
    rate: float = 100 * GBPS,
    delay: float = 1e-6,
    queue_bytes: int = 256 * 1024,
    host_queue_bytes: int = 16 << 20,
    priority: bool = True,
    **network_options: Any,
) -> Network:
    """All hosts on one switch ``sw``; one path between any pair (two links)."""
    net = Network(n_hosts, **network_options)
    sw = net.add_switch("sw")
    for h in range(n_hosts):
        net.add_link(h, sw, rate=rate, delay=delay, queue_bytes=host_queue_bytes, priority=priority)
        net.add_link(sw, h, rate=rate, delay=delay, queue_bytes=queue_bytes, priority=priority)
    net.topology = {"kind": "star"}
    return net


def pair(
    *,
    rate: float = 10 * GBPS,
    delay: float = 1e-6,
    queue_bytes: int = 16 << 20,
    priority: bool = True,
    **network_options: Any,
) -> Network:
    """Two hosts and one direct link each way (``h0>h1``, ``h1>h0``): exact timing tests."""
    net = Network(2, **network_options)
    for a, b in ((0, 1), (1, 0)):
        net.add_link(a, b, rate=rate, delay=delay, queue_bytes=queue_bytes, priority=priority)
    net.topology = {"kind": "pair"}
    return net
