"""All-reduce on loopback, one process per rank: gloo vs gradlane (UDP reliable, UDP bounded, ZMQ).

Usage::

    python -m gradlane.bench.perf.allreduce --ranks 2,4 --sizes 1,25,100 --reps 5 --json out.json
    python -m gradlane.bench.perf.allreduce --quick --json /tmp/ar.json  # 2 ranks, 1 and 25 MB
    python -m gradlane.bench.perf.allreduce --daemon --json bench/results/allreduce_daemon.json
    python -m gradlane.bench.perf.allreduce --chunk-bytes 1408 --offload-compare --no-zmq --sizes 25
    python -m gradlane.bench.perf.allreduce --zmq-batch-compare --sizes 25 --reps 9
    python -m gradlane.bench.perf.allreduce --keyed-compare --no-zmq --ranks 2 --sizes 25 --reps 9

``--chunk-bytes`` sets the UDP datagrams' payload (65000 by default, loopback's largest; 1408
is what a 1500-byte MTU carries, 8192 a jumbo frame's), and ``--offload-compare`` adds the
reliable UDP engine with UDP GRO off (``udp_gso_only``) and with both GSO and GRO off
(``udp_no_offload``), interleaved with the others: with MTU-sized datagrams, GSO (one message
per run of equal-sized datagrams sent) and GRO (one per run received) are what keep the
kernel's per-datagram cost off the path; ``summary.gso_only_vs_offload`` and
``summary.no_offload_vs_offload`` give the ratios to the default engine (both on).

``--zmq-batch-compare`` adds a second ZeroMQ plane that sends one packet per frame
(``zmq_unbatched``, ``batch_bytes=0``) next to the default one, which packs each run into
frames of up to 1 MiB; ``summary.zmq_unbatched_vs_zmq`` gives the ratio.

``--keyed-compare`` adds the reliable UDP engine with a job secret (``udp_keyed``: every packet
carries the keyed MAC instead of the checksum), interleaved; ``summary.udp_keyed_vs_unkeyed``
gives its ratio to the default engine: what authentication costs. ``--order-compare`` adds the
reliable engine adding contributions in rank order (``udp_ordered``: deterministic sums)
against the default, which adds them as they arrive; ``summary.udp_ordered_vs_unordered`` is
what the order costs.

``--daemon`` compares hierarchical daemon mode with the embedded engine for the same 4-rank
all-reduce: two "hosts" of two ranks, one ``gradlane daemon`` process per host (host h on
127.0.0.(h+1), one path each), every rank submitting through its host's daemon (shared memory,
local sum, the inter-host all-reduce among the daemons); against the embedded reliable UDP
engine in the same rank processes, interleaved. The JSON summary gets ``daemon_vs_embedded``.

For each rank count the parent spawns one process per rank. Rank 0 hosts a ``TCPStore`` on
127.0.0.1 (a free port); the gloo group is built on it and the same store carries every rank's
bound gradlane addresses (UDP: 127.0.0.1 and 127.0.0.2 as two paths; ZeroMQ: a tcp:// endpoint per
path). Each repetition runs every transport on a fresh copy of the same float32 buffer, reduced in
place as gloo's ``all_reduce`` does (``submit(..., out=buf)``), with a barrier before each
call; each rank times its own call and the step time is the max over ranks (a gloo MAX
all-reduce of the times). The first repetition of every (transport, size) checks the result
against gloo's: the reliable modes must match within float tolerance or the run fails; the
bounded mode's delivered fraction and error are reported.

Each call's CPU time is measured too (user + system of the rank's process across the call,
``getrusage``, summed over ranks): on a small shared machine wall times swing from run to
run while the CPU a collective costs is steadier, and with more ranks than cores
it is what the wall time comes down to. ``summary.<transport>_cpu_vs_gloo`` holds its ratios
(embedded transports only: a daemon's CPU is in another process). The rows split it into
user and system time (``cpu_user_median_s``, ``cpu_sys_median_s``): the system part is the
kernel moving the bytes (sockets, copies), the user part the transport's own work (for
gradlane the Python and the numba kernels, for gloo its C++), so the split tells which side a
gap is on.

Loopback on a shared machine: the numbers are informative, not a network measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np
from gradlane.bench.host import HostWatch

MB = 1 << 20
TRANSPORTS = (
    "gloo", "udp_reliable", "udp_keyed", "udp_ordered", "udp_gso_only", "udp_no_offload",
    "udp_bounded", "zmq", "zmq_unbatched", "daemon",
)  # fmt: skip
#: ``--keyed-compare``: the job secret of the keyed engine (the same on every rank).
KEYED_SECRET = "gradlane-bench-keyed"
#: ``--offload-compare``: the reliable engine again with UDP GRO off, and with GSO and GRO off.
OFFLOAD_VARIANTS = {"udp_gso_only": (True, False), "udp_no_offload": (False, False)}
SUMMARY_KEYS = {
    "udp_reliable": "udp_reliable_vs_gloo",
    "udp_keyed": "udp_keyed_vs_gloo",
    "udp_ordered": "udp_ordered_vs_gloo",
    "udp_gso_only": "udp_gso_only_vs_gloo",
    "udp_no_offload": "udp_no_offload_vs_gloo",
    "udp_bounded": "udp_bounded_vs_gloo",
    "zmq": "zmq_vs_gloo",
    "zmq_unbatched": "zmq_unbatched_vs_gloo",
    "daemon": "daemon_vs_gloo",
}
#: Daemon mode: hosts (daemons) and the job token they serve.
HOSTS = 2
DAEMON_JOB = 4242
N_PATHS = 2
HARD_DEADLINE_S = 120.0
RTOL = 1e-5


def _free_port(host: str = "127.0.0.1", kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# -- rank process ----------------------------------------------------------------------------------
def _udp_config(
    loss_bound: float,
    chunk_bytes: int = 65000,
    gso: bool = True,
    gro: bool = True,
    seed: int = 0,
    **extra: Any,
) -> Any:
    from gradlane.scheduling.loss import LossConfig
    from gradlane.transport.config import loopback_config

    return loopback_config(
        **extra,
        n_paths=N_PATHS,
        chunk_bytes=chunk_bytes,
        udp_gso=gso,
        udp_gro=gro,
        seed=seed,
        loss=LossConfig(
            loss_bound=loss_bound,
            hard_deadline_s=HARD_DEADLINE_S,
            on_hard_deadline="raise" if loss_bound == 0 else "degrade",
        ),
    )


def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], results: Any) -> None:
    """One rank: gloo group + two UDP engines + a ZeroMQ plane, then the timed loop."""
    import torch
    import torch.distributed as dist
    from gradlane.transport.drivers.peers import StaticPeers
    from gradlane.transport.drivers.udp.plane import InjectedLoss, UdpPlane
    from gradlane.transport.drivers.zmq.plane import ZmqPlane, zmq_config

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=_td(args["timeout"]))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    closers: list[Any] = []
    try:
        engines: dict[str, Any] = {}
        kinds: list[tuple[str, float, bool, bool, dict[str, Any]]] = [
            ("udp_reliable", 0.0, True, True, {})
        ]
        if args["keyed_compare"]:
            kinds.append(("udp_keyed", 0.0, True, True, {"secret": KEYED_SECRET}))
        if args["order_compare"]:
            kinds.append(("udp_ordered", 0.0, True, True, {"deterministic_sum": True}))
        if args["offload_compare"]:
            kinds += [(name, 0.0, *flags, {}) for name, flags in OFFLOAD_VARIANTS.items()]
        if not args["daemon"]:
            kinds.append(("udp_bounded", args["loss_bound"], True, True, {}))
        for name, bound, gso, gro, extra in kinds:
            cfg = _udp_config(bound, args["chunk_bytes"], gso, gro, args["seed"], **extra)
            loss = args["inject_loss"]
            tap = InjectedLoss(loss, seed=args["seed"]) if loss else None
            e = UdpPlane(rank, world, cfg, rx_tap=tap)
            closers.append(e)
            store.set(f"gl/{name}/{rank}", json.dumps(e.start()))
            engines[name] = e
        zmq_eps = [
            f"tcp://127.0.0.{1 + p}:{_free_port(f'127.0.0.{1 + p}')}" for p in range(N_PATHS)
        ]
        store.set(f"gl/zmq/{rank}", json.dumps(zmq_eps))
        if args["zmq_batch_compare"]:
            zmq_eps = [
                f"tcp://127.0.0.{1 + p}:{_free_port(f'127.0.0.{1 + p}')}" for p in range(N_PATHS)
            ]
            store.set(f"gl/zmq1/{rank}", json.dumps(zmq_eps))
        for name, e in engines.items():
            table = {
                r: [tuple(a) for a in json.loads(store.get(f"gl/{name}/{r}"))] for r in range(world)
            }
            e.set_peers(StaticPeers(table))
        if args["daemon"]:
            from gradlane.transport.daemon.client import DaemonPlane

            local = world // HOSTS
            client = DaemonPlane(
                args["daemon"][rank // local],
                job=DAEMON_JOB,
                rank=rank,
                world=world,
                local_rank=rank % local,
                local_world=local,
                request_timeout_s=HARD_DEADLINE_S * 2,
            )
            closers.append(client)
            engines["daemon"] = client.start()
        elif args["zmq"]:
            eps = [json.loads(store.get(f"gl/zmq/{r}")) for r in range(world)]
            plane = ZmqPlane(rank, world, zmq_config(n_paths=N_PATHS), eps)
            closers.append(plane)
            engines["zmq"] = plane.start()
            if args["zmq_batch_compare"]:
                eps = [json.loads(store.get(f"gl/zmq1/{r}")) for r in range(world)]
                plane = ZmqPlane(rank, world, zmq_config(n_paths=N_PATHS), eps, batch_bytes=0)
                closers.append(plane)
                engines["zmq_unbatched"] = plane.start()
        out = _timed_loop(rank, world, engines, args, dist, torch)
        for e in engines.values():  # peers have what this rank sent, while every engine answers
            e.drain()
        dist.barrier()
        if rank == 0:
            results.put(("ok", out))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        for c in reversed(closers):
            c.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _td(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _timed_loop(
    rank: int, world: int, engines: dict[str, Any], args: dict[str, Any], dist: Any, torch: Any
) -> dict[str, Any]:
    """Interleave the transports per repetition; times are the max over ranks."""
    transports = ["gloo", *engines]
    times: dict[str, dict[int, list[float]]] = {t: {} for t in transports}
    # Per call: (user, system) CPU seconds of this rank's process.
    cpu: dict[str, dict[int, list[tuple[float, float]]]] = {t: {} for t in transports}
    checks: dict[str, dict[int, Any]] = {t: {} for t in transports if t != "gloo"}
    # One untimed round first: numba loads its cached kernels and the engines their first
    # buffers on the first call, which would otherwise be the first repetition's outlier.
    warm = np.ones(MB // 4, dtype=np.float32)
    for e in engines.values():
        dist.barrier()
        e.submit(1, 1, warm).result(args["timeout"])
    dist.all_reduce(torch.from_numpy(warm.copy()))
    step = 1
    for mb in args["sizes"]:
        n = int(mb * MB) // 4
        data = np.random.default_rng([args["seed"], rank, n]).standard_normal(n).astype(np.float32)
        for t in transports:
            times[t][mb] = []
            cpu[t][mb] = []
        for rep in range(args["reps"]):
            step += 1
            mine, spent = [], []
            gloo_result = None
            for t in transports:
                if t == "gloo":
                    buf = torch.from_numpy(data.copy())
                    dist.barrier()
                    c0, t0 = _cpu_s(), time.perf_counter()
                    dist.all_reduce(buf)
                    mine.append(time.perf_counter() - t0)
                    spent.extend(_cpu_s() - c0)
                    gloo_result = buf.numpy()
                    continue
                buf = data.copy()  # in place, as gloo's all_reduce (and its copy, untimed)
                dist.barrier()
                c0, t0 = _cpu_s(), time.perf_counter()
                res, report = engines[t].submit(step, 0, buf, out=buf).result(args["timeout"])
                mine.append(time.perf_counter() - t0)
                spent.extend(_cpu_s() - c0)
                if rep == 0:
                    assert gloo_result is not None  # gloo runs first in every repetition
                    checks[t][mb] = _check(t, rank, mb, res, report, gloo_result)
            # The step time of a collective is its slowest rank's; its CPU, every rank's.
            tt = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            cc = torch.tensor(spent, dtype=torch.float64).reshape(len(transports), 2)
            dist.all_reduce(cc, op=dist.ReduceOp.SUM)
            for t, v, c in zip(transports, tt.tolist(), cc.tolist(), strict=True):
                times[t][mb].append(v)
                cpu[t][mb].append((c[0], c[1]))
        # Gather every rank's correctness check for this size (rank 0 reports all).
        flags = torch.tensor(
            [0.0 if checks[t][mb]["ok"] else 1.0 for t in checks], dtype=torch.float64
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        # This rank's delivered fraction covers only what it received; a peer's reduce loss
        # reaches it through the gather, so report the worst rank too.
        worst = torch.tensor(
            [checks[t][mb]["delivered_fraction"] for t in checks], dtype=torch.float64
        )
        dist.all_reduce(worst, op=dist.ReduceOp.MIN)
        for t, bad, low in zip(checks, flags.tolist(), worst.tolist(), strict=True):
            checks[t][mb]["ok_all_ranks"] = bad == 0.0
            checks[t][mb]["delivered_fraction_min_rank"] = low
        del data
    return {"times": times, "cpu": cpu, "checks": checks}


def _cpu_s() -> np.ndarray:
    """User and system CPU seconds of this process so far (every thread: engine loops
    included), as a pair."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([ru.ru_utime, ru.ru_stime])


