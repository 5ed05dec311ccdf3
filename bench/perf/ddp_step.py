"""DDP training step time: the reliable gradlane hook against DDP's default all-reduce.

Usage::

    python -m gradlane.bench.perf.ddp_step --json out.json  # 2 and 4 ranks, UDP and ZeroMQ
    python -m gradlane.bench.perf.ddp_step --ranks 2 --steps 10 --transports udp

For each rank count the parent spawns one process per rank (gloo group on a TCPStore on
127.0.0.1, exported as ``MASTER_ADDR``/``MASTER_PORT`` like torchrun does). Every rank builds
the same model (an MLP with 6 × 1024² weights: 25.5 MB of float32 gradients, DDP's default 25 MB
buckets) once per variant from the same seed: DDP with no hook (its built-in gloo all-reduce),
and DDP with :func:`~gradlane.integrations.ddp.gradlane_hook` over a *reliable* data plane (UDP
engine with ``loopback_config()`` and loss bound 0: two loopback paths, 65000-byte chunks; and the
ZeroMQ plane), plus DDP's no-op hook (no communication: the step's compute alone, for
headroom), and, with ``--transports udp,floor``, a hook over
``gradlane.bench.perf.udp_floor``'s batched protocol-free UDP all-reduce (what a UDP hook with no
protocol at all would cost). After warm-up steps (DDP's bucket rebuild, first allocations),
each measured step runs every variant once, the
order rotating from step to step, each behind a barrier; a rank times forward + backward +
optimizer step, and the step time is the slowest rank's (a gloo MAX all-reduce of the times).
Each step's CPU time is measured too (user + system of every rank's process over the step, its
engine threads included, summed over ranks): with more ranks than cores it is what the step
time comes down to, and it swings less than the time (``summary.cpu_ratio_vs_default``).
All variants see the same batches, so their models stay equal: the largest parameter gap to
the default's is reported as the correctness check (it fails the run above ``1e-4``).
For the UDP engine the rows also give its loop thread's CPU and timer wakeups per measured
step and rank (``engine_per_step``: the engine's own cost, apart from the training's).

Loopback on a shared machine: the figures compare transports in the same run; they are not a
network measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import queue
import resource
import socket
import sys
import time
import traceback
from typing import Any

import numpy as np

VARIANTS = ("default", "udp", "zmq", "floor")
#: Not a transport: DDP's no-op hook (no communication at all), the compute-only headroom.
NOOP = "noop"
N_PATHS = 2
#: Largest parameter gap to the default hook's model that still counts as equal (float32
#: summation order over a few steps of SGD).
MAX_PARAM_GAP = 1e-4


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- rank process ----------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=300)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            out = _measure(rank, world, args)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", out))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise


def _measure(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from gradlane.bench.demo.models import big_mlp
    from gradlane.bench.perf.udp_floor import FloorHook, floor_hook
    from gradlane.integrations.ddp import GradlaneState, HookConfig, gradlane_hook
    from gradlane.scheduling.loss import LossConfig
    from gradlane.transport.config import loopback_config
    from gradlane.transport.drivers.zmq.plane import zmq_config
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    variants = ["default", *args["transports"], NOOP]
    models, ddps, opts, states = {}, {}, {}, {}
    floor: FloorHook | None = None
    try:
        for v in variants:
            torch.manual_seed(args["seed"])
            models[v] = big_mlp()
            ddps[v] = DistributedDataParallel(models[v])
            opts[v] = torch.optim.SGD(models[v].parameters(), lr=0.01)
            if v == "udp":
                cfg = loopback_config(
                    n_paths=N_PATHS, loss=LossConfig(loss_bound=0.0, hard_deadline_s=120.0)
                )
            elif v == "zmq":
                cfg = zmq_config(n_paths=N_PATHS)
            elif v == "floor":
                floor = FloorHook(rank, world)
                ports: list[Any] = [None] * world
                dist.all_gather_object(ports, floor.port)
                floor.start(ports)
                ddps[v].register_comm_hook(floor, floor_hook)
                continue
            else:
                if v == NOOP:
                    ddps[v].register_comm_hook(None, noop_hook)
                continue
            state = GradlaneState(cfg, HookConfig(transport=v, log_every=0, name=f"step-{v}"))
            states[v] = state
            ddps[v].register_comm_hook(state, gradlane_hook)
        grad_bytes = sum(p.numel() * p.element_size() for p in models["default"].parameters())
        times: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        total = args["warmup"] + args["steps"]
        loop0: dict[str, Any] = {}
        for step in range(total):
            if step == args["warmup"]:
                loop0 = {v: _loop_stats(st) for v, st in states.items()}
            g = torch.Generator().manual_seed(args["seed"] * 1_000_003 + rank * 1009 + step)
            x = torch.randn(args["batch"], 64, generator=g)
            y = torch.randint(0, 10, (args["batch"],), generator=g)
            k = step % len(variants)
            for v in variants[k:] + variants[:k]:  # rotate the order every step
                dist.barrier()
                c0, t0 = _cpu_s(), time.perf_counter()
                opts[v].zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(ddps[v](x), y).backward()
                opts[v].step()
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                spent = torch.tensor([_cpu_s() - c0], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                dist.all_reduce(spent, op=dist.ReduceOp.SUM)
                if step >= args["warmup"]:
                    times[v].append(float(took))
                    cpu[v].append(float(spent))
        ref = torch.cat([p.detach().reshape(-1) for p in models["default"].parameters()])
        gaps = {}
        for v in args["transports"]:
            flat = torch.cat([p.detach().reshape(-1) for p in models[v].parameters()])
            gap = torch.tensor([float((flat - ref).abs().max())], dtype=torch.float64)
            dist.all_reduce(gap, op=dist.ReduceOp.MAX)
            gaps[v] = float(gap)
        # The hook's own view: from the first bucket handed over to the last one reduced.
        comm = {v: st.stats()["comm_s"]["p50"] for v, st in states.items()}
        # The UDP engine's loop thread per measured step, mean over ranks: its CPU (whatever
        # variant's step it served it in) and its timer wakeups.
        engine = {}
        for v, st in states.items():
            now, then = _loop_stats(st), loop0.get(v)
            if now is None or then is None:
                continue
            per = torch.tensor([now[0] - then[0], now[1] - then[1]], dtype=torch.float64)
            dist.all_reduce(per, op=dist.ReduceOp.SUM)
            per /= world * args["steps"]
            engine[v] = {"cpu_s": float(per[0]), "timer_passes": float(per[1])}
        for state in states.values():  # peers have what this rank sent, while all still answer
            state.drain()
        dist.barrier()  # every rank is past its last step and drained before the engines close
    finally:
        for state in states.values():
            state.close()
        if floor is not None:
            floor.close()
    return {
        "times": times,
        "cpu": cpu,
        "param_gap": gaps,
        "grad_bytes": grad_bytes,
        "hook_comm_p50_s": comm,
        "engine_per_step": engine,
    }


def _loop_stats(state: Any) -> tuple[float, float] | None:
    """The data plane's loop-thread CPU seconds and timer wakeups so far (the UDP engine's
    ``stats()["loop"]``; None for planes without one)."""
    loop = state.stats(plane=True)["plane"].get("loop")
    return None if loop is None or loop["cpu_s"] is None else (loop["cpu_s"], loop["timer_passes"])


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far (every thread: the engines' included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# -- parent ----------------------------------------------------------------------------------------
def run_world(world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Spawn ``world`` ranks, wait (bounded) for rank 0's result, clean up every process."""
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world, port, args, results), name=f"gl-ddp-step-{r}"
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + args["timeout"]
    try:
        for p in procs:
            p.start()
        while True:
            try:
                msg = results.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank process(es) died: {dead}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} ranks: no result in {args['timeout']}s") from None
        if msg[0] != "ok":
            raise RuntimeError(f"rank {msg[1]} failed:\n{msg[2]}")
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return dict(msg[1])
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


