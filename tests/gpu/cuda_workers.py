"""Two rank processes sharing one GPU, serving the CUDA tests' scenarios (importable by
``spawn`` children).

:class:`RankPair` (the parent's side) spawns two ranks once and hands them scenario after
scenario. Each rank (:func:`serve`) builds a gloo process group on a TCPStore that rank 0 hosts,
exporting ``MASTER_ADDR``/``MASTER_PORT`` as torchrun does so that every ``GradlaneState`` finds
its peers through the default rendezvous, warms the transport's kernels up, then runs what it is
sent and reports each result on the shared ``up`` queue. Both ranks put their models and DDP's
buckets on ``cuda:0``; ``RankPair("cpu")`` runs the same scenarios without a GPU (a check of the
scenarios themselves, not of the CUDA path). One pair serves a whole test module: starting a
rank (import torch, start CUDA, load the kernels) costs seconds.

A rank that fails a scenario, or a scenario without a result in time, ends the pair at once (a
rank left waiting in a collective would only time out later); the next scenario starts a new
pair. Nothing sleeps: every wait is a queue ``get`` with a timeout, or a transport deadline.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from gradlane.bench.demo.models import big_mlp
from gradlane.integrations.ddp import GradlaneState, HookConfig, gradlane_hook
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import shard_bounds
from gradlane.transport.drivers.warmup import warm_up
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.multiproc.ddp_workers import reliable
from tests.support.ddp import RecordingPlane
from tests.support.procs import JOIN_S, RankProcs

WORLD = 2
#: Longest wait for a pair to start: two imports of torch, CUDA, and a numba compile when the
#: kernel cache is cold (about a minute).
START_S = 240.0
#: Longest wait for one scenario's results.
WAIT_S = 120.0
#: A rank without a request for this long exits (its parent is gone).
IDLE_S = 900.0
#: How often a wait checks that both ranks are still alive.
_POLL_S = 1.0
#: gloo's bound on one collective: a peer that died is noticed.
GLOO_TIMEOUT_S = 60.0
#: The transport's bound on one bucket: a lost peer fails the step well inside ``WAIT_S``.
HARD_DEADLINE_S = 30.0


# -- parent's side ---------------------------------------------------------------------------------
class RankPair:
    """Two spawned ranks serving scenarios on ``device`` ("cuda" or "cpu"); see the module
    docstring. :meth:`close` ends them and returns their exit codes."""

    def __init__(self, device: str = "cuda") -> None:
        self.device = device
        self._procs: RankProcs | None = None
        self._serial = 0

    def run(self, scenario: str, args: dict | None = None) -> dict[int, Any]:
        """Run ``scenario`` on both ranks; their results by rank. A rank's error, or a result
        missing after :data:`WAIT_S`, ends the pair and raises ``AssertionError`` with the
        rank's traceback."""
        procs = self._start()
        self._serial += 1
        # A fresh name per run: the ranks' rendezvous channels never meet an earlier run's.
        args = {**(args or {}), "name": f"{scenario}-{self._serial}"}
        for rank in range(WORLD):
            procs.downs[rank].put((scenario, args))
        return self._collect(procs, scenario, WAIT_S)

    def close(self) -> dict[str, int | None]:
        """Let the ranks exit (killed if they do not); their exit codes by process name."""
        procs, self._procs = self._procs, None
        if procs is None:
            return {}
        procs.shutdown(None)
        return {p.name: p.exitcode for p in procs.procs}

    def _start(self) -> RankProcs:
        if self._procs is not None:
            return self._procs
        procs = self._procs = RankProcs()
        port = _free_port()
        for rank in range(WORLD):
            procs.spawn(
                serve,
                (rank, WORLD, port, self.device, procs.up, procs.down(rank)),
                f"gl-{self.device}-r{rank}",
            )
        self._collect(procs, "start", START_S)
        return procs

    def _collect(self, procs: RankProcs, what: str, wait_s: float) -> dict[int, Any]:
        out: dict[int, Any] = {}
        deadline = time.monotonic() + wait_s
        dead_before: dict[str, int | None] = {}
        try:
            while len(out) < WORLD:
                try:
                    status, rank, name, payload = procs.up.get(timeout=_POLL_S)
                except queue.Empty:
                    # A rank that died without a word (killed, crashed in C) ends the wait; one
                    # more poll first, for a report it sent just before it exited.
                    dead = {p.name: p.exitcode for p in procs.procs if p.exitcode is not None}
                    missing = sorted(set(range(WORLD)) - set(out))
                    if dead and dead_before:
                        raise AssertionError(f"{what}: rank process(es) died: {dead}") from None
                    dead_before = dead
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"{what}: no result from rank(s) {missing} in {wait_s:.0f} s"
                        ) from None
                    continue
                if status != "ok":
                    raise AssertionError(f"rank {rank} failed in {name}:\n{payload}")
                out[rank] = payload
        except BaseException:
            self._kill()
            raise
        return out

    def _kill(self) -> None:
        procs, self._procs = self._procs, None
        if procs is None:
            return
        for p in procs.procs:
            if p.is_alive():
                p.kill()
        for p in procs.procs:
            p.join(JOIN_S)
        procs.up.close()
        for q in procs.downs.values():
            q.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- rank's side -----------------------------------------------------------------------------------
