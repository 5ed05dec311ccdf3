"""``gradlane demo``: the main job, side by side.

Default (``--network auto``): the testbed where this machine can build it (root, or
unprivileged user namespaces), else loopback, saying why and how to get the testbed.

``--network testbed``: real DDP training across an emulated congested leaf-spine
(:mod:`gradlane.bench.demo.testbed`): one rank per testbed host, each inside its host's network
namespace, 200 Mbit/s links, UDP cross traffic at ``--congest`` of a link from host 0 to host 1
through spine 0 (``--cross-route spine``: on every link of spine 0), a
model with 4.5 MB of gradients (the network, not the CPU, sets the step time). Three runs from
the same initialisation on the same batches: gloo over the hosts' ECMP addresses (the baseline,
hashed over both spines as on a real fabric), gloo on path 0 (through the congested spine), and
gradlane over both paths; no injected loss. Held-out accuracy every few steps gives each run's
time to accuracy.

``--network loopback``: real DDP training. ``--ranks`` processes on this machine train
a model on scikit-learn's digits twice — with DDP's default gloo all-reduce hook, then with the
gradlane hook over UDP (a loss bound, and ``--inject-loss`` of the received datagrams dropped at
random with a fixed seed, since loopback never loses) — and print a table: test accuracy, step
and communication time percentiles, delivered fraction, retransmissions
(:mod:`gradlane.bench.demo.training` does the work).

``--network sim``: the all-reduce part of training on the simulated 8-rank leaf-spine (the real
protocol cores, a simulated clock) with cross traffic on one spine link: the TCP-like baseline
(no priorities, fully reliable, one hashed path per rank pair) against gradlane (priorities by
layer and magnitude, a 2% loss bound, per-packet multipath).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gradlane.bench.host import HostWatch
from gradlane.integrations.cli.command import Command, RunProgress, emit

__all__ = ["COMMAND", "add_arguments", "run"]

#: What the demo trains, in words.
_MODEL_TEXT = {
    "mlp": "an MLP (64-256-256-10, 85,002 parameters)",
    "cnn": "a CNN (2 conv + 2 linear layers, 38,282 parameters)",
    "wide": "a wide MLP (64-1024-1024-10, 1,126,410 parameters: 4.5 MB of gradients)",
}
#: Defaults that differ between the networks.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "loopback": {"ranks": 4, "steps": 200, "loss_bound": 0.05, "congest": 0.8, "model": "mlp"},
    "sim": {"ranks": 8, "steps": 8, "loss_bound": 0.02, "congest": 0.8, "model": "mlp"},
    "testbed": {"ranks": 4, "steps": 60, "loss_bound": 0.02, "congest": 0.7, "model": "wide"},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``gradlane demo``."""
    p.add_argument(
        "--network",
        choices=("auto", "testbed", "loopback", "sim"),
        default="auto",
        help="testbed: real DDP training across an emulated congested leaf-spine (root or "
        "user namespaces); loopback: the same in processes on this machine; sim: the "
        "all-reduce on the simulated leaf-spine; auto (default): testbed where possible",
    )
    p.add_argument("--ranks", type=int, help="ranks (default 4; sim: 8; testbed: hosts, 4)")
    p.add_argument("--steps", type=int, help="training steps (default 200; sim: 8; testbed: 60)")
    p.add_argument(
        "--model",
        choices=("mlp", "cnn", "wide"),
        help="the digits model (default mlp; testbed: wide, 4.5 MB of gradients)",
    )
    p.add_argument(
        "--loss-bound",
        type=float,
        help="gradlane's loss bound (default 0.05; sim, testbed: 0.02)",
    )
    p.add_argument(
        "--inject-loss",
        type=float,
        default=0.05,
        help="fraction of the datagrams each rank receives that gradlane drops at random, "
        "seeded (default 0.05; udp only)",
    )
    p.add_argument(
        "--transport",
        choices=("udp", "zmq"),
        default="udp",
        help="gradlane's data plane: udp (bounded loss) or zmq (reliable, TCP)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="accuracy against training time and step-time CDFs as a PNG (default: beside "
        "--json, same name; needs matplotlib)",
    )
    p.add_argument(
        "--timeline",
        metavar="PATH",
        help="write the gradlane run's timeline (every rank's buckets and their phases) as "
        "Chrome trace-event JSON for https://ui.perfetto.dev",
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        help="the accuracy (%%) time-to-accuracy is measured at (default: 1 point under "
        "gloo's final accuracy)",
    )
    sim = p.add_argument_group("--network sim and testbed")
    sim.add_argument(
        "--congest",
        type=float,
        help="cross traffic on one spine link, fraction of its rate (default 0.8; testbed 0.7)",
    )
    sim.add_argument(
        "--cross-route",
        choices=("pair", "spine"),  # gradlane.bench.testbed.crosstraffic.ROUTES (kept lazy)
        default="pair",
        help="testbed: where the cross traffic runs: from host 0 to host 1 through spine 0 "
        "(pair, the default) or on every link of spine 0 (spine: a ring of flows, which any "
        "gloo connection hashed onto spine 0 meets)",
    )
    sim.add_argument(
        "--link-mbit", type=float, default=200.0, help="testbed link rate (default 200)"
    )
    sim.add_argument("--bursty", action="store_true", help="on/off bursts of cross traffic")
    sim.add_argument(
        "--precision",
        default="adaptive",
        help="testbed: a fourth run, gradlane with this wire-precision policy (adaptive, bf16, "
        "e4m3; default adaptive); 'none' leaves it out",
    )
    sim.add_argument(
        "--no-error-feedback",
        action="store_true",
        help="testbed: that run without error feedback (to see what accuracy it costs)",
    )


def _resolve(args: argparse.Namespace) -> None:
    if args.network == "auto":
        args.network = _auto_network(args.transport)
    for name, value in _DEFAULTS[args.network].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _auto_network(transport: str) -> str:
    """The testbed where this machine can build one, else loopback (saying why and how)."""
    from gradlane.bench.testbed.netns import privilege
    from gradlane.transport.errors import GradlaneError

    if transport != "udp":
        emit(
            f"gradlane demo: running on loopback: the emulated network's run is gradlane's "
            f"multipath UDP plane, and --transport {transport} was asked"
        )
        return "loopback"
    try:
        privilege()
    except GradlaneError as e:
        emit(
            f"gradlane demo: running on loopback: the emulated network needs root or "
            f"unprivileged user namespaces ({e}); run as root for the testbed, or pass "
            "--network loopback to skip this check"
        )
        return "loopback"
    return "testbed"


def run(args: argparse.Namespace) -> int:
    """Run the comparison the options ask for and print it."""
    _resolve(args)
    if args.network == "sim":
        return _run_sim(args)
    if args.network == "testbed":
        return _run_testbed(args)
    return _run_ddp(args)


def _run_ddp(args: argparse.Namespace) -> int:
    from gradlane.bench.demo.training import DemoError, DemoOptions, run_demo

    inject = args.inject_loss if args.transport == "udp" else 0.0
    bound = args.loss_bound if args.transport == "udp" else 0.0
    opts = DemoOptions(
        ranks=args.ranks,
        steps=args.steps,
        model=args.model,
        loss_bound=bound,
        inject_loss=inject,
        transport=args.transport,
        seed=args.seed,
        target_accuracy=args.target_accuracy,
        timeline=_timeline_path(args),
    )
    if not 0.0 <= inject < 1.0 or not 0.0 <= bound <= 0.5 or opts.ranks < 2:
        emit("gradlane demo: needs --ranks >= 2, --inject-loss in [0, 1), --loss-bound in [0, 0.5]")
        return 2
    emit(
        f"gradlane demo: {opts.ranks} ranks train {_MODEL_TEXT[opts.model]} with DDP over loopback"
    )
    emit(
        f"on scikit-learn's digits (1437 train / 360 test images), {opts.steps} steps of "
        f"{opts.ranks}x{opts.batch} images, twice:"
    )
    emit("  gloo      DDP's default all-reduce hook (gloo, TCP, lossless loopback)")
    if opts.transport == "udp":
        emit(
            f"  gradlane  gradlane hook over UDP, 2 paths, loss bound {bound:g}; "
            f"{inject:.0%} of received datagrams dropped at random (seed {opts.seed})"
        )
    else:
        emit("  gradlane  gradlane hook over ZeroMQ (TCP), reliable")
    if args.transport == "zmq" and args.inject_loss:
        emit("  (--inject-loss and --loss-bound apply to udp only: ZeroMQ is reliable)")

    host = HostWatch()
    try:
        with RunProgress() as bars:
            out = run_demo(opts, _on_progress(bars))
    except (DemoError, ValueError) as e:
        emit(f"gradlane demo failed: {e}", err=True)
        return 1
    out["host"] = host.record()
    return _report(out, args)


def _timeline_path(args: argparse.Namespace) -> str:
    """``--timeline`` as an absolute path (the ranks may run elsewhere), or ''."""
    return str(Path(args.timeline).resolve()) if args.timeline else ""


def _report(out: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the side-by-side table, write ``--json``, the figure and the merged timeline; the
    exit code of a finished run."""
    from gradlane.bench.demo.report import plot, table
    from gradlane.bench.demo.training import merge_rank_timelines
    from gradlane.transport.errors import GradlaneError

    out["summary"] = {"network": args.network, "link_mbit": out.get("link_mbit"), **out["summary"]}
    out["command"] = " ".join(["gradlane", *getattr(args, "argv", ["demo"])])
    table(out)
    png = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        if plot(out, png):
            emit(f"figure: {png}")
        else:
            emit("figure: not drawn (matplotlib is not installed)")
    if args.timeline:
        try:
            merge_rank_timelines(_timeline_path(args), out["options"]["ranks"])
            emit(f"timeline: {args.timeline} (open in https://ui.perfetto.dev)")
        except (GradlaneError, OSError) as e:
            emit(f"timeline: not written ({e})", err=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=float)
    return 0


def _on_progress(bars: RunProgress) -> Callable[[str, int, int], None]:
    """The demo's progress callback: one bar per run. Step 0 is a run whose ranks are starting
    its data plane, which compiles gradlane's kernels on a first run (numba caches them on disk
    for the runs after it), so the bar says so until the first step."""

    def on_progress(run_name: str, step: int, steps: int) -> None:
        note = "compiling kernels, first run only" if step == 0 else ""
        bars.update(run_name, step, steps, note)

    return on_progress


def _run_testbed(args: argparse.Namespace) -> int:
    from gradlane.bench.demo.testbed import TestbedDemo, run_testbed_demo
    from gradlane.bench.demo.training import DemoError, DemoOptions
    from gradlane.bench.replay.rank_pipes import RankError
    from gradlane.bench.testbed.crosstraffic import cross_where
    from gradlane.scheduling.precision import precision_policy_names
    from gradlane.transport.errors import GradlaneError

    if args.transport != "udp" or not 0.0 <= args.loss_bound <= 0.5 or args.ranks < 2:
        emit("gradlane demo --network testbed: needs --transport udp, --ranks >= 2 (hosts), "
             "--loss-bound in [0, 0.5]", err=True)  # fmt: skip
        return 2
    opts = DemoOptions(
        ranks=args.ranks,
        steps=args.steps,
        model=args.model,
        loss_bound=args.loss_bound,
        inject_loss=0.0,
        seed=args.seed,
        chunk_bytes=8192,
        target_accuracy=args.target_accuracy,
        timeline=_timeline_path(args),
        precision="" if args.precision == "none" else args.precision,
        error_feedback=not args.no_error_feedback,
    )
    if opts.precision and opts.precision not in precision_policy_names():
        emit(f"gradlane demo: --precision {opts.precision!r}: one of "
             f"{', '.join(precision_policy_names())} or none", err=True)  # fmt: skip
        return 2
    tb = TestbedDemo(
        hosts=args.ranks, link_mbit=args.link_mbit, cross=args.congest, route=args.cross_route
    )
    emit(
        f"gradlane demo: {tb.hosts} hosts of an emulated leaf-spine (network namespaces, 2 "
        f"spines, {tb.link_mbit:g} Mbit/s links), UDP cross traffic at {tb.cross:.0%} of a "
        f"link {cross_where(tb.route)};"
    )
    emit(
        f"one rank per host trains {_MODEL_TEXT[opts.model]} with DDP on scikit-learn's "
        f"digits, {opts.steps} steps of {opts.ranks}x{opts.batch} images, "
        f"{'four' if opts.precision else 'three'} times:"
    )
    emit("  gloo        DDP's default all-reduce hook (gloo, TCP over the hosts' ECMP addresses,")
    emit("              each connection hashed onto a spine)")
    emit("  gloo_path0  the same on path 0 (every connection through the congested spine)")
    emit(f"  gradlane    gradlane hook over UDP, both paths, loss bound {opts.loss_bound:g}")
    if opts.precision:
        fb = "" if opts.error_feedback else ", no error feedback"
        emit(f"  gradlane_{opts.precision:<4s} the same, wire precision {opts.precision}{fb}")
    host = HostWatch()
    try:
        with RunProgress() as bars:
            out = run_testbed_demo(opts, tb, _on_progress(bars))
    except (DemoError, RankError, ValueError) as e:
        emit(f"gradlane demo failed: {e}", err=True)
        return 1
    except GradlaneError as e:  # TestbedUnavailable: not root (it says so), a testbed error
        emit(f"gradlane demo --network testbed: {e}", err=True)
        return 2
    out["host"] = host.record()
    return _report(out, args)


def _run_sim(args: argparse.Namespace) -> int:
    from gradlane.bench.sim.scenarios import CONFIGS, NetSpec, Workload, run_config

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
    with RunProgress(label_width=20) as bars:
        for cfg in (base_cfg, full_cfg):
            rows.append(
                run_config(
                    cfg, net, work, args.steps, args.seed, chunk_bytes=2048, on_progress=bars.update
                )
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


#: ``gradlane demo``, registered in the ``gradlane.commands`` entry-point group (this module is
#: light: the training code is imported by ``run``).
COMMAND = Command(
    help="the main job: DDP training on this machine, gloo's default hook vs gradlane's, "
    "side by side (--network sim: the simulated leaf-spine)",
    add_arguments=add_arguments,
    run=run,
)
