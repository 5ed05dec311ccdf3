"""``gradlane demo`` for real: DDP training in spawned ranks, gloo's hook against gradlane's.

``run_demo`` spawns the ranks, reads every message with a timeout and joins or kills every
process in a ``finally`` (see ``gradlane.bench.demo.training``).
"""

from __future__ import annotations

import json

import pytest
from gradlane.bench.demo.training import DemoOptions, run_demo
from gradlane.integrations.cli.main import main


@pytest.mark.timeout(300)
def test_bounded_loss_with_injected_loss_trains_digits_like_lossless():
    """4 ranks, 5% of every rank's received datagrams dropped (seeded), loss bound 0.05: the
    test accuracy after 100 steps is within 1.0 point of the lossless default hook's."""
    out = run_demo(DemoOptions(ranks=4, steps=100, inject_loss=0.05, loss_bound=0.05, seed=1))
    s = out["summary"]
    assert abs(s["accuracy_gradlane"] - s["accuracy_gloo"]) <= 1.0, s
    assert s["accuracy_gloo"] > 90.0, s  # it did learn
    # The loss happened and the bound absorbed part of it (not everything was recovered).
    assert s["injected_drops"] > 0, s
    assert s["delivered_fraction_min"] >= 0.95 - 1e-9 and s["delivered_fraction"] < 1.0, s
    assert out["runs"]["gradlane"]["degraded_buckets"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["zmq"])  # udp: the test above runs the same code
def test_cli_demo_prints_the_table_and_writes_the_summary(tmp_path, capsys, transport):
    path = tmp_path / "demo.json"
    args = ["demo", "--network", "loopback", "--ranks", "2", "--steps", "6",
            "--transport", transport]  # fmt: skip
    assert main([*args, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gloo (default)" in out and f"gradlane {transport}" in out
    assert "final test accuracy (%)" in out and "step time p99 (ms)" in out
    summary = json.loads(path.read_text())["summary"]
    assert set(summary) >= {
        "accuracy_gloo",
        "accuracy_gradlane",
        "delivered_fraction",
        "step_p99_gloo_s",
        "step_p99_gradlane_s",
        "network",
        "accuracy_target",
        "tta_s_gloo",
        "tta_s_gradlane",
        "tta_ratio_vs_gloo",
        "step_p99_ratio_vs_gloo",
    }
    assert summary["network"] == "loopback"
    assert "time to " in out and (tmp_path / "demo.png").exists()  # the figure beside the JSON
    if transport == "zmq":  # reliable: nothing lost, nothing dropped on purpose
        assert summary["delivered_fraction"] == 1.0 and summary["injected_drops"] == 0
