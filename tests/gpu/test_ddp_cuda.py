"""The DDP hook with CUDA gradients in this process (a world of one): buckets on the GPU go
through pinned host staging and come back as the mean, exactly as a model without DDP computes
it, and a failure on the staging path reaches ``backward()`` naming the step and bucket."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gradlane.integrations.ddp import GradlaneState, gradlane_hook
from gradlane.transport.core.events import CollectiveReport, LossReport
from torch.nn.parallel import DistributedDataParallel

from tests.support.ddp import hook_state, one_rank_group, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def store() -> Iterator[dist.Store]:
    """A one-rank gloo process group (destroyed after the test)."""
    with one_rank_group() as s:
        yield s


def _step(ddp: torch.nn.Module, dtype: torch.dtype = torch.float32) -> None:
    ddp(torch.randn(4, 8, device="cuda", dtype=dtype)).float().sum().backward()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_buckets_go_through_pinned_staging(store, dtype):
    model = tiny_model().to(device="cuda", dtype=dtype)
    ref = tiny_model().to(device="cuda", dtype=dtype)  # no DDP: one rank's mean is its gradient
    ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.002)
    with hook_state(store, model=model) as state:
        ddp.register_comm_hook(state, gradlane_hook)
        for _ in range(3):
            x = torch.randn(4, 8, device="cuda", dtype=dtype)
            ddp(x).float().sum().backward()
            ref(x).float().sum().backward()
            for a, b in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad)
                a.grad = b.grad = None
        stats = state.stats()
    assert stats["steps"] == 3 and stats["failed_buckets"] == 0
    assert stats["generation"] == 1  # DDP's rebuild after the first backward was seen


@pytest.mark.timeout(120)
def test_closed_state_fails_backward_naming_the_bucket(store):
    model = tiny_model().cuda()
    ddp = DistributedDataParallel(model, device_ids=[0])
    state = hook_state(store, model=model)
    ddp.register_comm_hook(state, gradlane_hook)
    _step(ddp)
    state.close()
    with pytest.raises(RuntimeError) as exc:
        _step(ddp)
    text = str(exc.value)
    assert "HookError: gradlane hook on rank 0: step 1 bucket 0" in text, text
    assert "data plane of rank 0 is closed" in text, text


class _WrongPlane:
    """A data plane that answers a bucket of n elements with n - 1."""

    def submit(
        self, step, bucket, data, layer_position=0.5, dtype=None, servers=None, out=None, *,
        scale=1.0, pinned=False,
    ):  # fmt: skip
        fut: concurrent.futures.Future = concurrent.futures.Future()
        lr = LossReport(step, bucket, 0, 0, data.size, 0, {}, 0.0, False)
        fut.set_result((np.array(data[:-1]), CollectiveReport(step, bucket, 0.0, lr, ())))
        return fut

    def stats(self):
        return {}

    def drain(self, timeout_s=2.0):
        return True

    def close(self):
        pass


@pytest.mark.timeout(120)
def test_a_wrong_result_on_the_staging_path_fails_backward(store):
    model = tiny_model().cuda()
    ddp = DistributedDataParallel(model, device_ids=[0])
    state = GradlaneState(rank=0, world=1, plane=_WrongPlane(), model=model)
    ddp.register_comm_hook(state, gradlane_hook)
    with pytest.raises(RuntimeError, match="the data plane returned float32"):
        _step(ddp)
    assert state.stats()["failed_buckets"] == 1
