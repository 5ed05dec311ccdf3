"""``python -m gradlane.bench.perf.allreduce`` runs end to end: every transport's result checked
against gloo's (the protocol-free UDP floor's too), the summary maps the issue names (keyed
``"<ranks>x<MB>@<chunk bytes>"`` for the UDP engines and the floor), and the CPU figures next to
the times.

No timing is asserted (machines are noisy): only that the run is real and its JSON complete.
"""

from __future__ import annotations

import json

import pytest
from gradlane.bench.perf import allreduce


@pytest.mark.timeout(300)
def test_allreduce_benchmark_checks_results_and_writes_its_summary(tmp_path):
    path = tmp_path / "ar.json"
    args = ["--ranks", "2", "--sizes", "1", "--reps", "2", "--json", str(path)]
    assert allreduce.main(args) == 0
    doc = json.loads(path.read_text())
    summary = doc["summary"]
    for key, case in (("udp_reliable", "2x1@65000"), ("udp_bounded", "2x1@65000"),
                      ("floor", "2x1@65000"), ("zmq", "2x1"), ("zmq_floor", "2x1")):  # fmt: skip
        assert set(summary[f"{key}_vs_gloo"]) == {case}
        assert set(summary[f"{key}_cpu_vs_gloo"]) == {case}
        assert summary[f"{key}_cpu_vs_gloo"][case] > 0
    rows = {r["transport"]: r for r in doc["rows"]}
    assert set(rows) == {"gloo", "udp_floor", "udp_reliable", "udp_bounded", "zmq_floor", "zmq"}
    assert {t: r["chunk_bytes"] for t, r in rows.items()} == {
        "gloo": None, "udp_floor": 65000, "udp_reliable": 65000, "udp_bounded": 65000,
        "zmq_floor": None, "zmq": None,
    }  # fmt: skip
    # Reliable: equal to gloo's sum on every rank.
    for t in ("udp_floor", "udp_reliable", "zmq_floor", "zmq"):
        assert rows[t]["check"]["ok_all_ranks"]
        assert rows[t]["check"]["delivered_fraction_min_rank"] == 1.0
    ratio = summary["udp_reliable_vs_floor"]
    assert ratio == {"2x1@65000": rows["udp_reliable"]["ratio_to_floor"]} and ratio["2x1@65000"] > 0
    assert summary["zmq_vs_floor"] == {"2x1": rows["zmq"]["ratio_to_floor"]}
    assert all(r["reps"] == 2 and r["cpu_median_s"] > 0 for r in rows.values())
    # The split into user and system time divides the same measurement as the total: with
    # two repetitions a median is their mean, so the parts' medians add up to the total's.
    for t, r in rows.items():
        parts = r["cpu_user_median_s"] + r["cpu_sys_median_s"]
        assert parts == pytest.approx(r["cpu_median_s"], rel=1e-9), (t, r)


@pytest.mark.timeout(300)
def test_allreduce_benchmark_runs_every_udp_transport_at_each_datagram_size(tmp_path):
    """``--chunk-bytes 65000,1408``: the UDP engines and the floor once per payload size, each
    checked against gloo's sum, the floor's datagrams the engine's size, every ratio keyed by
    its size."""
    path = tmp_path / "ar.json"
    args = ["--ranks", "2", "--sizes", "0.5", "--reps", "2", "--no-zmq",
            "--chunk-bytes", "65000,1408", "--json", str(path)]  # fmt: skip
    assert allreduce.main(args) == 0
    doc = json.loads(path.read_text())
    assert doc["config"]["chunk_bytes"] == [65000, 1408]
    rows = {(r["transport"], r["chunk_bytes"]): r for r in doc["rows"]}
    udp = {(t, c) for t in ("udp_floor", "udp_reliable", "udp_bounded") for c in (65000, 1408)}
    assert set(rows) == {("gloo", None)} | udp
    for t, c in udp - {("udp_bounded", 65000), ("udp_bounded", 1408)}:
        assert rows[t, c]["check"]["ok_all_ranks"], (t, c)
    s = doc["summary"]
    for key in ("udp_reliable_vs_floor", "floor_vs_gloo", "udp_reliable_vs_gloo"):
        assert set(s[key]) == {"2x0.5@65000", "2x0.5@1408"}, key
    for c in (65000, 1408):
        assert s["udp_reliable_vs_floor"][f"2x0.5@{c}"] == rows["udp_reliable", c]["ratio_to_floor"]
    assert rows["udp_floor", 1408]["gso"] in (True, False)  # what the floor used: recorded


