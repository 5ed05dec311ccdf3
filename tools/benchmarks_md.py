"""Regenerate docs/benchmarks.md (and the README's results table) from bench/results/*.json.

    python tools/benchmarks_md.py            # rewrite them
    python tools/benchmarks_md.py --check    # exit 1 when either is out of date

One section per results file: what it measures, the machine, the commit and command as the file
records them ("not recorded" otherwise), its summary and tables, and links to the PNGs beside
it. The README's table lives between ``<!-- benchmarks_md:ddp_step -->`` and
``<!-- /benchmarks_md -->``. Standard library only: no torch, no numpy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- benchmarks_md:ddp_step -->", "<!-- /benchmarks_md -->"

# fmt: off
#: stem -> (title, the module of gradlane.bench that writes such a file, what it measures).
ABOUT: dict[str, tuple[str, str, str]] = {
    "kernels": ("Kernels", "perf.kernels", "Single-thread throughput of the send, reduce and "
        "place kernels against NumPy's copy and add on the same bytes (ratio > 1: faster)."),
    "core_cpu": ("The core's CPU", "perf.core_cpu", "User-space CPU per collective of one rank's "
        "sans-I/O all-reduce core: N ranks in one process, no sockets."),
    "netsim": ("Network simulator", "sim.simulator", "8 simulated ranks, 80% cross traffic on one "
        "spine: the TCP-like baseline against priorities, bounded loss, multipath."),
    "ddp_step": ("DDP step time", "perf.ddp_step", "A whole DDP step (25.5 MB of gradients) on "
        "loopback: gradlane's reliable hook against gloo's, a protocol-free UDP hook, a no-op."),
    "allreduce": ("Loopback all-reduce against gloo", "perf.allreduce", "One process per rank: "
        "gloo against gradlane UDP (reliable, bounded), the protocol-free UDP floor "
        "(per datagram size), ZeroMQ and its protocol-free floor; CPU of all ranks."),
    "allreduce_daemon": ("Daemon mode against the embedded plane", "perf.allreduce", "4 ranks as "
        "2 hosts of 2, each host's through one `gradlane daemon`, against the embedded plane."),
    "allreduce_offload": ("UDP GSO and GRO with MTU-sized datagrams", "perf.allreduce", "The UDP "
        "plane with GSO and GRO, GSO only, and neither, at 1408- and 8192-byte chunks."),
    "allreduce_zmq_batch": ("ZeroMQ batch frames", "perf.allreduce", "The ZeroMQ plane with "
        "batch frames (`zmq`) against one packet per frame."),
    "udp_floor": ("Protocol-free UDP floor", "perf.udp_floor", "The transpose all-reduce over "
        "raw UDP with no protocol at all, against gloo: what any Python UDP transport costs."),
    "paced": ("Paced all-reduce against the link bound", "perf.paced", "One process per "
        "rank over loopback, each rank's sending paced at a set rate: all-reduce time over the "
        "time its bytes take at that rate."),
    "demo_loopback": ("The demo over loopback", "", "`gradlane demo --network loopback`: 4 ranks "
        "train with DDP over loopback, gloo (lossless TCP) against gradlane with 5% of the "
        "datagrams each rank receives dropped on purpose and a loss bound of 0.05."),
    "testbed_check": ("Testbed self-check", "testbed.selfcheck", "What the emulated leaf-spine "
        "itself delivers: shaping, drops, priority classes, impairment, generator CPU."),
}
REPLAY = ("Trace replay", "replay.run", "A trace's buckets replayed with their recorded timing "
    "over gloo and gradlane, interleaved step by step, on the testbed ([testbed.md](testbed.md)).")
#: Module names in commands recorded by older runs -> today's names.
RENAMED = (
    ("python -m bench.replay ", "python -m gradlane.bench.replay.run "),
    ("bench/traces/", "bench/replay/traces/"),
    ("python -m bench.allreduce", "python -m gradlane.bench.perf.allreduce"),
    ("python -m bench.testbed_check", "python -m gradlane.bench.testbed.selfcheck"),
    ("/work/main/bench/netsim.py", "python -m gradlane.bench.sim.simulator"),
)
# fmt: on
SETTINGS = ("config", "options", "spec", "network", "workload")
TABLES = ("rows", "results", "configs")
MACHINE = ("machine", "host", "cpus", "cpu_count", "cpu_model", "host_load", "load_avg_1m",
           "commit", "command", "started")  # fmt: skip
TRANSPOSE_OVER = 13  # a table with more columns than this is printed with rows and columns swapped


def fmt(value: Any) -> str:
    """One table cell: 4 significant digits, large numbers grouped, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:.4g}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value).replace("|", "\\|")