def summarize(per_world: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Rows per (variant, ranks) and the summary ratios (median step time / default's)."""
    rows = []
    summary: dict[str, dict[str, float]] = {"step_ratio_vs_default": {}, "cpu_ratio_vs_default": {}}
    for world, out in sorted(per_world.items()):
        base = float(np.median(out["times"]["default"]))
        cpu_base = float(np.median(out["cpu"]["default"]))
        for v, xs in out["times"].items():
            med = float(np.median(xs))
            cpu = float(np.median(out["cpu"][v]))
            rows.append(
                {
                    "variant": v,
                    "ranks": world,
                    "median_s": med,
                    "p90_s": float(np.percentile(xs, 90)),
                    "min_s": float(np.min(xs)),
                    "steps": len(xs),
                    "ratio_to_default": med / base,
                    "cpu_median_s": cpu,
                    "cpu_ratio_to_default": cpu / cpu_base,
                    "param_gap": out["param_gap"].get(v, 0.0),
                    "hook_comm_p50_s": out["hook_comm_p50_s"].get(v),
                    "engine_per_step": out.get("engine_per_step", {}).get(v),
                }
            )
            if v == "udp":
                summary["step_ratio_vs_default"][str(world)] = med / base
                summary["cpu_ratio_vs_default"][str(world)] = cpu / cpu_base
            elif v not in ("default", NOOP):
                summary.setdefault(f"step_ratio_vs_default_{v}", {})[str(world)] = med / base
                summary.setdefault(f"cpu_ratio_vs_default_{v}", {})[str(world)] = cpu / cpu_base
    return {"rows": rows, "summary": summary}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    head = (
        f"{'hook':<18}{'ranks':>6}{'median ms':>11}{'p90 ms':>9}{'x default':>11}"
        f"{'cpu ms':>9}{'cpu x':>7}{'hook comm ms':>14}{'engine ms':>11}{'timers':>8}  param gap"
    )
    lines = [head, "-" * len(head)]
    names = {"default": "default (gloo)", "udp": "gradlane udp", "zmq": "gradlane zmq",
             "floor": "udp floor (bench)", NOOP: "no-op (no comm)"}  # fmt: skip
    for r in rows:
        comm, eng = r["hook_comm_p50_s"], r.get("engine_per_step")
        eng_ms = "" if eng is None else f"{eng['cpu_s'] * 1e3:.1f}"
        timers = "" if eng is None else f"{eng['timer_passes']:.1f}"
        lines.append(
            f"{names[r['variant']]:<18}{r['ranks']:>6}{r['median_s'] * 1e3:>11.1f}"
            f"{r['p90_s'] * 1e3:>9.1f}{r['ratio_to_default']:>11.2f}"
            f"{r['cpu_median_s'] * 1e3:>9.1f}{r['cpu_ratio_to_default']:>7.2f}"
            f"{'' if comm is None else f'{comm * 1e3:.1f}':>14}{eng_ms:>11}{timers:>8}  "
            f"{'-' if r['variant'] == NOOP else format(r['param_gap'], '.1e')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gradlane.bench.perf.ddp_step", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    ap.add_argument("--steps", type=int, default=15, help="measured steps (default 15)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured first steps (default 3)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    ap.add_argument(
        "--transports",
        default="udp,zmq",
        help="gradlane data planes (default udp,zmq); floor adds gradlane.bench.perf.udp_floor's "
        "protocol-free UDP hook",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per rank count")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    ranks = [int(x) for x in ns.ranks.split(",")]
    transports = [t for t in ns.transports.split(",") if t]
    if ns.steps < 1 or ns.warmup < 2 or any(r < 2 for r in ranks):
        ap.error("need --steps >= 1, --warmup >= 2 (DDP rebuilds its buckets) and ranks >= 2")
    if "udp" not in transports or set(transports) - set(VARIANTS[1:]):
        ap.error("--transports: udp (the summary's), optionally zmq and floor")
    args = {"steps": ns.steps, "warmup": ns.warmup, "batch": ns.batch, "seed": ns.seed,
            "transports": transports, "timeout": ns.timeout}  # fmt: skip
    per_world: dict[int, dict[str, Any]] = {}
    for world in ranks:
        t0 = time.monotonic()
        per_world[world] = run_world(world, args)
        print(f"# {world} ranks done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    report = summarize(per_world)
    grad_mb = next(iter(per_world.values()))["grad_bytes"] / 1e6
    print(f"DDP step time, MLP with {grad_mb:.1f} MB of float32 gradients, loopback")
    print(table(report["rows"]))
    failed = [r for r in report["rows"] if r["param_gap"] > MAX_PARAM_GAP]
    if ns.json:
        from gradlane.bench.sim.scenarios import _commit

        doc = {
            "config": {
                **args,
                "ranks": ranks,
                "grad_bytes": per_world[ranks[0]]["grad_bytes"],
                "n_paths": N_PATHS,
                "chunk_bytes": 65000,
                "cpus": os.cpu_count(),
                "host_load": os.getloadavg(),
                "commit": _commit(),
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
            },
            **report,
            "times": {str(w): out["times"] for w, out in per_world.items()},
        }
        with open(ns.json, "w") as f:
            json.dump(doc, f, indent=2)
    if failed:
        print(f"CORRECTNESS FAILURE (parameters differ from the default hook's): {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
