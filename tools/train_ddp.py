#!/usr/bin/env python3
"""Plain DDP training with the gradlane hook, for ``torchrun``: what a user's script looks like.

    torchrun --standalone --nproc-per-node 2 tools/train_ddp.py --steps 300
    GRADLANE_N_PATHS=2 GRADLANE_CHUNK_BYTES=65000 GRADLANE_LOSS__LOSS_BOUND=0.02 \\
        torchrun --standalone --nproc-per-node 4 tools/train_ddp.py

``torchrun`` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the hook finds its
peers through that TCPStore, so gradlane needs no configuration of its own. Transport settings
come from ``GRADLANE_*`` variables (``GRADLANE_HOOK__*`` for the hook itself). The model is a
small MLP on scikit-learn's digits; every rank takes its slice of each global batch.
"""

from __future__ import annotations

import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
from gradlane.integrations.ddp import GradlaneState, gradlane_hook
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="images per rank and step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()

    logging.basicConfig(level=logging.WARNING)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    ).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)

    # The gradlane part: a state (data plane + peers found through torchrun's TCPStore) and
    # the hook. Everything else is ordinary DDP.
    state = GradlaneState.from_env(model=model)
    ddp.register_comm_hook(state, gradlane_hook)

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x_tr = torch.as_tensor(x_tr / 16.0, dtype=torch.float32, device=device)
    y_tr = torch.as_tensor(y_tr, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    rng = np.random.default_rng(0)  # the same sequence of global batches on every rank
    glob = world * args.batch
    perm = rng.permutation(len(y_tr))
    at = 0
    for step in range(args.steps):
        if at + glob > len(perm):
            perm, at = rng.permutation(len(y_tr)), 0
        idx = torch.as_tensor(perm[at + rank * args.batch : at + (rank + 1) * args.batch])
        at += glob
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x_tr[idx]), y_tr[idx])
        loss.backward()  # a late peer raises here, naming it (never a hang)
        opt.step()
        if rank == 0 and (step + 1) % args.log_every == 0:
            s = state.stats()
            print(
                f"step {step + 1}: loss {loss.item():.4f}, "
                f"comm p50 {s['comm_s']['p50'] * 1e3:.2f} ms, "
                f"delivered {s['delivered_fraction']['min']:.4f}, "
                f"retransmitted {s['retransmitted']}",
                flush=True,
            )

    with torch.no_grad():
        pred = model(torch.as_tensor(x_te / 16.0, dtype=torch.float32, device=device)).argmax(1)
        accuracy = float((pred.cpu() == torch.as_tensor(y_te)).float().mean()) * 100.0
    print(f"rank {rank}: test accuracy {accuracy:.2f}% after {args.steps} steps", flush=True)
    # Every peer has what this rank sent (drain) on every rank (barrier), while every engine
    # still answers; then close.
    state.drain()
    dist.barrier()
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