def in_ms(name: str, value: Any) -> tuple[str, Any]:
    """A duration in seconds (a ``_s`` name, or name part: ``step_s.p50``) in milliseconds."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.endswith("_s") and not part.endswith("_per_s"):
            parts[i] = part[:-2] + "_ms"
            number = isinstance(value, int | float) and not isinstance(value, bool)
            return ".".join(parts), value * 1e3 if number else value
    return name, value


def flat(record: dict[str, Any]) -> dict[str, Any]:
    """A record's scalar fields; small dicts (≤ 4 keys) flattened as ``key.sub``; lists dropped."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        items = value.items() if isinstance(value, dict) and len(value) <= 4 else [("", value)]
        for sub, v in items:
            if v is not None and not isinstance(v, dict | list):
                name, shown = in_ms(f"{key}.{sub}" if sub else key, v)
                out[name] = shown
    return out


def table(rows: list[dict[str, Any]]) -> list[str]:
    """A Markdown table of flat records (swapped when it has more than TRANSPOSE_OVER columns)."""
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    grid = [[fmt(row.get(c)) for c in cols] for row in rows]
    if len(cols) > TRANSPOSE_OVER:  # one column per record, named by its first field
        head = ["field", *(g[0] for g in grid)]
        grid = [[c, *(g[i] for g in grid)] for i, c in enumerate(cols) if i]
        cols = head
    lines = ["| " + " | ".join(cells) + " |" for cells in [cols, ["---"] * len(cols), *grid]]
    return [*lines, ""]


def summary(data: dict[str, Any]) -> list[str]:
    """The ``summary`` object: scalars as a two-column table, ``{case: value}`` maps as a grid."""
    scalars = [in_ms(k, v) for k, v in data.items() if not isinstance(v, dict) and v is not None]
    grids = [{"key": k, **v} for k, v in data.items() if isinstance(v, dict) and v]
    out = ["**Summary**", ""]
    if scalars:
        out += table([{"key": k, "value": v} for k, v in scalars])
    if grids:
        out += table(grids)
    return out


def machine(data: dict[str, Any], nested: bool = False) -> list[str]:
    """CPU model, cores, load, commit and command, wherever the file records them. A run nested
    in ``runs`` names only what it records itself; its file names the rest."""
    config: dict[str, Any] = data["config"] if isinstance(data.get("config"), dict) else {}
    mach: dict[str, Any] = data["machine"] if isinstance(data.get("machine"), dict) else {}
    host: dict[str, Any] = data["host"] if isinstance(data.get("host"), dict) else {}
    pool = {**mach, **config, **host, **data}
    cores = pool.get("cpus") or pool.get("cpu_count")
    cores = f"{cores} cores" if cores else "cores not recorded"
    if pool.get("load_start") and pool.get("load_end"):
        load = (
            f"1-minute load average {pool['load_start'][0]:.2f} at the start, "
            f"{pool['load_end'][0]:.2f} at the end"
        )
        if pool.get("warning"):
            load += f" (**{pool['warning']}**)"
    elif pool.get("host_load"):
        load = "load average " + " / ".join(f"{x:.2f}" for x in pool["host_load"]) + " (1/5/15 min)"
    elif pool.get("load_avg_1m"):
        before, after = pool["load_avg_1m"]
        load = f"1-minute load average {before:.2f} before the run, {after:.2f} after"
    else:
        load = "load not recorded"
    extra = "".join(f"; {k} {mach[k]}" for k in ("platform", "python", "numpy") if k in mach)
    model = pool.get("cpu_model") or "not recorded"
    out = [f"- machine: CPU model {model}; {cores}; {load}{extra}"]
    if "runs" in data and cores == "cores not recorded":
        out = ["- machine: recorded per run, below"]
    if pool.get("commit") or not nested:
        out.append(f"- commit: {pool.get('commit') or 'not recorded'}")
    if pool.get("started"):
        out.append(f"- started: {pool['started']}")
    command = pool.get("command") or ""
    if command or not nested:
        out.append(f"- command: `{command}`" if command else "- command: not recorded")
    today = command
    for old, new in RENAMED:
        today = today.replace(old, new)
    if today != command:
        out.append(f"- the same command with today's module names: `{today}`")
    return out


