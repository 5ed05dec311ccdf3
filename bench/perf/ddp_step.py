"""DDP training step time: the reliable gradlane hook against DDP's default all-reduce.

Usage::

    python -m gradlane.bench.perf.ddp_step --json out.json  # 2 and 4 ranks, UDP and ZeroMQ
    python -m gradlane.bench.perf.ddp_step --ranks 2 --steps 10 --transports udp
    python -m gradlane.bench.perf.ddp_step --device cuda --json gpu.json  # 2 ranks, one GPU

For each rank count the parent spawns one process per rank (gloo group on a TCPStore on
127.0.0.1, exported as ``MASTER_ADDR``/``MASTER_PORT`` like torchrun does). Every rank builds
the same model once per variant from the same seed: DDP with no hook (its built-in gloo
all-reduce), and DDP with :func:`~gradlane.integrations.ddp.gradlane_hook` over a *reliable* data
plane (UDP engine with ``loopback_config()`` and loss bound 0: two loopback paths, 65000-byte
chunks; and the ZeroMQ plane), plus DDP's no-op hook (no communication: the step's compute
alone, for headroom), and, with ``--transports udp,floor``, a hook over
``gradlane.bench.perf.udp_floor``'s batched protocol-free UDP all-reduce (what a UDP hook with no
protocol at all would cost). After warm-up steps (DDP's bucket rebuild, first allocations),
each measured step runs every variant once, the order rotating from step to step, each behind a
barrier; a rank times forward + backward + optimizer step, and the step time is the slowest
rank's (a gloo MAX all-reduce of the times). Each step's CPU time is measured too (user +
system of every rank's process over the step, its engine threads included, summed over ranks):
with more ranks than cores it is what the step time comes down to, and it swings less than the
time (``summary.cpu_ratio_vs_default``). All variants see the same batches, so their models stay
equal: the largest parameter gap to the default's is reported as the correctness check (it
fails the run above ``1e-4``). For the UDP engine the rows also give its loop thread's CPU and
timer wakeups per measured step and rank (``engine_per_step``: the engine's own cost, apart from
the training's).

Communication and overlap: a variant's *exposed* communication is its step time less the no-op
hook's in the same measured step (median over steps). For gradlane's planes the rows also give
how long the plane had a collective in flight per step (``plane_busy_s``: the union, over the
step's buckets, of submit to completion, the slowest rank's) and the share of it hidden behind
the backward pass: ``overlap_fraction = 1 - exposed / plane_busy``, clipped to [0, 1].

Models (``--model``): ``mlp``, an MLP with 6 × 1024² weights (25.5 MB of float32 gradients, DDP's
default 25 MB buckets) on 64 features; ``resnet``, ResNet-18's layout (four stages of two basic
blocks, batch norm) at 48 base channels instead of 64 on 32 × 32 synthetic images: 6.3 M
parameters, 25.2 MB of gradients, and convolutions that give a GPU real work per step.

``--device cuda`` puts every rank's models and DDP's buckets on ``cuda:0`` (the ranks share one
GPU; the group stays gloo, and DDP's default hook stages CUDA tensors through it itself); the
defaults become 2 ranks, the UDP plane, the ResNet at 512 images per rank, 5 + 30 steps. Steps
are timed between ``torch.cuda.synchronize()`` calls. The summary then holds
``gpu_step_ratio_vs_default``, ``gpu_exposed_comm_ratio_vs_default`` and
``gpu_overlap_fraction`` (per rank count) instead of the CPU run's ratios, and the JSON records
the device's name and the torch and CUDA versions. Without a CUDA device, ``--device cuda``
exits with status 2 and says so.

Loopback on a shared machine: the figures compare transports in the same run; they are not a
network measurement.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import multiprocessing as mp
import os
import queue
import resource
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from gradlane.bench.demo.models import big_mlp
from gradlane.bench.host import HostWatch, cpu_model
from gradlane.transport.drivers.plane import PlaneWrapper
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VARIANTS = ("default", "udp", "zmq", "floor")
#: Not a transport: DDP's no-op hook (no communication at all), the compute-only headroom.
NOOP = "noop"
N_PATHS = 2
#: Largest parameter gap to the default hook's model that still counts as equal (float32
#: summation order over a few steps of SGD).
MAX_PARAM_GAP = 1e-4
DEVICES = ("cpu", "cuda")
MODELS = ("mlp", "resnet")
#: Defaults that depend on the device (and, for the batch, on the model).
DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"ranks": "2,4", "transports": "udp,zmq", "steps": 15, "warmup": 3, "model": "mlp",
            "batch": {"mlp": 32, "resnet": 32}},
    "cuda": {"ranks": "2", "transports": "udp", "steps": 30, "warmup": 5, "model": "resnet",
             "batch": {"mlp": 16384, "resnet": 512}},
}  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- models ----------------------------------------------------------------------------------------
def build_model(name: str) -> nn.Module:
    """The benchmark's model ``name`` (``mlp`` or ``resnet``), from the current torch seed."""
    return big_mlp() if name == "mlp" else resnet18_like()


