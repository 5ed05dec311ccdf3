"""Trace replay on loopback (bench/replay/run.py): 2 rank processes, a tiny synthetic trace, every
transport; the report's structure and values. Every rank process is stopped by ``run_replay``
whatever happens (its ``finally``); each test has a timeout."""

from __future__ import annotations

import json

import pytest
from gradlane.bench.replay import report as replay_report
from gradlane.bench.replay.run import LoopbackNetwork, ReplayError, ReplayOptions, run_replay
from gradlane.bench.replay.synth import SynthSpec, synth_records, write_trace
from gradlane.integrations.cli.main import main

CONFIGS = ("gloo", "udp-reliable", "udp-bounded", "udp-reliable+flat", "udp-bounded+1path")
STEPS = 3


@pytest.fixture
def tiny_trace(tmp_path):
    """3 buckets (~40-160 KB) per step, 2 trace ranks, 2 steps (the replay cycles them)."""
    params = [
        ("z.w", 5_000),
        ("a.w", 40_000),
        ("a.b", 200),
        ("b.w", 20_000),
        ("b.b", 100),
        ("c.w", 10_000),
    ]
    spec = SynthSpec(world=2, steps=2, bucket_cap_mb=0.1, first_bucket_mb=0.05, flops=5e9)
    path = tmp_path / "tiny.jsonl"
    write_trace(synth_records(params, spec, {"model": "tiny", "command": "test"}), path)
    return path


@pytest.mark.timeout(240)
def test_loopback_replay_of_every_transport(tiny_trace, tmp_path):
    opts = ReplayOptions(trace=str(tiny_trace), configs=CONFIGS, steps=STEPS, warmup=1)
    seen = []
    raw = run_replay(opts, LoopbackNetwork(2), lambda c, s, n: seen.append((c, s, n)))
    doc = replay_report.build(raw, "test command")
    paths = replay_report.write(doc, tmp_path / "out")
    assert [p.name for p in paths] == [
        "out.json", "out_cdf.png", "out_paths.png", "out_delivered.png",
    ]  # fmt: skip
    for p in paths[1:]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    doc = json.loads(paths[0].read_text())
    assert doc["command"] == "test command" and doc["world"] == 2
    assert set(doc["summary"]) >= set(replay_report.SUMMARY_KEYS)
    assert set(doc["configs"]) == set(CONFIGS)
    assert sorted(set(seen)) == sorted((c, s, STEPS) for c in CONFIGS for s in range(1, STEPS + 1))
    per_step_bytes = 4 * 75_300
    for name, c in doc["configs"].items():
        steps = doc["steps"][name]
        assert c["steps"] == STEPS and [s["step"] for s in steps] == list(range(STEPS))
        assert c["bytes_per_step"] == per_step_bytes
        assert 0 < c["comm_p50_s"] <= c["comm_p99_s"] <= c["comm_max_s"]
        for s in steps:
            assert len(s["comm_s_per_rank"]) == 2 and s["comm_s"] == max(s["comm_s_per_rank"])
            assert set(s["bucket_lat_s"]) == {"0", "1", "2"}
            assert 0 < s["protected_s"] <= s["comm_s"] + 1e-9
        if name == "gloo":
            assert c["path_bytes"] == []
            continue
        # Every bucket was sent by both ranks (half of it each way, both phases).
        assert sum(c["path_bytes"]) >= STEPS * per_step_bytes, (name, c["path_bytes"])
        assert len(c["path_bytes"]) == (1 if name.endswith("+1path") else 2)
        if name.startswith("udp-reliable"):  # loopback loses nothing; reliable loses nothing
            assert c["delivered_min"] == 1.0 and c["degraded_buckets"] == 0
        assert c["delivered_min"] >= 1.0 - 0.02 - 1e-9
    s = doc["summary"]
    assert s["p99_ratio_vs_gloo"] > 0 and s["mean_ratio_vs_gloo"] > 0
    assert s["delivered_fraction_min"] >= 0.98 - 1e-9
    # Absent pairs (udp-bounded+flat, udp-reliable+1path) leave their keys null, not made up.
    assert s["goodput_fraction_of_link"] is None  # loopback has no link rate
    assert s["priority_protected_p99_gain"] is None or s["priority_protected_p99_gain"] > 0


@pytest.mark.timeout(180)
def test_gloo_draws_run_over_new_connections_and_are_reported_apart(tiny_trace):
    """Two draws: gloo's steps 0-1 over one group, 2-3 over a group opened for them."""
    opts = ReplayOptions(
        trace=str(tiny_trace), configs=("gloo", "udp-bounded"), steps=4, warmup=1, gloo_draws=2
    )
    doc = replay_report.build(run_replay(opts, LoopbackNetwork(2)), "test command")
    for name in ("gloo", "udp-bounded"):
        assert [s["draw"] for s in doc["steps"][name]] == [0, 0, 1, 1]
    assert [(d["draw"], d["steps"]) for d in doc["configs"]["gloo"]["draws"]] == [(0, 2), (1, 2)]
    per_draw = doc["summary"]["p99_ratio_vs_gloo_per_draw"]
    assert len(per_draw) == 2 and all(r > 0 for r in per_draw)


@pytest.mark.timeout(120)
def test_a_failing_rank_is_a_clear_error_and_nothing_is_left(tiny_trace, tmp_path):
    """Rank 1 has no records in this trace: the run fails with its message, it does not hang."""
    lines = tiny_trace.read_text().splitlines()
    meta = json.loads(lines[0])
    kept = [x for x in lines[1:] if json.loads(x)["rank"] == 0]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([json.dumps({**meta, "world": 3}), *kept]) + "\n")
    opts = ReplayOptions(trace=str(broken), configs=("udp-reliable",), steps=1, warmup=0)
    with pytest.raises(ReplayError, match="rank 1 failed: ValueError: the trace has no buckets"):
        run_replay(opts, LoopbackNetwork(2))


def test_cli_rejects_unknown_configurations(tiny_trace, capsys):
    assert main(["bench", "replay", str(tiny_trace), "--configs", "gloo,udp-fast"]) == 2
    err = capsys.readouterr().err
    assert "unknown configuration 'udp-fast'" in err and "udp-bounded+flat" in err
