"""Rank processes for the daemon-mode tests (importable by ``spawn`` children).

Two "hosts" of two ranks each: rank r is local rank ``r % 2`` of host ``r // 2`` and talks to
that host's daemon at ``args["sockets"][r // 2]``. The gloo group (DDP needs one) comes from
:func:`tests.multiproc.ddp_workers.run_rank`. Nothing sleeps: every wait is a queue ``get``
with a timeout or a transport deadline.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from gradlane.bench.demo.models import digits_mlp
from gradlane.integrations.ddp import GradlaneState, HookConfig, gradlane_hook
from torch.nn.parallel import DistributedDataParallel

from tests.multiproc.ddp_workers import BUCKET_CAP_MB, WAIT_S, _batch, _loss, reliable, run_rank

LOCAL_WORLD = 2
#: The daemons are up before the ranks start; after a daemon is gone, a step waits this long
#: for a new one before it fails.
CONNECT_S = 15.0


def rank_main(scenario: str, rank: int, world: int, port: int, args: dict, up: Any, down: Any):
    """Run ``SCENARIOS[scenario]`` in a gloo group (see :func:`ddp_workers.run_rank`)."""
    run_rank(SCENARIOS[scenario], rank, world, port, {**args, "up": up}, up, down)


def _daemon_state(
    rank: int, args: dict, model: torch.nn.Module, hard: float = 60.0
) -> GradlaneState:
    hook = HookConfig(
        mode="daemon",
        daemon_socket=args["sockets"][rank // LOCAL_WORLD],
        log_every=0,
        connect_timeout_s=CONNECT_S,
    )
    cfg = dataclasses.replace(reliable(hard), job=args["job"])
    return GradlaneState(
        cfg, hook, model=model, local_rank=rank % LOCAL_WORLD, local_world=LOCAL_WORLD
    )


def _gap(a: torch.nn.Module, b: torch.nn.Module, scale: float) -> float:
    d = max(
        float((p.grad - q.grad).abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    return d / max(scale, 1e-30)


def equality(rank: int, world: int, args: dict, down: Any) -> dict:
    """DDP's default hook, the embedded gradlane hook and the daemon-mode hook in lockstep.

    After training, report, then wait for ``down`` (the parent stops the daemons meanwhile) and
    try one more daemon-mode step: it must fail with a clear error, not hang.
    """
    torch.manual_seed(args["seed"])
    ref_model = digits_mlp()
    emb_model, dmn_model = copy.deepcopy(ref_model), copy.deepcopy(ref_model)
    models = (ref_model, emb_model, dmn_model)
    ddps = [DistributedDataParallel(m, bucket_cap_mb=BUCKET_CAP_MB) for m in models]
    emb = GradlaneState(reliable(), HookConfig(log_every=0), model=emb_model)
    dmn = _daemon_state(rank, args, dmn_model)
    ddps[1].register_comm_hook(emb, gradlane_hook)
    ddps[2].register_comm_hook(dmn, gradlane_hook)
    gaps: dict[str, list[float]] = {"embedded": [], "daemon": [], "daemon_vs_embedded": []}
    try:
        for step in range(args["steps"]):
            x, y = _batch(args["seed"], rank, step, torch.float32)
            for d in ddps:
                _loss(d, x, y).backward()
            scale = max(float(p.grad.abs().max()) for p in ref_model.parameters())
            gaps["embedded"].append(_gap(ref_model, emb_model, scale))
            gaps["daemon"].append(_gap(ref_model, dmn_model, scale))
            gaps["daemon_vs_embedded"].append(_gap(emb_model, dmn_model, scale))
            with torch.no_grad():  # the same step for all three
                for a, b, c in zip(*(m.parameters() for m in models), strict=True):
                    a.add_(a.grad, alpha=-0.1)
                    b.copy_(a)
                    c.copy_(a)
                    a.grad = b.grad = c.grad = None
        stats = dmn.stats(plane=True)
        args["up"].put(("trained", rank, {"gaps": gaps, "stats": stats}))
        down.get(timeout=WAIT_S)  # the parent stops the daemons (SIGTERM) meanwhile
        x, y = _batch(args["seed"], rank, args["steps"], torch.float32)
        t0 = time.monotonic()
        try:
            _loss(ddps[2], x, y).backward()
            after = {"raised": False}
        except RuntimeError as e:
            after = {"raised": True, "message": str(e)}
        after["elapsed"] = time.monotonic() - t0
    finally:
        emb.close()
        dmn.close()
    return after


def killed(rank: int, world: int, args: dict, down: Any) -> dict:
    """Host 0's daemon is killed (-9) while a step is in flight: every rank's ``backward()``
    raises naming the daemon or host; host 1's ranks submit only after the kill."""
    torch.manual_seed(args["seed"])
    model = digits_mlp()
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    state = _daemon_state(rank, args, model, args["hard_deadline_s"])
    ddp.register_comm_hook(state, gradlane_hook)
    try:
        for step in range(args["good_steps"]):
            x, y = _batch(args["seed"], rank, step, torch.float32)
            _loss(ddp, x, y).backward()
        args["up"].put(("ready", rank, None))
        if rank // LOCAL_WORLD == 1:
            down.get(timeout=WAIT_S)  # released once host 0's daemon is dead
        x, y = _batch(args["seed"], rank, args["good_steps"], torch.float32)
        t0 = time.monotonic()
        try:
            _loss(ddp, x, y).backward()
            return {"raised": False, "elapsed": time.monotonic() - t0}
        except RuntimeError as e:
            return {"raised": True, "message": str(e), "elapsed": time.monotonic() - t0}
    finally:
        state.close()


