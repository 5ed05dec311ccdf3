"""The replay's report: statistics per configuration, a summary of headline ratios, PNG plots.

:func:`build` turns the merged per-step records of :func:`gradlane.bench.replay.run.run_replay` into
the JSON document (``"summary"`` first); :func:`write` saves it with three plots beside it:

* ``<out>_cdf.png`` — CDF of the per-step communication time (first bucket ready → last bucket
  done, the slowest rank) per configuration;
* ``<out>_paths.png`` — throughput per path over time for every gradlane configuration (bytes
  every rank sent on the path during a step, over the step's communication time);
* ``<out>_delivered.png`` — delivered fraction per step (the worst rank and bucket).

Summary keys (``null`` when the run lacks the configurations a key compares):

=============================  ===================================================================
``p99_ratio_vs_gloo``          p99 communication time, ``udp-bounded`` over ``gloo``
``mean_ratio_vs_gloo``         the same for the mean
``delivered_fraction_min``     the lowest delivered fraction of any gradlane step
``goodput_fraction_of_link``   ``udp-reliable`` goodput (all-reduce bus bandwidth: bytes each rank
                               must send, ``2 (N-1)/N`` of the bucket, over the communication time)
                               over the capacity of the paths it used (link rate × paths)
``two_paths_vs_one``           goodput with every path over goodput with path 0 only
``priority_protected_p99_gain`` p99 latency of the protected (front-layer) bucket, priority off
                               (``+flat``: one class, DSCP 0, start order) over on
=============================  ===================================================================

With gloo's steps split into draws (``--gloo-draws``: each over new connections, so on an ECMP
fabric each a new hash of its flows onto the spines) the ratios above pool every step, and
``p99_ratio_vs_gloo_per_draw`` lists the same ratio over each draw's steps (``udp-bounded`` over
``gloo``); each configuration's ``draws`` holds gloo's percentiles per draw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SUMMARY_KEYS", "build", "config_stats", "table", "write"]

SUMMARY_KEYS = (
    "p99_ratio_vs_gloo",
    "mean_ratio_vs_gloo",
    "delivered_fraction_min",
    "goodput_fraction_of_link",
    "two_paths_vs_one",
    "priority_protected_p99_gain",
)


def _precision(steps: list[dict[str, Any]]) -> dict[str, Any]:
    if not all(s.get("format_bytes") for s in steps):
        return {}
    fb: list[list[int]] = [s["format_bytes"] for s in steps]
    if not any(sum(f) for f in fb):  # gloo: no gradlane engine, nothing counted
        return {}
    elems = sum(s.get("elems", 0) for s in steps)
    norm2 = sum(s.get("norm2", 0.0) for s in steps)
    return {
        "wire_bytes_per_step": float(np.mean([sum(f) for f in fb])),
        "format_bytes_per_step": [float(np.mean([f[k] for f in fb])) for k in range(3)],
        "compressed_share": sum(s.get("lossy_elems", 0) for s in steps) / elems if elems else 0.0,
        "rel_error": float(np.sqrt(sum(s.get("err2", 0.0) for s in steps) / norm2))
        if norm2 > 0
        else 0.0,
        "precision_level_last": float(steps[-1].get("precision_level", 0.0)),
    }


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def config_stats(steps: list[dict[str, Any]], world: int, link_Bps: float) -> dict[str, Any]:
    """Percentiles, delivery, goodput and path use of one configuration's steps."""
    comm = [s["comm_s"] for s in steps]
    prot = [s["protected_s"] for s in steps]
    sent = [s["bytes"] * 2 * (world - 1) / world for s in steps]  # per rank, both phases
    goodput = sum(sent) / sum(comm) if sum(comm) > 0 else 0.0
    n_paths = max((len(s["path_bytes"]) for s in steps), default=0)
    path_bytes = [
        sum(s["path_bytes"][p] for s in steps if p < len(s["path_bytes"])) for p in range(n_paths)
    ]
    used = sum(1 for b in path_bytes if b > 0)
    by_draw: dict[int, list[float]] = {}
    for s in steps:
        by_draw.setdefault(int(s.get("draw", 0)), []).append(s["comm_s"])
    return {
        "steps": len(steps),
        "comm_p50_s": _pct(comm, 50),
        "comm_p99_s": _pct(comm, 99),
        "comm_mean_s": float(np.mean(comm)),
        "comm_max_s": float(np.max(comm)),
        "protected_p50_s": _pct(prot, 50),
        "protected_p99_s": _pct(prot, 99),
        "delivered_min": float(min(s["delivered"] for s in steps)),
        "delivered_mean": float(np.mean([s["delivered"] for s in steps])),
        "degraded_buckets": int(sum(s["degraded"] for s in steps)),
        "retransmitted_chunks": int(sum(s["retransmitted"] for s in steps)),
        "bytes_per_step": steps[0]["bytes"],
        "goodput_Bps": goodput,
        "goodput_mbit": goodput * 8 / 1e6,
        "goodput_fraction_of_link": goodput / (link_Bps * max(used, 1)) if link_Bps > 0 else None,
        "path_bytes": path_bytes,
        "paths_used": used,
        # The wire precision (gradlane runs): payload bytes all ranks started per step, the
        # share of elements sent in fewer bits, the relative error of what was sent.
        **_precision(steps),
        # Per gloo draw (see the module docstring): one entry without draws.
        "draws": [
            {"draw": d, "steps": len(c), "comm_p50_s": _pct(c, 50), "comm_p99_s": _pct(c, 99)}
            for d, c in sorted(by_draw.items())
        ],
        # CPU seconds of all ranks per second of step: near the machine's core count, the
        # transport (not the network) sets the pace.
        "cpu_cores_busy": sum(s["cpu_s"] for s in steps)
        / max(sum(s["wall_s"] for s in steps), 1e-9),
        # The whole machine over the same steps (forwarding and shaping run in softirq, outside
        # every process); None where rank 0 could not read /proc/stat.
        "machine_cores_busy": _weighted(
            [(s["host_cores"], s["wall_s"]) for s in steps if s.get("host_cores") is not None]
        ),
    }


