"""The main job on one machine: real DDP training, DDP's default gloo hook against gradlane's.

``run_demo`` spawns ``ranks`` processes on loopback. They build one gloo process group (a
TCPStore on 127.0.0.1, exported as ``MASTER_ADDR``/``MASTER_PORT`` like ``torchrun`` does) and
train the same model from the same initialisation on scikit-learn's digits twice, one after the
other: with DDP's default all-reduce hook over gloo (TCP), then with :func:`gradlane_hook`
(UDP, two loopback paths, a loss bound, and ``inject_loss`` of the datagrams every rank receives
dropped at random with a fixed seed, because loopback never loses anything). Each run is
wrapped in the trace recorder, which times every bucket's communication; each rank times every
step (forward, backward, optimizer). Rank 0 reports progress; at the end every rank reports its
test accuracy, step and communication times and gradlane's statistics, and the parent builds the
comparison (per step, the slowest rank counts).

Every hand-off is a queue read with a timeout and every process is joined or killed, whatever
happens.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["RUNS", "DemoError", "DemoOptions", "merge_rank_timelines", "run_demo"]

RUNS = ("gloo", "gradlane")
#: Seconds the parent waits for any word from the ranks before it gives up.
SILENCE_S = 180.0


class DemoError(RuntimeError):
    """A rank failed, or the ranks went silent."""


@dataclass(frozen=True)
class DemoOptions:
    """What the demo trains and how gradlane is configured."""

    ranks: int = 4
    steps: int = 200
    model: str = "mlp"
    loss_bound: float = 0.05
    inject_loss: float = 0.05
    transport: str = "udp"
    batch: int = 32
    """Images per rank and step."""
    lr: float = 0.05
    seed: int = 1
    chunk_bytes: int = 4096
    """gradlane payload per datagram (MTU-sized: a bucket of this small model is then dozens
    of chunks per shard, enough for a loss bound to mean something)."""
    warmup_steps: int = 2
    """Steps left out of the timing percentiles (DDP's bucket rebuild happens in them)."""
    eval_every: int = 4
    """Held-out accuracy every this many steps (outside the timed step): the time-to-accuracy
    curve."""
    target_accuracy: float | None = None
    """The accuracy (%) whose first crossing the time-to-accuracy figures time; None: 1 point
    under the baseline's final accuracy."""
    timeline: str = ""
    """The gradlane run's hook timeline (``HookConfig.timeline``: one file per rank, merged by
    :func:`merge_rank_timelines`); '' = off."""
    hard_deadline_s: float = 10.0
    timeout_s: float = 900.0
    precision: str = ""
    """The testbed demo's extra gradlane run with this wire-precision policy
    (``gradlane_<policy>``, e.g. ``adaptive``); '' = none."""
    error_feedback: bool = True
    """That run's error feedback (``PrecisionConfig.error_feedback``)."""


def run_demo(
    opts: DemoOptions, on_progress: Callable[[str, int, int], None] | None = None
) -> dict[str, Any]:
    """Train twice on ``opts.ranks`` processes; returns the comparison (``"summary"`` etc.).

    ``on_progress(run, step, steps)`` follows rank 0; step 0 says that the run's data plane is
    starting (a gradlane run's ranks then compile or load the kernels: see
    :mod:`gradlane.transport.drivers.warmup`)."""
    if opts.ranks < 2:
        raise ValueError("the demo needs at least 2 ranks")
    if opts.steps <= opts.warmup_steps:
        raise ValueError(f"--steps must be more than the {opts.warmup_steps} warm-up steps")
    ctx = mp.get_context("spawn")
    up: Any = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, opts.ranks, port, asdict(opts), up),
            name=f"gradlane-demo-r{r}",
            daemon=True,
        )
        for r in range(opts.ranks)
    ]
    t0 = time.perf_counter()
    results: dict[str, dict[int, dict[str, Any]]] = {run: {} for run in RUNS}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + opts.timeout_s
        silent_since = time.monotonic()
        while any(len(results[run]) < opts.ranks for run in RUNS):
            if time.monotonic() > deadline:
                raise DemoError(f"the demo did not finish within {opts.timeout_s:.0f}s")
            try:
                msg = up.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise DemoError(f"rank process(es) {dead} died without a word") from None
                if time.monotonic() - silent_since > SILENCE_S:
                    raise DemoError(f"no word from the ranks for {SILENCE_S:.0f}s") from None
                continue
            silent_since = time.monotonic()
            if msg[0] == "progress" and on_progress is not None:
                on_progress(msg[1], msg[2], opts.steps)
            elif msg[0] == "result":
                results[msg[1]][msg[2]] = msg[3]
            elif msg[0] == "error":
                raise DemoError(f"rank {msg[1]} failed:\n{msg[2]}")
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            p.join(30.0)
        for p in started:
            if p.is_alive():
                p.kill()
                p.join(10.0)
        up.close()
        up.join_thread()
    out = _compare(opts, results)
    out["wall_s"] = time.perf_counter() - t0
    return out


