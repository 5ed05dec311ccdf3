"""What ``gradlane demo`` prints after a testbed run, from the committed run's JSON: the table,
which case gloo's ECMP hash was, and both comparisons (gloo over ECMP, and gloo on path 0, the
baseline that does not depend on the hash)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from gradlane.bench.demo.report import table

RESULT = Path(__file__).resolve().parents[2] / "bench" / "results" / "demo_testbed.json"


@pytest.fixture
def out() -> dict:
    return json.loads(RESULT.read_text())


def test_the_demo_reports_both_baselines_and_which_case_the_hash_was(out, capsys):
    table(out)
    text = capsys.readouterr().out
    s = out["summary"]
    assert f"in {s['tta_ratio_vs_gloo']:.2f}x gloo's time" in text
    assert (
        f"against gloo on path 0: {s['tta_ratio_vs_gloo_path0']:.2f}x its time to accuracy; "
        f"step p99 {s['step_p99_ratio_vs_gloo_path0']:.2f}x"
    ) in text
    busy, alone = s["gloo_cross_route_busy"], s["cross_share"]
    missed = "kept gloo's connections off the congested links"
    assert (missed in text) == (busy <= alone + 0.05)


def test_a_hash_that_crossed_the_congestion_is_named(out, capsys):
    crossed = copy.deepcopy(out)
    crossed["summary"]["gloo_cross_route_busy"] = 1.0
    table(crossed)
    text = capsys.readouterr().out
    assert "gloo's ring shared a congested link" in text
    assert "kept gloo's connections off the congested links" not in text


def test_a_lucky_hash_is_named_and_a_run_without_path0_prints_no_path0_line(out, capsys):
    lucky = copy.deepcopy(out)
    lucky["summary"]["gloo_cross_route_busy"] = lucky["summary"]["cross_share"]
    del lucky["summary"]["tta_ratio_vs_gloo_path0"]
    table(lucky)
    text = capsys.readouterr().out
    assert "kept gloo's connections off the congested links" in text
    assert "against gloo on path 0" not in text


def test_every_column_heading_stands_apart(out, capsys):
    table(out)
    header = next(ln for ln in capsys.readouterr().out.splitlines() if "gloo (default)" in ln)
    cols = [c.strip() for c in header.split("  ") if c.strip()]
    assert cols == ["gloo (default)", "gloo, path 0", "gradlane udp", "gradlane adaptive"]
