"""Rank processes for the DDP hook tests (importable by ``spawn`` children).

Every rank builds a gloo process group on a TCPStore that rank 0 hosts, and exports
``MASTER_ADDR``/``MASTER_PORT`` as ``torchrun`` would, so each :class:`GradlaneState` finds its
peers through the default TCPStore rendezvous. A scenario returns a picklable result that the
rank puts on ``up``; a rank that must outlive the others (the silent one) waits on its ``down``
queue. Nothing sleeps: every wait is a queue ``get`` with a timeout, and the transport's hard
deadlines bound every collective.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from gradlane.bench.demo.models import digits_cnn, digits_mlp
from gradlane.integrations.ddp import GradlaneState, HookConfig, gradlane_hook
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.config import TransportConfig, loopback_config
from torch import nn
from torch.nn.parallel import DistributedDataParallel

#: Longest any rank waits for a queue hand-off.
WAIT_S = 120.0

MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": digits_mlp, "cnn": digits_cnn}
#: Small buckets, so that after DDP's rebuild every model has several.
BUCKET_CAP_MB = 0.05


def reliable(hard_deadline_s: float = 60.0) -> TransportConfig:
    """``loopback_config()`` (two paths, 65000-byte chunks), exact, fail at the hard deadline."""
    return loopback_config(
        loss=LossConfig(
            loss_bound=0.0,
            hard_deadline_s=hard_deadline_s,
            soft_deadline_max_s=min(0.5, hard_deadline_s),
            on_hard_deadline="raise",
        ),
    )


def rank_main(
    scenario: str, rank: int, world: int, port: int, args: dict, up: Any, down: Any
) -> None:
    """Run ``SCENARIOS[scenario]`` in a gloo group; report ``("ok"|"error", rank, payload)``."""
    run_rank(SCENARIOS[scenario], rank, world, port, args, up, down)


def run_rank(
    fn: Callable[[int, int, dict, Any], Any],
    rank: int,
    world: int,
    port: int,
    args: dict,
    up: Any,
    down: Any,
) -> None:
    """Run ``fn(rank, world, args, down)`` in a gloo group on a TCPStore that rank 0 hosts."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=WAIT_S)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            result = fn(rank, world, args, down)
        finally:
            dist.destroy_process_group()
        up.put(("ok", rank, result))
    except BaseException:
        up.put(("error", rank, traceback.format_exc()))
        raise


def _batch(seed: int, rank: int, step: int, dtype: torch.dtype, n: int = 16):
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + step)
    x = torch.rand(n, 64, generator=g).to(dtype)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float(), y)


def _pair(name: str, dtype: torch.dtype, static: bool, seed: int):
    torch.manual_seed(seed)
    ref_model = MODELS[name]().to(dtype)
    gl_model = copy.deepcopy(ref_model)
    kw = {"bucket_cap_mb": BUCKET_CAP_MB, "static_graph": static}
    return (
        ref_model,
        gl_model,
        DistributedDataParallel(ref_model, **kw),
        DistributedDataParallel(gl_model, **kw),
    )


def equality(rank: int, world: int, args: dict, down: Any) -> list[dict]:
    """Default hook vs gradlane hook, same parameters every step: per-step max relative gap."""
    out = []
    for name, dtype_name, static in args["cases"]:
        dtype = getattr(torch, dtype_name)
        ref_model, gl_model, ref, gl = _pair(name, dtype, static, args["seed"])
        state = GradlaneState(reliable(), HookConfig(log_every=0), model=gl_model)
        gl.register_comm_hook(state, gradlane_hook)
        gaps, buckets = [], []
        try:
            for step in range(args["steps"]):
                x, y = _batch(args["seed"], rank, step, dtype)
                _loss(ref, x, y).backward()
                _loss(gl, x, y).backward()
                scale = max(float(p.grad.abs().max()) for p in ref_model.parameters())
                gap = max(
                    float((a.grad.float() - b.grad.float()).abs().max())
                    for a, b in zip(ref_model.parameters(), gl_model.parameters(), strict=True)
                )
                gaps.append(gap / max(scale, 1e-30))
                with torch.no_grad():  # the same step for both, so each step compares one
                    for a, b in zip(ref_model.parameters(), gl_model.parameters(), strict=True):
                        a.add_(a.grad, alpha=-0.1)
                        b.copy_(a)
                        a.grad = b.grad = None
            stats = state.stats()
            buckets = [s.buckets for s in state.step_stats()]
        finally:
            state.close()
        out.append(
            {
                "case": (name, dtype_name, static),
                "gaps": gaps,
                "generation": stats["generation"],
                "buckets": buckets,
                "steps": stats["steps"],
                "failed": stats["failed_buckets"],
            }
        )
    return out


def silent_rank(rank: int, world: int, args: dict, down: Any) -> dict:
    """Rank ``args['silent']`` stops after ``args['good_steps']`` steps (alive, not sending):
    the others' ``backward()`` must raise, naming it."""
    torch.manual_seed(args["seed"])
    model = digits_mlp()
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    state = GradlaneState(reliable(args["hard_deadline_s"]), HookConfig(log_every=0), model=model)
    ddp.register_comm_hook(state, gradlane_hook)
    try:
        for step in range(args["good_steps"]):
            x, y = _batch(args["seed"], rank, step, torch.float32)
            _loss(ddp, x, y).backward()
        if rank == args["silent"]:
            down.get(timeout=WAIT_S)  # stay alive and silent until every other rank reported
            return {"silent": True}
        x, y = _batch(args["seed"], rank, args["good_steps"], torch.float32)
        t0 = time.monotonic()
        try:
            _loss(ddp, x, y).backward()
        except RuntimeError as e:
            return {"raised": True, "message": str(e), "elapsed": time.monotonic() - t0}
        return {"raised": False, "elapsed": time.monotonic() - t0}
    finally:
        state.close()


