"""The trace replay's wire-precision figures (bench/replay/report.py) and its ``--set
precision=...`` override (bench/replay/rank.py)."""

from __future__ import annotations

import pytest
from gradlane.bench.replay import report
from gradlane.bench.replay.rank import NetParams, ReplayConfig, transport_config
from gradlane.transport.errors import ConfigError


def _step(formats: list[int], lossy: int, elems: int, err2: float, norm2: float) -> dict:
    return {"comm_s": 0.1, "protected_s": 0.05, "delivered": 1.0, "degraded": 0,
            "retransmitted": 0, "bytes": 4000, "path_bytes": [100, 100], "cpu_s": 0.1,
            "wall_s": 0.2, "format_bytes": formats, "lossy_elems": lossy, "elems": elems,
            "err2": err2, "norm2": norm2, "precision_level": 1.5}  # fmt: skip


def test_the_summary_gives_bytes_per_format_share_and_error():
    steps = [
        _step([1000, 500, 0], 300, 1000, 0.01, 4.0),
        _step([1000, 0, 250], 700, 1000, 0.03, 4.0),
    ]
    s = report.config_stats(steps, world=2, link_Bps=1e6)
    assert s["wire_bytes_per_step"] == pytest.approx(1375.0)
    assert s["format_bytes_per_step"] == pytest.approx([1000.0, 250.0, 125.0])
    assert s["compressed_share"] == pytest.approx(0.5)
    assert s["rel_error"] == pytest.approx((0.04 / 8.0) ** 0.5)
    assert s["precision_level_last"] == 1.5


def test_gloo_steps_have_no_precision_figures():
    steps = [_step([0, 0, 0], 0, 0, 0.0, 0.0)]
    assert "wire_bytes_per_step" not in report.config_stats(steps, world=2, link_Bps=1e6)


def test_set_precision_by_name_reaches_the_ranks_config():
    net = NetParams(overrides={"precision": "adaptive", "tick_s": 0.004})
    cfg = transport_config(ReplayConfig("udp", 0.0), net, 2, 2, seed=1)
    assert cfg.precision.policy == "adaptive" and cfg.tick_s == 0.004
    with pytest.raises(ConfigError, match="not registered"):
        transport_config(ReplayConfig("udp", 0.0), NetParams(overrides={"precision": "nope"}),
                         2, 2, seed=1)  # fmt: skip