def body(data: dict[str, Any], level: str) -> list[str]:
    """Settings, summary and tables of one results object (``runs`` nest further objects)."""
    out = []
    for key in SETTINGS:  # run settings (``config``, ``options``, ...), one line each
        value = data.get(key)
        if isinstance(value, dict):
            value = ", ".join(f"{k}={fmt(v)}" for k, v in value.items() if k not in MACHINE)
        out += [f"- {key}: {value}"] if value else []
    out += [""] if out else []
    if isinstance(data.get("summary"), dict):
        out += summary(data["summary"])
    for key in TABLES:
        value = data.get(key)
        if isinstance(value, dict):  # {name: record}, e.g. the replay's configurations
            value = [{"name": k, **v} for k, v in value.items() if isinstance(v, dict)]
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            out += [f"**{key}**", "", *table([flat(r) for r in value])]
    for name, run in (data.get("runs") or {}).items():
        # A run that records nothing of its machine shares its file's (the demo's runs).
        records = any(k in run for k in MACHINE if k != "machine") or "machine" in run
        head = machine(run, nested=True) if records else []
        inner = body(run, level + "#")
        if head or any(line.strip() for line in inner):
            out += [f"{level} {name}", "", *head, *inner]
    return out


def describe(path: Path, data: dict[str, Any]) -> tuple[str, str, str]:
    """(title, module, what it measures) of a results file; a replay report known by its shape."""
    return ABOUT.get(path.stem) or (REPLAY if "configs" in data else (path.stem, "", ""))