@pytest.mark.timeout(300)
def test_allreduce_benchmark_compares_offloads_with_mtu_sized_datagrams(tmp_path):
    """``--chunk-bytes 1408 --offload-compare``: the reliable UDP engine with GSO and GRO, with
    GSO only, and with neither, each checked against gloo's sum, and their ratios to the
    first in the summary."""
    path = tmp_path / "ar.json"
    args = ["--ranks", "2", "--sizes", "1", "--reps", "2", "--no-zmq", "--chunk-bytes", "1408",
            "--offload-compare", "--json", str(path)]  # fmt: skip
    assert allreduce.main(args) == 0
    doc = json.loads(path.read_text())
    assert doc["config"]["chunk_bytes"] == [1408]
    rows = {r["transport"]: r for r in doc["rows"]}
    assert set(rows) == {
        "gloo", "udp_floor", "udp_reliable", "udp_gso_only", "udp_no_offload", "udp_bounded"
    }  # fmt: skip
    for t in ("udp_reliable", "udp_gso_only", "udp_no_offload"):
        assert rows[t]["check"]["ok_all_ranks"]
        assert rows[t]["check"]["delivered_fraction_min_rank"] == 1.0
    for t in ("gso_only", "no_offload"):
        ratio = doc["summary"][f"{t}_vs_offload"]
        case = "2x1@1408"
        assert set(ratio) == {case} and ratio[case] == rows[f"udp_{t}"]["ratio_to_offload"] > 0


@pytest.mark.timeout(300)
def test_allreduce_benchmark_compares_zmq_batch_frames_with_one_packet_per_frame(tmp_path):
    """``--zmq-batch-compare``: a second ZeroMQ plane sending one packet per frame, checked
    against gloo's sum like the others, and its ratio to the batching plane in the summary."""
    path = tmp_path / "ar.json"
    args = ["--ranks", "2", "--sizes", "1", "--reps", "2", "--zmq-batch-compare",
            "--json", str(path)]  # fmt: skip
    assert allreduce.main(args) == 0
    doc = json.loads(path.read_text())
    rows = {r["transport"]: r for r in doc["rows"]}
    assert {"zmq", "zmq_unbatched"} <= set(rows)
    for t in ("zmq", "zmq_unbatched"):
        assert rows[t]["check"]["ok_all_ranks"]
        assert rows[t]["check"]["delivered_fraction_min_rank"] == 1.0
    ratio = doc["summary"]["zmq_unbatched_vs_zmq"]
    assert set(ratio) == {"2x1"} and ratio["2x1"] == rows["zmq_unbatched"]["ratio_to_batched"] > 0


@pytest.mark.timeout(300)
def test_allreduce_benchmark_compares_the_keyed_and_ordered_engines_with_the_default(tmp_path):
    """``--keyed-compare`` / ``--order-compare``: the reliable UDP engine with a job secret,
    and with deterministic sums, each checked against gloo's sum like the others, and their
    ratios to the default engine in the summary."""
    path = tmp_path / "ar.json"
    args = ["--ranks", "3", "--sizes", "1", "--reps", "2", "--keyed-compare", "--order-compare",
            "--no-zmq", "--json", str(path)]  # fmt: skip
    assert allreduce.main(args) == 0
    doc = json.loads(path.read_text())
    rows = {r["transport"]: r for r in doc["rows"]}
    assert rows["udp_keyed"]["check"]["ok_all_ranks"]
    assert rows["udp_keyed"]["check"]["delivered_fraction_min_rank"] == 1.0
    ratio = doc["summary"]["udp_keyed_vs_unkeyed"]
    case = "3x1@65000"
    assert set(ratio) == {case} and ratio[case] == rows["udp_keyed"]["ratio_to_unkeyed"] > 0
    assert rows["udp_ordered"]["check"]["ok_all_ranks"]
    ratio = doc["summary"]["udp_ordered_vs_unordered"]
    assert ratio[case] == rows["udp_ordered"]["ratio_to_unordered"] > 0


@pytest.mark.timeout(300)
def test_allreduce_benchmark_with_injected_loss(tmp_path):
    """``--inject-loss``: the UDP engines drop received datagrams, recover them (reliable:
    still gloo's sum exactly) and report what the bounded one gave up; the config says so."""
    path = tmp_path / "ar.json"
    args = ["--ranks", "2", "--sizes", "0.1", "--reps", "3", "--no-zmq", "--chunk-bytes", "4096",
            "--inject-loss", "0.1", "--loss-bound", "0.05", "--json", str(path)]  # fmt: skip
    assert allreduce.main(args) == 0
    doc = json.loads(path.read_text())
    assert doc["config"]["inject_loss"] == 0.1 and doc["config"]["loss_bound"] == 0.05
    rows = {r["transport"]: r for r in doc["rows"]}
    assert rows["udp_reliable"]["check"]["ok_all_ranks"]
    assert rows["udp_reliable"]["check"]["delivered_fraction_min_rank"] == 1.0
    assert rows["udp_bounded"]["check"]["delivered_fraction_min_rank"] >= 0.95
