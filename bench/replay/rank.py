"""One rank of a trace replay (:mod:`gradlane.bench.replay.run` starts N): ``python -m
gradlane.bench.replay.rank``.

The parent writes one JSON job to the rank's stdin and reads JSON lines from its stdout; the rank
may run in another network namespace (``Host.popen`` on the testbed), so nothing but the pipes and
the network joins it to the parent. Lines written: ``{"type": "ready"}`` once the gloo group is up,
one ``{"type": "step", ...}`` per measured step and configuration, ``{"type": "done"}`` at the end,
or ``{"type": "error", "message": ...}`` (then the rank exits with status 1).

Theory of operation
-------------------
Rank 0 hosts a ``TCPStore`` at the job's master address (on the testbed: host 0's path-0 address);
the gloo group is built on it (gloo's sockets on the interface holding this rank's path-0 address)
and the same store carries every engine's bound UDP addresses. For each configuration in turn
(:class:`ReplayConfig`), every step:

1. ``dist.barrier()`` (untimed): the ranks start the step together, as DDP's ranks do after the
   previous step's all-reduce;
2. the step's buckets are submitted at their recorded ready times (a sleep until ``t0 + ready_s``:
   the compute the trace recorded), each through the configuration's transport — gloo's
   ``all_reduce(async_op=True)`` or the gradlane engine's ``submit`` — and each completion is
   time-stamped on the thread that completes it;
3. the step ends when every bucket completed; its record holds the communication time (first
   bucket ready → last bucket done), each bucket's completion, the protected bucket's latency,
   the delivered fraction and the bytes each path carried (the engine's ``CollectiveReport``).

With ``gloo_draws`` above 1 the gloo configuration's steps are split into that many runs of
consecutive steps, each over a gloo group of its own (``new_group``: new connections, new source
ports), warmed with one untimed all-reduce of every bucket. On an ECMP fabric each connection's
spine follows from a hash of its ports, so each run is one draw of where gloo's flows go; a
step's record says which draw it belongs to (``draw``).

The *protected* bucket is the front layer's (the one whose span starts at layer position 0: the
next forward pass needs it first). With priority on it is submitted ``pinned`` — every chunk
protected, class 0, the highest DSCP — and with priority off like any other (policy ``flat``,
DSCP 0, buckets sent in the order they start, as by a transport without priorities).
Buffers are refilled from the rank's gradients between steps (untimed), so sums never grow.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np
from gradlane.bench.host import cpu_times
from gradlane.bench.replay.rank_pipes import say

__all__ = [
    "NetParams",
    "ReplayConfig",
    "StepPlan",
    "config_names",
    "cores_busy",
    "cpu_jiffies",
    "describe",
    "ifname_of",
    "main",
    "plan_steps",
    "transport_config",
]

log = logging.getLogger(__name__)

#: Largest datagram payload per MTU: IP (20) and UDP (8) headers, then gradlane's 48-byte header.
_IP_UDP = 28
_GL_HEADER = 48


@dataclass(frozen=True)
class ReplayConfig:
    """One transport configuration of the comparison."""

    transport: str = "udp"
    """``gloo`` (``dist.all_reduce``, the baseline) or ``udp`` (the gradlane engine)."""
    loss_bound: float = 0.0
    """0 = reliable; e.g. 0.02 = bounded (each receiver may miss 2% of each sender's elements)."""
    priority: bool = True
    """Priority classes by layer and magnitude, DSCP marked, the front layer pinned; off = one
    class, start order (policy ``flat``, DSCP 0)."""
    multipath: bool = True
    """Spray over every path; off = path 0 only."""

    def __post_init__(self) -> None:
        if self.transport not in ("gloo", "udp"):
            raise ValueError(f"transport {self.transport!r}: gloo or udp")
        if not 0.0 <= self.loss_bound <= 0.5:
            raise ValueError(f"loss_bound {self.loss_bound}: in [0, 0.5]")

    @property
    def name(self) -> str:
        """``gloo``, ``udp-reliable``, ``udp-bounded``; ``+flat`` (priority off), ``+1path``."""
        if self.transport == "gloo":
            return "gloo"
        name = "udp-reliable" if self.loss_bound == 0 else "udp-bounded"
        return name + ("" if self.priority else "+flat") + ("" if self.multipath else "+1path")

    @classmethod
    def parse(cls, name: str, bound: float = 0.02) -> ReplayConfig:
        """The configuration a :attr:`name` stands for (``bound`` for ``udp-bounded``)."""
        base, *mods = name.split("+")
        table = {"gloo": ("gloo", 0.0), "udp-reliable": ("udp", 0.0), "udp-bounded": ("udp", bound)}
        if base not in table or set(mods) - {"flat", "1path"} or len(set(mods)) != len(mods):
            raise ValueError(f"unknown configuration {name!r}; valid: {', '.join(config_names())}")
        if base == "gloo" and mods:
            raise ValueError("gloo has no +flat/+1path variants (it is TCP over path 0)")
        transport, lb = table[base]
        return cls(transport, lb, priority="flat" not in mods, multipath="1path" not in mods)


def config_names() -> list[str]:
    """Every configuration name :meth:`ReplayConfig.parse` accepts."""
    out = ["gloo"]
    for base in ("udp-reliable", "udp-bounded"):
        out += [base, base + "+flat", base + "+1path", base + "+flat+1path"]
    return out


@dataclass(frozen=True)
class NetParams:
    """What the transport needs to know about the network the ranks run on."""

    loopback: bool = True
    mtu: int = 65535
    """Path MTU: sets the chunk size (loopback: 65000-byte chunks)."""
    link_Bps: float = 0.0  # noqa: N815 (B = bytes)
    """Rate of one path (bytes/s): pacing starts at an even share of it per peer; 0 = loopback."""
    nic_Bps: float = 0.0  # noqa: N815 (B = bytes)
    """This host's total sending rate (bytes/s); 0 = uncapped."""
    hard_deadline_s: float = 30.0
    controller: str = "loss-tolerant"
    """Pacing controller on a real network (``fixed``: the even share of the link, constant)."""
    tx_quantum_packets: int = 4
    """Packets' worth of pacing tokens per send burst (fewer wake-ups per byte when larger)."""
    tx_quantum_min_packets: int = 0
    """0: a fixed burst; else the burst follows loss down to this (``TransportConfig``)."""
    rx_coalesce_s: float = 0.0
    """Hold received datagrams this long to process them as one batch."""
    suspect_after_s: float = 0.05
    """A path silent this long is suspect (and 4x this long, down): ``PathConfig``."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Any other ``TransportConfig`` fields (top level, e.g. ``{"tick_s": 0.005}``)."""

    @property
    def chunk_bytes(self) -> int:
        """Payload per datagram: the MTU less the IP, UDP and gradlane headers."""
        if self.loopback:
            return 65000
        return (self.mtu - _IP_UDP - _GL_HEADER) // 4 * 4


def transport_config(cfg: ReplayConfig, net: NetParams, n_paths: int, world: int, seed: int) -> Any:
    """The engine's ``TransportConfig`` for one configuration on one network."""
    from gradlane.scheduling.loss import LossConfig
    from gradlane.scheduling.pacing import PacingConfig
    from gradlane.scheduling.paths import PathConfig
    from gradlane.scheduling.priority import PriorityConfig
    from gradlane.transport.config import TransportConfig, loopback_config

    n = n_paths if cfg.multipath else 1
    prio = PriorityConfig() if cfg.priority else PriorityConfig(policy="flat", dscp=(0, 0, 0, 0))
    bounded = cfg.loss_bound > 0
    loss = LossConfig(
        loss_bound=cfg.loss_bound,
        hard_deadline_s=net.hard_deadline_s,
        # A bounded run prefers progress (what is lost is reported); a reliable one must fail.
        on_hard_deadline="degrade" if bounded else "raise",
    )
    if net.loopback:
        return _overridden(loopback_config(n_paths=n, priority=prio, loss=loss, seed=seed), net)
    # As in the simulator (bench/sim/scenarios.py): each (peer, path) starts at an even share
    # of the path so N-1 senders do not incast one receiver, the delay-based controller probes
    # up to the link rate, and the NIC pacer caps the host's total.
    share = net.link_Bps / max(world - 1, 1)
    tcfg = TransportConfig(
        chunk_bytes=net.chunk_bytes,
        n_paths=n,
        multipath=True,
        nic_rate_Bps=net.nic_Bps,
        tx_quantum_packets=net.tx_quantum_packets,
        tx_quantum_min_packets=net.tx_quantum_min_packets,
        rx_coalesce_s=net.rx_coalesce_s,
        seed=seed,
        priority=prio,
        loss=loss,
        # Emulated hosts share a few cores with the switches' forwarding: a rank can go unserved
        # for tens of milliseconds, so silence means a dead path only after much longer than on
        # real hardware (with the defaults, 50 ms / 200 ms, a congested run would write the idle
        # spine off and send everything over the congested one).
        # A path's rate estimate starts at the link's rate, not the 1 Gbit/s default: at first
        # the water-fill splits by it, and an estimate five times the link (200 Mbit/s) takes the
        # first steps to come down, while the congested spine gets as much as the free one.
        paths=PathConfig(
            suspect_after_s=net.suspect_after_s,
            down_after_s=4 * net.suspect_after_s,
            initial_rate_Bps=net.link_Bps,
        ),
        pacing=PacingConfig(
            controller=net.controller,
            initial_rate_Bps=share,
            min_rate_Bps=min(1e6, share),
            max_rate_Bps=net.link_Bps,
            increase_Bps_per_s=net.link_Bps * 4,
            burst_bytes=max(64 * 1024, 2 * net.tx_quantum_packets * net.chunk_bytes),
        ),
    )
    return _overridden(tcfg, net)


def _overridden(cfg: Any, net: NetParams) -> Any:
    """``cfg`` with ``net.overrides`` (``--set``: nested tables as mappings, ``precision`` as a
    policy's name too, read as ``TransportConfig.from_mapping`` reads them)."""
    from gradlane.transport.config import TransportConfig

    if not net.overrides:
        return cfg
    parsed = TransportConfig.from_mapping(net.overrides)
    return replace(cfg, **{k: getattr(parsed, k) for k in net.overrides})


@dataclass(frozen=True)
class StepPlan:
    """One step of one rank: its buckets (index, elements, ready time, layer position)."""

    buckets: tuple[tuple[int, int, float, float], ...]

    @property
    def protected(self) -> int:
        """The front layer's bucket: the one whose layer span starts nearest position 0."""
        return min(self.buckets, key=lambda b: (b[3], -b[0]))[0]


def plan_steps(records: list[dict[str, Any]], rank: int, trace_world: int) -> list[StepPlan]:
    """The trace's steps for ``rank`` (it replays trace rank ``rank % trace_world``), leaving
    out steps whose bucket layout differs from the last step's (DDP's pre-rebuild step 0)."""
    mine = rank % trace_world
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r["rank"] == mine and r.get("ok", True):
            by_step.setdefault(int(r["step"]), []).append(r)
    if not by_step:
        raise ValueError(f"the trace has no buckets for rank {mine}")
    plans = []
    for s in sorted(by_step):
        recs = sorted(by_step[s], key=lambda r: r["bucket"])
        plans.append(
            StepPlan(
                tuple(
                    (int(r["bucket"]), int(r["numel"]), float(r["ready_s"]), r["layer_span"][0])
                    for r in recs
                )
            )
        )
    layout = [(b, n) for b, n, _, _ in plans[-1].buckets]
    return [p for p in plans if [(b, n) for b, n, _, _ in p.buckets] == layout]


def describe(cfg: ReplayConfig) -> dict[str, Any]:
    """A configuration as JSON (its name and fields)."""
    return {"name": cfg.name, **asdict(cfg)}


# -- the rank process ------------------------------------------------------------------------------
def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far (:func:`cpu_times`; 0s elsewhere)."""
    t = cpu_times()
    total = sum(t.values())
    return (total - t.get("idle", 0) - t.get("iowait", 0), total)


def cores_busy(a: tuple[int, int], b: tuple[int, int]) -> float:
    """Cores the machine kept busy between two :func:`cpu_jiffies` snapshots (user, system and
    softirq: the testbed's forwarding and shaping run in softirq, outside every process)."""
    total = b[1] - a[1]
    return (b[0] - a[0]) / total * (os.cpu_count() or 1) if total > 0 else 0.0


def ifname_of(addr: str) -> str | None:
    """The interface that holds ``addr`` (for gloo's GLOO_SOCKET_IFNAME), or None."""
    try:
        out = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == addr:
            return parts[1]
    return None


def _gradients(plan: StepPlan, rank: int, seed: int) -> dict[int, np.ndarray]:
    """Per bucket: float32 gradients with uneven chunk magnitudes, correlated across ranks (the
    same model's gradient on different data = signal + noise), as the simulator makes them."""
    out = {}
    for b, n, _, _ in plan.buckets:
        shared = np.random.default_rng([seed, b])
        scale = np.repeat(shared.lognormal(0.0, 1.5, size=-(-n // 512)), 512)[:n]
        signal = shared.standard_normal(n)
        noise = np.random.default_rng([seed, b, rank + 1]).standard_normal(n)
        out[b] = ((signal + 0.5 * noise) * scale).astype(np.float32)
    return out


def _stamp(done: dict[int, float], bucket: int, stamped: threading.Event, _: object) -> None:
    done[bucket] = time.monotonic()
    stamped.set()


class _Rank:
    """The rank's state for one job (see the module docstring)."""

    def __init__(self, job: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from gradlane.integrations.trace import read_trace

        self.job = job
        self.rank, self.world = int(job["rank"]), int(job["world"])
        self.addrs: list[str] = list(job["addrs"])
        self.net = NetParams(**job["net"])
        self.timeout = float(job["timeout_s"])
        metas, records = read_trace(job["trace"])
        trace_world = int(metas[0].get("world", 1)) if metas else 1
        self.plans = plan_steps(records, self.rank, trace_world)
        self.grads = _gradients(self.plans[-1], self.rank, int(job["seed"]))
        self.bufs = {b: g.copy() for b, g in self.grads.items()}
        torch.set_num_threads(1)
        if not self.net.loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = ifname_of(job.get("gloo_addr") or self.addrs[0])
            if ifname:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        td = datetime.timedelta(seconds=self.timeout)
        master, port = job["master"]
        self.store = dist.TCPStore(master, int(port), self.world, self.rank == 0, timeout=td)
        dist.init_process_group(
            "gloo", store=self.store, rank=self.rank, world_size=self.world, timeout=td
        )
        self.dist, self.torch = dist, torch
        self.tensors = {b: torch.from_numpy(buf) for b, buf in self.bufs.items()}
        self.draws = int(job.get("gloo_draws", 1))
        self.gloo_group: Any = None  # None: the default group (one draw)
        self.draw = 0

    def run(self) -> None:
        say(type="ready", rank=self.rank)
        bound = float(self.job["loss_bound"])
        cfgs = [ReplayConfig.parse(name, bound) for name in self.job["configs"]]
        engines: list[Any] = []
        try:
            for k, cfg in enumerate(cfgs):
                engines.append(None if cfg.transport == "gloo" else self._engine(k, cfg))
            self._replay(cfgs, engines)
            for engine in engines:  # peers have what this rank sent (UdpPlane.drain)...
                if engine is not None:
                    engine.drain()
            self.dist.barrier()  # ...on every rank before any engine stops answering
        finally:
            for engine in engines:
                if engine is not None:
                    engine.close()
        say(type="replayed", rank=self.rank)
        self.dist.barrier()
        say(type="done", rank=self.rank)

    def _engine(self, k: int, cfg: ReplayConfig) -> Any:
        from gradlane.transport.drivers.peers import StaticPeers
        from gradlane.transport.drivers.udp.plane import UdpPlane

        n_paths = len(self.addrs) if cfg.multipath else 1
        seed = int(self.job["seed"]) * 1000 + self.rank
        tcfg = transport_config(cfg, self.net, len(self.addrs), self.world, seed)
        eng = UdpPlane(self.rank, self.world, tcfg, local_addrs=self.addrs[:n_paths])
        try:
            self.store.set(f"replay/{k}/{self.rank}", json.dumps(eng.start()))
            table = {
                r: [tuple(a) for a in json.loads(self.store.get(f"replay/{k}/{r}"))]
                for r in range(self.world)
            }
            eng.set_peers(StaticPeers(table))
        except BaseException:
            eng.close()
            raise
        return eng

    def _replay(self, cfgs: list[ReplayConfig], engines: list[Any]) -> None:
        """Every step of the trace under every configuration in turn (interleaved, so a change
        in the machine's background load hits every configuration alike)."""
        warmup, steps = int(self.job["warmup"]), int(self.job["steps"])
        per_draw = -(-steps // self.draws)
        with_gloo = any(cfg.transport == "gloo" for cfg in cfgs)
        t_start = time.monotonic()
        for i in range(-warmup, steps):
            plan = self.plans[i % len(self.plans)]
            draw = max(i, 0) // per_draw
            if with_gloo and self.draws > 1 and (self.gloo_group is None or draw != self.draw):
                self._new_gloo_group(draw)
            for k, (cfg, engine) in enumerate(zip(cfgs, engines, strict=True)):
                for b, buf in self.bufs.items():
                    buf[:] = self.grads[b]  # untimed: the sums never grow
                self.dist.barrier()
                rec = self._step(k * 100_000 + i + warmup + 1, cfg, engine, plan)
                if i >= 0:
                    rec.update(type="step", config=cfg.name, rank=self.rank, step=i, draw=draw)
                    rec["t_s"] = rec.pop("t0") - t_start
                    say(**rec)

    def _new_gloo_group(self, draw: int) -> None:
        """A gloo group of its own for ``draw`` (every rank calls this at the same step), the
        previous one destroyed; one untimed all-reduce of every bucket opens its connections."""
        old, self.gloo_group = self.gloo_group, self.dist.new_group(backend="gloo")
        if old is not None:
            self.dist.destroy_process_group(old)
        self.draw = draw
        for b, t in self.tensors.items():
            t.copy_(self.torch.from_numpy(self.grads[b]))
            self.dist.all_reduce(t, group=self.gloo_group)

    def _step(self, step_id: int, cfg: ReplayConfig, engine: Any, plan: StepPlan) -> dict[str, Any]:
        protected = plan.protected
        submitted: dict[int, float] = {}
        done: dict[int, float] = {}
        waits = []
        events: dict[int, threading.Event] = {}
        cpu0 = time.process_time()  # every thread of this rank: the engine's and gloo's too
        host0 = cpu_jiffies() if self.rank == 0 else None
        t0 = time.monotonic()
        for b, _, ready, pos in sorted(plan.buckets, key=lambda x: x[2]):
            delay = t0 + ready - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the compute the trace recorded before this bucket
            submitted[b] = time.monotonic()
            if engine is None:
                work = self.dist.all_reduce(self.tensors[b], group=self.gloo_group, async_op=True)
                waits.append((b, work.get_future().then(lambda _: time.monotonic())))
            else:
                fut = engine.submit(
                    step_id,
                    b,
                    self.grads[b],
                    layer_position=float(pos),
                    out=self.bufs[b],
                    pinned=cfg.priority and b == protected,
                )
                # Time-stamped on the engine's thread as it completes; a Future wakes its waiters
                # before it runs callbacks, so the waiter below also waits for this stamp.
                stamped = threading.Event()
                fut.add_done_callback(partial(_stamp, done, b, stamped))
                waits.append((b, fut))
                events[b] = stamped
        # gloo's TCP reports no per-path bytes (it uses path 0 only); an engine, its paths'.
        n_paths = 0 if engine is None else engine.config.n_paths
        delivered, per_path, retx, degraded = 1.0, [0] * n_paths, 0, 0
        formats, lossy, elems, err2, norm2, level = [0, 0, 0], 0, 0, 0.0, 0.0, 0.0
        for b, w in waits:
            if engine is None:
                done[b] = float(w.wait())
                continue
            _, report = w.result(self.timeout)
            events[b].wait(self.timeout)
            delivered = min(delivered, report.delivered_fraction)
            degraded += int(report.degraded)
            retx += sum(report.sender.retransmitted)
            for p, nbytes in enumerate(report.sender.per_path_bytes):
                per_path[p] += int(nbytes)
            snd = report.sender
            formats = [a + int(b) for a, b in zip(formats, snd.format_bytes, strict=True)]
            lossy, elems = lossy + snd.lossy_elems, elems + snd.elems
            err2, norm2 = err2 + snd.err2, norm2 + snd.norm2
            level = max(level, report.precision_level)
        first = min(submitted.values())
        return {
            "t0": t0,
            "wall_s": time.monotonic() - t0,
            "cpu_s": time.process_time() - cpu0,
            # The whole machine's busy cores over the step (rank 0 only: /proc/stat is global).
            "host_cores": None if host0 is None else cores_busy(host0, cpu_jiffies()),
            "comm_s": max(done.values()) - first,
            "bucket_done_s": {str(b): done[b] - t0 for b in done},
            "bucket_lat_s": {str(b): done[b] - submitted[b] for b in done},
            "protected_s": done[protected] - submitted[protected],
            "delivered": delivered,
            "degraded": degraded,
            "retransmitted": retx,
            "path_bytes": per_path,
            "bytes": sum(n * 4 for _, n, _, _ in plan.buckets),
            # The wire precision: payload bytes started per format (float32, bfloat16, E4M3),
            # the share of elements sent in fewer bits, the rounding's error energy.
            "format_bytes": formats,
            "lossy_elems": lossy,
            "elems": elems,
            "err2": err2,
            "norm2": norm2,
            "precision_level": level,
        }

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def main() -> int:
    """Read the job from stdin, replay it, report on stdout; errors as one ``error`` line."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("gradlane.transport.drivers.udp.sockets").setLevel(
        logging.ERROR
    )  # capped buffers: known, noisy
    rank = None
    try:
        job = json.loads(sys.stdin.readline())
        rank = job.get("rank")
        r = _Rank(job)
        try:
            r.run()
        finally:
            r.close()
    except BaseException as e:  # reported to the parent, which stops every rank
        say(type="error", rank=rank, message=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