def serve(rank: int, world: int, port: int, device_type: str, up: Any, down: Any) -> None:
    """A rank: group, warm-up, then ``(scenario, args)`` from ``down`` until ``None``.

    Reports ``(status, rank, scenario, payload)`` on ``up``; after an error it exits (the parent
    ends the pair)."""
    try:
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore(
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=START_S)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
        )
        warm_up(udp=True)  # the compile (or the cache load) before any scenario's clock runs
    except BaseException:
        up.put(("error", rank, "start", traceback.format_exc()))
        raise
    up.put(("ok", rank, "start", None))
    try:
        while True:
            msg = down.get(timeout=IDLE_S)
            if msg is None:
                return
            scenario, args = msg
            try:
                result = SCENARIOS[scenario](rank, world, device, args)
            except BaseException:
                up.put(("error", rank, scenario, traceback.format_exc()))
                return
            up.put(("ok", rank, scenario, result))
    finally:
        dist.destroy_process_group()


# -- models and data -------------------------------------------------------------------------------
class Dot(nn.Module):
    """``forward(xs) = Σ_i <p_i, x_i>``: the gradient of ``p_i`` is exactly ``x_i``, so every
    bucket DDP hands the hook holds known data (parameters start at zero and never matter)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in sizes])

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the dot products (a scalar)."""
        return torch.stack([(p * x).sum() for p, x in zip(self.ps, xs, strict=True)]).sum()


def dot_inputs(
    sizes: list[int], seed: int, rank: int, step: int, device: torch.device
) -> list[torch.Tensor]:
    """Rank ``rank``'s inputs (= gradients) of :class:`Dot` at ``step``: in [1, 2) on even
    ranks, in (-2, -1] on odd ones, so that a rank's own value is never within 0.5 of the mean
    of two ranks (a stale or filled element cannot pass for a right one)."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank * 1009 + step)
    sign = 1.0 if rank % 2 == 0 else -1.0
    return [sign * (1.0 + torch.rand(n, generator=g, device=device)) for n in sizes]


def _batch(
    seed: int, rank: int, step: int, dtype: torch.dtype, device: torch.device, n: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    # Made on the device: no host-to-device copy (nor any staging it might allocate) per step.
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank * 1009 + step)
    x = torch.rand(n, 64, generator=g, device=device).to(dtype)
    y = torch.randint(0, 10, (n,), generator=g, device=device)
    return x, y


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float(), y)


def _ddp(model: nn.Module, device: torch.device, cap_mb: float) -> DistributedDataParallel:
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=cap_mb)


def _state(name: str, model: nn.Module, **hook: Any) -> GradlaneState:
    """A reliable gradlane state (loss bound 0, ``HARD_DEADLINE_S``) named ``name``."""
    return GradlaneState(
        reliable(HARD_DEADLINE_S), HookConfig(log_every=0, name=name, **hook), model=model
    )


def _end(state: GradlaneState) -> None:
    """A clean end: the peers have what this rank sent before any plane closes."""
    state.drain()
    dist.barrier()


def _relative_gap(a: nn.Module, b: nn.Module, grads: bool) -> float:
    pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    ts = [(p.grad, q.grad) if grads else (p.detach(), q.detach()) for p, q in pairs]
    scale = max(float(x.float().abs().max()) for x, _ in ts)
    gap = max(float((x.float() - y.float()).abs().max()) for x, y in ts)
    return gap / max(scale, 1e-30)


def logged_hook(st, bucket):
    """``gradlane_hook`` on ``st = (state, seen)``, noting ``(step, bucket index, parameters)``
    of every bucket in ``seen`` first. Not annotated: DDP compares a hook's annotations with
    the real classes, and this module's would be strings."""
    state, seen = st
    seen.append((state.step, bucket.index(), bucket.parameters()))
    return gradlane_hook(state, bucket)