def _check(
    t: str, rank: int, mb: float, res: np.ndarray, report: Any, ref: np.ndarray
) -> dict[str, Any]:
    """Compare one gradlane result with gloo's; reliable transports must agree."""
    err = np.abs(res.astype(np.float64) - ref)
    scale = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2))) or 1.0
    out = {
        "ok": bool(np.allclose(res, ref, rtol=RTOL, atol=RTOL)) and res.shape == ref.shape,
        "max_abs_err": float(err.max()) if err.size else 0.0,
        "rms_err_rel": float(np.sqrt(np.mean(err**2)) / scale) if err.size else 0.0,
        "delivered_fraction": float(report.delivered_fraction),
        "degraded": bool(report.degraded),
    }
    if t == "udp_bounded":
        out["ok"] = True  # bounded loss may differ by design; reported, not enforced
    elif not out["ok"]:
        raise AssertionError(
            f"rank {rank}: {t} all-reduce of {mb} MB differs from gloo's: max abs error "
            f"{out['max_abs_err']:.3g}, relative rms {out['rms_err_rel']:.3g}"
        )
    return out


# -- parent ----------------------------------------------------------------------------------------
class _Daemons:
    """``HOSTS`` ``gradlane daemon`` processes (host h on 127.0.0.(h+1)), for ``--daemon``."""

    def __init__(self, world: int, timeout: float) -> None:
        self.dir = tempfile.mkdtemp(prefix="gl-bench-")
        self.sockets = [os.path.join(self.dir, f"h{h}.sock") for h in range(HOSTS)]
        paths = [
            f"127.0.0.{h + 1}:{_free_port(f'127.0.0.{h + 1}', socket.SOCK_DGRAM)}"
            for h in range(HOSTS)
        ]
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for h in range(HOSTS):
                cmd = [
                    sys.executable,
                    "-m",
                    "gradlane.integrations.cli.main",
                    "daemon",
                    "--job",
                    str(DAEMON_JOB),
                    "--host-rank",
                    str(h),
                    "--hosts",
                    str(HOSTS),
                    "--socket",
                    self.sockets[h],
                    "--path",
                    paths[h],
                    "--peers",
                    ";".join(paths),
                    "--local-world",
                    str(world // HOSTS),
                    "--hard-deadline",
                    str(HARD_DEADLINE_S),
                    "--metrics",
                    "",
                    "--log-level",
                    "WARNING",
                ]
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
                self.procs.append(p)
                assert p.stdout is not None
                ready, _, _ = select.select([p.stdout], [], [], timeout)
                line = p.stdout.readline() if ready else ""
                if "gradlane daemon: ready" not in line:
                    raise RuntimeError(f"daemon {h} did not start: {line!r}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """SIGTERM every daemon (kill if it does not exit), remove the socket directory."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(HARD_DEADLINE_S + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)
            if p.stdout is not None:
                p.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_world(world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Spawn ``world`` rank processes, wait (bounded) for rank 0's results, clean up every one."""
    if args["daemon"] is True:
        daemons = _Daemons(world, args["timeout"])
        try:
            return run_world(world, {**args, "daemon": daemons.sockets})
        finally:
            daemons.close()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, args, results), name=f"gl-bench-{r}")
        for r in range(world)
    ]
    deadline = time.monotonic() + args["timeout"]
    try:
        for p in procs:
            p.start()
        msg = _wait_for_result(results, procs, deadline, world, args["timeout"])
        if msg[0] != "ok":
            raise RuntimeError(f"rank {msg[1]} failed:\n{msg[2]}")
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return msg[1]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(10.0)
        results.close()


