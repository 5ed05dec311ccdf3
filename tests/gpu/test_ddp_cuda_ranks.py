"""The DDP hook's CUDA path in two rank processes sharing the one GPU: a gloo process group,
models and DDP's buckets on ``cuda:0``, gradlane's data plane over loopback.

One pair of ranks (:class:`tests.gpu.cuda_workers.RankPair`) serves the whole module, one
scenario per test; a failed scenario ends the pair and the next test starts a new one. Every
wait is bounded (a pair's start, a scenario's results, the transport's hard deadline), the
pair is ended in the fixture's ``finally``, and nothing asserts on timing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch
from gradlane.transport.daemon.config import DaemonConfig
from gradlane.transport.daemon.server import Daemon

from tests.gpu.cuda_workers import START_S, WAIT_S, RankPair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: pytest's bound on one test: a pair's start and one scenario, with room to spare.
TIMEOUT_S = int(START_S + WAIT_S + 60)
#: Largest gap between the two hooks' results, relative to the largest value: float32 sums
#: differ only in summation order; bfloat16 rounds once in either hook, at different points.
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


@pytest.fixture(scope="module")
def pair() -> Iterator[RankPair]:
    """The module's two ranks; ended (and their exit codes checked) after its last test."""
    ranks = RankPair("cuda")
    try:
        yield ranks
    finally:
        codes = ranks.close()
    assert all(c == 0 for c in codes.values()), f"rank processes exited abnormally: {codes}"


@pytest.fixture
def daemon() -> Iterator[tuple[str, int]]:
    """A ``gradlane daemon`` in this process for one host of two local ranks: (socket, job)."""
    folder = tempfile.mkdtemp(prefix="gl-gpu-")
    sock, job = os.path.join(folder, "d.sock"), 500_000 + os.getpid() % 100_000
    try:
        with Daemon(DaemonConfig(job=job, socket=sock, metrics="", local_world=2)):
            yield sock, job
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("cap_mb", [1, 25])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reliable_hook_equals_default_hook(pair: RankPair, dtype: str, cap_mb: int):
    steps = 4
    results = pair.run("equality", {"dtype": dtype, "cap_mb": cap_mb, "steps": steps, "seed": 3})
    for rank, r in sorted(results.items()):
        where = f"rank {rank} {dtype} bucket_cap_mb={cap_mb}"
        assert r["steps"] == steps and r["failed"] == 0, f"{where}: {r}"
        assert max(r["grad_gaps"]) <= TOLERANCE[dtype], f"{where}: gaps {r['grad_gaps']}"
        assert r["param_gap"] <= TOLERANCE[dtype], f"{where}: parameters {r['param_gap']}"
        # DDP rebuilt its buckets after the first step, and the hook saw the new layout.
        assert r["generation"] >= 1, where
        if r["grad_bytes"] > cap_mb * 2**20:
            assert max(r["buckets"]) > 1, f"{where}: buckets per step {r['buckets']}"


@pytest.mark.timeout(TIMEOUT_S)
def test_bounded_mode_with_injected_loss_reports_exactly_what_it_filled(pair: RankPair):
    bound = 0.1
    args = {"sizes": [120_001, 100_003, 80_021], "cap_mb": 0.5, "steps": 3, "seed": 1,
            "loss_bound": bound, "inject_loss": 0.04}  # fmt: skip
    results = pair.run("bounded", args)
    given_up = 0
    for rank, r in sorted(results.items()):
        assert r["injected_drops"] > 0, f"rank {rank}: the plane dropped nothing"
        assert r["failed"] == 0 and r["degraded"] == 0, f"rank {rank}: {r}"
        for b in r["buckets"]:
            where = f"rank {rank} step {b['step']} bucket {b['bucket']}: {b}"
            # DDP's gradients are the plane's result, bit for bit: the copy back to the GPU.
            assert b["written_back"], where
            assert not b["degraded"] and b["delivered_min"] >= 1.0 - bound, where
            # Own shard: exactly the reduce phase's missing elements were filled, with this
            # rank's own value (the unbiased fill of one contribution, scaled to the mean).
            assert b["own_wrong"] == b["reduce_missing"], where
            assert b["filled_with_own"], where
            # The peer's shard: what this rank's gather missed, plus what the peer's reduce did.
            lo, hi = b["gather_missing"], b["gather_missing"] + b["peer_reduce_missing"]
            assert lo <= b["peer_wrong"] <= hi, where
            given_up += b["reduce_missing"] + b["gather_missing"]
    # The bound was used (some data given up on), else this would test reliable recovery only.
    assert given_up > 0


@pytest.mark.timeout(TIMEOUT_S)
def test_backward_never_synchronizes_the_device(pair: RankPair):
    steps = 4
    results = pair.run("sync_debug", {"steps": steps, "cap_mb": 1, "seed": 5})
    for rank, r in sorted(results.items()):
        assert r["detects"], "set_sync_debug_mode('error') let .item() pass: a vacuous check"
        raised = r["raised"]
        assert raised is None, (
            f"rank {rank}: a synchronizing CUDA call under backward() at step "
            f"{raised['step']}:\n{raised['message']}"
        )
        assert r["steps"] == steps and r["failed"] == 0, r
        assert r["mode_after"] == r["mode_before"], r


@pytest.mark.timeout(TIMEOUT_S)
def test_staging_buffers_are_reused_across_100_steps(pair: RankPair):
    steps = 101  # the first step has DDP's whole-model bucket; 100 steps of the rebuilt layout
    results = pair.run("staging_reuse", {"steps": steps, "cap_mb": 0.25, "seed": 7})
    for rank, r in sorted(results.items()):
        assert r["steps"] == steps and r["failed"] == 0 and r["generation"] >= 1, (rank, r)
        assert r["buckets"] > 1, (rank, r)
        # Each bucket of the rebuilt layout went through one pinned buffer, every step.
        assert set(r["addresses_per_bucket"].values()) == {1}, r
        assert r["addresses"] == r["buckets"], r
        assert all(r["pinned"]), r
        # No pinned memory was allocated after the rebuilt layout's first step.
        if r["host_after_rebuild"] is not None:
            assert r["host_at_end"] == r["host_after_rebuild"], r


@pytest.mark.timeout(TIMEOUT_S)
def test_copy_back_is_ordered_before_ddp_reads_the_bucket(pair: RankPair):
    numel = 32 * 2**20  # 128 MiB of float32: the copy back takes milliseconds
    results = pair.run("ordering", {"numel": numel, "cap_mb": 25, "steps": 3, "seed": 9})
    for rank, r in sorted(results.items()):
        assert r["failed"] == 0 and set(r["buckets"]) == {1}, r
        # A read of this rank's own gradient instead of the mean would be off by >= 1 here...
        assert min(r["own_gaps"]) >= 0.5, r
        # ...and the mean of values in [1, 2) and (-2, -1] is exact in float32.
        assert max(r["gaps"]) <= 1e-6, f"rank {rank}: gradients read before the copy: {r}"


@pytest.mark.timeout(TIMEOUT_S)
def test_daemon_mode_with_cuda_buckets(pair: RankPair, daemon: tuple[str, int]):
    sock, job = daemon
    steps = 3
    args = {"socket": sock, "job": job, "steps": steps, "cap_mb": 0.25, "seed": 11}
    results = pair.run("daemon", args)
    for rank, r in sorted(results.items()):
        assert max(r["gaps"]) <= TOLERANCE["float32"], f"rank {rank}: {r['gaps']}"
        assert r["transport"] == "daemon" and r["steps"] == steps and r["failed"] == 0, r