def no_sync(rank: int, world: int, args: dict, down: Any) -> dict:
    """Gradient accumulation: one ``no_sync`` micro-batch, then a synchronised one."""
    ref_model, gl_model, ref, gl = _pair("mlp", torch.float32, False, args["seed"])
    state = GradlaneState(reliable(), HookConfig(log_every=0), model=gl_model)
    gl.register_comm_hook(state, gradlane_hook)
    gaps = []
    try:
        for step in range(args["steps"]):
            for ddp in (ref, gl):
                x, y = _batch(args["seed"], rank, 2 * step, torch.float32)
                with ddp.no_sync():
                    _loss(ddp, x, y).backward()
                x, y = _batch(args["seed"], rank, 2 * step + 1, torch.float32)
                _loss(ddp, x, y).backward()
            gaps.append(
                max(
                    float((a.grad - b.grad).abs().max())
                    for a, b in zip(ref_model.parameters(), gl_model.parameters(), strict=True)
                )
            )
            for p in (*ref_model.parameters(), *gl_model.parameters()):
                p.grad = None
        stats = state.stats()
    finally:
        state.close()
    return {"gaps": gaps, "steps": stats["steps"], "next_step": stats["next_step"]}


def join(rank: int, world: int, args: dict, down: Any) -> dict:
    """Uneven inputs under ``join()``: rank r has ``base + r`` batches. The same training with
    the default hook and with gradlane's must end with the same parameters."""
    batches = args["base"] + rank
    finals = {}
    steps = None
    for kind in ("default", "gradlane"):
        torch.manual_seed(args["seed"])
        model = digits_mlp()
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
        state = None
        if kind == "gradlane":
            state = GradlaneState(reliable(), HookConfig(log_every=0), model=model)
            ddp.register_comm_hook(state, gradlane_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            with ddp.join():
                for step in range(batches):
                    x, y = _batch(args["seed"], rank, step, torch.float32)
                    opt.zero_grad(set_to_none=True)
                    _loss(ddp, x, y).backward()
                    opt.step()
            if state is not None:
                steps = state.stats()["steps"]
        finally:
            if state is not None:
                state.close()
        finals[kind] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gap = float((finals["default"] - finals["gradlane"]).abs().max())
    return {"gap": gap, "scale": float(finals["default"].abs().max()), "steps": steps}


def timeline(rank: int, world: int, args: dict, down: Any) -> dict:
    """A few steps with ``GRADLANE_HOOK__TIMELINE`` set (a state built from the environment):
    the buckets per step, and where the state wrote its timeline."""
    os.environ["GRADLANE_HOOK__TIMELINE"] = args["path"]
    os.environ["GRADLANE_HOOK__LOG_EVERY"] = "0"
    torch.manual_seed(args["seed"])
    model = digits_mlp()
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    state = GradlaneState.from_env(model=model)
    ddp.register_comm_hook(state, gradlane_hook)
    try:
        for step in range(args["steps"]):
            x, y = _batch(args["seed"], rank, step, torch.float32)
            _loss(ddp, x, y).backward()
        buckets = [s.buckets for s in state.step_stats()]
        state.drain()
        dist.barrier()
    finally:
        state.close()  # writes the timeline
    assert state.timeline is not None
    return {"buckets": buckets, "path": str(state.timeline.path)}


def lossy(rank: int, world: int, args: dict, down: Any) -> dict:
    """Training with a lossy wire precision (``args['policy']``, adaptive from
    ``args['level']``), the default hook alongside on the same batches: per step both losses,
    the step's compressed share, relative error, bytes per format and level; at the end how
    far this rank's parameters are from rank 0's."""
    from gradlane.scheduling.precision import PrecisionConfig

    ref_model, gl_model, ref, gl = _pair("mlp", torch.float32, False, args["seed"])
    prec = PrecisionConfig(policy=args["policy"], initial_level=args.get("level", 0.0))
    state = GradlaneState(
        # 4 KB chunks: a small bucket's shard is then many chunks, most of them not protected.
        dataclasses.replace(reliable(), chunk_bytes=4096, precision=prec),
        HookConfig(log_every=0),
        model=gl_model,
    )
    gl.register_comm_hook(state, gradlane_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref_model, gl_model)]
    losses: list[tuple[float, float]] = []
    try:
        for step in range(args["steps"]):
            x, y = _batch(args["seed"], rank, step, torch.float32)
            pair = []
            for model, opt in zip((ref, gl), opts, strict=True):
                loss = _loss(model, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                pair.append(float(loss.detach()))
            losses.append((pair[0], pair[1]))
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in gl_model.parameters()])
            ref0 = flat.clone()
            dist.broadcast(ref0, 0)
        steps = state.step_stats()
    finally:
        state.close()
    return {
        "losses": losses,
        "divergence": float((flat - ref0).abs().max()),
        "share": [s.compressed_share for s in steps],
        "error": [s.rel_error for s in steps],
        "format_bytes": [list(s.format_bytes) for s in steps],
        "level": [s.precision_level for s in steps],
    }


SCENARIOS: dict[str, Callable[[int, int, dict, Any], Any]] = {
    "lossy": lossy,
    "equality": equality,
    "silent_rank": silent_rank,
    "no_sync": no_sync,
    "join": join,
    "timeline": timeline,
}