def anchor(heading: str) -> str:
    """GitHub's anchor of a section heading."""
    return "".join(c for c in heading.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def section(path: Path, data: dict[str, Any], pngs: list[Path]) -> list[str]:
    """The section of one results file."""
    title, module, what = describe(path, data)
    link = f"[bench/results/{path.name}](../bench/results/{path.name})"
    out = [f"## {title}: {path.name}", ""]
    if what:
        by = f" Written by `python -m gradlane.bench.{module}`." if module else ""
        out += [f"{what}{by}", ""]
    out += [f"- file: {link}", *machine(data), "", *body(data, "###")]
    if pngs:
        out += ["Figures: " + ", ".join(f"[{p.name}](../bench/results/{p.name})" for p in pngs), ""]
    shown = {"summary", "runs", "units", "bench", *SETTINGS, *TABLES, *MACHINE}
    rest = [f"`{k}`" for k in data if k not in shown]
    if rest:
        out += ["Also in the file: " + ", ".join(rest) + ".", ""]
    return out + ([f"Units: {data['units']}.", ""] if data.get("units") else [])


def render(results: Path = RESULTS) -> str:
    """The whole of docs/benchmarks.md."""
    files = {p: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
    stems = sorted((p.stem for p in files), key=len, reverse=True)
    owned: dict[str, list[Path]] = {s: [] for s in stems}
    for png in sorted(results.glob("*.png")):  # a PNG belongs to the longest stem it starts with
        owner = next((s for s in stems if png.stem == s or png.name.startswith(s + "_")), None)
        if owner:
            owned[owner].append(png)
    out = [
        "# Benchmarks",
        "",
        "Generated by `python tools/benchmarks_md.py` from `bench/results/*.json`: do not edit",
        "by hand (`tests/unit/test_benchmarks_md.py` fails when this page is out of date). Every",
        "ratio compares against a baseline measured in the same run, on the machine its section",
        "names. Times are in milliseconds (`_ms`); `–` marks a value the run did not record.",
        "",
    ]
    for p, data in files.items():
        heading = f"{describe(p, data)[0]}: {p.name}"
        out.append(f"- [{heading}](#{anchor(heading)})")
    out.append("")
    for p, data in files.items():
        out += section(p, data, owned[p.stem])
    return "\n".join(out).rstrip() + "\n"


def readme_block(results: Path = RESULTS) -> str:
    """The README's one results table: the DDP step, from ddp_step.json."""
    data = json.loads((results / "ddp_step.json").read_text())
    names = {"default": "DDP's default hook (gloo)", "udp": "gradlane, UDP, reliable",
             "zmq": "gradlane, ZeroMQ, reliable", "floor": "protocol-free UDP hook (a floor)",
             "noop": "no-op hook (no communication)"}  # fmt: skip
    ranks = sorted({r["ranks"] for r in data["rows"]})
    rows = {(r["variant"], r["ranks"]): r for r in data["rows"]}
    head = " | ".join(f"{n} ranks: step | × gloo | CPU × gloo" for n in ranks)
    out = [BEGIN, f"| hook | {head} |", "|---|" + "---|---|---|" * len(ranks)]
    for variant in dict.fromkeys(r["variant"] for r in data["rows"]):
        cells = []
        for n in ranks:
            r = rows.get((variant, n), {})
            step = f"{r['median_s'] * 1e3:.1f} ms" if r else "–"
            ratios = [r.get("ratio_to_default"), r.get("cpu_ratio_to_default")]
            cells += [step, *("–" if x is None else f"{x:.2f}" for x in ratios)]
        out.append(f"| {names.get(variant, variant)} | " + " | ".join(cells) + " |")
    cfg = data["config"]
    cores = (data.get("host") or {}).get("cpus") or cfg.get("cpus")
    out += ["", f"Medians of {cfg['steps']} steps (the slowest rank's) on {cores} cores; "
            "CPU: user + system time of every rank."]  # fmt: skip
    demo = results / "demo_testbed.json"
    if demo.exists():  # the main job where it is meant to win
        s = json.loads(demo.read_text())["summary"]
        busy, share = s.get("gloo_cross_route_busy"), s.get("cross_share")
        if busy is None or share is None:
            hashed = ""
        elif busy > share + 0.05:  # gloo's traffic on top of the cross traffic (as bench.demo)
            hashed = (
                f" (this run's hash put gloo's ring on a congested link: the busiest one "
                f"{busy:.0%} busy, the cross traffic {share:.0%})"
            )
        else:
            hashed = (
                f" (this run's hash kept gloo's ring off the congested links, so gloo ran "
                f"as on a free network: the busiest one {busy:.0%} busy, the cross traffic's "
                "own share)"
            )
        path0 = ""
        if s.get("tta_ratio_vs_gloo_path0") is not None:
            path0 = (
                "; against gloo over the congested path 0, "
                f"{s['tta_ratio_vs_gloo_path0']:.2f}× its time to accuracy and "
                f"{s['step_p99_ratio_vs_gloo_path0']:.2f}× its step p99"
            )
        out += ["", f"`gradlane demo` on the emulated leaf-spine ({s['link_mbit']:g} Mbit/s links, "
                "70% cross traffic through one spine, 4.5 MB of gradients per step; "
                "`bench/results/demo_testbed.json`), gloo's connections hashed over both "
                f"spines{hashed}: gradlane reaches "
                f"{s['accuracy_target']:.1f}% held-out accuracy in {s['tta_s_gradlane']:.1f} s of "
                f"training against gloo's {s['tta_s_gloo']:.1f} s "
                f"({s['tta_ratio_vs_gloo']:.2f}×), its step p99 is "
                f"{s['step_p99_ratio_vs_gloo']:.2f}× gloo's{path0}, "
                + ("at the same final accuracy"
                   if round(s["accuracy_gradlane"], 2) == round(s["accuracy_gloo"], 2)
                   else "final accuracy gradlane / gloo")
                + f" ({s['accuracy_gradlane']:.2f}% / {s['accuracy_gloo']:.2f}%)."
                + _demo_precision(s)]  # fmt: skip
    net = results / "testbed200_congested_ecmp.json"
    if net.exists():  # the case gradlane is for: the network, not the CPU, binds
        s = json.loads(net.read_text())["summary"]
        out += ["", "Where the network binds — the emulated leaf-spine, 200 Mbit/s links, 70% "
                "cross traffic through one spine, gloo's connections hashed over both spines "
                "(`bench/results/testbed200_congested_ecmp.json`) — gradlane's p99 "
                f"communication time is {s['p99_ratio_vs_gloo']:.2f}× gloo's and its mean "
                f"{s['mean_ratio_vs_gloo']:.2f}×; the lowest delivered fraction of a step was "
                f"{s['delivered_fraction_min']:.5g}." + _ecmp_hash(net)]  # fmt: skip
    return "\n".join([*out, END])


def _demo_precision(s: dict[str, Any]) -> str:
    """The demo's run with a lossy wire precision, if it had one (``gradlane_<policy>``)."""
    for key, wire in s.items():
        if key.startswith("wire_bytes_ratio_") and key.endswith("_vs_f32"):
            p = key[len("wire_bytes_ratio_") : -len("_vs_f32")]
            tta, acc = s.get(f"tta_ratio_vs_gloo_{p}"), s.get(f"accuracy_gradlane_{p}")
            if tta is None or acc is None or wire is None:
                return ""
            return (
                f" With `precision={p}` (wire precision per chunk, error feedback), gradlane "
                f"sends {wire:.2f}× the bytes of float32 gradlane (compressed share "
                f"{s[f'compressed_share_{p}']:.2f}, relative error {s[f'rel_error_{p}']:.3f}) "
                f"and reaches the target in {tta:.2f}× gloo's time "
                f"({s[f'tta_ratio_{p}_vs_gradlane']:.2f}× float32 gradlane's), final accuracy "
                f"{acc:.2f}%."
            )
    return ""


def _ecmp_hash(net: Path) -> str:
    """Where gloo's ECMP hash put its ring in that run, told by its p50 against gloo's over
    the congested path 0 (``testbed200_congested.json``): per-flow hashing makes it a matter of
    chance per run, and the ratio depends on it."""
    path0 = net.with_name("testbed200_congested.json")
    if not path0.exists():
        return ""
    doc = json.loads(net.read_text())
    ecmp = doc["configs"].get("gloo", {}).get("comm_p50_s")
    cong = json.loads(path0.read_text())
    p0 = cong["configs"].get("gloo", {}).get("comm_p50_s")
    if not ecmp or not p0:
        return ""
    draws = doc["configs"]["gloo"].get("draws") or []
    per_draw = doc["summary"].get("p99_ratio_vs_gloo_per_draw") or []
    if len(draws) > 1 and len(per_draw) == len(draws):
        crossed = sum(d["comm_p50_s"] >= 0.5 * p0 for d in draws)
        return (" The hash is per flow, so where gloo's ring goes is a draw: the run took "
                f"{len(draws)}, each over new connections, and the ratios pool their steps. "
                f"{crossed} of the {len(draws)} put gloo's ring across the congested spine "
                "(gloo's p50 per draw "
                + ", ".join(f"{d['comm_p50_s'] * 1e3:.0f}" for d in draws)
                + f" ms, against {p0 * 1e3:.0f} ms over the congested path 0); gradlane's p99 "
                "per draw is " + ", ".join(f"{r:.2f}" for r in per_draw) + "× gloo's (see "
                "[docs/testbed.md](docs/testbed.md)).")  # fmt: skip
    where = (
        "kept gloo's ring off the congested spine" if ecmp < 0.5 * p0
        else "put gloo's ring across the congested spine"
    )  # fmt: skip
    return (" The hash is per flow, so it differs from run to run (gloo's ring is four flows, "
            "two of which can meet the cross traffic: how often is measured in "
            f"[docs/testbed.md](docs/testbed.md)); it {where} in this run: gloo's "
            f"p50 {ecmp * 1e3:.0f} ms against {p0 * 1e3:.0f} ms over the congested path 0, where "
            f"gradlane's p99 is {cong['summary']['p99_ratio_vs_gloo']:.2f}× gloo's "
            "(`bench/results/testbed200_congested.json`).")  # fmt: skip


def with_readme_block(text: str, block: str) -> str:
    """README text with its marked block replaced (unchanged when it has no markers)."""
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < 0:
        return text
    return text[:start] + block + text[stop + len(END) :]


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) docs/benchmarks.md and the README's table."""
    ap = argparse.ArgumentParser(description="Regenerate docs/benchmarks.md from bench/results.")
    ap.add_argument("--check", action="store_true", help="exit 1 when a page is out of date")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
    ap.add_argument("--out", type=Path, default=DOC, help="the page to write")
    ap.add_argument("--readme", type=Path, default=README, help="the README holding the table")
    args = ap.parse_args(argv)
    pages = {args.out: render(args.results)}
    if args.readme.exists() and (args.results / "ddp_step.json").exists():
        pages[args.readme] = with_readme_block(args.readme.read_text(), readme_block(args.results))
    stale = [p for p, text in pages.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p} is out of date: run python tools/benchmarks_md.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(pages[p])
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
