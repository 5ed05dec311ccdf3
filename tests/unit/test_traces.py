"""The traces shipped under ``bench/replay/traces/`` follow the documented format (docs/testbed.md,
trace.py)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.traces import BUCKET_FIELDS

TRACES = Path(__file__).resolve().parents[2] / "bench" / "replay" / "traces"


@pytest.mark.parametrize(
    ("model", "params"), [("mlp", 85_002), ("cnn", 38_282), ("bert", 109_483_778)]
)
def test_shipped_trace_is_consistent(model: str, params: int):
    lines = (TRACES / f"{model}.jsonl").read_text().splitlines()
    meta, records = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    assert meta["kind"] == "meta" and meta["format"] == "gradlane-trace" and meta["version"] == 1
    assert meta["model"] == model and meta["params"] == params
    assert meta["grad_bytes"] == 4 * params and meta["command"].startswith("python -m bench.")
    per_step: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in records:
        assert set(r) == BUCKET_FIELDS and r["kind"] == "bucket" and r["ok"]
        assert r["bytes"] == 4 * r["numel"] and r["dtype"] == "float32"
        assert 0.0 <= r["layer_span"][0] <= r["layer_span"][1] <= 1.0
        assert r["ready_s"] >= r["gap_s"] >= 0.0 and r["comm_s"] >= 0.0
        per_step[(r["step"], r["rank"])].append(r)
    assert {s for s, _ in per_step} == set(range(meta["steps"]))
    assert {k for _, k in per_step} == set(meta["ranks"])
    for key, recs in per_step.items():
        recs.sort(key=lambda r: r["bucket"])
        assert [r["bucket"] for r in recs] == list(range(len(recs))), key
        assert sum(r["bytes"] for r in recs) == meta["grad_bytes"], key  # every gradient once
        assert [r["last"] for r in recs] == [False] * (len(recs) - 1) + [True], key
        if key[0] == 0:  # DDP's first iteration: one whole-model bucket
            assert len(recs) == 1 and recs[0]["layer_span"] == [0.0, 1.0]
