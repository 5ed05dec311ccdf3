"""The all-reduce benchmark's report (``gradlane.bench.perf.allreduce_report``) on synthetic
timings: rows per (transport, chunk bytes, ranks, MB), the summary maps keyed
``"<ranks>x<MB>@<chunk bytes>"`` for the UDP engines and the floor and ``"<ranks>x<MB>"`` for the
rest, and the ratios among transports of one datagram size. No process, socket or clock."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gradlane.bench.perf.allreduce_report import case, summarize, table

CHUNKS = (65000, 8972)
MB = 25.0
#: Median time (s) per (transport, chunk bytes): every ratio below is a ratio of these.
MEDIANS: dict[tuple[str, int | None], float] = {
    ("gloo", None): 0.100,
    ("udp_floor", 65000): 0.040,
    ("udp_reliable", 65000): 0.080,
    ("udp_bounded", 65000): 0.070,
    ("udp_floor", 8972): 0.050,
    ("udp_reliable", 8972): 0.120,
    ("udp_bounded", 8972): 0.110,
    ("zmq", None): 0.150,
}


def _world(medians: dict[tuple[str, int | None], float]) -> dict[str, Any]:
    """One rank count's ``times``, ``cpu`` and ``checks`` as the rank processes hand them
    over: three repetitions around each median, CPU twice the time (user 3/4 of it)."""
    times = {k: {MB: [0.9 * m, m, 1.2 * m]} for k, m in medians.items()}
    cpu = {k: {MB: [(1.5 * x, 0.5 * x) for x in xs[MB]]} for k, xs in times.items()}
    check = {"ok": True, "ok_all_ranks": True, "delivered_fraction_min_rank": 1.0,
             "max_abs_err": 0.0, "rms_err_rel": 0.0}  # fmt: skip
    checks = {k: {MB: dict(check)} for k in medians if k[0] != "gloo"}
    return {"times": times, "cpu": cpu, "checks": checks}


def test_case_keys_name_the_chunk_only_for_udp_transports():
    assert case(4, 25.0, 8972) == "4x25@8972"
    assert case(2, 0.5, None) == "2x0.5"


def test_every_ratio_comes_from_the_medians_of_one_run_per_datagram_size():
    report = summarize({2: _world(MEDIANS)})
    s = report["summary"]
    for chunk in CHUNKS:
        key = f"2x25@{chunk}"
        floor, reliable = MEDIANS["udp_floor", chunk], MEDIANS["udp_reliable", chunk]
        gloo = MEDIANS["gloo", None]
        assert s["udp_reliable_vs_floor"][key] == pytest.approx(reliable / floor)
        assert s["floor_vs_gloo"][key] == pytest.approx(floor / gloo)
        assert s["udp_reliable_vs_gloo"][key] == pytest.approx(reliable / gloo)
        assert s["udp_bounded_vs_gloo"][key] == pytest.approx(MEDIANS["udp_bounded", chunk] / gloo)
        # CPU twice the time for every transport: the CPU ratio is the time ratio.
        assert s["floor_cpu_vs_gloo"][key] == pytest.approx(floor / gloo)
    assert set(s["udp_reliable_vs_floor"]) == {"2x25@65000", "2x25@8972"}
    assert s["zmq_vs_gloo"] == {"2x25": pytest.approx(1.5)}
    assert s["zmq_cpu_vs_gloo"] == {"2x25": pytest.approx(1.5)}
    assert s["daemon_vs_embedded"] == {}


def test_rows_carry_their_chunk_and_the_reliable_one_its_ratio_to_the_floor():
    rows = summarize({2: _world(MEDIANS)})["rows"]
    by = {(r["transport"], r["chunk_bytes"]): r for r in rows}
    assert set(by) == set(MEDIANS)
    assert len(rows) == len(MEDIANS)
    for chunk in CHUNKS:
        r = by["udp_reliable", chunk]
        assert r["ratio_to_floor"] == pytest.approx(
            MEDIANS["udp_reliable", chunk] / MEDIANS["udp_floor", chunk]
        )
        assert by["udp_floor", chunk]["check"]["ok_all_ranks"]
        assert by["udp_floor", chunk]["median_s"] == pytest.approx(MEDIANS["udp_floor", chunk])
    assert by["gloo", None]["chunk_bytes"] is None and "check" not in by["gloo", None]
    assert by["zmq", None]["cpu_user_median_s"] == pytest.approx(1.5 * MEDIANS["zmq", None])


def test_the_floor_s_offloads_reach_its_rows():
    world = _world(MEDIANS)
    world["offloads"] = {("udp_floor", 65000): {"gso": True, "gro": False}}
    by = {(r["transport"], r["chunk_bytes"]): r for r in summarize({2: world})["rows"]}
    assert by["udp_floor", 65000]["gso"] is True and by["udp_floor", 65000]["gro"] is False
    assert "gso" not in by["udp_reliable", 65000]


def test_the_daemon_is_compared_with_the_embedded_engine_at_every_datagram_size():
    medians = {**MEDIANS, ("daemon", None): 0.240}
    del medians["zmq", None]
    report = summarize({4: _world(medians)})
    s = report["summary"]
    assert s["daemon_vs_embedded"] == {
        "4x25@65000": pytest.approx(0.240 / 0.080),
        "4x25@8972": pytest.approx(0.240 / 0.120),
    }
    assert s["daemon_vs_gloo"] == {"4x25": pytest.approx(2.4)}
    (daemon,) = [r for r in report["rows"] if r["transport"] == "daemon"]
    assert daemon["ratio_to_embedded"] == pytest.approx(0.240 / 0.080)  # the first size's
    assert "cpu_median_s" not in daemon  # its CPU is in the daemon's process


def test_the_table_has_a_chunk_column_and_groups_udp_rows_by_chunk():
    text = table(summarize({2: _world(MEDIANS)})["rows"])
    head, _, *lines = text.splitlines()
    assert head.split()[:3] == ["transport", "chunk", "ranks"]
    cells = [line.split()[:2] for line in lines]
    assert cells == [
        ["gloo", "-"],
        ["udp_floor", "8972"],
        ["udp_reliable", "8972"],
        ["udp_bounded", "8972"],
        ["udp_floor", "65000"],
        ["udp_reliable", "65000"],
        ["udp_bounded", "65000"],
        ["zmq", "-"],
    ]
    assert not np.isnan(float(lines[1].split()[6]))  # the floor's "x gloo"
