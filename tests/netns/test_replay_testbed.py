"""Trace replay on the testbed (netns tier: root, or unprivileged user namespaces).

Two hosts, two spines: a replay over gradlane's engine must carry traffic over both paths — seen
by the engines' per-path counters and by the bytes the two spines' switch ports sent. The testbed
is a context manager (torn down also when the test fails) and its prefix is unique per run.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from gradlane.bench.replay.run import ReplayOptions, TestbedNetwork, run_replay
from gradlane.bench.replay.synth import SynthSpec, synth_records, write_trace
from gradlane.bench.testbed import netns as testbed


def _need_testbed() -> None:
    try:
        testbed.privilege()
    except testbed.TestbedUnavailable as e:
        pytest.skip(f"netns tier: {e}")


@pytest.mark.timeout(180)
def test_two_host_replay_uses_both_paths(tmp_path):
    _need_testbed()
    params = [("a.w", 200_000), ("a.b", 500), ("b.w", 100_000), ("b.b", 100)]
    trace = tmp_path / "t.jsonl"
    write_trace(synth_records(params, SynthSpec(world=2, steps=2, bucket_cap_mb=0.5)), trace)
    prefix = f"rt{os.getpid() % 1_000_000}"
    spec = testbed.TestbedSpec(hosts=2, spines=2, link_mbit=1000.0, prefix=prefix)
    opts = ReplayOptions(trace=str(trace), configs=("udp-reliable",), steps=3, warmup=1)
    with testbed.Testbed(spec) as bed:
        raw = run_replay(opts, TestbedNetwork(bed))
    steps = raw["steps"]["udp-reliable"]
    assert len(steps) == 3 and all(s["delivered"] == 1.0 for s in steps)
    per_path = [sum(s["path_bytes"][p] for s in steps) for p in range(2)]
    total = sum(per_path)
    assert total >= 3 * 4 * 300_600, per_path  # both ranks sent half of every bucket, twice
    assert min(per_path) >= 0.01 * total, per_path  # the engines sprayed over both paths
    # The switches agree: each spine forwarded the engines' bytes toward both leaves.
    ports = raw["link_stats"]
    for p in range(2):
        sent = sum(v["sent_bytes"] for k, v in ports.items() if k.startswith(f"{prefix}-s{p}/"))
        assert sent >= 0.5 * per_path[p], (p, sent, per_path)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    assert prefix not in names.stdout  # nothing left behind
