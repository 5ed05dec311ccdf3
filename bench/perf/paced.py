"""All-reduce over loopback with every rank's sending paced at a set rate: time against the link.

Usage::

    python -m gradlane.bench.perf.paced --ranks 2,4 --mb 4 --rate-mbit 200 --json out.json

One process per rank, each a :class:`~gradlane.transport.drivers.udp.plane.UdpPlane` whose
NIC pacer sends at most ``--rate-mbit`` (its paths' pacers share that rate), so the network —
not the CPU, not loopback's memory speed — is what binds, as on a real link. Each rank sends
``2 (N-1)/N`` of the bucket per all-reduce (its peers' shards, then its own sum to every peer),
so an all-reduce cannot take less than that many bytes at the rate: the **link bound**. The
summary's ``time_vs_link_bound`` (``"<ranks>x<MB>"``) is the median all-reduce time (the
slowest rank's, per repetition) over that bound: 1.0 is a link busy from the first byte to the
last. Only the protocol's scheduling can keep it above 1 when the CPU has room, which each row
shows too (``cpu_per_rank``: cores busy in one rank's process).

It needs no network namespace, so it runs anywhere the tests run: a quick check of how the
sender orders and paces traffic, which the testbed's replays measure in full
(:mod:`gradlane.bench.replay.run`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np
from gradlane.bench.host import HostWatch
from gradlane.transport.wire.header import HEADER_SIZE

MB = 1 << 20


def _rank(rank: int, world: int, args: dict[str, Any], peers_q: Any, out: Any) -> None:
    """One rank: a paced UDP plane, a warm-up all-reduce, then timed ones; puts its times."""
    from gradlane.scheduling.pacing import PacingConfig
    from gradlane.transport.config import loopback_config
    from gradlane.transport.drivers.peers import StaticPeers
    from gradlane.transport.drivers.udp.plane import UdpPlane

    try:
        rate = args["rate_mbit"] * 1e6 / 8
        chunk, paths = args["chunk_bytes"], args["paths"]
        cfg = loopback_config(n_paths=paths, chunk_bytes=chunk, nic_rate_Bps=rate, burst_packets=64)
        # Each path's pacer shares the rate; its bucket holds two quanta, as the testbed's does.
        quanta = 2 * cfg.tx_quantum_packets * cfg.slot_bytes
        cfg = replace(
            cfg,
            pacing=PacingConfig(
                controller="fixed", initial_rate_Bps=rate / paths, burst_bytes=quanta
            ),
        )
        plane = UdpPlane(rank, world, cfg)
        try:
            out.put(("addr", rank, plane.start()))
            table = peers_q.get(timeout=60)
            plane.set_peers(StaticPeers({r: [tuple(a) for a in v] for r, v in table.items()}))
            n = int(args["mb"] * MB) // 4
            data = np.full(n, rank + 1.0, dtype=np.float32)
            buf = data.copy()
            want = world * (world + 1) / 2
            times, cpu = [], []
            for step in range(args["reps"] + 1):  # step 0 warms up
                buf[:] = data
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                res, _ = plane.submit(step, 0, buf, out=buf).result(timeout=args["timeout"])
                t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                if res[0] != want or res[-1] != want:
                    raise RuntimeError(f"rank {rank}: wrong sum {res[0]} (want {want})")
                if step:
                    times.append(t1 - t0)
                    cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
            plane.drain()
        finally:
            plane.close()
        out.put(("ok", rank, times, cpu))
    except BaseException as e:  # the parent must hear of it, not wait for the timeout
        out.put(("error", rank, repr(e)))
        raise


def run_one(world: int, args: dict[str, Any]) -> dict[str, Any]:
    """``args["reps"]`` paced all-reduces among ``world`` rank processes: one result row."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    queues = [ctx.Queue() for _ in range(world)]
    procs = [ctx.Process(target=_rank, args=(r, world, args, queues[r], out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        addrs: dict[int, Any] = {}
        results: dict[int, tuple[list[float], list[float]]] = {}
        deadline = time.monotonic() + args["timeout"] * (args["reps"] + 2)
        while len(results) < world:
            msg = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if msg[0] == "error":
                raise RuntimeError(f"rank {msg[1]} failed: {msg[2]}")
            if msg[0] == "addr":
                addrs[msg[1]] = msg[2]
                if len(addrs) == world:
                    for q in queues:
                        q.put(addrs)
            else:
                results[msg[1]] = (msg[2], msg[3])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    slowest = [max(results[r][0][i] for r in range(world)) for i in range(args["reps"])]
    cpu = [statistics.median(results[r][1]) for r in range(world)]
    rate = args["rate_mbit"] * 1e6 / 8
    n_bytes = int(args["mb"] * MB) // 4 * 4
    sent = 2 * (world - 1) / world * n_bytes
    datagrams = sent / args["chunk_bytes"]
    bound = (sent + HEADER_SIZE * datagrams) / rate
    median = statistics.median(slowest)
    return {
        "ranks": world,
        "MB": args["mb"],
        "rate_mbit": args["rate_mbit"],
        "paths": args["paths"],
        "chunk_bytes": args["chunk_bytes"],
        "link_bound_ms": bound * 1e3,
        "median_ms": median * 1e3,
        "p90_ms": float(np.percentile(slowest, 90)) * 1e3,
        "time_vs_link_bound": median / bound,
        "cpu_per_rank": statistics.median(cpu) / median,
        "times_ms": [t * 1e3 for t in slowest],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the paced all-reduces and print (and optionally write) their rows."""
    ap = argparse.ArgumentParser(prog="python -m gradlane.bench.perf.paced", description=__doc__)
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    ap.add_argument("--mb", type=float, default=4.0, help="bucket size in MiB")
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="each rank's sending rate")
    ap.add_argument("--paths", type=int, default=2)
    ap.add_argument("--chunk-bytes", type=int, default=8972, help="payload per datagram")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per all-reduce")
    ap.add_argument("--json", help="write the results here")
    args = vars(ap.parse_args(argv))
    host = HostWatch()
    rows = []
    for world in (int(x) for x in args["ranks"].split(",")):
        row = run_one(world, args)
        rows.append(row)
        print(
            f"{world} ranks {args['mb']:g} MB at {args['rate_mbit']:g} Mbit/s: "
            f"{row['median_ms']:.1f} ms (link bound {row['link_bound_ms']:.1f} ms, "
            f"x{row['time_vs_link_bound']:.2f}), {row['cpu_per_rank']:.2f} cores per rank",
            flush=True,
        )
    result = {
        "config": {k: v for k, v in args.items() if k != "json"},
        "host": host.record(),
        "rows": rows,
        "summary": {
            "time_vs_link_bound": {
                f"{r['ranks']}x{r['MB']:g}": round(r["time_vs_link_bound"], 3) for r in rows
            }
        },
    }
    if args["json"]:
        with open(args["json"], "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
