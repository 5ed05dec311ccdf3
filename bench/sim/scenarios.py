"""All-reduce scenarios on the simulated network: ``python -m gradlane.bench.sim.simulator``,
``gradlane netsim``.

The real sans-I/O cores (:class:`gradlane.transport.core.collective.TransposeAllReduce`) run N ranks
on a simulated leaf-spine with one congested spine link. Each step, every rank submits the
workload's buckets in backward order (bucket 0 = the last layers, ready first) ``gap`` apart; the
step ends when every rank has every bucket, and the next starts after a forward-pass gap. The same
seeded
workload and cross traffic run under each configuration, in the same process:

==================  =========================================================================
config              what changes
==================  =========================================================================
flat-reliable       the TCP-like baseline: no priorities (DSCP 0), loss bound 0, one hashed
                    path per rank pair (ECMP)
layer               P3/ByteScheduler-style priority by layer position (DSCP marked)
layer+magnitude     priority by layer and chunk magnitude (protected / droppable classes)
+bounded            the above with loss_bound 0.02 (droppable chunks may be given up)
+multipath (full)   the above sprayed over every spine by path health: full gradlane
==================  =========================================================================

Output: a table on stdout and JSON with a ``"summary"`` (p99 ratio of full gradlane to the
baseline, minimum delivered fraction, simulator events per second, ranks simulated).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from gradlane.bench.sim.simulator import GBPS, Network, Simulation, leafspine, measure_event_rate
from gradlane.integrations.cli.command import RunProgress, emit
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.pacing import PacingConfig
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import AllReduceComplete, AllReduceFailed

__all__ = ["CONFIGS", "Workload", "add_arguments", "main", "run", "run_config"]


@dataclass(frozen=True)
class Workload:
    """Buckets (float32 elements, bucket 0 first) and timing of one training step."""

    bucket_elems: tuple[int, ...] = (524_288, 393_216, 262_144, 262_144)
    ready_gap_s: float = 0.0005
    forward_gap_s: float = 0.002

    @property
    def n_buckets(self) -> int:
        """Buckets per step."""
        return len(self.bucket_elems)

    def layer_position(self, bucket: int) -> float:
        """0 for the front layer (the highest bucket index), 1 for the last layer (bucket 0)."""
        n = self.n_buckets
        return 1.0 if n == 1 else (n - 1 - bucket) / (n - 1)


@dataclass(frozen=True)
class NetSpec:
    """The simulated network: a leaf-spine with an optional congested spine link."""

    ranks: int = 8
    spines: int = 2
    hosts_per_leaf: int = 4
    host_gbps: float = 10.0
    congest: float = 0.8
    """Cross traffic on leaf0→spine0 and spine0→leaf1, as a fraction of the link (0 = none)."""
    bursty: bool = False
    """Cross traffic in random on/off bursts (mean on = off = ``burst_s``) rather than steady."""
    burst_s: float = 0.004
    priority: bool = True
    """Switches serve DSCP classes in strict priority (False: one FIFO per port)."""

    def build(self) -> Network:
        """Build the network, cross traffic included."""
        hpl = min(self.hosts_per_leaf, self.ranks)
        net = leafspine(
            self.ranks,
            n_spines=self.spines,
            hosts_per_leaf=hpl,
            host_rate=self.host_gbps * GBPS,
            delay=2e-6,
            queue_bytes=256 * 1024,
            priority=self.priority,
        )
        n_leaves = math.ceil(self.ranks / hpl)
        if self.congest > 0 and n_leaves > 1:
            for link in ("leaf0>spine0", "spine0>leaf1"):
                if self.bursty:
                    on = off = self.burst_s
                    net.add_cross_traffic(self.congest, link=link, on_s=on, off_s=off)
                else:
                    net.add_cross_traffic(self.congest, link=link)
        return net


@dataclass(frozen=True)
class Config:
    """One row of the comparison."""

    name: str
    policy: str
    loss_bound: float
    multipath: bool
    marked: bool = True
    """Packets carry their class's DSCP; False = everything DSCP 0 (best effort)."""