def _weighted(pairs: list[tuple[float, float]]) -> float | None:
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _per_draw(ours: dict[str, Any] | None, gloo: dict[str, Any] | None) -> list[float] | None:
    """p99 over each gloo draw's steps, ours over gloo's; None without draws or either side."""
    if ours is None or gloo is None or len(gloo["draws"]) < 2:
        return None
    p99 = {d["draw"]: d["comm_p99_s"] for d in ours["draws"]}
    return [
        r for d in gloo["draws"] if (r := _ratio(p99.get(d["draw"]), d["comm_p99_s"])) is not None
    ]


def build(raw: dict[str, Any], command: str) -> dict[str, Any]:
    """The report document: ``summary``, ``command``, per-configuration stats, the raw steps."""
    world, link = raw["world"], float(raw["net"]["link_Bps"])
    stats = {
        name: config_stats(steps, world, link) for name, steps in raw["steps"].items() if steps
    }

    def get(name: str, key: str) -> Any:
        return stats[name][key] if name in stats else None

    gradlane = [n for n in stats if n != "gloo"]
    two = next(
        (
            _ratio(get(n, "goodput_Bps"), get(n + "+1path", "goodput_Bps"))
            for n in ("udp-reliable", "udp-bounded")
            if n in stats and n + "+1path" in stats
        ),
        None,
    )
    gain = next(
        (
            _ratio(get(n + "+flat", "protected_p99_s"), get(n, "protected_p99_s"))
            for n in ("udp-bounded", "udp-reliable")
            if n in stats and n + "+flat" in stats
        ),
        None,
    )
    good = next(
        (get(n, "goodput_fraction_of_link") for n in ("udp-reliable", "udp-bounded") if n in stats),
        None,
    )
    summary = {
        "p99_ratio_vs_gloo": _ratio(get("udp-bounded", "comm_p99_s"), get("gloo", "comm_p99_s")),
        "mean_ratio_vs_gloo": _ratio(get("udp-bounded", "comm_mean_s"), get("gloo", "comm_mean_s")),
        "delivered_fraction_min": min((stats[n]["delivered_min"] for n in gradlane), default=None),
        "goodput_fraction_of_link": good,
        "two_paths_vs_one": two,
        "priority_protected_p99_gain": gain,
        "p99_ratio_reliable_vs_gloo": _ratio(
            get("udp-reliable", "comm_p99_s"), get("gloo", "comm_p99_s")
        ),
        "mean_ratio_reliable_vs_gloo": _ratio(
            get("udp-reliable", "comm_mean_s"), get("gloo", "comm_mean_s")
        ),
        "p99_ratio_vs_gloo_per_draw": _per_draw(stats.get("udp-bounded"), stats.get("gloo")),
    }
    return {
        "summary": summary,
        "command": command,
        "network": raw["network"],
        "trace": raw["trace"],
        "trace_meta": raw["trace_meta"],
        "world": world,
        "options": raw["options"],
        "configs": {n: {**raw["configs"][n], **stats[n]} for n in stats},
        "host": raw.get("host"),
        "link_stats": raw.get("link_stats", {}),
        "wall_s": raw["wall_s"],
        "steps": raw["steps"],
    }