# -- rank processes --------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, opts_dict: dict[str, Any], up: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Loopback socket buffers are capped on most machines; the engine's warning is noise here.
    logging.getLogger("gradlane.transport.drivers.udp.sockets").setLevel(logging.ERROR)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # what torchrun exports: the hook finds the store
    os.environ["MASTER_PORT"] = str(port)
    opts = DemoOptions(**opts_dict)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            from gradlane.bench.demo.models import load_digits

            data = load_digits(opts.seed)
            for run in RUNS:
                up.put(("result", run, rank, _train(run, rank, world, opts, data, up)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        up.put(("error", rank, traceback.format_exc()))
        raise


def _batches(n: int, size: int, seed: int) -> Iterator[np.ndarray]:
    """Global batches of ``size`` indices: a fresh seeded permutation per epoch."""
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - size + 1, size):
            yield perm[i : i + size]


def _train(
    run: str,
    rank: int,
    world: int,
    opts: DemoOptions,
    data: Any,
    up: Any,
    transport: Any = None,
    hosts: tuple[str, ...] = (),
    group: Any = None,
) -> dict[str, Any]:
    """Train one run on this rank; ``up.put`` gets the progress. ``transport`` and ``hosts``
    (a TransportConfig and the local address per path) replace the loopback defaults; a
    baseline run (a name not starting with ``gradlane``) all-reduces over ``group`` (a gloo
    process group; None: the default one)."""
    import torch
    import torch.distributed as dist
    from gradlane.bench.demo.models import build
    from gradlane.integrations.ddp import GradlaneState, HookConfig, gradlane_hook
    from gradlane.integrations.trace import TraceRecorder
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn import functional
    from torch.nn.parallel import DistributedDataParallel

    model = build(opts.model, opts.seed)
    ddp = DistributedDataParallel(model, process_group=group)
    state = None
    if not run.startswith("gradlane"):
        rec = TraceRecorder(allreduce_hook, group, model=model)
    else:
        if rank == 0:  # step 0: the data plane starts, compiling the kernels on a first run
            up.put(("progress", run, 0))
        hook_cfg = HookConfig(
            transport=opts.transport,
            hosts=hosts,
            log_every=0,
            name=f"demo-{run}",
            inject_loss=opts.inject_loss if opts.transport == "udp" else 0.0,
            timeline=opts.timeline,
        )
        state = GradlaneState(transport or gradlane_transport(opts), hook_cfg, model=model)
        rec = TraceRecorder(gradlane_hook, state, model=model)
    rec.attach(ddp)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=0.9)
        batches = _batches(len(data.y_train), world * opts.batch, opts.seed)
        every = max(1, opts.steps // 50)
        step_s = []
        curve: list[tuple[int, float]] = []  # (steps done, held-out accuracy)
        for step in range(opts.steps):
            idx = torch.as_tensor(next(batches)[rank * opts.batch : (rank + 1) * opts.batch])
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = functional.cross_entropy(ddp(data.x_train[idx]), data.y_train[idx])
            loss.backward()
            opt.step()
            step_s.append(time.perf_counter() - t0)
            if (step + 1) % opts.eval_every == 0 or step + 1 == opts.steps:
                curve.append((step + 1, _accuracy(model, data)))  # outside the timed step
            if rank == 0 and ((step + 1) % every == 0 or step + 1 == opts.steps):
                up.put(("progress", run, step + 1))
        accuracy = curve[-1][1]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            ref = flat.clone()
            dist.broadcast(ref, 0)
            divergence = float((flat - ref).abs().max())
        out: dict[str, Any] = {
            "accuracy": accuracy,
            "param_divergence": divergence,
            "step_s": step_s,
            "comm_s": _comm_per_step(rec.records(), opts.steps),
            "curve": curve,
        }
        if state is not None:
            stats = state.stats(plane=True)
            out["stats"] = stats
            out["delivered"] = [s.delivered_fraction for s in state.step_stats()]
            out["retransmitted"] = stats["retransmitted"]
            out["degraded_buckets"] = stats["degraded_buckets"]
            out["injected_drops"] = int(stats["plane"].get("injected_drops", 0))
            out["precision"] = _precision_steps(state.step_stats())
        return out
    finally:
        rec.close()
        if state is not None:
            # Drain, then the barrier: every engine still answers while the others drain what
            # they sent, and none closes before all have (GradlaneState.drain).
            state.drain()
            dist.barrier()
            state.close()


def merge_rank_timelines(path: str, ranks: int) -> None:
    """Merge the ranks' timeline files of ``path`` into ``path`` itself and remove them."""
    from gradlane.integrations.timeline import merge_timelines, rank_path

    parts = [rank_path(path, r) for r in range(ranks)]
    merge_timelines(parts, path)
    for part in parts:
        part.unlink(missing_ok=True)


def _accuracy(model: Any, data: Any) -> float:
    """Held-out accuracy (%) of ``model`` on ``data``'s test split."""
    import torch

    with torch.no_grad():
        pred = model(data.x_test).argmax(1)
        return float((pred == data.y_test).float().mean()) * 100.0


def gradlane_transport(opts: DemoOptions) -> Any:
    """The demo's transport config: two loopback paths, the loss bound, the seed (which also
    seeds the injected loss, a setting of the hook: ``HookConfig.inject_loss``)."""
    from gradlane.scheduling.loss import LossConfig
    from gradlane.transport.config import loopback_config
    from gradlane.transport.drivers.zmq.plane import zmq_config

    if opts.transport == "zmq":
        return zmq_config(n_paths=2)
    bounded = opts.loss_bound > 0
    return loopback_config(
        n_paths=2,
        chunk_bytes=opts.chunk_bytes,
        seed=opts.seed,
        loss=LossConfig(
            loss_bound=opts.loss_bound,
            hard_deadline_s=opts.hard_deadline_s,
            on_hard_deadline="degrade" if bounded else "raise",
        ),
    )


def _precision_steps(steps: list[Any]) -> dict[str, list[float]]:
    """Per step (the hook's :class:`~gradlane.integrations.steps.StepStats`): the payload bytes
    this rank started sending by wire format, the compressed share, the relative error and
    the adaptive level."""
    return {
        "step": [s.step for s in steps],
        "f32_bytes": [s.format_bytes[0] for s in steps],
        "bf16_bytes": [s.format_bytes[1] for s in steps],
        "e4m3_bytes": [s.format_bytes[2] for s in steps],
        "compressed_share": [s.compressed_share for s in steps],
        "rel_error": [s.rel_error for s in steps],
        "level": [s.precision_level for s in steps],
    }


def _comm_per_step(records: list[dict[str, Any]], steps: int) -> list[float]:
    """Per step: from the first bucket's ready time to the last bucket's completion."""
    first = np.full(steps, np.inf)
    last = np.full(steps, -np.inf)
    for r in records:
        s = r["step"]
        if s < steps and r["comm_s"] is not None:
            first[s] = min(first[s], r["ready_s"])
            last[s] = max(last[s], r["ready_s"] + r["comm_s"])
    return [float(x) for x in np.where(np.isfinite(first), last - first, np.nan)]


# -- the comparison --------------------------------------------------------------------------------
def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q))