def _wait_for_result(results: Any, procs: list[Any], deadline: float, world: int, limit: float):
    """Rank 0's message; raises as soon as a rank dies or the deadline passes."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            pass
        dead = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"rank process(es) died: {dead}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{world} ranks: no result within {limit}s")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def summarize(per_world: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Rows per (transport, ranks, MB) with median/p99 and the ratio to gloo; the summary maps."""
    rows: list[dict[str, Any]] = []
    summary: dict[str, dict[str, float]] = {k: {} for k in SUMMARY_KEYS.values()}
    summary["daemon_vs_embedded"] = {}
    for world, out in per_world.items():
        times, cpu = out["times"], out["cpu"]
        for t, by_mb in times.items():
            for mb_key, xs in by_mb.items():
                mb = float(mb_key)
                gloo = float(np.median(times["gloo"][mb_key]))
                med = float(np.median(xs))
                cs = cpu[t][mb_key]
                row = {
                    "transport": t,
                    "ranks": world,
                    "MB": mb,
                    "median_s": med,
                    "p99_s": _pct(xs, 99),
                    "times_s": [float(x) for x in xs],  # every repetition, in run order
                    "reps": len(xs),
                    "ratio_to_gloo": med / gloo if gloo > 0 else math.nan,
                    "gbps": mb * MB * 8 / med / 1e9 if med > 0 else math.nan,
                }
                if cs and t != "daemon":
                    cpu_gloo = float(np.median(np.sum(cpu["gloo"][mb_key], axis=1)))
                    split = np.asarray(cs, dtype=float)
                    row["cpu_median_s"] = float(np.median(split.sum(axis=1)))
                    row["cpu_user_median_s"] = float(np.median(split[:, 0]))
                    row["cpu_sys_median_s"] = float(np.median(split[:, 1]))
                    row["cpu_ratio_to_gloo"] = (
                        row["cpu_median_s"] / cpu_gloo if cpu_gloo > 0 else math.nan
                    )
                    if t != "gloo":
                        key = f"{SUMMARY_KEYS[t].removesuffix('_vs_gloo')}_cpu_vs_gloo"
                        summary.setdefault(key, {})[f"{world}x{mb:g}"] = row["cpu_ratio_to_gloo"]
                if t != "gloo":
                    row["check"] = out["checks"][t][mb_key]
                    summary[SUMMARY_KEYS[t]][f"{world}x{mb:g}"] = row["ratio_to_gloo"]
                if t == "daemon":
                    emb = float(np.median(times["udp_reliable"][mb_key]))
                    row["ratio_to_embedded"] = med / emb
                    summary["daemon_vs_embedded"][f"{world}x{mb:g}"] = med / emb
                if t == "udp_keyed":  # the same engine with a job secret, against it
                    plain = float(np.median(times["udp_reliable"][mb_key]))
                    row["ratio_to_unkeyed"] = med / plain
                    summary.setdefault("udp_keyed_vs_unkeyed", {})[f"{world}x{mb:g}"] = med / plain
                if t == "udp_ordered":  # deterministic sums against the default (arrival order)
                    plain = float(np.median(times["udp_reliable"][mb_key]))
                    row["ratio_to_unordered"] = med / plain
                    summary.setdefault("udp_ordered_vs_unordered", {})[f"{world}x{mb:g}"] = (
                        med / plain
                    )
                if t in OFFLOAD_VARIANTS:  # the same engine without (some) offloads, against it
                    full = float(np.median(times["udp_reliable"][mb_key]))
                    row["ratio_to_offload"] = med / full
                    key = f"{t.removeprefix('udp_')}_vs_offload"
                    summary.setdefault(key, {})[f"{world}x{mb:g}"] = med / full
                if t == "zmq_unbatched":  # one packet per frame, against batch frames
                    batched = float(np.median(times["zmq"][mb_key]))
                    row["ratio_to_batched"] = med / batched
                    summary.setdefault("zmq_unbatched_vs_zmq", {})[f"{world}x{mb:g}"] = (
                        med / batched
                    )
                rows.append(row)
    return {"rows": rows, "summary": summary}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    head = (
        f"{'transport':<14}{'ranks':>6}{'MB':>7}{'median ms':>12}{'p99 ms':>10}{'x gloo':>9}"
        f"{'Gb/s':>8}{'cpu ms':>9}{'user':>7}{'sys':>7}{'cpu x':>7}  check"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["ranks"], r["MB"], TRANSPORTS.index(r["transport"]))):
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
        cpu_ms = r.get("cpu_median_s", math.nan) * 1e3
        cpu_x = r.get("cpu_ratio_to_gloo", math.nan)
        user_ms = r.get("cpu_user_median_s", math.nan) * 1e3
        sys_ms = r.get("cpu_sys_median_s", math.nan) * 1e3
        lines.append(
            f"{r['transport']:<14}{r['ranks']:>6}{r['MB']:>7g}{r['median_s'] * 1e3:>12.1f}"
            f"{r['p99_s'] * 1e3:>10.1f}{r['ratio_to_gloo']:>9.2f}{r['gbps']:>8.2f}"
            f"{cpu_ms:>9.1f}{user_ms:>7.1f}{sys_ms:>7.1f}{cpu_x:>7.2f}  {check}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gradlane.bench.perf.allreduce", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    ap.add_argument("--sizes", default="1,25,100", help="comma-separated bucket sizes in MB")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per size (default 5)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="2 ranks, 1 and 25 MB, 3 reps")
    ap.add_argument("--no-zmq", action="store_true", help="skip the ZeroMQ data plane")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per rank count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=65000,
        help="payload per UDP datagram (default 65000, loopback's largest; 1408 is MTU 1500's)",
    )
    ap.add_argument(
        "--offload-compare",
        action="store_true",
        help="also run the reliable UDP engine with UDP GRO off (udp_gso_only) and with GSO "
        "and GRO off (udp_no_offload), interleaved",
    )
    ap.add_argument(
        "--keyed-compare",
        action="store_true",
        help="also run the reliable UDP engine with a job secret (udp_keyed), interleaved",
    )
    ap.add_argument(
        "--order-compare",
        action="store_true",
        help="also run the reliable UDP engine adding contributions in rank order "
        "(udp_ordered: deterministic sums; the default adds them as they arrive), interleaved",
    )
    ap.add_argument(
        "--zmq-batch-compare",
        action="store_true",
        help="also run a ZeroMQ plane sending one packet per frame (zmq_unbatched), interleaved",
    )
    ap.add_argument(
        "--inject-loss",
        type=float,
        default=0.0,
        help="the UDP engines drop this fraction of the datagrams they receive (seeded by "
        "--seed and the rank; gloo and ZeroMQ stay lossless): loss recovery's cost",
    )
    ap.add_argument(
        "--loss-bound", type=float, default=0.02, help="udp_bounded's loss bound (default 0.02)"
    )
    ap.add_argument(
        "--daemon",
        action="store_true",
        help="daemon mode (2 hosts x ranks/2) against the embedded engine; default --ranks 4",
    )
    ns = ap.parse_args(argv)
    host = HostWatch()
    if ns.quick:
        ns.ranks, ns.sizes, ns.reps = "2", "1,25", 3
    if ns.daemon and ns.ranks == "2,4":
        ns.ranks = "4"
    ranks = [int(x) for x in ns.ranks.split(",")]
    sizes = [float(x) for x in ns.sizes.split(",")]
    if ns.reps < 1 or any(r < 2 for r in ranks) or any(s <= 0 for s in sizes):
        ap.error("need --reps >= 1, rank counts >= 2 and positive sizes")
    if ns.daemon and any(r % HOSTS for r in ranks):
        ap.error(f"--daemon splits the ranks over {HOSTS} hosts: give even rank counts")
    from gradlane.transport.drivers.udp.plane import InjectedLoss
    from gradlane.transport.errors import ConfigError

    try:  # the configs' own checks, here rather than in every rank process
        _udp_config(ns.loss_bound, ns.chunk_bytes)
        InjectedLoss(ns.inject_loss)
    except ConfigError as e:
        ap.error(f"--chunk-bytes, --loss-bound or --inject-loss: {e}")
    args = {"sizes": sizes, "reps": ns.reps, "timeout": ns.timeout, "seed": ns.seed,
            "zmq": not ns.no_zmq, "daemon": ns.daemon, "chunk_bytes": ns.chunk_bytes,
            "inject_loss": ns.inject_loss, "loss_bound": ns.loss_bound,
            "offload_compare": ns.offload_compare, "keyed_compare": ns.keyed_compare,
            "order_compare": ns.order_compare,
            "zmq_batch_compare": ns.zmq_batch_compare and not ns.no_zmq}  # fmt: skip
    per_world: dict[int, dict[str, Any]] = {}
    for world in ranks:
        t0 = time.monotonic()
        per_world[world] = run_world(world, args)
        print(f"# {world} ranks done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    report = summarize(per_world)
    failed = [r for r in report["rows"] if "check" in r and not r["check"]["ok_all_ranks"]]
    print(table(report["rows"]))
    if ns.daemon:
        ratios = ", ".join(
            f"{k}: {v:.2f}" for k, v in report["summary"]["daemon_vs_embedded"].items()
        )
        print(f"daemon mode / embedded engine (ranks x MB): {ratios}")
    if ns.json:
        doc = {
            "config": {
                **args,
                "ranks": ranks,
                "n_paths": N_PATHS,
            },
            "host": host.record(),
            **report,
        }
        with open(ns.json, "w") as f:
            json.dump(doc, f, indent=2)
    if failed:
        print(f"CORRECTNESS FAILURE: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