CONFIGS = (
    Config("flat-reliable", "flat", 0.0, multipath=False, marked=False),
    Config("layer", "layer", 0.0, multipath=False),
    Config("layer+magnitude", "layer+magnitude", 0.0, multipath=False),
    Config("+bounded", "layer+magnitude", 0.02, multipath=False),
    Config("+multipath (full)", "layer+magnitude", 0.02, multipath=True),
)


def transport_config(cfg: Config, net: NetSpec, chunk_bytes: int) -> TransportConfig:
    """The TransportConfig of one comparison row."""
    dscp = (46, 34, 26, 8) if cfg.marked else (0, 0, 0, 0)
    host_rate = net.host_gbps * GBPS
    return TransportConfig(
        chunk_bytes=chunk_bytes,
        n_paths=net.spines,
        nic_rate_Bps=host_rate,
        rx_coalesce_s=20e-6,
        multipath=cfg.multipath,
        priority=PriorityConfig(policy=cfg.policy, dscp=dscp),
        loss=LossConfig(
            loss_bound=cfg.loss_bound,
            soft_deadline_min_s=0.001,
            soft_deadline_max_s=0.2,
            hard_deadline_s=2.0,
            on_hard_deadline="degrade",  # a training job prefers progress; losses are reported
        ),
        # Start each (peer, path) at an even share of the NIC so N-1 senders do not incast
        # one receiver; the controller probes up from there.
        pacing=PacingConfig(
            initial_rate_Bps=host_rate / max(net.ranks - 1, 1) / net.spines,
            max_rate_Bps=host_rate,
            increase_Bps_per_s=host_rate * 20,
            # Simulated clocks are exact: a datacenter-grade delay signal.
            delay_floor_s=100e-6,
        ),
    )


@dataclass
class _StepLog:
    started: float = 0.0
    done: int = 0
    ended: float = 0.0
    delivered: list[float] = field(default_factory=list)
    bucket_done: dict[int, float] = field(default_factory=dict)


