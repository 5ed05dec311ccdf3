"""``gradlane demo``: the main job, side by side — the TCP-like baseline against gradlane.

Until the DDP hook exists this runs the all-reduce part of training on the simulated 8-rank
leaf-spine (the real protocol cores, a simulated clock) with cross traffic on one spine
link: the same workload and the same cross traffic under the baseline (no priorities, fully
reliable, one hashed path per rank pair) and under gradlane (priorities by layer and magnitude,
a 2% loss bound, per-packet multipath). It prints per-step communication times, the delivered
fraction and the error of the reduced gradients against the exact sum.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from bench.netsim_scenarios import CONFIGS, NetSpec, Workload, run_config
from integrations.cli import emit

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``gradlane demo``."""
    p.add_argument("--ranks", type=int, default=8, help="simulated ranks (default 8)")
    p.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    p.add_argument(
        "--congest",
        type=float,
        default=0.8,
        help="cross traffic on one spine link, fraction of its rate (default 0.8)",
    )
    p.add_argument("--loss-bound", type=float, default=0.02, help="gradlane's loss bound")
    p.add_argument("--bursty", action="store_true", help="on/off bursts of cross traffic")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def run(args: argparse.Namespace) -> int:
    """Run both configurations and print the comparison."""
    net = NetSpec(ranks=args.ranks, congest=args.congest, bursty=args.bursty)
    work = Workload()
    base_cfg = CONFIGS[0]
    full_cfg = CONFIGS[-1]
    if args.loss_bound != full_cfg.loss_bound:
        full_cfg = replace(full_cfg, loss_bound=args.loss_bound)
    emit(
        f"gradlane demo: {args.ranks} ranks on a simulated leaf-spine (2 spines, 10 Gb/s hosts), "
        f"{args.congest:.0%} cross traffic on one spine link; {args.steps} steps of "
        f"{sum(work.bucket_elems) * 4 / 1e6:.1f} MB of gradients in {work.n_buckets} buckets"
    )
    t0 = time.perf_counter()
    rows = []
    for cfg in (base_cfg, full_cfg):
        rows.append(
            run_config(cfg, net, work, args.steps, args.seed, chunk_bytes=2048, progress=True)
        )
    base, full = rows
    emit("")
    emit(f"{'':<28}{'baseline (TCP-like)':>22}{'gradlane':>14}")
    line = "{:<28}{:>22}{:>14}"
    for label, key, fmt in (
        ("step comm time p50 (ms)", ("step_s", "p50"), "{:.2f}"),
        ("step comm time p99 (ms)", ("step_s", "p99"), "{:.2f}"),
        ("step comm time max (ms)", ("step_s", "max"), "{:.2f}"),
        ("front layers ready (ms)", ("front_bucket_done_p50_s",), "{:.2f}"),
    ):
        vals = []
        for r in rows:
            v = r[key[0]] if len(key) == 1 else r[key[0]][key[1]]
            vals.append(fmt.format(v * 1e3))
        emit(line.format(label, *vals))
    emit(
        line.format(
            "delivered fraction (min)",
            f"{base['delivered_fraction_min']:.4f}",
            f"{full['delivered_fraction_min']:.4f}",
        )
    )
    emit(
        line.format(
            "gradient rel. error (max)",
            f"{base['rel_error_max']:.1e}",
            f"{full['rel_error_max']:.1e}",
        )
    )
    ratio = full["step_s"]["p99"] / base["step_s"]["p99"]
    emit(
        f"\ngradlane p99 step communication time = {ratio:.2f}x the baseline's "
        f"({time.perf_counter() - t0:.0f} s wall)"
    )
    if args.json:
        summary = {
            "step_p99_baseline_s": base["step_s"]["p99"],
            "step_p99_gradlane_s": full["step_s"]["p99"],
            "p99_ratio": ratio,
            "delivered_fraction": full["delivered_fraction_min"],
        }
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "results": rows}, f, indent=2, default=float)
    return 0
