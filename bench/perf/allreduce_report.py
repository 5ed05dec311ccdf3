"""The report of ``python -m gradlane.bench.perf.allreduce``: rows, summary maps and the table.

The rank processes hand over, per rank count, ``times``, ``cpu`` and ``checks`` keyed by
``(transport, chunk_bytes)`` (``chunk_bytes`` None for gloo, ZeroMQ and the daemon), each a map
from the bucket size in MB to one entry per repetition. :func:`summarize` turns them into one
row per (transport, chunk bytes, ranks, MB) and the summary maps: ``<transport>_vs_gloo`` (and
``<transport>_cpu_vs_gloo``) for every transport, and the ratios of a variant to its baseline at
the same datagram size (:data:`RELATIVE`). A map's keys are ``"<ranks>x<MB>@<chunk bytes>"``
for the UDP engines and the floor (``"4x25@8972"``) and ``"<ranks>x<MB>"`` for the others.
Standard library and NumPy only: the parent process reports without torch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MB = 1 << 20
#: Every transport, in the order the table lists them.
TRANSPORTS = (
    "gloo", "udp_floor", "udp_reliable", "udp_keyed", "udp_ordered", "udp_gso_only",
    "udp_no_offload", "udp_bounded", "zmq_floor", "zmq", "zmq_unbatched", "daemon",
)  # fmt: skip
#: ``--offload-compare``: the reliable engine again with UDP GRO off, and with GSO and GRO off
#: (the flags are ``(gso, gro)``).
OFFLOAD_VARIANTS = {"udp_gso_only": (True, False), "udp_no_offload": (False, False)}
#: The summary map of each transport's ratio to gloo.
SUMMARY_KEYS = {
    "udp_floor": "floor_vs_gloo",
    "udp_reliable": "udp_reliable_vs_gloo",
    "udp_keyed": "udp_keyed_vs_gloo",
    "udp_ordered": "udp_ordered_vs_gloo",
    "udp_gso_only": "udp_gso_only_vs_gloo",
    "udp_no_offload": "udp_no_offload_vs_gloo",
    "udp_bounded": "udp_bounded_vs_gloo",
    "zmq_floor": "zmq_floor_vs_gloo",
    "zmq": "zmq_vs_gloo",
    "zmq_unbatched": "zmq_unbatched_vs_gloo",
    "daemon": "daemon_vs_gloo",
}
#: Ratios of a transport to another at the same datagram size: transport -> (baseline, the
#: row's field, the summary map).
RELATIVE = {
    "udp_reliable": ("udp_floor", "ratio_to_floor", "udp_reliable_vs_floor"),
    "udp_keyed": ("udp_reliable", "ratio_to_unkeyed", "udp_keyed_vs_unkeyed"),
    "udp_ordered": ("udp_reliable", "ratio_to_unordered", "udp_ordered_vs_unordered"),
    "udp_gso_only": ("udp_reliable", "ratio_to_offload", "gso_only_vs_offload"),
    "udp_no_offload": ("udp_reliable", "ratio_to_offload", "no_offload_vs_offload"),
    "zmq": ("zmq_floor", "ratio_to_floor", "zmq_vs_floor"),
    "zmq_unbatched": ("zmq", "ratio_to_batched", "zmq_unbatched_vs_zmq"),
}
#: Transports whose CPU is not in the rank processes (a daemon's is in another process).
OUT_OF_PROCESS = ("daemon",)

#: A transport and its datagram payload (None: not a UDP transport).
Key = tuple[str, int | None]


def case(world: int, mb: float, chunk: int | None) -> str:
    """A summary map's key: ``"<ranks>x<MB>"``, with ``"@<chunk bytes>"`` for a UDP transport."""
    base = f"{world}x{mb:g}"
    return base if chunk is None else f"{base}@{chunk}"


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def _row(
    t: str, chunk: int | None, world: int, mb: float, xs: list[float], gloo: float
) -> dict[str, Any]:
    """The timing part of one row."""
    med = float(np.median(xs))
    return {
        "transport": t,
        "chunk_bytes": chunk,  # the UDP datagrams' payload; None where there are none
        "ranks": world,
        "MB": mb,
        "median_s": med,
        "p99_s": _pct(xs, 99),
        "times_s": [float(x) for x in xs],  # every repetition, in run order
        "reps": len(xs),
        "ratio_to_gloo": med / gloo if gloo > 0 else math.nan,
        "gbps": mb * MB * 8 / med / 1e9 if med > 0 else math.nan,
    }


