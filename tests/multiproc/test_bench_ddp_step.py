"""``python -m gradlane.bench.perf.ddp_step`` runs end to end (one measured step) and writes its
summary.

The benchmark's ranks are spawned, waited on with a deadline and killed in a ``finally``
(``gradlane.bench.perf.ddp_step.run_world``). No timing is asserted: only that every variant ran,
the reliable hooks (and the protocol-free floor's) trained the same model as the default hook, and
the JSON has its summary.
"""

from __future__ import annotations

import json

import pytest
import torch
from gradlane.bench.perf import ddp_step


@pytest.mark.timeout(300)
def test_ddp_step_benchmark_writes_its_summary(tmp_path):
    path = tmp_path / "step.json"
    args = ["--ranks", "2", "--steps", "1", "--warmup", "2", "--transports", "udp,zmq,floor"]
    args += ["--json", str(path)]
    assert ddp_step.main(args) == 0
    doc = json.loads(path.read_text())
    assert set(doc["summary"]["step_ratio_vs_default"]) == {"2"}
    assert set(doc["summary"]["step_ratio_vs_default_zmq"]) == {"2"}
    assert set(doc["summary"]["cpu_ratio_vs_default"]) == {"2"}
    assert doc["config"]["grad_bytes"] >= 25_000_000
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"default", "udp", "zmq", "floor", "noop"}
    assert set(doc["summary"]["step_ratio_vs_default_floor"]) == {"2"}
    for v in ("udp", "zmq", "floor"):
        assert rows[v]["param_gap"] <= ddp_step.MAX_PARAM_GAP
    for v in ("udp", "zmq"):
        assert rows[v]["hook_comm_p50_s"] > 0
    for r in rows.values():  # every rank's process spent CPU on its step
        assert r["cpu_median_s"] > 0
    # The UDP engine's loop thread, per step and rank: it spent CPU, and its timers fired (a
    # step's transfers arm the retransmission and ACK timers; a count stuck at 0 is a plane
    # that does not count its wakeups).
    eng = rows["udp"]["engine_per_step"]
    assert eng["cpu_s"] > 0 and eng["timer_passes"] > 0, eng
    assert rows["zmq"]["engine_per_step"] is None
    # Communication against the no-op hook's step, and the planes' time in flight.
    assert rows["noop"]["exposed_comm_s"] == 0.0
    for v in ("udp", "zmq"):
        assert rows[v]["plane_busy_s"] > 0 and rows[v]["exposed_comm_s"] is not None
        assert 0.0 <= rows[v]["overlap_fraction"] <= 1.0
    assert rows["floor"]["plane_busy_s"] is None  # not a gradlane plane
    # What ran it; a CPU run's summary has none of the GPU run's keys.
    assert doc["config"]["device"] == "cpu" and doc["config"]["model"] == "mlp"
    assert doc["config"]["torch"] == torch.__version__
    assert not any(k.startswith("gpu_") for k in doc["summary"])
