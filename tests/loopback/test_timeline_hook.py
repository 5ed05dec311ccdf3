"""The DDP hook's timeline in this process (a world of one): recorded when set, written at
``close()`` and on request, absent when unset. Several ranks: tests/multiproc/test_ddp_hook.py."""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gradlane.integrations.ddp import GradlaneState, HookConfig, HookError, gradlane_hook
from gradlane.integrations.rendezvous import StoreRendezvous
from gradlane.integrations.timeline import STEPS_TID, read_timeline
from gradlane.transport.config import TransportConfig
from torch.nn.parallel import DistributedDataParallel

from tests.support.ddp import hook_state, one_rank_group, tiny_model


@pytest.fixture
def store() -> Iterator[dist.Store]:
    """A one-rank gloo process group on a HashStore (destroyed after the test)."""
    with one_rank_group() as s:
        yield s


@pytest.fixture
def folder() -> Iterator[Path]:
    """A temporary folder, removed with everything in it after the test."""
    with tempfile.TemporaryDirectory(prefix="gradlane-timeline-") as d:
        yield Path(d)


def _train(state: GradlaneState, model: torch.nn.Module, steps: int) -> None:
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)
    ddp.register_comm_hook(state, gradlane_hook)
    for _ in range(steps):
        ddp(torch.randn(4, 8)).sum().backward()
        for p in model.parameters():
            p.grad = None


@pytest.mark.timeout(60)
def test_the_state_writes_its_timeline_at_close(store, folder):
    model = tiny_model()
    config = HookConfig(log_every=0, timeline=str(folder / "t.json"))
    state = GradlaneState(
        TransportConfig(chunk_bytes=65000), config, rendezvous=StoreRendezvous(store), model=model
    )
    try:
        _train(state, model, steps=3)
        per_step = [s.buckets for s in state.step_stats()]
        early = state.write_timeline(folder / "early-{rank}.json")
        stats = state.stats()
    finally:
        state.close()
    assert early == folder / "early-0.json" and early.exists()
    assert stats["timeline"]["dropped"] == 0 and stats["timeline"]["events"] > 0
    data = read_timeline(folder / "t.rank0.json")  # '.rank0' inserted before the suffix
    events = data["traceEvents"]
    spans = Counter(e["args"]["step"] for e in events if e.get("cat") == "bucket")
    assert [spans[s] for s in range(3)] == per_step
    phases = Counter(e["name"] for e in events if e.get("cat") == "phase")
    assert phases["reduce"] == sum(per_step)  # a world of one has no gather phase
    steps = [e for e in events if e.get("cat") == "step"]
    assert [e["name"] for e in steps] == ["step 0", "step 1", "step 2"]
    assert all(e["tid"] == STEPS_TID for e in steps)
    assert not [e for e in events if e["ph"] == "i"]  # nothing lost or failed on one rank


@pytest.mark.timeout(60)
def test_without_a_timeline_nothing_is_recorded(store, folder):
    model = tiny_model()
    with hook_state(store, model=model) as state:
        _train(state, model, steps=2)
        assert state.timeline is None and "timeline" not in state.stats()
        with pytest.raises(HookError, match="GRADLANE_HOOK__TIMELINE"):
            state.write_timeline(folder / "t.json")
    assert not list(folder.iterdir())
