"""``python -m gradlane.bench.perf.udp_floor`` runs end to end and writes its summary.

No timing is asserted: only that both protocol-free floors (per-datagram calls, and batched
``sendmmsg``/``recvmmsg`` with a compiled apply pass) computed gloo's sum (so its time is
the time of a real all-reduce), that nothing was lost on loopback, and that the JSON has its
summary.
"""

from __future__ import annotations

import json
import os

import pytest
from gradlane.bench.perf import udp_floor


@pytest.mark.timeout(300)
def test_udp_floor_benchmark_matches_gloo_and_writes_its_summary(tmp_path):
    path = tmp_path / "floor.json"
    args = ["--ranks", "2", "--sizes", "1", "--reps", "2", "--json", str(path)]
    assert udp_floor.main(args) == 0
    doc = json.loads(path.read_text())
    assert set(doc["summary"]["floor_vs_gloo"]) == {"2x1"}
    assert set(doc["summary"]["floor_mmsg_vs_gloo"]) == {"2x1"}
    (row,) = doc["rows"]
    assert row["lost_reps"] == 0
    assert row["max_abs_err_vs_gloo"] < 1e-5  # float32 sums of two ranks, order may differ
    assert row["floor_median_s"] > 0 and row["gloo_median_s"] > 0
    assert row["floor_mmsg_median_s"] > 0
    # The CPU split, summed over both ranks' processes, is of the timed calls themselves: some
    # spent, and no more than every core busy for the call (twice over, and 10 ms, for the
    # accounting's granularity), so not the process's CPU so far nor a figure in other units.
    cores = os.cpu_count() or 1
    for t in ("gloo", "floor", "floor_mmsg"):
        user, sys_ = row[f"{t}_cpu_user_median_s"], row[f"{t}_cpu_sys_median_s"]
        wall = row[f"{t}_median_s"]
        assert 0 < user + sys_ <= 2 * cores * wall + 0.01, (t, user, sys_, wall)
