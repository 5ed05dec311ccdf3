"""``python -m gradlane.bench.perf.core_cpu`` runs end to end and writes its summary.

No timing is asserted: only that every collective it times computed the sum (the harness
checks each result against NumPy and raises otherwise), that the cores' CPU was measured and
their service passes counted, and that the JSON has its summary.
"""

from __future__ import annotations

import json

from gradlane.bench.perf import core_cpu


def test_core_cpu_benchmark_sums_and_writes_its_summary(tmp_path):
    path = tmp_path / "core.json"
    args = ["--ranks", "2,3", "--sizes", "0.25", "--reps", "2", "--json", str(path)]
    assert core_cpu.main(args) == 0
    doc = json.loads(path.read_text())
    assert set(doc["summary"]["cpu_ms_per_rank"]) == {"2x0.25", "3x0.25"}
    assert doc["host"]["cpus"] >= 1 and len(doc["host"]["load_start"]) == 3  # the machine
    for row in doc["rows"]:
        assert row["cpu_ms_per_rank"] > 0
        # Two phases: a rank's gather waits for what its peers send only after their own
        # reduce pass, so every collective takes at least two rounds of one pass per rank.
        assert row["passes_per_rank_per_collective"] >= 2, row


def test_core_cpu_benchmark_under_loss_replays_the_same_run(tmp_path):
    """With loss and a fixed clock the harness drops the same datagrams at the same times: two
    runs take the same service passes (what makes a CPU comparison of two commits fair)."""
    args = ["--ranks", "3", "--sizes", "0.05", "--reps", "3", "--chunk-bytes", "2048",
            "--loss", "0.1", "--loss-bound", "0.05", "--round-us", "200"]  # fmt: skip
    rows = []
    for k in range(2):
        path = tmp_path / f"lossy{k}.json"
        assert core_cpu.main([*args, "--json", str(path)]) == 0
        rows.append(json.loads(path.read_text())["rows"][0])
    assert rows[0]["loss"] == 0.1 and rows[0]["chunk_bytes"] == 2048
    assert rows[0]["passes_per_rank_per_collective"] == rows[1]["passes_per_rank_per_collective"]


def test_core_cpu_benchmark_with_small_bursts_takes_more_passes(tmp_path):
    """``--burst``: datagrams reach a rank a few at a time (as from a paced network), so the same
    collective takes more service passes than with whole bursts, and still sums."""
    args = ["--ranks", "2", "--sizes", "0.25", "--reps", "2", "--chunk-bytes", "8192"]
    rows = {}
    for burst in ("4", None):
        path = tmp_path / f"burst{burst}.json"
        extra = ["--burst", burst] if burst else []
        assert core_cpu.main([*args, *extra, "--json", str(path)]) == 0
        rows[burst] = json.loads(path.read_text())["rows"][0]
    assert rows["4"]["burst"] == 4 and rows[None]["burst"] is None
    passes = {k: row["passes_per_rank_per_collective"] for k, row in rows.items()}
    assert passes["4"] > passes[None], passes
