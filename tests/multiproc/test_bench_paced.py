"""``python -m gradlane.bench.perf.paced`` runs end to end and writes its summary.

No timing is asserted beyond what pacing itself guarantees: a paced all-reduce can never beat
its link bound (its NIC pacer lets no more bytes out), so a ratio under one would mean the
bound or the pacing is wrong. The ranks check their sums themselves.
"""

from __future__ import annotations

import json

import pytest
from gradlane.bench.perf import paced


@pytest.mark.timeout(300)
def test_paced_benchmark_runs_and_reports_its_time_against_the_link_bound(tmp_path):
    path = tmp_path / "paced.json"
    args = ["--ranks", "2", "--mb", "0.5", "--rate-mbit", "400", "--reps", "2",
            "--json", str(path)]  # fmt: skip
    assert paced.main(args) == 0
    doc = json.loads(path.read_text())
    assert set(doc["summary"]["time_vs_link_bound"]) == {"2x0.5"}
    (row,) = doc["rows"]
    assert len(row["times_ms"]) == 2
    # 0.5 MiB among 2 ranks: each sends 0.5 MiB (plus headers) at 50 MB/s, about 10.6 ms.
    assert 10.0 < row["link_bound_ms"] < 11.5, row
    # The pacers' buckets start full: two quanta (72 KB) of the 0.55 MB may leave at once.
    assert row["time_vs_link_bound"] >= 0.8, row
    assert doc["host"]["cpus"] >= 1