def table(doc: dict[str, Any]) -> str:
    """Per configuration: p50/p99/mean communication time, protected p99, delivery, goodput."""
    head = (
        f"{'configuration':<24}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'prot p99':>10}"
        f"{'delivered':>11}{'Mbit/s':>9}{'ranks':>7}{'host':>6}  paths"
    )
    lines = [head, "-" * len(head)]
    for name, c in doc["configs"].items():
        lines.append(
            f"{name:<24}{c['comm_p50_s'] * 1e3:>9.1f}{c['comm_p99_s'] * 1e3:>9.1f}"
            f"{c['comm_mean_s'] * 1e3:>9.1f}{c['protected_p99_s'] * 1e3:>10.1f}"
            f"{c['delivered_min']:>11.4f}{c['goodput_mbit']:>9.0f}{c['cpu_cores_busy']:>7.2f}"
            f"{c['machine_cores_busy'] or 0:>6.2f}  "
            + "/".join(f"{b / 1e6:.0f}MB" for b in c["path_bytes"])
        )
    gloo = doc["configs"].get("gloo")
    if gloo is not None and len(gloo["draws"]) > 1:
        lines.append(
            "gloo per draw (new connections each; p50/p99 ms): "
            + ", ".join(
                f"{d['draw']}: {d['comm_p50_s'] * 1e3:.0f}/{d['comm_p99_s'] * 1e3:.0f}"
                for d in gloo["draws"]
            )
        )
    lines.append("")
    cores = (doc.get("host") or {}).get("cpus")
    lines.append(
        "ranks/host: CPU cores busy in the rank processes / on the whole machine (softirq "
        f"forwarding included) of {cores}; paths: bytes sent per path, all ranks"
    )
    lines.append("summary: " + ", ".join(f"{k}={_fmt(v)}" for k, v in doc["summary"].items()))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return "null" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def write(doc: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``<out>.json`` and the three PNGs; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = out.with_suffix("") if out.suffix == ".json" else out
    paths = [
        base.with_name(base.name + s) for s in (".json", "_cdf.png", "_paths.png", "_delivered.png")
    ]
    paths[0].write_text(json.dumps(doc, indent=1, default=float) + "\n")
    title = f"{Path(doc['trace']).name} on {doc['network'].split(':')[0]}, {doc['world']} ranks"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, steps in doc["steps"].items():
        xs = np.sort([s["comm_s"] * 1e3 for s in steps])
        if xs.size:
            ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=name)
    ax.set(xlabel="per-step communication time (ms)", ylabel="CDF", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    udp = [n for n, s in doc["steps"].items() if n != "gloo" and s]
    fig, axes = plt.subplots(
        len(udp) or 1, 1, figsize=(7, 2.2 * max(len(udp), 1) + 0.6), squeeze=False
    )
    for ax, name in zip(axes[:, 0], udp, strict=False):
        steps = doc["steps"][name]
        t = [s["t_s"] for s in steps]
        for p in range(max(len(s["path_bytes"]) for s in steps)):
            mbit = [
                s["path_bytes"][p] * 8 / s["comm_s"] / 1e6 if s["comm_s"] > 0 else 0.0
                for s in steps
            ]
            ax.plot(t, mbit, marker=".", label=f"path {p} (spine {p})")
        ax.set(ylabel="Mbit/s", title=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("time since the configuration started (s)")
    fig.suptitle(
        "per-path throughput, all ranks (bytes sent in a step / its communication time)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in udp:
        steps = doc["steps"][name]
        ax.plot([s["step"] for s in steps], [s["delivered"] for s in steps], marker=".", label=name)
    ax.set(xlabel="step", ylabel="delivered fraction (worst rank)", title=title, ylim=(None, 1.002))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[3], dpi=110)
    plt.close(fig)
    return paths
