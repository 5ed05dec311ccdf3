"""``gradlane demo --network testbed`` and ``gradlane bench replay --network testbed`` say clearly
when this machine cannot run the testbed (no root, no user namespaces), and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from gradlane.bench.testbed import netns as testbed
from gradlane.integrations.cli.main import main


@pytest.fixture
def no_testbed(monkeypatch):
    def refuse() -> str:
        raise testbed.TestbedUnavailable(testbed.NEEDS_ROOT)

    monkeypatch.setattr(testbed, "privilege", refuse)


def test_demo_on_the_testbed_needs_root(no_testbed, capsys):
    assert main(["demo", "--network", "testbed", "--steps", "5"]) == 2
    assert "the testbed needs root" in capsys.readouterr().err


def test_replay_on_the_testbed_needs_root(no_testbed, capsys):
    trace = str(Path(__file__).resolve().parents[2] / "bench" / "replay" / "traces" / "mlp.jsonl")
    assert main(["bench", "replay", trace, "--network", "testbed", "--steps", "1"]) == 2
    assert "the testbed needs root" in capsys.readouterr().err


def test_replay_rejects_a_bad_transport_setting_before_building_anything(monkeypatch, capsys):
    built = []
    monkeypatch.setattr(testbed, "privilege", lambda: "root")
    monkeypatch.setattr(testbed.Testbed, "up", built.append)
    trace = str(Path(__file__).resolve().parents[2] / "bench" / "replay" / "traces" / "mlp.jsonl")
    args = ["bench", "replay", trace, "--network", "testbed", "--set", "tick_ms=5"]
    assert main(args) == 2
    assert "unknown setting 'tick_ms'" in capsys.readouterr().err and not built
