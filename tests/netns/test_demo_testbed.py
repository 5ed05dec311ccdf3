"""``gradlane demo --network testbed`` on a small testbed (netns tier: root or user namespaces):
two host namespaces, cross traffic through spine 0, DDP over gloo and over gradlane."""

from __future__ import annotations

import os
import subprocess

import pytest
from gradlane.bench.demo.testbed import TestbedDemo, run_testbed_demo
from gradlane.bench.demo.training import DemoOptions
from gradlane.bench.testbed import netns as testbed


@pytest.mark.timeout(240)
def test_demo_trains_on_the_testbed_over_gloo_and_gradlane():
    try:
        testbed.privilege()
    except testbed.TestbedUnavailable as e:
        pytest.skip(f"netns tier: {e}")
    seen = []
    opts = DemoOptions(steps=8, loss_bound=0.02, inject_loss=0.0)
    out = run_testbed_demo(opts, TestbedDemo(hosts=2, cross=0.5), lambda *a: seen.append(a))
    s = out["summary"]
    assert {run for run, _, _ in seen} == {"gloo", "gradlane"} and ("gradlane", 8, 8) in seen
    assert s["injected_drops"] == 0 and s["delivered_fraction_min"] >= 0.98 - 1e-9
    # Same initialisation, same batches, (nearly) the same sums: the same model to a point.
    assert abs(s["accuracy_gradlane"] - s["accuracy_gloo"]) <= 2.0, s
    # Every rank holds the same model when everything arrived. A gather-phase chunk lost within
    # the bound keeps each rank's own value (ARCHITECTURE §4 fill rules): replicas then differ
    # by that stale piece of one step's update, a small gap (1.8e-4 seen once under CPU load).
    divergence = out["runs"]["gradlane"]["param_divergence"]
    if s["delivered_fraction_min"] == 1.0:
        assert divergence == 0.0
    else:
        assert divergence < 1e-2, divergence
    assert "cross traffic" in out["network"]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    assert f"dm{os.getpid() % 1_000_000}-" not in names.stdout  # torn down
