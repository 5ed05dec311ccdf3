"""Trace replay: N ranks replay a trace's buckets with its timing over gloo and gradlane.

Usage::

    gradlane bench replay TRACE [--network loopback|testbed] [--configs gloo,udp-bounded,...]
    python -m gradlane.bench.replay.run bench/replay/traces/mlp.jsonl --ranks 2 --steps 20 --out
    /tmp/replay

Each rank is a process (:mod:`gradlane.bench.replay.rank`): on ``loopback`` a local process with two
loopback paths (127.0.0.1, 127.0.0.2), on ``testbed`` one per testbed host, started inside the
host's namespace (``Host.popen``) with the host's path addresses. The parent hands each rank its
job on stdin and reads its JSON lines from stdout (pipes cross namespaces; nothing else needs
to), merges the ranks' step records (per step the slowest rank's communication time, the worst
delivered fraction, the bytes of every rank per path), shows a progress bar, and writes the
report (:mod:`gradlane.bench.replay.report`: JSON with a ``"summary"``, PNG plots).

Configurations (``--configs``, names from :func:`gradlane.bench.replay.rank.config_names`): ``gloo``
(``dist.all_reduce`` over TCP, the baseline), ``udp-reliable`` and ``udp-bounded`` (gradlane's
engine, loss bound 0 and ``--loss-bound``), each with ``+flat`` (priority off: one class, DSCP 0)
and ``+1path`` (multipath off: path 0 only). They run in the same processes, over the same
network and cross traffic, interleaved step by step (step 0 under every configuration, then
step 1, ...), so a change in a shared machine's background load hits every configuration
alike and their ratios compare like with like.

Scenarios (``--scenario``, testbed) preset the network and the configurations for the issue's
targets: ``congested`` (cross traffic at 70% of a link from host 0 to host 1 through spine 0, or
on every link of it with ``--cross-route spine``: gloo against gradlane bounded and reliable),
``clean`` (no cross traffic, buckets back to back: goodput, two paths against one),
``priority`` (congested, priority-aware switches: priority on against off).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Protocol

from gradlane.bench.host import HostWatch
from gradlane.bench.replay.rank import NetParams, ReplayConfig, config_names, describe
from gradlane.bench.replay.rank_pipes import RankError, RankPipes
from gradlane.bench.testbed.crosstraffic import ROUTES, cross_where
from gradlane.integrations.cli.command import RunProgress, emit
from gradlane.integrations.trace import read_trace
from gradlane.transport.errors import GradlaneError

__all__ = [
    "SCENARIOS",
    "TESTBED_TRANSPORT",
    "LoopbackNetwork",
    "ReplayError",
    "ReplayOptions",
    "TestbedNetwork",
    "add_arguments",
    "main",
    "run",
    "run_replay",
]

#: Seconds without a word from any rank before the replay gives up.
SILENCE_S = 120.0


#: gradlane's transport settings on the testbed (NetParams fields), each measured here: see the
#: ``--pacing``, ``--tx-quantum``, ``--rx-coalesce-us`` and ``--path-suspect-ms`` options.
TESTBED_TRANSPORT: dict[str, Any] = {
    "controller": "fixed",
    "tx_quantum_packets": 32,
    "tx_quantum_min_packets": 8,
    "rx_coalesce_s": 1e-3,
    "suspect_after_s": 0.5,
}

#: A rank failed or went silent; the message carries its error and stderr.
ReplayError = RankError


class Network(Protocol):
    """Where the ranks run: their path addresses, the gloo master, how to start a process."""

    world: int
    params: NetParams
    description: str

    def addrs(self, rank: int) -> list[str]:
        """``rank``'s local address per path."""

    def gloo_addr(self, rank: int) -> str:
        """The address of ``rank``'s gloo sockets."""

    def master(self) -> tuple[str, int]:
        """Address and port of rank 0's TCPStore."""

    def popen(self, rank: int, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` where ``rank`` runs."""

    def link_stats(self) -> dict[str, Any] | None:
        """Per switch port counters, or None where there are no switches."""


class LoopbackNetwork:
    """Ranks as local processes; path ``p`` is 127.0.0.(p+1)."""

    def __init__(self, world: int, n_paths: int = 2) -> None:
        if world < 2 or not 1 <= n_paths <= 8:
            raise ValueError("loopback replay needs >= 2 ranks and 1..8 paths")
        self.world = world
        self.n_paths = n_paths
        self.params = NetParams(loopback=True)
        self.description = f"loopback, {world} local processes, {n_paths} paths (127.0.0.x)"
        self._port = _free_port()

    def addrs(self, rank: int) -> list[str]:
        """Every rank has the same loopback path addresses (its own ports)."""
        return [f"127.0.0.{1 + p}" for p in range(self.n_paths)]

    def gloo_addr(self, rank: int) -> str:
        """127.0.0.1."""
        return "127.0.0.1"

    def master(self) -> tuple[str, int]:
        """127.0.0.1 and a port that was free."""
        return ("127.0.0.1", self._port)

    def popen(self, rank: int, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """A plain child process."""
        return subprocess.Popen(argv, **kw)

    def link_stats(self) -> dict[str, Any] | None:
        """Loopback has no switch ports."""
        return None


class TestbedNetwork:
    """Ranks on a running :class:`gradlane.bench.testbed.netns.Testbed`, one per host namespace.

    gloo's store and sockets use ``gloo="path0"`` (``addrs[0]``: every connection via spine 0,
    like a single-path job) or ``"ecmp"`` (``Host.ecmp_addr``: each connection hashed onto one
    spine, like a datacenter fabric; which spine varies from run to run); gradlane binds one
    socket per path address. Pacing starts at the link rate shared among the peers, and the host
    (one interface per spine) may send at ``spines`` times the link rate in all.
    """

    __test__ = False

    def __init__(
        self,
        bed: Any,
        master_port: int = 29400,
        gloo: str = "path0",
        tcp_idle_restart: bool = False,
        **transport: Any,
    ) -> None:
        if gloo not in ("path0", "ecmp"):
            raise ValueError(f"gloo={gloo!r}: path0 or ecmp")
        if gloo == "ecmp" and bed.hosts[0].ecmp_addr is None:
            raise ValueError("this testbed has no ECMP addresses")
        # The replay interleaves configurations, so gloo's connections sit idle while the others
        # run (about a second): longer than TCP's RTO, after which Linux restarts the window from
        # slow start (RFC 2861) - a penalty gloo would not pay between back-to-back steps. Off in
        # every host namespace unless asked for (many datacenters turn it off too).
        flag = int(tcp_idle_restart)
        for host in bed.hosts:
            argv = ["sysctl", "-q", "-w", f"net.ipv4.tcp_slow_start_after_idle={flag}"]
            host.run(argv, timeout=30, check=True, capture_output=True)
        self.bed = bed
        self.gloo = gloo
        spec = bed.spec
        self.world = len(bed.hosts)
        link_Bps = spec.link_mbit * 1e6 / 8
        self.params = NetParams(
            loopback=False,
            mtu=spec.mtu,
            link_Bps=link_Bps,
            nic_Bps=link_Bps * spec.spines,
            **transport,
        )
        self.description = (
            f"testbed {spec.prefix}: {spec.hosts} hosts, {spec.spines} spines, "
            f"{spec.link_mbit:g} Mbit/s links, MTU {spec.mtu}, queues {spec.queue_packets} "
            f"packets, priority-aware switches {'on' if spec.priority else 'off'}; gloo over "
            + ("path 0 (spine 0)" if gloo == "path0" else "the ECMP addresses (hashed)")
            + f", tcp_slow_start_after_idle={flag}"
        )
        self._port = master_port

    def addrs(self, rank: int) -> list[str]:
        """The host's path addresses."""
        return list(self.bed.hosts[rank].addrs)

    def master(self) -> tuple[str, int]:
        """Host 0's gloo address."""
        return (self.gloo_addr(0), self._port)

    def gloo_addr(self, rank: int) -> str:
        """The address gloo's sockets use on ``rank``'s host."""
        host = self.bed.hosts[rank]
        return str(host.ecmp_addr) if self.gloo == "ecmp" else str(host.addrs[0])

    def popen(self, rank: int, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Inside the host's namespace (the testbed reaps it at ``down``)."""
        return self.bed.hosts[rank].popen(argv, **kw)

    def link_stats(self) -> dict[str, Any] | None:
        """The switch ports' counters (``Testbed.link_stats``)."""
        return dict(self.bed.link_stats())


@dataclass(frozen=True)
class ReplayOptions:
    """What to replay and how."""

    trace: str
    configs: tuple[str, ...] = ("gloo", "udp-reliable", "udp-bounded")
    steps: int = 30
    warmup: int = 2
    """Untimed steps per configuration first (kernels load, pacing settles)."""
    loss_bound: float = 0.02
    back_to_back: bool = False
    """Submit every bucket at the step's start (no compute gaps): a throughput measurement."""
    seed: int = 0
    timeout_s: float = 600.0
    """Whole-run limit; each collective also has the transport's hard deadline."""
    gloo_draws: int = 1
    """gloo's steps in this many runs, each over new connections (on an ECMP fabric, a new draw
    of the spines its flows hash onto); 1: one group for the whole replay."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("--steps must be >= 1 and --warmup >= 0")
        if not 1 <= self.gloo_draws <= self.steps:
            raise ValueError(f"--gloo-draws must be in [1, --steps = {self.steps}]")
        if not self.configs:
            raise ValueError("no configuration to run")
        for name in self.configs:
            ReplayConfig.parse(name, self.loss_bound)  # raises with the valid names
        if not 0.0 < self.loss_bound <= 0.5:
            raise ValueError("--loss-bound must be in (0, 0.5]")


def run_replay(
    opts: ReplayOptions,
    net: Network,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Run every configuration over ``net``; returns the merged per-step records (raw report)."""
    metas, records = read_trace(opts.trace)
    trace = _back_to_back(opts.trace, records, metas) if opts.back_to_back else opts.trace
    job = {
        "world": net.world,
        "master": list(net.master()),
        "net": asdict(net.params),
        "trace": str(trace),
        "configs": list(opts.configs),
        "loss_bound": opts.loss_bound,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "seed": opts.seed,
        "timeout_s": opts.timeout_s,
        "gloo_draws": opts.gloo_draws,
    }
    links: dict[str, Any] = {}
    before = net.link_stats()
    host = HostWatch()
    t0 = time.monotonic()
    jobs = [
        {**job, "rank": r, "addrs": net.addrs(r), "gloo_addr": net.gloo_addr(r)}
        for r in range(net.world)
    ]
    try:
        with RankPipes() as ranks:
            ranks.start(
                [partial(net.popen, r) for r in range(net.world)],
                "gradlane.bench.replay.rank",
                jobs,
            )
            steps = _collect(opts, net, ranks, before, links, on_progress)
    finally:
        if trace != opts.trace:
            with contextlib.suppress(OSError):
                os.unlink(trace)
    return {
        "trace": opts.trace,
        "trace_meta": metas[0] if metas else {},
        "network": net.description,
        "net": asdict(net.params),
        "world": net.world,
        "options": asdict(opts),
        "configs": {
            name: describe(ReplayConfig.parse(name, opts.loss_bound)) for name in opts.configs
        },
        "steps": steps,
        "link_stats": links,  # the switch ports over the whole run (all configurations)
        # Other work on a shared machine shows here (load averages at the start and the end).
        "host": host.record(),
        "wall_s": time.monotonic() - t0,
    }


def _collect(
    opts: ReplayOptions,
    net: Network,
    ranks: RankPipes,
    before: dict[str, Any] | None,
    links: dict[str, Any],
    on_progress: Callable[[str, int, int], None] | None,
) -> dict[str, list[dict[str, Any]]]:
    """Read every rank's messages until all are done; merge step records across ranks.

    The switch counters are read when rank 0 has replayed every configuration (they cover the
    whole run: the configurations interleave step by step).
    """
    pending: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    merged: dict[str, list[dict[str, Any]]] = {name: [] for name in opts.configs}
    for rank, msg in ranks.messages(opts.timeout_s, SILENCE_S):
        kind = msg.get("type")
        if kind == "replayed" and rank == 0 and before is not None:
            links.update(_delta(before, net.link_stats() or {}))
        elif kind == "step":
            key = (msg["config"], msg["step"])
            got = pending.setdefault(key, {})
            got[rank] = msg
            if len(got) == net.world:
                merged[msg["config"]].append(_merge(pending.pop(key)))
                if on_progress is not None:
                    on_progress(msg["config"], msg["step"] + 1, opts.steps)
    for recs in merged.values():
        recs.sort(key=lambda r: r["step"])
    return merged


def _merge(per_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One step over all ranks: the slowest rank's times, the worst delivery, bytes summed."""
    recs = [per_rank[r] for r in sorted(per_rank)]
    buckets = recs[0]["bucket_lat_s"].keys()
    n_paths = max(len(r["path_bytes"]) for r in recs)
    return {
        "step": recs[0]["step"],
        "draw": recs[0].get("draw", 0),
        "t_s": recs[0]["t_s"],
        "comm_s": max(r["comm_s"] for r in recs),
        "comm_s_per_rank": [r["comm_s"] for r in recs],
        "protected_s": max(r["protected_s"] for r in recs),
        "bucket_lat_s": {b: max(r["bucket_lat_s"][b] for r in recs) for b in buckets},
        "bucket_done_s": {b: max(r["bucket_done_s"][b] for r in recs) for b in buckets},
        "delivered": min(r["delivered"] for r in recs),
        "wall_s": max(r["wall_s"] for r in recs),
        "host_cores": recs[0].get("host_cores"),
        "cpu_s": sum(r["cpu_s"] for r in recs),
        "degraded": sum(r["degraded"] for r in recs),
        "retransmitted": sum(r["retransmitted"] for r in recs),
        "path_bytes": [
            sum(r["path_bytes"][p] for r in recs if p < len(r["path_bytes"]))
            for p in range(n_paths)
        ],
        "bytes": recs[0]["bytes"],
        "format_bytes": [sum(r.get("format_bytes", [0, 0, 0])[k] for r in recs) for k in range(3)],
        "lossy_elems": sum(r.get("lossy_elems", 0) for r in recs),
        "elems": sum(r.get("elems", 0) for r in recs),
        "err2": sum(r.get("err2", 0.0) for r in recs),
        "norm2": sum(r.get("norm2", 0.0) for r in recs),
        "precision_level": max(r.get("precision_level", 0.0) for r in recs),
    }


_COUNTERS = ("sent_bytes", "sent_packets", "drops", "overlimits")


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Counter growth per switch port (and per DSCP class of a priority port) between two
    ``link_stats`` snapshots."""
    out = {}
    for port, cb in b.items():
        ca = a.get(port, {})
        grown = {k: int(cb.get(k, 0)) - int(ca.get(k, 0)) for k in _COUNTERS}
        classes = {
            name: {k: int(c.get(k, 0)) - int(ca.get("classes", {}).get(name, {}).get(k, 0))
                   for k in _COUNTERS}
            for name, c in cb.get("classes", {}).items()
        }  # fmt: skip
        out[port] = {"link": cb.get("link"), **grown, "classes": classes}
    return out


def _back_to_back(path: str, records: list[dict[str, Any]], metas: list[dict[str, Any]]) -> str:
    """A copy of the trace with every ready time 0 (a temporary file the caller removes)."""
    fd, tmp = tempfile.mkstemp(prefix="gl-replay-", suffix=".jsonl")
    with os.fdopen(fd, "w") as f:
        for m in metas:
            f.write(json.dumps(m) + "\n")
        for r in records:
            f.write(json.dumps({**r, "ready_s": 0.0, "gap_s": 0.0}) + "\n")
    return tmp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- command line ----------------------------------------------------------------------------------
#: --scenario presets (testbed): cross traffic (fraction of one spine link), priority-aware
#: switches, buckets back to back, configurations.
SCENARIOS: dict[str, dict[str, Any]] = {
    "congested": {
        "cross": 0.7,
        "switch_priority": False,
        "back_to_back": False,
        "configs": ("gloo", "udp-bounded", "udp-reliable"),
    },
    "clean": {
        "cross": 0.0,
        "switch_priority": False,
        "back_to_back": True,
        "configs": ("udp-reliable", "udp-reliable+1path", "gloo"),
    },
    "priority": {
        "cross": 0.7,
        "switch_priority": True,
        "back_to_back": False,
        "configs": ("udp-bounded", "udp-bounded+flat"),
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``gradlane bench``: its subcommands (``replay``)."""
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    r = sub.add_parser("replay", help="replay a trace over gloo and gradlane", description=__doc__)
    _replay_arguments(r)


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace", help="a gradlane-trace file (bench/replay/traces/*.jsonl, or synthetic)"
    )
    p.add_argument("--network", choices=("loopback", "testbed"), default="loopback")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), help="testbed presets (see above)")
    p.add_argument("--configs", help=f"comma-separated, of: {', '.join(config_names())}")
    p.add_argument("--ranks", type=int, default=2, help="loopback: rank processes (default 2)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    p.add_argument("--loss-bound", type=float, default=0.02, help="udp-bounded's (default 0.02)")
    p.add_argument("--back-to-back", action="store_true", help="no compute gaps (throughput)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="whole-run limit in seconds")
    p.add_argument("--out", help="write OUT.json and OUT_{cdf,paths,delivered}.png")
    tb = p.add_argument_group("--network testbed")
    tb.add_argument("--hosts", type=int, default=4)
    tb.add_argument("--link-mbit", type=float, default=1000.0)
    tb.add_argument("--queue-packets", type=int, default=1000)
    tb.add_argument("--cross", type=float, help="cross traffic on spine 0, fraction of a link")
    tb.add_argument("--cross-proto", choices=("udp", "tcp"), default="udp")
    tb.add_argument(
        "--cross-route",
        choices=ROUTES,
        default="pair",
        help="host 0 to host 1 through spine 0 (the default) or every link of spine 0 (a ring "
        "of flows, host h to host h+1)",
    )
    tb.add_argument(
        "--tcp-idle-restart",
        action="store_true",
        help="keep Linux's TCP slow start after idle in the hosts (off by default: the "
        "interleaved configurations would idle gloo's connections past their RTO)",
    )
    tb.add_argument(
        "--gloo",
        choices=("path0", "ecmp"),
        default="path0",
        help="gloo over path 0 (spine 0, default) or the hosts' ECMP addresses (hashed)",
    )
    tb.add_argument(
        "--gloo-draws",
        type=int,
        help="split gloo's steps into this many runs over new connections, each a new draw of "
        "the spines ECMP hashes them onto (default 4 with --gloo ecmp, else 1)",
    )
    tb.add_argument("--switch-priority", action="store_true", help="DSCP classes on switch ports")
    tb.add_argument(
        "--pacing",
        choices=("loss-tolerant", "fixed"),
        default=TESTBED_TRANSPORT["controller"],
        help="gradlane's pacing controller (default fixed: an even share of the link per peer)",
    )
    # Fixed pacing by default for the reason loopback_config() gives: the emulated hosts share
    # a few cores with the switches, and the delay-based controller reads scheduling delay as
    # queueing, which holds a path far below its link rate. Send bursts of 32 packets and
    # receive batching (1 ms) serve the links in fewer, larger passes, which such hosts need to
    # fill them; larger bursts queue up at the links past the RTO learned between steps (64:
    # about twice the retransmissions and 4% less goodput on the clean scenario). Where a queue
    # drops their tails (a priority switch's small low-class queues) they shrink, down to 8
    # packets, and grow back without loss: on the priority scenario the switch drops went from
    # thousands to a handful and the bounded p99 down by a fifth, while clean runs, which lose
    # almost nothing, kept their goodput (3 interleaved pairs: 0.828-0.842 against 0.820-0.824).
    tb.add_argument(
        "--tx-quantum",
        type=int,
        default=TESTBED_TRANSPORT["tx_quantum_packets"],
        help="packets per paced send burst (%(default)s)",
    )
    tb.add_argument(
        "--tx-quantum-min",
        type=int,
        default=TESTBED_TRANSPORT["tx_quantum_min_packets"],
        help="the burst follows loss between this and --tx-quantum (halved on a loss, one "
        "packet more per 0.1 s without; default %(default)s); 0: a fixed burst",
    )
    tb.add_argument(
        "--rx-coalesce-us",
        type=float,
        default=TESTBED_TRANSPORT["rx_coalesce_s"] * 1e6,
        help="receive batching in µs (%(default)g)",
    )
    tb.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other TransportConfig field of gradlane's ranks (e.g. tick_s=0.005)",
    )
    tb.add_argument(
        "--path-suspect-ms",
        type=float,
        default=TESTBED_TRANSPORT["suspect_after_s"] * 1e3,
        help="a path silent this long is suspect, 4x as long down (default 500)",
    )


#: gloo draws by default over ECMP: four new hashes of gloo's connections per replay (how often
#: one meets the cross traffic is measured in docs/testbed.md).
ECMP_DRAWS = 4


def _gloo_draws(args: argparse.Namespace) -> int:
    """``--gloo-draws``, else :data:`ECMP_DRAWS` over ECMP on the testbed (capped at the steps),
    else 1."""
    if args.gloo_draws is not None:
        return int(args.gloo_draws)
    if args.network == "testbed" and args.gloo == "ecmp":
        return min(ECMP_DRAWS, max(args.steps, 1))
    return 1


def run(args: argparse.Namespace) -> int:
    """``gradlane bench replay``: run, print the table, write the report."""
    preset = SCENARIOS.get(args.scenario or "", {})
    configs = args.configs.split(",") if args.configs else preset.get("configs")
    try:
        opts = ReplayOptions(
            trace=args.trace,
            configs=tuple(configs) if configs else ReplayOptions.configs,
            steps=args.steps,
            warmup=args.warmup,
            loss_bound=args.loss_bound,
            back_to_back=args.back_to_back or preset.get("back_to_back", False),
            seed=args.seed,
            timeout_s=args.timeout,
            gloo_draws=_gloo_draws(args),
        )
        read_trace(opts.trace)
    except (ValueError, OSError) as e:
        emit(f"gradlane bench replay: {e}", err=True)
        return 2
    command = (
        "gradlane " + shlex.join(sys.argv[1:])
        if sys.argv[1:2] == ["bench"]
        else ("python -m gradlane.bench.replay.run " + shlex.join(sys.argv[1:]))
    )
    try:
        with RunProgress(label_width=22) as bars:
            if args.network == "loopback":
                raw = run_replay(opts, LoopbackNetwork(args.ranks), bars.update)
            else:
                raw = _on_testbed(args, preset, opts, bars.update)
    except ReplayError as e:
        emit(f"gradlane bench replay failed: {e}", err=True)
        return 1
    except (GradlaneError, ValueError) as e:  # not root (it says so), a bad --set, TestbedError
        emit(f"gradlane bench replay: {e}", err=True)
        return 2
    from gradlane.bench.replay import report as replay_report

    doc = replay_report.build(raw, command)
    emit(f"replay of {opts.trace}: {raw['network']}; {raw['wall_s']:.0f} s wall")
    emit(replay_report.table(doc))
    if args.out:
        for path in replay_report.write(doc, args.out):
            emit(f"wrote {path}")
    return 0


def _on_testbed(
    args: argparse.Namespace,
    preset: dict[str, Any],
    opts: ReplayOptions,
    on_progress: Callable[[str, int, int], None],
) -> dict[str, Any]:
    """Bring up a testbed (torn down whatever happens), start cross traffic, replay."""
    from gradlane.bench.testbed.netns import Testbed, TestbedSpec, privilege
    from gradlane.bench.testbed.orphans import owned_prefix, sweep_orphans

    privilege()  # raises TestbedUnavailable, naming what is missing (root)
    overrides = _settings(args.set)  # bad settings fail before the testbed is built
    cross = args.cross if args.cross is not None else preset.get("cross", 0.0)
    sweep_orphans("rp")  # what killed runs left (nothing else removes it)
    spec = TestbedSpec(
        hosts=args.hosts,
        spines=2,
        link_mbit=args.link_mbit,
        queue_packets=args.queue_packets,
        priority=args.switch_priority or preset.get("switch_priority", False),
        prefix=owned_prefix("rp"),
    )
    with Testbed(spec) as bed:
        net = TestbedNetwork(
            bed,
            gloo=args.gloo,
            tcp_idle_restart=args.tcp_idle_restart,
            controller=args.pacing,
            tx_quantum_packets=args.tx_quantum,
            tx_quantum_min_packets=args.tx_quantum_min,
            rx_coalesce_s=args.rx_coalesce_us * 1e-6,
            suspect_after_s=args.path_suspect_ms * 1e-3,
            overrides=overrides,
        )
        if cross > 0:
            bed.load_spine(0, cross * spec.link_mbit, args.cross_route, proto=args.cross_proto)
            net.description += (
                f"; {args.cross_proto} cross traffic at {cross:.0%} of a link "
                f"{cross_where(args.cross_route)}"
            )
        return run_replay(opts, net, on_progress)


def _settings(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` flags as TransportConfig fields (values parsed as JSON, else strings);
    unknown keys are a ConfigError naming the valid ones."""
    from gradlane.transport.config import TransportConfig

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise ValueError(f"--set {pair!r}: write KEY=VALUE")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    TransportConfig.from_mapping(out)  # validates names and values here, not in every rank
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m gradlane.bench.replay.run TRACE ...`` (the same options as ``gradlane bench
    replay``)."""
    p = argparse.ArgumentParser(prog="python -m gradlane.bench.replay.run", description=__doc__)
    _replay_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