def summarize(per_world: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Rows per (transport, chunk bytes, ranks, MB) with median/p99 and the ratio to gloo; the
    summary maps (see the module's docstring). ``per_world``: each rank count's ``times``,
    ``cpu`` (user and system seconds per repetition, summed over ranks) and ``checks`` by
    ``(transport, chunk_bytes)`` and MB, and optionally ``offloads`` (the floor's GSO and GRO
    in use, by the same key)."""
    rows: list[dict[str, Any]] = []
    summary: dict[str, dict[str, float]] = {k: {} for k in SUMMARY_KEYS.values()}
    summary["daemon_vs_embedded"] = {}
    for world, out in per_world.items():
        times: dict[Key, dict[Any, list[float]]] = out["times"]
        cpu: dict[Key, dict[Any, list[Any]]] = out["cpu"]
        udp_chunks = [c for (t, c) in times if t == "udp_reliable" and c is not None]
        for (t, chunk), by_mb in times.items():
            for mb_key, xs in by_mb.items():
                mb = float(mb_key)
                at = case(world, mb, chunk)
                gloo = float(np.median(times["gloo", None][mb_key]))
                row = _row(t, chunk, world, mb, xs, gloo)
                med = row["median_s"]
                cs = cpu[t, chunk][mb_key]
                if cs and t not in OUT_OF_PROCESS:
                    cpu_gloo = float(np.median(np.sum(cpu["gloo", None][mb_key], axis=1)))
                    split = np.asarray(cs, dtype=float)
                    row["cpu_median_s"] = float(np.median(split.sum(axis=1)))
                    row["cpu_user_median_s"] = float(np.median(split[:, 0]))
                    row["cpu_sys_median_s"] = float(np.median(split[:, 1]))
                    row["cpu_ratio_to_gloo"] = (
                        row["cpu_median_s"] / cpu_gloo if cpu_gloo > 0 else math.nan
                    )
                    if t != "gloo":
                        key = f"{SUMMARY_KEYS[t].removesuffix('_vs_gloo')}_cpu_vs_gloo"
                        summary.setdefault(key, {})[at] = row["cpu_ratio_to_gloo"]
                if t != "gloo":
                    row["check"] = out["checks"][t, chunk][mb_key]
                    summary[SUMMARY_KEYS[t]][at] = row["ratio_to_gloo"]
                row.update(out.get("offloads", {}).get((t, chunk), {}))
                base = RELATIVE.get(t)
                if base is not None and (base[0], chunk) in times:
                    ref = float(np.median(times[base[0], chunk][mb_key]))
                    row[base[1]] = med / ref
                    summary.setdefault(base[2], {})[at] = med / ref
                if t == "daemon":  # against the embedded engine at every datagram size
                    for c in udp_chunks:
                        emb = float(np.median(times["udp_reliable", c][mb_key]))
                        row.setdefault("ratio_to_embedded", med / emb)  # the first size's
                        summary["daemon_vs_embedded"][case(world, mb, c)] = med / emb
                rows.append(row)
    return {"rows": rows, "summary": summary}


def _order(r: dict[str, Any]) -> tuple[Any, ...]:
    """Table order: by ranks and MB, gloo first, then the UDP transports by datagram size,
    then the rest."""
    chunk = r.get("chunk_bytes")
    group = 0 if r["transport"] == "gloo" else (1 if chunk is not None else 2)
    return (r["ranks"], r["MB"], group, chunk or 0, TRANSPORTS.index(r["transport"]))


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    head = (
        f"{'transport':<14}{'chunk':>7}{'ranks':>6}{'MB':>7}{'median ms':>12}{'p99 ms':>10}"
        f"{'x gloo':>9}{'Gb/s':>8}{'cpu ms':>9}{'user':>7}{'sys':>7}{'cpu x':>7}  check"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=_order):
        c = r.get("check")
        check = (
            ""
            if c is None
            else (
                f"{'ok' if c['ok_all_ranks'] else 'MISMATCH'}"
                f" delivered(min rank)={c['delivered_fraction_min_rank']:.4f}"
                f" rms_rel={c['rms_err_rel']:.1e}"
            )
        )
        chunk = r.get("chunk_bytes")
        cpu_ms = r.get("cpu_median_s", math.nan) * 1e3
        cpu_x = r.get("cpu_ratio_to_gloo", math.nan)
        user_ms = r.get("cpu_user_median_s", math.nan) * 1e3
        sys_ms = r.get("cpu_sys_median_s", math.nan) * 1e3
        lines.append(
            f"{r['transport']:<14}{'-' if chunk is None else chunk:>7}{r['ranks']:>6}"
            f"{r['MB']:>7g}{r['median_s'] * 1e3:>12.1f}{r['p99_s'] * 1e3:>10.1f}"
            f"{r['ratio_to_gloo']:>9.2f}{r['gbps']:>8.2f}{cpu_ms:>9.1f}{user_ms:>7.1f}"
            f"{sys_ms:>7.1f}{cpu_x:>7.2f}  {check}"
        )
    return "\n".join(lines)
