"""Synthetic traces (bench/replay/synth.py): real DDP buckets, the trace format, the timing."""

from __future__ import annotations

import datetime
import json

import pytest
import torch
import torch.distributed as dist
from gradlane.bench.demo.models import big_mlp
from gradlane.bench.replay.synth import SynthSpec, load_params, main, model_params, synth_records
from gradlane.integrations.trace import read_trace
from torch.nn.parallel import DistributedDataParallel

from tests.support.traces import BUCKET_FIELDS


@pytest.fixture
def gloo_world_of_one():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp_bucket_numels(model: torch.nn.Module, **ddp_kw) -> list[int]:
    """Bucket sizes (elements, bucket 0 first) that real DDP uses after its rebuild."""
    ddp = DistributedDataParallel(model, **ddp_kw)
    seen: dict[int, list[int]] = {}
    step = [0]

    def hook(state, bucket):
        seen.setdefault(step[0], []).append(bucket.buffer().numel())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    for s in range(3):
        step[0] = s
        ddp(torch.randn(4, 64)).sum().backward()
    assert seen[1] == seen[2]  # rebuilt once, after the first backward
    return seen[2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("width", "depth", "cap_mb"),
    [(300, 5, 0.5), (600, 3, None)],  # a custom cap; DDP's default (1 MiB first bucket)
)
def test_buckets_match_real_ddp(gloo_world_of_one, width, depth, cap_mb):
    torch.manual_seed(0)
    model = big_mlp(width=width, depth=depth)
    real = _ddp_bucket_numels(model, bucket_cap_mb=cap_mb)
    assert len(real) >= 2  # the case says something about the cut
    spec = SynthSpec(world=1, steps=1, bucket_cap_mb=cap_mb or 25.0)
    recs = synth_records(model_params(model), spec)
    assert [r["numel"] for r in recs[1:]] == real


def test_records_follow_the_trace_format(tmp_path):
    params = [("a.weight", 300 * 64), ("a.bias", 300), ("b.weight", 10 * 300), ("b.bias", 10)]
    spec = SynthSpec(world=2, steps=3, bucket_cap_mb=0.05, jitter=0.1, seed=3)
    path = tmp_path / "t.jsonl"
    assert main(["--params-json", _params_json(tmp_path, params), "--out", str(path),
                 "--world", "2", "--steps", "3", "--bucket-cap-mb", "0.05", "--jitter", "0.1",
                 "--seed", "3"]) == 0  # fmt: skip
    metas, buckets = read_trace(path)
    assert len(metas) == 1 and metas[0]["synthetic"] and metas[0]["params"] == 22_510
    assert metas[0]["command"].startswith("python -m gradlane.bench.replay.synth")
    assert buckets == synth_records(params, spec)[1:]  # seeded: the same trace every time
    per = {}
    for r in buckets:
        assert set(r) == BUCKET_FIELDS and r["bytes"] == 4 * r["numel"]
        per.setdefault((r["step"], r["rank"]), []).append(r)
    assert len(per) == 6
    for recs in per.values():
        assert sum(r["numel"] for r in recs) == 22_510
        assert [r["last"] for r in recs][-1] and not any(r["last"] for r in recs[:-1])
        # Backward order: bucket 0 holds the last layer; ready times grow by the gaps.
        assert recs[0]["layer_span"][1] == 1.0 and recs[-1]["layer_span"][0] == 0.0
        t = 0.0
        for r in recs:
            t += r["gap_s"]
            assert r["ready_s"] == pytest.approx(t, abs=1e-8)
    # Jitter differs between ranks and steps.
    assert len({recs[0]["ready_s"] for recs in per.values()}) == 6


def test_flop_model_and_given_rates():
    params = [("w", 1_000_000)]
    (b,) = synth_records(params, SynthSpec(world=1, steps=1, jitter=0, batch=10, flops=1e9))[1:]
    # forward 2 x 10 x 1e6 FLOPs, backward 4 x 10 x 1e6, at 1 GFLOP/s
    assert b["ready_s"] == pytest.approx(0.02 + 0.04)
    spec = SynthSpec(world=1, steps=1, jitter=0, grad_rate_mbps=400, forward_ms=5)
    (b,) = synth_records(params, spec)[1:]
    assert b["ready_s"] == pytest.approx(0.005 + 4e6 / 400e6)


def test_bad_parameter_lists_are_clear_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([["w", [3, 0]]]))
    with pytest.raises(ValueError, match="shape must be a list of positive ints"):
        load_params(bad)
    assert main(["--params-json", str(bad), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "positive ints" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no parameters"):
        synth_records([], SynthSpec())


def _params_json(tmp_path, params) -> str:
    p = tmp_path / "params.json"
    p.write_text(json.dumps([{"name": n, "shape": [k]} for n, k in params]))
    return str(p)