@contextlib.contextmanager
def device_sync_is_an_error(device: torch.device) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` inside (on CUDA), the previous mode after."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _host_allocations() -> dict[str, float] | None:
    """The pinned host allocator's growth counters (None where this torch keeps no such
    stats: the buffer addresses are the test's evidence then)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    try:
        s = stats() if stats is not None else None
    except RuntimeError:
        return None
    if s is None:
        return None
    return {k: float(s[k]) for k in ("num_host_alloc", "allocations.current") if k in s}


# -- scenarios -------------------------------------------------------------------------------------
def equality(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """DDP's default hook and gradlane's reliable hook train copies of one MLP side by side
    (SGD, the same batches): per-step gradient gaps and the final parameter gap, relative.

    The MLP has 8 × 1024² weights: 33.6 MB of float32 gradients, two buckets at DDP's default
    25 MB cap and dozens at 1 MB."""
    dtype = getattr(torch, args["dtype"])
    torch.manual_seed(args["seed"])
    ref_model = big_mlp(depth=8).to(device=device, dtype=dtype)
    gl_model = copy.deepcopy(ref_model)
    ref, gl = _ddp(ref_model, device, args["cap_mb"]), _ddp(gl_model, device, args["cap_mb"])
    state = _state(args["name"], gl_model)
    gl.register_comm_hook(state, gradlane_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref_model, gl_model)]
    gaps = []
    try:
        for step in range(args["steps"]):
            x, y = _batch(args["seed"], rank, step, dtype, device)
            for ddp, opt in zip((ref, gl), opts, strict=True):
                opt.zero_grad(set_to_none=True)
                _loss(ddp, x, y).backward()
            gaps.append(_relative_gap(ref_model, gl_model, grads=True))
            for opt in opts:
                opt.step()
        stats = state.stats()
        buckets = [s.buckets for s in state.step_stats()]
        _end(state)
    finally:
        state.close()
    return {
        "grad_gaps": gaps,
        "param_gap": _relative_gap(ref_model, gl_model, grads=False),
        "grad_bytes": sum(p.numel() * p.element_size() for p in gl_model.parameters()),
        "buckets": buckets,
        "generation": stats["generation"],
        "steps": stats["steps"],
        "failed": stats["failed_buckets"],
    }


def bounded(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """Bounded mode over a plane that drops ``inject_loss`` of what it receives: per bucket,
    what the report says was missing and filled against what differs from the exact mean, and
    whether DDP's gradients are exactly the plane's result (the copy back to the GPU)."""
    sizes, bound = args["sizes"], args["loss_bound"]
    model = Dot(sizes).to(device)
    ddp = _ddp(model, device, args["cap_mb"])
    cfg = TransportConfig(
        n_paths=2,
        chunk_bytes=1408,
        seed=args["seed"],
        loss=LossConfig(
            loss_bound=bound,
            soft_deadline_max_s=0.05,
            hard_deadline_s=HARD_DEADLINE_S,
            on_hard_deadline="raise",
        ),
    )
    hook = HookConfig(
        hosts=("127.0.0.1", "127.0.0.2"),
        inject_loss=args["inject_loss"],
        log_every=0,
        name=args["name"],
    )
    state = GradlaneState(cfg, hook, model=model)
    plane = state.plane = RecordingPlane(state.plane, keep=True)
    seen: list[tuple[int, int, list[torch.Tensor]]] = []
    ddp.register_comm_hook((state, seen), logged_hook)
    out = []
    try:
        for step in range(args["steps"]):
            model.zero_grad(set_to_none=True)
            ddp(dot_inputs(sizes, args["seed"], rank, step, device)).backward()
            params = {b: ps for s, b, ps in seen if s == step}
            for rec in plane.of_step(step):
                out.append(_check_filled(rank, world, rec, params[rec.bucket]))
        stats = state.stats(plane=True)
        _end(state)
    finally:
        state.close()
    return {
        "buckets": out,
        "failed": stats["failed_buckets"],
        "degraded": stats["degraded_buckets"],
        "injected_drops": stats["plane"]["injected_drops"],
    }


def _check_filled(rank: int, world: int, rec: Any, params: list[torch.Tensor]) -> dict:
    """One bucket of :func:`bounded`, as the loopback test of injected loss checks a plane."""
    assert rec.error is None, rec.error
    data, res, rep = rec.data, rec.result, rec.report
    total = torch.from_numpy(data.astype(np.float64))
    dist.all_reduce(total)  # the exact sum of the contributions (CPU, float64)
    exact = total.numpy() / world
    missing = [0] * world
    dist.all_gather_object(missing, rep.reduce.missing_elems)
    b = shard_bounds(data.size, world)
    own = slice(int(b[rank]), int(b[rank + 1]))
    peer = slice(int(b[1 - rank]), int(b[2 - rank]))  # world 2: the other rank's shard
    wrong = ~np.isclose(res, exact, rtol=1e-5, atol=1e-5)
    filled = wrong[own]
    on_gpu = torch.cat([p.grad.reshape(-1) for p in params]).cpu().numpy()
    return {
        "step": rec.step,
        "bucket": rec.bucket,
        "own_wrong": int(filled.sum()),
        "reduce_missing": rep.reduce.missing_elems,
        # A missing element of its own shard is filled with this rank's value (× world / 1
        # contributor × the 1 / world scale).
        "filled_with_own": bool(np.allclose(res[own][filled], data[own][filled], rtol=1e-6)),
        "peer_wrong": int(wrong[peer].sum()),
        "gather_missing": sum(g.missing_elems for g in rep.gather),
        "peer_reduce_missing": missing[1 - rank],
        "delivered_min": min(f for ph in (rep.reduce, *rep.gather) for f in ph.delivered.values()),
        "degraded": rep.degraded,
        "written_back": bool(np.array_equal(on_gpu, res)),
    }


def sync_debug(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """Every backward with gradlane's hook under ``set_sync_debug_mode("error")`` (forward
    outside it: DDP's bucket rebuild at the second forward synchronizes by itself)."""
    cuda = device.type == "cuda"
    mode_before = torch.cuda.get_sync_debug_mode() if cuda else 0
    with device_sync_is_an_error(device):  # the mode bites on this torch: a sync raises
        try:
            torch.ones(1, device=device).item()
            detects = False
        except RuntimeError:
            detects = True
    torch.manual_seed(args["seed"])
    model = big_mlp().to(device)
    ddp = _ddp(model, device, args["cap_mb"])
    state = _state(args["name"], model)
    ddp.register_comm_hook(state, gradlane_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raised = None
    try:
        for step in range(args["steps"]):
            x, y = _batch(args["seed"], rank, step, torch.float32, device)
            opt.zero_grad(set_to_none=True)
            loss = _loss(ddp, x, y)
            try:
                with device_sync_is_an_error(device):
                    loss.backward()
            except RuntimeError as e:
                raised = {"step": step, "message": str(e)}
                break
            opt.step()
        stats = state.stats()
        if raised is None:
            _end(state)
    finally:
        state.close()
    return {
        "detects": detects,
        "raised": raised,
        "steps": stats["steps"],
        "failed": stats["failed_buckets"],
        "mode_before": mode_before,
        "mode_after": torch.cuda.get_sync_debug_mode() if cuda else 0,
    }


def staging_reuse(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """``steps`` steps of a small MLP: the buffers the hook hands the plane (its pinned staging
    buffers for CUDA buckets), and the pinned host allocator's counters after the rebuild and
    at the end."""
    torch.manual_seed(args["seed"])
    model = big_mlp(width=256, depth=4).to(device)
    ddp = _ddp(model, device, args["cap_mb"])
    state = _state(args["name"], model)
    plane = state.plane = RecordingPlane(state.plane)
    ddp.register_comm_hook(state, gradlane_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cuda = device.type == "cuda"
    before = None
    try:
        for step in range(args["steps"]):
            x, y = _batch(args["seed"], rank, step, torch.float32, device)
            opt.zero_grad(set_to_none=True)
            _loss(ddp, x, y).backward()
            opt.step()
            if step == 1:  # the rebuilt layout's buffers exist from its first step on
                before = _host_allocations() if cuda else None
        after = _host_allocations() if cuda else None
        stats = state.stats()
        _end(state)
    finally:
        state.close()
    last = plane.of_step(args["steps"] - 1)
    by_bucket: dict[int, set[int]] = {}
    for step in range(1, args["steps"]):
        for rec in plane.of_step(step):
            by_bucket.setdefault(rec.bucket, set()).add(rec.address)
    return {
        "buckets": len(last),
        "addresses_per_bucket": {b: len(a) for b, a in by_bucket.items()},
        "addresses": len(set().union(*by_bucket.values())),
        "pinned": [bool(torch.from_numpy(r.view).is_pinned()) for r in last] if cuda else None,
        "host_after_rebuild": before,
        "host_at_end": after,
        "generation": stats["generation"],
        "steps": stats["steps"],
        "failed": stats["failed_buckets"],
    }


def ordering(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """One large bucket whose mean is read the moment ``backward()`` returns: DDP's copy into
    ``.grad`` and this read run on the current stream, which only DDP's wait on the hook's
    Future orders after the side stream's copy back. Without that order they would read this
    rank's own gradient (at least 0.5 from the mean everywhere) for much of the bucket."""
    n = args["numel"]
    model = Dot([n]).to(device)
    ddp = _ddp(model, device, args["cap_mb"])
    state = _state(args["name"], model)
    ddp.register_comm_hook(state, gradlane_hook)
    gaps, own_gaps = [], []
    try:
        for step in range(args["steps"]):
            xs = [dot_inputs([n], args["seed"], r, step, device)[0] for r in range(world)]
            mean = torch.stack(xs).sum(0) / world
            if device.type == "cuda":
                torch.cuda.synchronize()  # only the step's own copies are still to order
            model.zero_grad(set_to_none=True)
            ddp([xs[rank]]).backward()
            gaps.append(float((model.ps[0].grad - mean).abs().max()))
            own_gaps.append(float((xs[rank] - mean).abs().min()))
        stats = state.stats()
        _end(state)
    finally:
        state.close()
    return {
        "gaps": gaps,
        "own_gaps": own_gaps,
        "bucket_bytes": n * 4,
        "buckets": [s.buckets for s in state.step_stats()],
        "failed": stats["failed_buckets"],
    }


def daemon(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """DDP's default hook and the daemon-mode hook (the host's daemon sums both local ranks)
    side by side on one MLP: per-step gradient gaps, relative."""
    torch.manual_seed(args["seed"])
    ref_model = big_mlp(width=256, depth=4).to(device)
    dmn_model = copy.deepcopy(ref_model)
    ref, dmn = _ddp(ref_model, device, args["cap_mb"]), _ddp(dmn_model, device, args["cap_mb"])
    hook = HookConfig(
        mode="daemon",
        daemon_socket=args["socket"],
        log_every=0,
        connect_timeout_s=30.0,
        name=args["name"],
    )
    cfg = dataclasses.replace(reliable(HARD_DEADLINE_S), job=args["job"])
    state = GradlaneState(cfg, hook, model=dmn_model, local_rank=rank, local_world=world)
    dmn.register_comm_hook(state, gradlane_hook)
    gaps = []
    try:
        for step in range(args["steps"]):
            x, y = _batch(args["seed"], rank, step, torch.float32, device)
            for d in (ref, dmn):
                _loss(d, x, y).backward()
            gaps.append(_relative_gap(ref_model, dmn_model, grads=True))
            with torch.no_grad():  # the same SGD step for both
                for a, b in zip(ref_model.parameters(), dmn_model.parameters(), strict=True):
                    a.add_(a.grad, alpha=-0.1)
                    b.copy_(a)
                    a.grad = b.grad = None
        stats = state.stats()
    finally:
        state.close()
    return {
        "gaps": gaps,
        "transport": stats["transport"],
        "steps": stats["steps"],
        "failed": stats["failed_buckets"],
    }


SCENARIOS: dict[str, Callable[[int, int, torch.device, dict], Any]] = {
    "equality": equality,
    "bounded": bounded,
    "sync_debug": sync_debug,
    "staging_reuse": staging_reuse,
    "ordering": ordering,
    "daemon": daemon,
}