def run_config(
    cfg: Config,
    net: NetSpec,
    work: Workload,
    steps: int,
    seed: int,
    chunk_bytes: int = 8192,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Run ``steps`` steps of the workload under one configuration; per-step times and stats.

    ``on_progress(config, step, steps)`` hears of every finished step."""
    network = net.build()
    tcfg = transport_config(cfg, net, chunk_bytes)
    eps = [TransposeAllReduce(r, net.ranks, replace(tcfg, seed=seed + r)) for r in range(net.ranks)]
    rng = np.random.default_rng(seed)
    # Gradients with uneven magnitudes (chunks differ in scale, as real gradients do) that are
    # correlated across ranks: the same model's gradient on different data = signal + noise.
    grads: list[list[np.ndarray]] = [[] for _ in range(net.ranks)]
    for n in work.bucket_elems:
        scale = np.repeat(rng.lognormal(0.0, 1.5, size=-(-n // 512)), 512)[:n]
        signal = rng.standard_normal(n)
        for r in range(net.ranks):
            grads[r].append(((signal + 0.5 * rng.standard_normal(n)) * scale).astype(np.float32))
    exact = [np.sum([grads[r][b] for r in range(net.ranks)], axis=0) for b in range(work.n_buckets)]
    logs: list[_StepLog] = []
    errors: list[float] = []
    failures: list[str] = []
    n_expect = net.ranks * work.n_buckets

    def start_step(step: int, t0: float) -> None:
        logs.append(_StepLog(started=t0))
        for b in range(work.n_buckets):
            at = t0 + b * work.ready_gap_s
            for r in range(net.ranks):
                sim.call_at(at, _submit(r, step, b), host=r)

    def _submit(r: int, step: int, b: int) -> Callable[[float], None]:
        def fn(now: float) -> None:
            eps[r].start(step, b, grads[r][b], work.layer_position(b), now)

        return fn

    def on_event(host: int, ev: object, now: float) -> None:
        if isinstance(ev, AllReduceFailed):
            failures.append(str(ev.error))
            return
        if not isinstance(ev, AllReduceComplete):
            return
        log = logs[ev.step]
        log.done += 1
        log.delivered.append(ev.report.delivered_fraction)
        log.bucket_done[ev.bucket] = max(log.bucket_done.get(ev.bucket, 0.0), now)
        if host == 0:
            err = float(np.linalg.norm(ev.result - exact[ev.bucket]))
            errors.append(err / max(float(np.linalg.norm(exact[ev.bucket])), 1e-30))
        if log.done == n_expect:
            log.ended = now
            if on_progress is not None:
                on_progress(cfg.name, ev.step + 1, steps)
            if ev.step + 1 < steps:
                start_step(ev.step + 1, now + work.forward_gap_s)

    sim = Simulation(network, eps, seed=seed, on_event=on_event)
    wall = time.perf_counter()
    start_step(0, 0.0)
    sim.run(
        stop=lambda: (len(logs) == steps and logs[-1].done == n_expect) or bool(failures),
        until=steps * 5.0,
    )
    wall = time.perf_counter() - wall
    if failures:
        raise RuntimeError(f"{cfg.name}: {failures[0]}")
    times = np.array([lg.ended - lg.started for lg in logs if lg.done == n_expect])
    stats = sim.stats()
    front = [lg.bucket_done[work.n_buckets - 1] - lg.started for lg in logs]
    back = [lg.bucket_done[0] - lg.started for lg in logs]
    return {
        "config": cfg.name,
        "steps": int(times.size),
        "step_s": {
            "p50": _pct(times, 50),
            "p99": _pct(times, 99),
            "max": float(times.max()),
            "mean": float(times.mean()),
        },
        "front_bucket_done_p50_s": _pct(np.array(front), 50),
        "back_bucket_done_p50_s": _pct(np.array(back), 50),
        "delivered_fraction_min": float(min(d for lg in logs for d in lg.delivered)),
        "delivered_fraction_mean": float(np.mean([d for lg in logs for d in lg.delivered])),
        "rel_error_max": float(max(errors)) if errors else 0.0,
        "wall_s": wall,
        "events": stats["events"],
        "paths_bytes": stats["paths"]["delivered_bytes"],
        "queue_drops": stats["packets"]["queue_drops"],
    }


def _commit() -> str | None:
    """The git commit the results were produced with (None outside a checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(__file__),
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if a.size else math.nan


def scale_run(ranks: int, seed: int) -> dict[str, Any]:
    """One step of a small bucket over ``ranks`` simulated ranks: does it scale, how fast."""
    net = NetSpec(ranks=ranks, spines=2, hosts_per_leaf=16, congest=0.0, host_gbps=100.0)
    work = Workload(bucket_elems=(ranks * 256,), ready_gap_s=0.0, forward_gap_s=0.0)
    cfg = Config("scale", "layer+magnitude", 0.0, multipath=True)
    res = run_config(cfg, net, work, steps=1, seed=seed, chunk_bytes=1024)
    return {
        "ranks": ranks,
        "wall_s_per_step": res["wall_s"],
        "events": res["events"],
        "sim_step_s": res["step_s"]["p50"],
        "delivered_fraction_min": res["delivered_fraction_min"],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line options (shared by ``gradlane netsim`` and ``python -m
    gradlane.bench.sim.simulator``)."""
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--topology", choices=["leafspine"], default="leafspine")
    p.add_argument("--spines", type=int, default=2)
    p.add_argument(
        "--congest",
        type=float,
        default=0.8,
        help="cross traffic on one spine link, fraction of its rate (default 0.8)",
    )
    p.add_argument(
        "--bursty",
        action="store_true",
        help="cross traffic in random on/off bursts (mean 4 ms each) instead of steady",
    )
    p.add_argument("--fifo", action="store_true", help="priority-unaware switches")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=2048,
        help="payload per packet (small enough that a 2%% loss budget spans chunks)",
    )
    p.add_argument("--configs", default="all", help="comma-separated config names, or 'all'")
    p.add_argument(
        "--scale-ranks",
        type=int,
        default=256,
        help="also simulate one step on this many ranks (0 = skip)",
    )
    p.add_argument("--quick", action="store_true", help="fewer steps, smaller scale run")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the comparison; print a table; write JSON."""
    commit = _commit()  # now: the code is loaded at start, HEAD may move while this runs
    steps = 8 if args.quick else args.steps
    net = NetSpec(
        ranks=args.ranks,
        spines=args.spines,
        congest=args.congest,
        bursty=args.bursty,
        priority=not args.fifo,
    )
    work = Workload()
    chosen = (
        CONFIGS
        if args.configs == "all"
        else tuple(c for c in CONFIGS if c.name in args.configs.split(","))
    )
    rows = []
    with RunProgress(label_width=20) as bars:
        for cfg in chosen:
            rows.append(run_config(cfg, net, work, steps, args.seed, args.chunk_bytes, bars.update))
    base = next((r for r in rows if r["config"] == "flat-reliable"), rows[0])
    full = next((r for r in rows if r["config"].startswith("+multipath")), rows[-1])
    _table(rows, base)
    scale = None
    if args.scale_ranks:
        scale = scale_run(64 if args.quick else args.scale_ranks, args.seed)
        emit(
            f"\nscale: {scale['ranks']} ranks, one step in {scale['wall_s_per_step']:.1f} s wall "
            f"({scale['events']['packet_per_s']:,.0f} packet events/s)"
        )
    events = [r["events"]["packet"] for r in rows]
    wall = [r["wall_s"] for r in rows]
    # The simulator's own capacity (endpoints that do no work), and the end-to-end rate with
    # the real protocol cores, whose per-packet Python work dominates.
    sim_rate = measure_event_rate()
    emit(
        f"simulator: {sim_rate:,.0f} packet events/s alone; "
        f"{sum(events) / sum(wall):,.0f} with the real cores"
    )
    summary = {
        "p99_ratio_full_vs_flat": full["step_s"]["p99"] / base["step_s"]["p99"],
        "mean_ratio_full_vs_flat": full["step_s"]["mean"] / base["step_s"]["mean"],
        "delivered_fraction_min": min(r["delivered_fraction_min"] for r in rows),
        "events_per_s": sim_rate,
        "events_per_s_with_cores": float(sum(events) / sum(wall)),
        "max_ranks_simulated": max(args.ranks, scale["ranks"] if scale else 0),
        "wall_s_per_step_at_max_ranks": scale["wall_s_per_step"] if scale else None,
    }
    emit("\nsummary: " + json.dumps(summary))
    if args.json:
        doc = {
            "summary": summary,
            "network": net.__dict__,
            "workload": work.__dict__,
            "steps": steps,
            "results": rows,
            "scale": scale,
            "command": " ".join(sys.argv),
            "commit": commit,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, default=float)
    return 0


def _table(rows: list[dict[str, Any]], base: dict[str, Any]) -> None:
    head = (
        f"{'config':<20}{'p50 ms':>9}{'p99 ms':>9}{'p99/base':>10}{'front ms':>10}"
        f"{'back ms':>9}{'delivered':>11}{'rel.err':>9}"
    )
    emit(head)
    emit("-" * len(head))
    for r in rows:
        s = r["step_s"]
        emit(
            f"{r['config']:<20}{s['p50'] * 1e3:>9.2f}{s['p99'] * 1e3:>9.2f}"
            f"{s['p99'] / base['step_s']['p99']:>10.2f}{r['front_bucket_done_p50_s'] * 1e3:>10.2f}"
            f"{r['back_bucket_done_p50_s'] * 1e3:>9.2f}{r['delivered_fraction_min']:>11.4f}"
            f"{r['rel_error_max']:>9.1e}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m gradlane.bench.sim.simulator``."""
    p = argparse.ArgumentParser(
        prog="python -m gradlane.bench.sim.simulator", description=__doc__.splitlines()[0]
    )
    add_arguments(p)
    return run(p.parse_args(argv))
