"""What ``gradlane demo`` shows: the side-by-side table (with time-to-accuracy) and the figure.

:func:`table` prints one column per run (the baseline first, gradlane last);
:func:`plot` draws held-out accuracy against training time for every run, with the target
accuracy and each run's time-to-accuracy marked, beside the step-time CDFs (matplotlib, only
when it is installed: the figure is an extra, the table and the JSON are the results).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
from gradlane.integrations.cli.command import emit

__all__ = ["LABELS", "plot", "table"]

#: Column titles of the runs.
LABELS = {
    "gloo": "gloo (default)",
    "gloo_path0": "gloo, path 0",
    "gradlane": "gradlane",
    "gradlane_adaptive": "gradlane adaptive",
    "gradlane_bf16": "gradlane bf16",
    "gradlane_e4m3": "gradlane e4m3",
}


def _fmt_s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.1f}"


def table(out: dict[str, Any]) -> None:
    """Print the comparison: one column per run."""
    runs = out["runs"]
    names = list(runs)
    opts = out["options"]
    cols = [LABELS.get(n, n) if n != "gradlane" else f"gradlane {opts['transport']}" for n in names]
    # Each column as wide as its longest cell, two spaces at least between columns.
    width = max(16, *(len(c) + 2 for c in cols))
    line = "{:<32}" + f"{{:>{width}}}" * len(names)

    def row(label: str, cells: list[str]) -> None:
        emit(line.format(label, *cells))

    emit("")
    row("", cols)
    row("final test accuracy (%)", [f"{runs[n]['accuracy_mean']:.2f}" for n in names])
    s = out["summary"]
    row(f"time to {s['accuracy_target']:.1f}% (s)", [_fmt_s(runs[n]["tta_s"]) for n in names])
    row("training time (s)", [f"{runs[n]['train_s']:.1f}" for n in names])
    for label, key in (
        ("step time p50 (ms)", "step_p50_s"),
        ("step time p99 (ms)", "step_p99_s"),
        ("comm time p50 (ms)", "comm_p50_s"),
        ("comm time p99 (ms)", "comm_p99_s"),
    ):
        row(label, [f"{runs[n][key] * 1e3:.2f}" for n in names])
    ours = [n.startswith("gradlane") for n in names]

    def cells(fmt: Any, other: str) -> list[str]:
        return [fmt(runs[n]) if mine else other for n, mine in zip(names, ours, strict=True)]

    row(
        "delivered fraction (mean/min)",
        cells(lambda r: f"{r['delivered_fraction_mean']:.4f}/{r['delivered_fraction_min']:.3f}",
              "1 (TCP)"),
    )  # fmt: skip
    row("retransmitted chunks", cells(lambda r: str(r["retransmitted"]), "n/a"))
    row("degraded buckets", cells(lambda r: str(r["degraded_buckets"]), "-"))
    row("datagrams dropped on purpose", cells(lambda r: str(r["injected_drops"]), "-"))
    if any("wire_bytes_per_step" in runs[n] for n in names):
        row("payload sent / step (MB)", cells(
            lambda r: f"{r['wire_bytes_per_step'] / 1e6:.2f}" if r.get("wire_bytes_per_step")
            else "-", "-"))  # fmt: skip
        row("compressed share / error", cells(
            lambda r: f"{r['compressed_share_mean']:.2f} / {r['rel_error_mean']:.3f}"
            if "compressed_share_mean" in r else "-", "-"))  # fmt: skip
    w = opts["warmup_steps"]
    emit("")
    emit("accuracy: mean over the ranks, on the 360 held-out images, every "
         f"{opts['eval_every']} steps (not timed)")  # fmt: skip
    emit(
        f"time to accuracy: training time (the steps' times, summed) until the held-out accuracy "
        f"first reaches {s['accuracy_target']:.1f}%"
    )
    emit(
        f"times: per step the slowest rank, steps {w + 1}..{opts['steps']} (the first {w} "
        "rebuild DDP's buckets);"
    )
    emit("       comm: from the first bucket ready to the last bucket reduced")
    emit(f"retransmissions and drops: all ranks together; {out['wall_s']:.0f} s wall")
    busy = s.get("gloo_cross_route_busy")
    if busy is not None:
        # gloo's own traffic on top of the cross traffic's share; tools/benchmarks_md.py agrees
        lucky = busy <= s.get("cross_share", 0.0) + 0.05
        verdict = (
            "the hash kept gloo's connections off the congested links, so gloo ran as on a free "
            "network (gloo on path 0 is the congested case)"
            if lucky
            else "gloo's ring shared a congested link"
        )
        emit(
            f"gloo over ECMP: the cross traffic's busiest link was {busy:.0%} busy during gloo's "
            f"run ({s.get('cross_share', 0.0):.0%} is the cross traffic alone): {verdict}"
        )
    ratio = s.get("tta_ratio_vs_gloo")
    if ratio is not None:
        emit(
            f"gradlane reaches {s['accuracy_target']:.1f}% in {ratio:.2f}x gloo's time; "
            f"step p99 {s['step_p99_ratio_vs_gloo']:.2f}x gloo's"
        )
    for key in [
        k for k in s if k.startswith("tta_ratio_vs_gloo_") and k != "tta_ratio_vs_gloo_path0"
    ]:
        p = key[len("tta_ratio_vs_gloo_") :]
        wire = s.get(f"wire_bytes_ratio_{p}_vs_f32")
        if s[key] is not None and wire is not None:
            emit(
                f"gradlane with {p} wire precision: {s[key]:.2f}x gloo's time to accuracy, "
                f"{wire:.2f}x the bytes of float32 gradlane, accuracy "
                f"{s[f'accuracy_gradlane_{p}']:.2f}%"
            )
    ratio0 = s.get("tta_ratio_vs_gloo_path0")
    if ratio0 is not None and s.get("step_p99_ratio_vs_gloo_path0") is not None:
        # The baseline that does not depend on the hash: every connection on the congested spine.
        emit(
            f"against gloo on path 0: {ratio0:.2f}x its time to accuracy; step p99 "
            f"{s['step_p99_ratio_vs_gloo_path0']:.2f}x"
        )


def plot(out: dict[str, Any], path: str | Path) -> bool:
    """Accuracy against training time for every run (target and time-to-accuracy marked) and
    the step-time CDFs, as a PNG at ``path``; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = out["runs"]
    target = out["summary"]["accuracy_target"]
    # A run with a lossy wire precision adds a panel: its controller over the steps.
    traced = [(n, r["precision_trace"]) for n, r in runs.items() if "precision_trace" in r
              and any(r["precision_trace"]["compressed_share"])]  # fmt: skip
    fig, axes = plt.subplots(1, 3 if traced else 2, figsize=(16 if traced else 11, 4.2))
    ax1, ax2 = axes[0], axes[1]
    if traced:
        _precision_panel(axes[2], *traced[0])
    for name, r in runs.items():
        curve = np.asarray(r["tta_curve"], dtype=float)
        (line,) = ax1.plot(curve[:, 0], curve[:, 1], marker=".", label=LABELS.get(name, name))
        if r["tta_s"] is not None:
            ax1.axvline(r["tta_s"], color=line.get_color(), linestyle=":", linewidth=1)
        steps = np.sort(np.asarray(r["step_s"], dtype=float)) * 1e3
        ax2.plot(steps, np.arange(1, steps.size + 1) / steps.size, label=LABELS.get(name, name))
    ax1.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.1f}%")
    ax1.set_xlabel("training time (s)")
    ax1.set_ylabel("held-out accuracy (%)")
    ax1.set_title("time to accuracy")
    ax1.legend(loc="lower right")
    ax2.set_xscale("log")
    ax2.set_xlabel("step time (ms, slowest rank)")
    ax2.set_ylabel("fraction of steps")
    ax2.set_title("step-time CDF")
    ax2.legend(loc="lower right")
    where = out.get("network", "loopback")
    width = 190 if traced else 130  # characters per line of the figure's width
    fig.suptitle(textwrap.fill(f"gradlane demo: {where}", width), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _precision_panel(ax: Any, name: str, trace: dict[str, list[float]]) -> None:
    """Rank 0's wire precision per step: the adaptive level (0-2), the share of elements sent
    in fewer bits and the relative error of what it sent (right axis)."""
    steps = trace["step"]
    ax.plot(steps, trace["level"], label="level (0: float32, 1: bf16, 2: E4M3)")
    ax.plot(steps, trace["compressed_share"], label="compressed share")
    ax.set_xlabel("step")
    ax.set_ylim(0, 2.1)
    ax.set_title(f"{LABELS.get(name, name)}: the controller, rank 0")
    err = ax.twinx()
    err.plot(steps, trace["rel_error"], color="tab:red", linestyle="--", label="relative error")
    err.set_ylabel("relative error")
    err.set_ylim(0, max(0.05, 1.2 * max(trace["rel_error"], default=0.0)))
    lines = ax.get_lines() + err.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="center right", fontsize=8)