def _wire_row(per_rank: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """A gradlane run's wire bytes per step (summed over the ranks, averaged over the steps
    after the warm-up), its mean compressed share and error, and rank 0's per-step trace."""
    precs = [r["precision"] for r in per_rank]
    n = min(len(p["step"]) for p in precs)
    total = np.zeros(n)
    for p in precs:
        total += np.add(np.add(p["f32_bytes"][:n], p["bf16_bytes"][:n]), p["e4m3_bytes"][:n])
    share = np.mean([p["compressed_share"][warmup:n] for p in precs]) if n > warmup else 0.0
    error = np.mean([p["rel_error"][warmup:n] for p in precs]) if n > warmup else 0.0
    return {
        "wire_bytes_per_step": float(total[warmup:].mean()) if n > warmup else None,
        "compressed_share_mean": float(share),
        "rel_error_mean": float(error),
        "precision_trace": precs[0],
    }


def _compare(
    opts: DemoOptions,
    results: dict[str, dict[int, dict[str, Any]]],
    runs: tuple[str, ...] = RUNS,
) -> dict[str, Any]:
    """The runs side by side (``runs[0]`` the baseline, ``"gradlane"`` among them): per run the
    slowest rank's step and communication times, accuracy, the time-to-accuracy curve (held-out
    accuracy against the training time so far: the sum of the steps' times, evaluation left
    out) and the time at which it first reaches the target accuracy."""
    w = opts.warmup_steps
    rows: dict[str, dict[str, Any]] = {}
    for run in runs:
        per_rank = [results[run][r] for r in range(opts.ranks)]
        every_step = np.max([r["step_s"] for r in per_rank], axis=0)
        step = every_step[w:]
        comm = np.nanmax([r["comm_s"] for r in per_rank], axis=0)[w:]
        acc = [r["accuracy"] for r in per_rank]
        elapsed = np.cumsum(every_step)
        points = np.mean([[a for _, a in r["curve"]] for r in per_rank], axis=0)
        curve = [[float(elapsed[k - 1]), float(a)]
                 for (k, _), a in zip(per_rank[0]["curve"], points, strict=True)]  # fmt: skip
        row: dict[str, Any] = {
            "accuracy_mean": float(np.mean(acc)),
            "accuracy_per_rank": acc,
            "param_divergence": max(r["param_divergence"] for r in per_rank),
            "step_p50_s": _pct(step, 50),
            "step_p99_s": _pct(step, 99),
            "comm_p50_s": _pct(comm, 50),
            "comm_p99_s": _pct(comm, 99),
            "train_s": float(elapsed[-1]),
            "step_s": step.tolist(),
            "comm_s": comm.tolist(),
            "tta_curve": curve,
        }
        if run.startswith("gradlane"):
            delivered = np.concatenate([np.asarray(r["delivered"]) for r in per_rank])
            row.update(
                delivered_fraction_mean=float(delivered.mean()),
                delivered_fraction_min=float(delivered.min()),
                retransmitted=sum(r["retransmitted"] for r in per_rank),
                degraded_buckets=sum(r["degraded_buckets"] for r in per_rank),
                injected_drops=sum(r["injected_drops"] for r in per_rank),
                per_rank_stats=[r["stats"] for r in per_rank],
            )
            if all("precision" in r for r in per_rank):
                row.update(_wire_row(per_rank, w))
        else:
            row.update(delivered_fraction_mean=1.0, delivered_fraction_min=1.0)
        rows[run] = row
    g, d = rows[runs[0]], rows["gradlane"]
    target = opts.target_accuracy
    if target is None:
        target = g["accuracy_mean"] - 1.0
    for row in rows.values():
        row["tta_s"] = next((t for t, a in row["tta_curve"] if a >= target), None)
    summary = {
        "accuracy_gloo": g["accuracy_mean"],
        "accuracy_gradlane": d["accuracy_mean"],
        "accuracy_target": target,
        "tta_s_gloo": g["tta_s"],
        "tta_s_gradlane": d["tta_s"],
        "tta_ratio_vs_gloo": _ratio(d["tta_s"], g["tta_s"]),
        "step_p50_ratio_vs_gloo": _ratio(d["step_p50_s"], g["step_p50_s"]),
        "step_p99_ratio_vs_gloo": _ratio(d["step_p99_s"], g["step_p99_s"]),
        "delivered_fraction": d["delivered_fraction_mean"],
        "delivered_fraction_min": d["delivered_fraction_min"],
        "step_p99_gloo_s": g["step_p99_s"],
        "step_p99_gradlane_s": d["step_p99_s"],
        "step_p50_gloo_s": g["step_p50_s"],
        "step_p50_gradlane_s": d["step_p50_s"],
        "comm_p99_gloo_s": g["comm_p99_s"],
        "comm_p99_gradlane_s": d["comm_p99_s"],
        "retransmitted": d["retransmitted"],
        "injected_drops": d["injected_drops"],
    }
    for run in runs:  # gradlane with a lossy wire precision (gradlane_<policy>)
        if run.startswith("gradlane_") and "wire_bytes_per_step" in d:
            p, c = run[len("gradlane_") :], rows[run]
            summary[f"tta_s_gradlane_{p}"] = c["tta_s"]
            summary[f"tta_ratio_vs_gloo_{p}"] = _ratio(c["tta_s"], g["tta_s"])
            summary[f"tta_ratio_{p}_vs_gradlane"] = _ratio(c["tta_s"], d["tta_s"])
            summary[f"wire_bytes_ratio_{p}_vs_f32"] = _ratio(
                c["wire_bytes_per_step"], d["wire_bytes_per_step"]
            )
            summary[f"accuracy_gradlane_{p}"] = c["accuracy_mean"]
            summary[f"step_p50_ratio_vs_gloo_{p}"] = _ratio(c["step_p50_s"], g["step_p50_s"])
            summary[f"compressed_share_{p}"] = c["compressed_share_mean"]
            summary[f"rel_error_{p}"] = c["rel_error_mean"]
    for run in runs[1:]:  # further baselines (the testbed's gloo on path 0)
        if not run.startswith("gradlane"):
            b = rows[run]
            summary[f"tta_s_{run}"] = b["tta_s"]
            summary[f"tta_ratio_vs_{run}"] = _ratio(d["tta_s"], b["tta_s"])
            summary[f"step_p99_ratio_vs_{run}"] = _ratio(d["step_p99_s"], b["step_p99_s"])
            summary[f"accuracy_{run}"] = b["accuracy_mean"]
    return {"summary": summary, "options": asdict(opts), "runs": rows}


def _ratio(x: float | None, y: float | None) -> float | None:
    """``x / y``, or None when either is missing (a run that never reached the target)."""
    return None if x is None or y is None or y <= 0 else x / y


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