def resnet18_like(width: int = 48, classes: int = 10) -> nn.Module:
    """ResNet-18's layout for 32 × 32 images (a 3 × 3 stem, four stages of two basic blocks,
    strides 1, 2, 2, 2, batch norm) with ``width`` base channels (64 in ResNet-18); 48 gives
    6,288,442 parameters, 25.2 MB of float32 gradients."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    ]
    cin = width
    for stage, stride in enumerate((1, 2, 2, 2)):
        cout = width * 2**stage
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [GlobalAvgPool(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class GlobalAvgPool(nn.Module):
    """The mean over the spatial dimensions, ``(N, C, H, W) -> (N, C)``: what
    ``AdaptiveAvgPool2d(1)`` and ``Flatten`` compute, with a backward that CUDA runs
    deterministically (the adaptive pool's scatters with atomics)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x.mean((2, 3))``."""
        return x.mean((2, 3))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3 × 3 convolutions with batch norm, added to a shortcut (a
    1 × 1 projection where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(body(x) + shortcut(x))``."""
        return nn.functional.relu(self.body(x) + self.shortcut(x))


def _inputs(
    args: dict[str, Any], rank: int, step: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step`` (the same for every variant), made on ``device``."""
    g = torch.Generator(device=device).manual_seed(args["seed"] * 1_000_003 + rank * 1009 + step)
    shape = (args["batch"], 3, 32, 32) if args["model"] == "resnet" else (args["batch"], 64)
    x = torch.randn(*shape, generator=g, device=device)
    y = torch.randint(0, 10, (args["batch"],), generator=g, device=device)
    return x, y


# -- timing the plane ------------------------------------------------------------------------------
def busy_s(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of the ``(start, end)`` intervals: how long at least one collective
    was in flight."""
    total, reach = 0.0, -float("inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class TimedPlane(PlaneWrapper):
    """A data plane, wrapped to time each collective from its submit (for a GPU bucket, once the
    hook has it in host memory) to its completion; otherwise the wrapped plane's."""

    def __init__(self, plane: Any) -> None:
        super().__init__(plane)
        self._lock = threading.Lock()
        self._spans: dict[int, list[tuple[float, float]]] = {}

    def watch(self, step: int, bucket: int, data: np.ndarray) -> Callable[[Any], None]:
        """Start the collective's clock; its completion stops it."""
        t0 = time.perf_counter()
        return lambda _: self._done(step, t0)

    def _done(self, step: int, t0: float) -> None:
        t1 = time.perf_counter()
        with self._lock:
            self._spans.setdefault(step, []).append((t0, t1))

    def busy_s(self, step: int) -> float:
        """How long a collective of ``step`` was in flight (0.0 for a step not seen)."""
        with self._lock:
            return busy_s(self._spans.get(step, ()))


def deterministic_cuda() -> None:
    """Make this process's CUDA kernels deterministic (cuDNN's and cuBLAS's choices, and an
    error from any op without a deterministic kernel), so that the hooks' models can be compared
    bit-for-bit: otherwise the atomic adds of some kernels alone part two copies of the ResNet
    by about 5e-4 within 30 steps (H200). Call it before the first cuBLAS use."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


# -- rank process ----------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], results: Any) -> None:
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
    import torch.distributed as dist
    from gradlane.bench.perf.udp_floor import FloorHook, floor_hook
    from gradlane.integrations.ddp import GradlaneState, HookConfig, gradlane_hook
    from gradlane.scheduling.loss import LossConfig
    from gradlane.transport.config import loopback_config
    from gradlane.transport.drivers.zmq.plane import zmq_config
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    cuda = args["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        deterministic_cuda()

    def sync() -> None:  # the clock is read only once the device has done the step's work
        if cuda:
            torch.cuda.synchronize(device)

    variants = ["default", *args["transports"], NOOP]
    models, ddps, opts, states, timed = {}, {}, {}, {}, {}
    floor: FloorHook | None = None
    try:
        for v in variants:
            torch.manual_seed(args["seed"])
            models[v] = build_model(args["model"]).to(device)
            ddps[v] = DistributedDataParallel(
                models[v], device_ids=[0] if cuda else None, **_no_buffer_sync(models[v])
            )
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
            state.plane = timed[v] = TimedPlane(state.plane)
            ddps[v].register_comm_hook(state, gradlane_hook)
        grad_bytes = sum(p.numel() * p.element_size() for p in models["default"].parameters())
        times: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        total = args["warmup"] + args["steps"]
        loop0: dict[str, Any] = {}
        for step in range(total):
            if step == args["warmup"]:
                loop0 = {v: _loop_stats(st) for v, st in states.items()}
            x, y = _inputs(args, rank, step, device)
            k = step % len(variants)
            for v in variants[k:] + variants[:k]:  # rotate the order every step
                dist.barrier()
                sync()
                c0, t0 = _cpu_s(), time.perf_counter()
                opts[v].zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(ddps[v](x), y).backward()
                opts[v].step()
                sync()
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
        # The plane's busy time per measured step, the slowest rank's.
        busy = {}
        for v, tp in timed.items():
            per = torch.tensor([tp.busy_s(s) for s in range(args["warmup"], total)])
            dist.all_reduce(per, op=dist.ReduceOp.MAX)
            busy[v] = [float(b) for b in per]
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
        "plane_busy_s": busy,
        "engine_per_step": engine,
        "env": _environment(device),
    }


def _no_buffer_sync(model: nn.Module) -> dict[str, Any]:
    """DDP's option that skips the broadcast of buffers (batch norm's running statistics)
    before each forward, which would add a gloo broadcast to every variant's step alike: named
    ``forward_sync_buffers`` where torch has it, ``broadcast_buffers`` before. Nothing for a
    model without buffers."""
    if not any(True for _ in model.buffers()):
        return {}
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return {name: False}


def _environment(device: torch.device) -> dict[str, Any]:
    """What ran the steps: the device's name, torch's version and the CUDA it was built for."""
    cuda = device.type == "cuda"
    return {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if cuda else cpu_model(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
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


def overlap_fraction(exposed_s: float | None, busy: float | None) -> float | None:
    """The share of the plane's busy time hidden behind the step's compute: ``1 - exposed /
    busy``, clipped to [0, 1]; None without a busy time."""
    if exposed_s is None or busy is None or busy <= 0:
        return None
    return float(min(1.0, max(0.0, 1.0 - max(exposed_s, 0.0) / busy)))


def summarize(per_world: dict[int, dict[str, Any]], device: str = "cpu") -> dict[str, Any]:
    """Rows per (variant, ranks) and the summary ratios (median step time / default's).

    ``per_world[ranks]`` holds per-variant lists of measured steps: ``times`` (step seconds,
    the slowest rank's; the no-op hook's among them), ``cpu``, and, for gradlane's planes,
    ``plane_busy_s``. A CPU run's summary has ``step_ratio_vs_default`` and
    ``cpu_ratio_vs_default`` (``_<variant>`` suffixed for the other planes); a CUDA run's
    ``gpu_step_ratio_vs_default``, ``gpu_exposed_comm_ratio_vs_default`` (None where the
    default hook exposes no communication at all) and ``gpu_overlap_fraction``.
    """
    rows = []
    gpu = device == "cuda"
    keys = (
        ("gpu_step_ratio_vs_default", "gpu_exposed_comm_ratio_vs_default", "gpu_overlap_fraction")
        if gpu
        else ("step_ratio_vs_default", "cpu_ratio_vs_default")
    )
    summary: dict[str, dict[str, float | None]] = {k: {} for k in keys}
    for world, out in sorted(per_world.items()):
        times = out["times"]
        base = float(np.median(times["default"]))
        cpu_base = float(np.median(out["cpu"]["default"]))
        noop = np.asarray(times[NOOP], dtype=np.float64) if NOOP in times else None
        exposed = {
            v: None if noop is None else float(np.median(np.asarray(xs) - noop))
            for v, xs in times.items()
        }
        for v, xs in times.items():
            med = float(np.median(xs))
            cpu = float(np.median(out["cpu"][v]))
            busy_steps = out.get("plane_busy_s", {}).get(v)
            busy = float(np.median(busy_steps)) if busy_steps else None
            overlap = overlap_fraction(exposed[v], busy)
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
                    "exposed_comm_s": exposed[v],
                    "plane_busy_s": busy,
                    "overlap_fraction": overlap,
                    "param_gap": out["param_gap"].get(v, 0.0),
                    "hook_comm_p50_s": out["hook_comm_p50_s"].get(v),
                    "engine_per_step": out.get("engine_per_step", {}).get(v),
                }
            )
            if v in ("default", NOOP):
                continue
            sfx, w = ("" if v == "udp" else f"_{v}"), str(world)
            if gpu:
                # None where the default hook exposes no communication (no ratio to take).
                mine, theirs = exposed[v], exposed["default"]
                ratio = None
                if mine is not None and theirs is not None and theirs > 0:
                    ratio = mine / theirs
                summary.setdefault(f"gpu_step_ratio_vs_default{sfx}", {})[w] = med / base
                summary.setdefault(f"gpu_exposed_comm_ratio_vs_default{sfx}", {})[w] = ratio
                summary.setdefault(f"gpu_overlap_fraction{sfx}", {})[w] = overlap
            else:
                summary.setdefault(f"step_ratio_vs_default{sfx}", {})[w] = med / base
                summary.setdefault(f"cpu_ratio_vs_default{sfx}", {})[w] = cpu / cpu_base
    return {"rows": rows, "summary": summary}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    head = (
        f"{'hook':<18}{'ranks':>6}{'median ms':>11}{'p90 ms':>9}{'x default':>11}"
        f"{'cpu ms':>9}{'cpu x':>7}{'exposed ms':>12}{'overlap':>9}{'hook comm ms':>14}"
        f"{'engine ms':>11}{'timers':>8}  param gap"
    )
    lines = [head, "-" * len(head)]
    names = {"default": "default (gloo)", "udp": "gradlane udp", "zmq": "gradlane zmq",
             "floor": "udp floor (bench)", NOOP: "no-op (no comm)"}  # fmt: skip
    for r in rows:
        comm, eng = r["hook_comm_p50_s"], r.get("engine_per_step")
        eng_ms = "" if eng is None else f"{eng['cpu_s'] * 1e3:.1f}"
        timers = "" if eng is None else f"{eng['timer_passes']:.1f}"
        exposed, overlap = r.get("exposed_comm_s"), r.get("overlap_fraction")
        lines.append(
            f"{names[r['variant']]:<18}{r['ranks']:>6}{r['median_s'] * 1e3:>11.1f}"
            f"{r['p90_s'] * 1e3:>9.1f}{r['ratio_to_default']:>11.2f}"
            f"{r['cpu_median_s'] * 1e3:>9.1f}{r['cpu_ratio_to_default']:>7.2f}"
            f"{'' if exposed is None else f'{exposed * 1e3:.1f}':>12}"
            f"{'' if overlap is None else f'{overlap:.2f}':>9}"
            f"{'' if comm is None else f'{comm * 1e3:.1f}':>14}{eng_ms:>11}{timers:>8}  "
            f"{'-' if r['variant'] == NOOP else format(r['param_gap'], '.1e')}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """The run's options, the device's defaults filled in; argument errors exit with status 2
    (argparse's ``error``)."""
    ap = argparse.ArgumentParser(
        prog="python -m gradlane.bench.perf.ddp_step", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--device", choices=DEVICES, default="cpu",
                    help="where the models and DDP's buckets live (default cpu); cuda: cuda:0 "
                    "for every rank (they share the GPU)")  # fmt: skip
    ap.add_argument("--model", choices=MODELS, help="default: mlp on cpu, resnet on cuda")
    ap.add_argument("--ranks", help="comma-separated rank counts (default 2,4; 2 on cuda)")
    ap.add_argument("--steps", type=int, help="measured steps (default 15; 30 on cuda)")
    ap.add_argument("--warmup", type=int, help="unmeasured first steps (default 3; 5 on cuda)")
    ap.add_argument("--batch", type=int,
                    help="samples per rank and step (default 32; on cuda 512 images for resnet, "
                    "16384 for mlp)")  # fmt: skip
    ap.add_argument(
        "--transports",
        help="gradlane data planes (default udp,zmq; udp on cuda); floor adds "
        "gradlane.bench.perf.udp_floor's protocol-free UDP hook (cpu only)",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per rank count")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    d = DEFAULTS[ns.device]
    model = ns.model or d["model"]
    opts = {
        "device": ns.device,
        "model": model,
        "ranks": [int(x) for x in (ns.ranks or d["ranks"]).split(",") if x],
        "transports": [t for t in (ns.transports or d["transports"]).split(",") if t],
        "steps": d["steps"] if ns.steps is None else ns.steps,
        "warmup": d["warmup"] if ns.warmup is None else ns.warmup,
        "batch": d["batch"][model] if ns.batch is None else ns.batch,
        "seed": ns.seed,
        "timeout": ns.timeout,
        "json": ns.json,
    }
    if opts["steps"] < 1 or opts["warmup"] < 2 or opts["batch"] < 1:
        ap.error("need --steps >= 1, --warmup >= 2 (DDP rebuilds its buckets) and --batch >= 1")
    if not opts["ranks"] or any(r < 2 for r in opts["ranks"]):
        ap.error("need ranks >= 2")
    transports = opts["transports"]
    if "udp" not in transports or set(transports) - set(VARIANTS[1:]):
        ap.error("--transports: udp (the summary's), optionally zmq and floor")
    if ns.device == "cuda" and "floor" in transports:
        ap.error("--transports floor: the protocol-free hook reduces CPU buckets only")
    return opts


def cuda_missing() -> str | None:
    """Why ``--device cuda`` cannot run here (None when a CUDA device is there)."""
    if torch.cuda.is_available():
        return None
    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"--device cuda needs a CUDA GPU, and torch {torch.__version__} ({built}) sees none"


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    host = HostWatch()
    if opts["device"] == "cuda":
        why = cuda_missing()
        if why is not None:
            print(f"ddp_step: error: {why}", file=sys.stderr)
            return 2
    ranks = opts["ranks"]
    args = {k: opts[k] for k in ("steps", "warmup", "batch", "seed", "transports", "timeout",
                                 "device", "model")}  # fmt: skip
    per_world: dict[int, dict[str, Any]] = {}
    for world in ranks:
        t0 = time.monotonic()
        per_world[world] = run_world(world, args)
        print(f"# {world} ranks done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    report = summarize(per_world, opts["device"])
    first = per_world[ranks[0]]
    env = first["env"]
    where = "loopback" if env["device"] == "cpu" else f"{env['device_name']}, loopback"
    grad_mb = first["grad_bytes"] / 1e6
    print(f"DDP step time, {opts['model']} with {grad_mb:.1f} MB of float32 gradients, {where}")
    print(table(report["rows"]))
    failed = [r for r in report["rows"] if r["param_gap"] > MAX_PARAM_GAP]
    if opts["json"]:
        from gradlane.bench.sim.scenarios import _commit

        doc = {
            "config": {
                **args,
                "ranks": ranks,
                "grad_bytes": first["grad_bytes"],
                "n_paths": N_PATHS,
                "chunk_bytes": 65000,
                "commit": _commit(),
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
                **env,
            },
            "host": host.record(),
            **report,
            "times": {str(w): out["times"] for w, out in per_world.items()},
        }
        with open(opts["json"], "w") as f:
            json.dump(doc, f, indent=2)
    if failed:
        print(f"CORRECTNESS FAILURE (parameters differ from the default hook's): {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
