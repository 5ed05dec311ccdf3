"""Cross traffic on the testbed: paced UDP and TCP flows between two hosts over one spine.

A flow is two processes of :mod:`gradlane.bench.testbed.trafficgen` started in host namespaces: a
sink on the destination host and a sender on the source host, both bound to the hosts' path-``p``
addresses, so the flow crosses spine ``p`` (leaf ``src`` -> spine ``p`` -> leaf ``dst`` -> host
``dst``, each an htb-shaped switch port) and competes there with whatever else uses that path.

Rates are wire rates (Ethernet header included, as htb counts them), so ``rate_mbit=700`` on a
1000 Mbit/s link is 70 % of it. :meth:`CrossTraffic.stop` returns both processes' counters;
the queue drops it caused are in :meth:`gradlane.bench.testbed.netns.Testbed.link_stats`.

A *congested spine* (:func:`load_spine`, the ``spine`` route) is one flow from every host to the
next over that spine, a ring: every link of the spine, up from each leaf and down to each leaf,
carries the rate, so any connection an ECMP hash puts on that spine meets it. The ``pair`` route
is one flow (host ``src`` to host ``dst``), which loads only the links of its own route.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from gradlane.bench.testbed.netns import Testbed, finish, read_ready
from gradlane.bench.testbed.trafficgen import PATTERNS, PROTOS
from gradlane.transport.errors import ConfigError

__all__ = [
    "ROUTES",
    "CrossTraffic",
    "FlowSpec",
    "cross_where",
    "load_spine",
    "route_flows",
    "route_links",
    "start",
]

#: IPv4 + UDP header bytes inside the MTU.
IP_UDP_HEADERS = 28
#: Cross-traffic routes over a spine: every link of it (a ring of flows), or one host pair's.
ROUTES = ("spine", "pair")
#: Seconds a sender or sink gets to report ``ready``.
READY_TIMEOUT_S = 20.0
_next_port = [5200]


@dataclass(frozen=True)
class FlowSpec:
    """One cross-traffic flow.

    Attributes:
        spine: the path (spine) the flow crosses.
        rate_mbit: sending rate in Mbit/s on the wire (while "on"); ``None`` for bulk TCP.
        proto: ``"udp"`` or ``"tcp"``.
        pattern: ``"steady"`` or ``"onoff"`` (exponential on/off periods, means ``on_s``,
            ``off_s``).
        src: sending host; dst: receiving host.
        on_s: mean burst length in seconds (``onoff``); off_s: mean silence.
        dscp: DSCP mark of the flow's packets (0 = best effort).
        seed: seed of the on/off schedule.
        payload: UDP payload bytes per datagram (:func:`start` fills the testbed's MTU).
    """

    spine: int = 0
    rate_mbit: float | None = 700.0
    proto: str = "udp"
    pattern: str = "steady"
    src: int = 0
    dst: int = 1
    on_s: float = 0.05
    off_s: float = 0.05
    dscp: int = 0
    seed: int = 0
    payload: int = 8972

    def __post_init__(self) -> None:
        if self.proto not in PROTOS:
            raise ConfigError(f"proto must be one of {PROTOS}, got {self.proto!r}")
        if self.pattern not in PATTERNS:
            raise ConfigError(f"pattern must be one of {PATTERNS}, got {self.pattern!r}")
        if self.rate_mbit is None and self.proto == "udp":
            raise ConfigError("a UDP flow needs rate_mbit (only TCP may run unpaced, as bulk)")
        if self.rate_mbit is not None and not 0.1 <= self.rate_mbit <= 100_000:
            raise ConfigError(f"rate_mbit must be in [0.1, 100000], got {self.rate_mbit}")
        if self.src == self.dst:
            raise ConfigError(f"src and dst must differ, both are host {self.src}")
        if self.on_s <= 0 or self.off_s <= 0:
            raise ConfigError(f"on_s and off_s must be > 0, got {self.on_s}, {self.off_s}")
        if not 0 <= self.dscp <= 63:
            raise ConfigError(f"dscp must be in [0, 63], got {self.dscp}")
        if not 64 <= self.payload <= 65000:
            raise ConfigError(f"payload must be in [64, 65000] bytes, got {self.payload}")


class CrossTraffic:
    """A running flow (sink + sender processes); :meth:`stop` ends it and returns its counters."""

    def __init__(self, bed: Testbed, spec: FlowSpec, port: int) -> None:
        self.bed = bed
        self.spec = spec
        self.port = port
        self.src_addr = bed.hosts[spec.src].addrs[spec.spine]
        self.dst_addr = bed.hosts[spec.dst].addrs[spec.spine]
        self._procs: list[subprocess.Popen[str]] = []
        self.stats: dict[str, Any] | None = None

    @property
    def pids(self) -> list[int]:
        """Process ids of the sink and the sender (in that order, once started)."""
        return [p.pid for p in self._procs]

    def _launch(self, host: int, argv: list[str]) -> None:
        proc = self.bed.hosts[host].popen(
            [sys.executable, "-m", "gradlane.bench.testbed.trafficgen", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._procs.append(proc)
        read_ready(proc, READY_TIMEOUT_S, f"cross traffic {argv[0]} on host {host}")

    def start(self) -> CrossTraffic:
        """Start the sink, then the sender; returns once both are ready."""
        s = self.spec
        try:
            self._launch(
                s.dst,
                ["sink", "--proto", s.proto, "--bind", self.dst_addr, "--port", str(self.port)],
            )
            argv = ["send", "--proto", s.proto, "--src", self.src_addr, "--dst", self.dst_addr]
            argv += ["--port", str(self.port), "--pattern", s.pattern, "--seed", str(s.seed)]
            argv += ["--on-s", str(s.on_s), "--off-s", str(s.off_s), "--dscp", str(s.dscp)]
            argv += ["--payload", str(s.payload)]
            if s.rate_mbit is not None:
                argv += ["--rate-mbit", str(s.rate_mbit)]
            self._launch(s.src, argv)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> dict[str, Any]:
        """Stop sender then sink (always reaped); returns ``{"sender": {...}, "sink": {...}}``."""
        if self.stats is not None:
            return self.stats
        stats: dict[str, Any] = {}
        for proc in reversed(self._procs):  # sender first, so the sink counts everything
            record = finish(proc)
            if "role" in record:
                stats[record["role"]] = record
        self.bed.disown(self)
        self.stats = stats
        return stats


def start(bed: Testbed, spine: int, rate_mbit: float | None, **kw: Any) -> CrossTraffic:
    """Start a flow over spine ``spine`` at ``rate_mbit`` (see :class:`FlowSpec` for ``kw``).

    The testbed stops it at ``down`` if the caller does not; ``port`` picks the UDP/TCP port.
    """
    port = kw.pop("port", None)
    kw.setdefault("payload", bed.spec.mtu - IP_UDP_HEADERS)  # one datagram fills one frame
    spec = FlowSpec(spine=spine, rate_mbit=rate_mbit, **kw)
    if not 0 <= spine < bed.spec.spines:
        raise ConfigError(f"spine {spine} out of range [0, {bed.spec.spines})")
    if spec.proto == "udp" and spec.payload + IP_UDP_HEADERS > bed.spec.mtu:
        raise ConfigError(
            f"payload {spec.payload} does not fit the MTU {bed.spec.mtu} "
            f"(at most {bed.spec.mtu - IP_UDP_HEADERS} bytes)"
        )
    for host in (spec.src, spec.dst):
        if not 0 <= host < bed.spec.hosts:
            raise ConfigError(f"host {host} out of range [0, {bed.spec.hosts})")
    if port is None:
        port = _next_port[0]
        _next_port[0] = 5200 + (_next_port[0] - 5199) % 1000
    flow = CrossTraffic(bed, spec, int(port))
    bed.own(flow)
    return flow.start()


def route_flows(hosts: int, route: str, src: int = 0, dst: int = 1) -> list[tuple[int, int]]:
    """The (source, destination) host pairs of a cross-traffic ``route`` (see :data:`ROUTES`)
    among ``hosts`` hosts: ``spine`` is the ring ``h -> h+1``, ``pair`` is ``src -> dst``."""
    if route not in ROUTES:
        raise ConfigError(f"cross-traffic route must be one of {ROUTES}, got {route!r}")
    if hosts < 2:
        raise ConfigError(f"cross traffic needs at least 2 hosts, got {hosts}")
    if route == "pair":
        return [(src, dst)]
    return [(h, (h + 1) % hosts) for h in range(hosts)]  # 2 hosts: one flow each way


def cross_where(route: str, spine: int = 0, src: int = 0, dst: int = 1) -> str:
    """Where a ``route`` puts the cross traffic, in words (for run descriptions)."""
    if route == "pair":
        return f"from host {src} to host {dst} through spine {spine}"
    return f"on every link of spine {spine} (a ring of flows, host h to host h+1)"


def route_links(flows: list[tuple[int, int]], spine: int) -> tuple[str, ...]:
    """The switch links that ``flows`` over ``spine`` load, named as
    :meth:`gradlane.bench.testbed.netns.Testbed.link_stats` names them."""
    links: list[str] = []
    for src, dst in flows:
        for link in (
            f"leaf{src}->spine{spine}",
            f"spine{spine}->leaf{dst}",
            f"leaf{dst}->host{dst}.p{spine}",
        ):
            if link not in links:
                links.append(link)
    return tuple(links)


def load_spine(
    bed: Testbed, spine: int, rate_mbit: float, route: str = "spine", **kw: Any
) -> list[CrossTraffic]:
    """Cross traffic at ``rate_mbit`` on each flow of ``route`` over ``spine`` (see
    :func:`route_flows`; ``src``/``dst`` in ``kw`` pick the ``pair``); the flows are started
    in turn and all stopped if one fails to start."""
    src, dst = kw.pop("src", 0), kw.pop("dst", 1)
    flows: list[CrossTraffic] = []
    try:
        for s, d in route_flows(bed.spec.hosts, route, src, dst):
            flows.append(start(bed, spine, rate_mbit, src=s, dst=d, **kw))
    except BaseException:
        for flow in flows:
            flow.stop()
        raise
    return flows