def lossy(rank: int, world: int, args: dict, down: Any) -> dict:
    """Daemon-mode training whose daemons send chunks in a lossy wire precision (their
    ``[transport]`` config), beside DDP's default hook on the same batches: per step the gap
    between the two models' gradients, the step statistics the daemon reported back, and at
    the end how far this rank's parameters are from rank 0's."""
    import torch.distributed as dist

    torch.manual_seed(args["seed"])
    ref_model = digits_mlp()
    dmn_model = copy.deepcopy(ref_model)
    ddps = [DistributedDataParallel(m, bucket_cap_mb=BUCKET_CAP_MB) for m in (ref_model, dmn_model)]
    dmn = _daemon_state(rank, args, dmn_model)
    ddps[1].register_comm_hook(dmn, gradlane_hook)
    gaps: list[float] = []
    try:
        for step in range(args["steps"]):
            x, y = _batch(args["seed"], rank, step, torch.float32)
            for d in ddps:
                _loss(d, x, y).backward()
            scale = max(float(p.grad.abs().max()) for p in ref_model.parameters())
            gaps.append(_gap(ref_model, dmn_model, scale))
            with torch.no_grad():  # the same step for both
                for a, b in zip(ref_model.parameters(), dmn_model.parameters(), strict=True):
                    a.add_(a.grad, alpha=-0.1)
                    b.copy_(a)
                    a.grad = b.grad = None
        # The daemon-mode model as trained by its own gradients for one more step: every rank
        # must hold the same parameters (the owners keep what they gather).
        x, y = _batch(args["seed"], rank, args["steps"], torch.float32)
        _loss(ddps[1], x, y).backward()
        with torch.no_grad():
            for p in dmn_model.parameters():
                p.add_(p.grad, alpha=-0.1)
            flat = torch.cat([p.reshape(-1) for p in dmn_model.parameters()])
            ref0 = flat.clone()
            dist.broadcast(ref0, 0)
        steps = dmn.step_stats()
    finally:
        dmn.close()
    return {
        "gaps": gaps,
        "divergence": float((flat - ref0).abs().max()),
        "share": [st.compressed_share for st in steps],
        "format_bytes": [list(st.format_bytes) for st in steps],
    }


SCENARIOS: dict[str, Callable[[int, int, dict, Any], Any]] = {
    "lossy": lossy,
    "equality": equality,
    "killed": killed,
}
