"""Record bench traces from real DDP runs (the files under ``bench/replay/traces/``).

Usage::

    python -m gradlane.bench.replay.record --models mlp,cnn,bert --out bench/replay/traces

Each model trains for ``--steps`` steps on ``--ranks`` processes (gloo over loopback, DDP's default
25 MB buckets) with DDP's default all-reduce hook wrapped in
:class:`~gradlane.integrations.trace.TraceRecorder`; every rank records its buckets, and the parent
merges them into ``<out>/<model>.jsonl``: one meta record, then the bucket records ordered by (step,
rank, bucket). Step 0 is DDP's whole-model bucket; the buckets are rebuilt after it.

Models (torch.nn): ``mlp`` (64-256-256-10) and ``cnn`` on scikit-learn's digits, 32 images per
rank; ``bert``: the shape of BERT-base (12 layers, width 768, 12 heads, FFN 3072, 30,522-token
vocabulary; 109.5 M parameters) on random token ids, 2 sequences of 128 tokens per rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

MODELS = ("mlp", "cnn", "bert")


def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], up: Any) -> None:
    import torch
    import torch.distributed as dist
    from gradlane.bench.demo.models import BertShapedEncoder, build, load_digits
    from gradlane.integrations.trace import TraceRecorder
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=600)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            name = args["model"]
            g = torch.Generator().manual_seed(1000 + rank)
            if name == "bert":
                torch.manual_seed(0)
                model: torch.nn.Module = BertShapedEncoder()
                batch: tuple[int, ...] = (2, 128)

                def sample() -> tuple[torch.Tensor, torch.Tensor]:
                    ids = torch.randint(0, 30522, batch, generator=g)
                    return ids, torch.randint(0, 2, (batch[0],), generator=g)
            else:
                model = build(name, 0)
                data = load_digits(0)
                batch = (32,)

                def sample() -> tuple[torch.Tensor, torch.Tensor]:
                    idx = torch.randint(0, len(data.y_train), batch, generator=g)
                    return data.x_train[idx], data.y_train[idx]

            ddp = DistributedDataParallel(model)
            params = sum(p.numel() for p in model.parameters())
            meta = {
                "model": name,
                "params": params,
                "grad_bytes": params * 4,
                "batch_per_rank": list(batch),
                "bucket_cap_mb": 25,
                "backend": "gloo (loopback)",
                "cpus": os.cpu_count(),
                "threads_per_rank": 1,
            }
            rec = TraceRecorder(allreduce_hook, None, path=args["path"], model=model, meta=meta)
            rec.attach(ddp)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(args["steps"]):
                x, y = sample()
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
            dist.barrier()
            rec.close()
        finally:
            dist.destroy_process_group()
        up.put(("ok", rank))
    except BaseException:
        up.put(("error", rank, traceback.format_exc()))
        raise


def record(model: str, ranks: int, steps: int, out: Path, timeout: float) -> Path:
    """Record one model's trace into ``out/<model>.jsonl``; returns the path."""
    from gradlane.bench.demo.training import _free_port
    from gradlane.bench.sim.scenarios import _commit

    ctx = mp.get_context("spawn")
    up: Any = ctx.Queue()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"r{r}.jsonl" for r in range(ranks)]
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, ranks, port, {"model": model, "steps": steps, "path": str(paths[r])}, up),
                name=f"gl-trace-{model}-r{r}",
            )
            for r in range(ranks)
        ]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.start()
            done = 0
            while done < ranks:
                try:
                    msg = up.get(timeout=1.0)
                except queue.Empty:
                    dead = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        raise RuntimeError(f"{model}: ranks died or timed out: {dead}") from None
                    continue
                if msg[0] != "ok":
                    raise RuntimeError(f"{model}: rank {msg[1]} failed:\n{msg[2]}")
                done += 1
        finally:
            for p in procs:
                if p.pid is not None:
                    p.join(30.0)
                    if p.is_alive():
                        p.kill()
                        p.join(10.0)
            up.close()
        metas: list[dict[str, Any]] = []
        buckets: list[dict[str, Any]] = []
        for path in paths:
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                (metas if rec["kind"] == "meta" else buckets).append(rec)
    meta = {k: v for k, v in metas[0].items() if k != "rank"}
    meta.update(
        ranks=sorted(m["rank"] for m in metas),
        steps=steps,
        commit=_commit(),
        recorded=datetime.date.today().isoformat(),
        command=(
            "python -m gradlane.bench.replay.record"
            f" --models {model} --ranks {ranks} --steps {steps}"
        ),
    )
    buckets.sort(key=lambda r: (r["step"], r["rank"], r["bucket"]))
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{model}.jsonl"
    with open(target, "w", encoding="utf-8") as f:
        for rec in [meta, *buckets]:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gradlane.bench.replay.record", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--models", default="mlp,cnn,bert", help="comma-separated (mlp,cnn,bert)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "traces"))
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per model")
    ns = ap.parse_args(argv)
    models = [m for m in ns.models.split(",") if m]
    if set(models) - set(MODELS) or ns.ranks < 2 or ns.steps < 2:
        ap.error(f"models from {MODELS}, --ranks >= 2, --steps >= 2 (step 0 is pre-rebuild)")
    for model in models:
        t0 = time.monotonic()
        path = record(model, ns.ranks, ns.steps, Path(ns.out), ns.timeout)
        print(f"{model}: {path} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
