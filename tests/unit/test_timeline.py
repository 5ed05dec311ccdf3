"""The hook's timeline recorder, from synthetic reports: where each event goes, the bound on
events, the JSON it writes, and merging the ranks' files.

Times are given in seconds (what the hook passes: ``time.monotonic()``) with a clock offset of
0, so an event's ``ts`` is the given time in microseconds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from gradlane.integrations.ddp import GradlaneState, HookConfig
from gradlane.integrations.timeline import (
    STEPS_TID,
    Timeline,
    TimelineError,
    main,
    merge_timelines,
    rank_path,
    read_timeline,
)
from gradlane.scheduling.errors import ConfigError
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import CollectiveReport, LossReport, SenderReport
from gradlane.transport.drivers.plane import Plane

#: Keys every event of each phase type must carry (Trace Event Format).
REQUIRED = {
    "X": {"ph", "pid", "tid", "name", "cat", "ts", "dur", "args"},
    "i": {"ph", "pid", "tid", "name", "cat", "ts", "s", "args"},
    "M": {"ph", "pid", "tid", "name", "args"},
}


@pytest.fixture
def folder() -> Iterator[Path]:
    """A temporary folder, removed with everything in it after the test."""
    with tempfile.TemporaryDirectory(prefix="gradlane-timeline-") as d:
        yield Path(d)


def _loss(
    phase: int, duration: float, *, shard: int = 0, missing: int = 0, degraded: bool = False
) -> LossReport:
    return LossReport(
        step=0,
        bucket=0,
        shard=shard,
        phase=phase,
        expected_elems=1000,
        missing_elems=missing,
        delivered={1: 1.0 - missing / 1000},
        duration=duration,
        degraded=degraded,
    )


def _report(
    duration: float = 0.008,
    reduce_s: float = 0.003,
    *,
    retransmitted: tuple[int, ...] = (0, 0),
    degraded_reduce: bool = False,
    degraded_gather: bool = False,
) -> CollectiveReport:
    return CollectiveReport(
        step=0,
        bucket=0,
        duration=duration,
        reduce=_loss(0, reduce_s, missing=10 if degraded_reduce else 0, degraded=degraded_reduce),
        gather=(
            _loss(1, 0.004, shard=1, missing=5 if degraded_gather else 0, degraded=degraded_gather),
        ),
        sender=SenderReport(sent=(8, 4), dropped=(0, 1), retransmitted=retransmitted),
        reduce_s=reduce_s,
    )


def _events(tl: Timeline, ph: str | None = None, cat: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in tl.trace()["traceEvents"]
        if (ph is None or e["ph"] == ph) and (cat is None or e.get("cat") == cat)
    ]


def test_a_bucket_and_its_phases_sit_where_the_report_puts_them():
    tl = Timeline(rank=1, world=2, clock_offset_us=0)
    tl.bucket_ready(step=4, bucket=2, nbytes=4096, now=10.0, last=False)
    tl.bucket_done(step=4, bucket=2, now=10.010, report=_report(0.008, 0.003), generation=1)
    (span,) = _events(tl, "X", "bucket")
    # The bucket: from ready to result, on its own track, in rank 1's process (pid = rank + 1).
    assert (span["ts"], span["dur"], span["pid"], span["tid"]) == (10_000_000, 10_000, 2, 4)
    assert span["name"] == "bucket 2"
    assert span["args"] == {
        "step": 4,
        "bucket": 2,
        "generation": 1,
        "bytes": 4096,
        "delivered": 1.0,
        "retransmitted": 0,
        "dropped": 1,
        "degraded": False,
        "nonfinite": 0,
    }
    reduce, gather = _events(tl, "X", "phase")
    # The collective started report.duration before its end; the reduce took reduce_s from
    # there; the gather runs from the reduce's end to the end.
    assert (reduce["name"], reduce["ts"], reduce["dur"]) == ("reduce", 10_002_000, 3_000)
    assert (gather["name"], gather["ts"], gather["dur"]) == ("gather", 10_005_000, 5_000)
    assert reduce["tid"] == gather["tid"] == span["tid"]
    assert gather["args"]["shards"] == 1
    assert not _events(tl, "i")  # nothing retransmitted, degraded or failed


def test_phases_stay_inside_the_bucket_whatever_the_plane_reports():
    tl = Timeline(rank=0, clock_offset_us=0)
    tl.bucket_ready(0, 0, 100, 1.0, False)
    # A collective longer than the bucket's span, and a reduce longer than the collective.
    tl.bucket_done(0, 0, 1.001, report=_report(duration=0.5, reduce_s=0.9))
    (span,) = _events(tl, "X", "bucket")
    reduce, gather = _events(tl, "X", "phase")
    assert reduce["ts"] == span["ts"] and reduce["ts"] + reduce["dur"] == span["ts"] + span["dur"]
    assert gather["dur"] == 0


def test_retransmissions_and_degraded_fills_are_instant_events():
    tl = Timeline(rank=0, clock_offset_us=0)
    tl.bucket_ready(1, 0, 100, 2.0, True)
    report = _report(0.008, 0.003, retransmitted=(2, 3), degraded_reduce=True, degraded_gather=True)
    tl.bucket_done(1, 0, 2.010, report=report)
    instants = {e["name"]: e for e in _events(tl, "i")}
    assert set(instants) == {"retransmitted", "degraded fill: reduce", "degraded fill: gather"}
    assert all(e["s"] == "t" and e["tid"] == 2 for e in instants.values())
    retrans = instants["retransmitted"]
    assert retrans["ts"] == 2_010_000 and retrans["args"]["chunks"] == 5
    assert retrans["args"]["per_class"] == [2, 3]
    fill = instants["degraded fill: reduce"]
    assert fill["ts"] == 2_005_000  # the reduce's end
    assert fill["args"]["missing_elems"] == 10 and fill["args"]["delivered"] == {"1": 0.99}
    gather_fill = instants["degraded fill: gather"]
    assert gather_fill["ts"] == 2_010_000 and gather_fill["args"]["shard"] == 1
    (span,) = _events(tl, "X", "bucket")
    assert span["args"]["degraded"] is True and span["args"]["retransmitted"] == 5


def test_a_failure_is_a_span_and_an_instant_on_its_bucket_or_on_the_steps_track():
    tl = Timeline(rank=0, clock_offset_us=0)
    tl.bucket_ready(3, 1, 64, 5.0, False)
    tl.bucket_done(3, 1, 5.5, error=TimeoutError("rank 1 is late"))
    tl.bucket_done(3, -1, 5.6, error=ValueError("no index"))  # failed before its index
    (span,) = _events(tl, "X", "bucket")
    assert span["dur"] == 500_000 and span["args"]["error"] == "TimeoutError: rank 1 is late"
    failed = _events(tl, "i", "failure")
    assert [(e["tid"], e["ts"]) for e in failed] == [(3, 5_500_000), (STEPS_TID, 5_600_000)]
    assert failed[1]["args"] == {"step": 3, "bucket": -1, "error": "ValueError: no index"}


def test_a_step_span_covers_its_buckets_once_the_last_one_is_done():
    tl = Timeline(rank=0, clock_offset_us=0)
    tl.bucket_ready(7, 0, 100, 1.0, False)
    tl.bucket_ready(7, 1, 50, 1.002, True)
    tl.bucket_done(7, 1, 1.004, report=_report(0.001, 0.0005))
    assert not _events(tl, "X", "step")  # bucket 0 is still running
    tl.bucket_done(7, 0, 1.006, report=_report(0.001, 0.0005, degraded_reduce=True))
    (step,) = _events(tl, "X", "step")
    assert (step["tid"], step["name"], step["ts"], step["dur"]) == (
        STEPS_TID,
        "step 7",
        1_000_000,
        6_000,
    )
    assert step["args"] == {
        "step": 7,
        "buckets": 2,
        "bytes": 150,
        "degraded_buckets": 1,
        "failed_buckets": 0,
    }


def test_past_max_events_new_events_are_counted_not_kept(folder, caplog):
    tl = Timeline(rank=0, max_events=5, clock_offset_us=0, path=folder / "t.json")
    for b in range(3):  # three events each (bucket, reduce, gather): 9 offered
        tl.bucket_ready(0, b, 10, 1.0 + b, False)
        tl.bucket_done(0, b, 1.5 + b, report=_report(0.1, 0.05))
    assert (tl.events, tl.dropped) == (5, 4)
    with caplog.at_level(logging.WARNING, logger="gradlane.integrations.timeline"):
        path = tl.write()
    data = read_timeline(path)
    assert data["otherData"]["dropped_events"] == 4 and data["otherData"]["events"] == 5
    assert "4 later ones were dropped" in caplog.text


def test_the_file_is_json_with_one_named_process_per_rank_and_every_required_key(folder):
    tl = Timeline(rank=3, world=4, clock_offset_us=1_700_000_000_000_000, path=folder / "t.json")
    for step in range(2):
        for b in range(2):
            tl.bucket_ready(step, b, 100, step + b * 0.01, b == 1)
        for b in range(2):
            tl.bucket_done(step, b, step + 0.5, report=_report(0.1, 0.05, retransmitted=(1,)))
    path = tl.write()
    assert sorted(os.listdir(folder)) == ["t.json"]  # no probe or temporary file left
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    assert data["otherData"]["format"] == "gradlane-timeline" and data["otherData"]["rank"] == 3
    events = data["traceEvents"]
    for e in events:
        assert REQUIRED[e["ph"]] <= e.keys(), e
        assert e["pid"] == 4 and isinstance(e["tid"], int) and e["tid"] >= 1
    meta = {(e["name"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[("process_name", STEPS_TID)] == {"name": "rank 3"}
    assert meta[("process_sort_index", STEPS_TID)] == {"sort_index": 3}
    names = {tid: a["name"] for (kind, tid), a in meta.items() if kind == "thread_name"}
    assert names == {STEPS_TID: "steps", 2: "bucket 0", 3: "bucket 1"}
    # Wall-clock microseconds: the monotonic time plus the offset.
    first = min(e["ts"] for e in events if e["ph"] == "X")
    assert first == 1_700_000_000_000_000
    assert sum(e["ph"] == "X" and e["cat"] == "step" for e in events) == 2


def test_records_from_several_threads_are_all_kept():
    tl = Timeline(rank=0, clock_offset_us=0)
    errors: list[BaseException] = []

    def record(step: int) -> None:
        try:
            for b in range(100):
                tl.bucket_ready(step, b, 8, 1.0, b == 99)
                tl.bucket_done(step, b, 1.1, report=_report(0.05, 0.02))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=record, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert not any(t.is_alive() for t in threads) and not errors
    assert tl.events == 4 * (100 * 3 + 1) and tl.dropped == 0


def test_merge_joins_the_ranks_and_refuses_one_rank_twice(folder):
    paths = []
    for rank in range(2):
        tl = Timeline(
            rank=rank, world=2, clock_offset_us=0, path=rank_path(folder / "t.json", rank)
        )
        tl.bucket_ready(0, 0, 100, 1.0 + rank, True)
        tl.bucket_done(0, 0, 1.5 + rank, report=_report(0.1, 0.05))
        paths.append(tl.write())
    assert [p.name for p in paths] == ["t.rank0.json", "t.rank1.json"]
    out = merge_timelines(paths, folder / "all.json")
    data = json.loads(out.read_text())
    procs = {
        e["pid"]: e["args"]["name"]
        for e in data["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert procs == {1: "rank 0", 2: "rank 1"}
    assert len(data["traceEvents"]) == sum(len(read_timeline(p)["traceEvents"]) for p in paths)
    assert [o["rank"] for o in data["otherData"]["merged"]] == [0, 1]
    with pytest.raises(TimelineError, match="both hold process 1"):
        merge_timelines([paths[0], paths[0]], folder / "twice.json")
    (folder / "bad.json").write_text("[1, 2]")
    with pytest.raises(TimelineError, match="not a trace-event file"):
        merge_timelines([folder / "bad.json"], folder / "x.json")


def test_the_merge_command(folder, capsys):
    for rank in range(2):
        tl = Timeline(rank=rank, clock_offset_us=0, path=folder / f"r{rank}.json")
        tl.write()
    args = ["merge", str(folder / "all.json"), str(folder / "r0.json"), str(folder / "r1.json")]
    assert main(args) == 0
    assert "merged 2 file(s)" in capsys.readouterr().out
    assert read_timeline(folder / "all.json")["otherData"]["dropped_events"] == 0
    assert main(["merge", str(folder / "x.json"), str(folder / "missing.json")]) == 1
    assert "cannot read the timeline" in capsys.readouterr().err


def test_rank_paths():
    assert rank_path("out/t.json", 3) == Path("out/t.rank3.json")
    assert rank_path("out/t", 3) == Path("out/t.rank3")
    assert rank_path("out/r{rank}/t.json", 3) == Path("out/r3/t.json")
    assert rank_path("t-{rank}.json", 0) == Path("t-0.json")


def test_a_path_that_cannot_be_written_is_refused_at_construction(folder):
    with pytest.raises(ConfigError, match="does not exist"):
        Timeline(rank=0, path=folder / "missing" / "t.json")
    with pytest.raises(ConfigError, match="is a folder"):
        Timeline(rank=0, path=folder)
    with pytest.raises(ConfigError, match="max_events"):
        Timeline(rank=0, max_events=0)


def test_hook_config_timeline_settings():
    env = {"GRADLANE_HOOK__TIMELINE": "/tmp/t-{rank}.json", "GRADLANE_HOOK__TIMELINE_EVENTS": "9"}
    cfg = HookConfig.from_env(env)
    assert (cfg.timeline, cfg.timeline_events) == ("/tmp/t-{rank}.json", 9)
    assert HookConfig().timeline == ""  # off by default
    with pytest.raises(ConfigError, match="timeline_events"):
        HookConfig(timeline_events=0)


def test_the_state_refuses_an_unwritable_timeline_before_it_starts_a_plane(folder):
    bad = HookConfig(timeline=str(folder / "missing" / "t.json"))
    never = cast(Plane, object())  # the check comes first: no plane is touched
    with pytest.raises(ConfigError, match=r"GRADLANE_HOOK__TIMELINE.*does not exist"):
        GradlaneState(TransportConfig(), bad, rank=0, world=1, plane=never)


def test_a_report_without_reduce_s_falls_back_to_the_reduce_transfers_duration():
    tl = Timeline(rank=0, clock_offset_us=0)
    tl.bucket_ready(0, 0, 100, 10.0, False)
    report = dataclasses.replace(_report(duration=0.008, reduce_s=0.003), reduce_s=0.0)
    tl.bucket_done(0, 0, 10.010, report=report)
    reduce, _ = _events(tl, "X", "phase")
    assert (reduce["ts"], reduce["dur"]) == (10_002_000, 3_000)  # reduce.duration: 0.003
