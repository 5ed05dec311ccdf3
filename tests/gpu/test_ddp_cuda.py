"""The DDP hook with CUDA gradients: buckets on the GPU go through pinned host staging and come
back as the mean, exactly as a model without DDP computes it (a world of one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from gradlane.integrations.ddp import gradlane_hook
from torch.nn.parallel import DistributedDataParallel

from tests.support.ddp import hook_state, one_rank_group, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def store() -> Iterator[dist.Store]:
    """A one-rank gloo process group (destroyed after the test)."""
    with one_rank_group() as s:
        yield s


@pytest.mark.timeout(120)
def test_cuda_buckets_go_through_pinned_staging(store):
    model = tiny_model().cuda()
    ref = tiny_model().cuda()  # the same initialisation, no DDP: one rank's mean is its gradient
    ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.002)
    with hook_state(store, model=model) as state:
        ddp.register_comm_hook(state, gradlane_hook)
        for _ in range(3):
            x = torch.randn(4, 8, device="cuda")
            ddp(x).sum().backward()
            ref(x).sum().backward()
            for a, b in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad)
                a.grad = b.grad = None
        assert state.stats()["steps"] == 3
