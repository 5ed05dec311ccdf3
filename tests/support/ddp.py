"""A DDP world of one in this process: the gloo group, a small seeded model, a hook state.

A one-rank gloo group on a ``HashStore`` is enough for DDP to call communication hooks
(buckets, the rebuild after the first backward, ``is_last``), and a one-rank data plane
completes at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from gradlane.integrations.ddp import GradlaneState, HookConfig
from gradlane.integrations.rendezvous import StoreRendezvous
from gradlane.transport.config import TransportConfig
from torch import nn

__all__ = ["hook_state", "one_rank_group", "tiny_model"]


@contextlib.contextmanager
def one_rank_group() -> Iterator[dist.Store]:
    """A one-rank gloo process group on a ``HashStore``, destroyed on exit; yields the store."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def tiny_model() -> nn.Module:
    """Three linear layers, 8 -> 32 -> 32 -> 4, initialised from seed 0 (equal every call)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def hook_state(store: dist.Store, **kw: Any) -> GradlaneState:
    """A gradlane hook state meeting its peers through ``store`` (64 KB chunks, stats logged
    every step); ``kw`` goes to :class:`GradlaneState`."""
    return GradlaneState(
        TransportConfig(chunk_bytes=65000),
        HookConfig(log_every=1),
        rendezvous=StoreRendezvous(store),
        **kw,
    )
