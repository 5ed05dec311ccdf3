"""gloo draws in the trace replay's report (bench/replay/report.py) and options (run.py).

A draw is a run of gloo's steps over connections of their own: on an ECMP fabric each draw hashes
gloo's flows onto the spines anew. The report keeps each configuration's percentiles per draw and
the p99 ratio per draw beside the pooled one; one draw adds nothing.
"""

from __future__ import annotations

import argparse

import pytest
from gradlane.bench.replay import report
from gradlane.bench.replay.run import ECMP_DRAWS, ReplayOptions, _gloo_draws


def _step(i: int, draw: int, comm: float) -> dict:
    return {
        "step": i, "draw": draw, "t_s": float(i), "comm_s": comm, "comm_s_per_rank": [comm],
        "protected_s": comm / 2, "bucket_lat_s": {"0": comm}, "bucket_done_s": {"0": comm},
        "delivered": 1.0, "wall_s": comm, "host_cores": None, "cpu_s": 0.1, "degraded": 0,
        "retransmitted": 0, "path_bytes": [], "bytes": 1000,
    }  # fmt: skip


def _raw(gloo: list[tuple[int, float]], ours: list[tuple[int, float]]) -> dict:
    return {
        "world": 2,
        "net": {"link_Bps": 0.0},
        "steps": {
            "gloo": [_step(i, d, c) for i, (d, c) in enumerate(gloo)],
            "udp-bounded": [_step(i, d, c) for i, (d, c) in enumerate(ours)],
        },
        "configs": {"gloo": {"name": "gloo"}, "udp-bounded": {"name": "udp-bounded"}},
        "network": "test",
        "trace": "t.jsonl",
        "trace_meta": {},
        "options": {},
        "wall_s": 1.0,
    }


def test_each_draw_has_its_percentiles_and_ratio_and_the_pool_keeps_every_step():
    # Draw 0 kept gloo off the congestion (0.3 s), draw 1 did not (0.9 s); ours 0.2 s throughout.
    gloo = [(0, 0.3), (0, 0.3), (1, 0.9), (1, 0.9)]
    doc = report.build(_raw(gloo, [(d, 0.2) for d, _ in gloo]), "cmd")
    draws = doc["configs"]["gloo"]["draws"]
    assert [(d["draw"], d["steps"]) for d in draws] == [(0, 2), (1, 2)]
    assert [d["comm_p50_s"] for d in draws] == pytest.approx([0.3, 0.9])
    per_draw = doc["summary"]["p99_ratio_vs_gloo_per_draw"]
    assert per_draw == pytest.approx([0.2 / 0.3, 0.2 / 0.9])
    assert doc["summary"]["p99_ratio_vs_gloo"] == pytest.approx(0.2 / 0.9, rel=0.05)
    assert "gloo per draw" in report.table(doc)


def test_one_draw_reports_no_per_draw_ratio():
    doc = report.build(_raw([(0, 0.3)] * 3, [(0, 0.2)] * 3), "cmd")
    assert len(doc["configs"]["gloo"]["draws"]) == 1
    assert doc["summary"]["p99_ratio_vs_gloo_per_draw"] is None
    assert "gloo per draw" not in report.table(doc)


@pytest.mark.parametrize("draws", [0, 4])
def test_draws_must_be_between_one_and_the_steps(draws):
    with pytest.raises(ValueError, match="--gloo-draws"):
        ReplayOptions(trace="t.jsonl", steps=3, gloo_draws=draws)


@pytest.mark.parametrize(
    ("network", "gloo", "given", "steps", "want"),
    [
        ("testbed", "ecmp", None, 30, ECMP_DRAWS),
        ("testbed", "ecmp", None, 2, 2),
        ("testbed", "path0", None, 30, 1),
        ("loopback", "path0", None, 30, 1),
        ("testbed", "ecmp", 1, 30, 1),
    ],
)
def test_draws_default_to_several_only_over_ecmp(network, gloo, given, steps, want):
    args = argparse.Namespace(network=network, gloo=gloo, gloo_draws=given, steps=steps)
    assert _gloo_draws(args) == want
