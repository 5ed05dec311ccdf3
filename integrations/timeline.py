"""A timeline of the DDP hook: Chrome trace-event JSON that opens in Perfetto.

Usage: ``HookConfig(timeline="timeline.json")`` (or ``GRADLANE_HOOK__TIMELINE``) makes each
rank's :class:`~gradlane.integrations.ddp.GradlaneState` record one and write it at ``close()``,
one file per rank; :func:`merge_timelines` (``python -m gradlane.integrations.timeline merge OUT
IN...``) joins the ranks' files into one view for https://ui.perfetto.dev.

Theory of operation
-------------------
The hook notes each bucket twice: when DDP hands it over (:meth:`Timeline.bucket_ready`, on the
autograd thread) and when its all-reduce ends (:meth:`Timeline.bucket_done`, on the data plane's
thread), passing the time it read (``time.monotonic()``): the recorder reads no clock of its
own while recording. At the end, the :class:`~gradlane.transport.core.events.CollectiveReport`
gives the phases: the collective started ``report.duration`` before it ended, its reduce phase
ran ``report.reduce_s`` from that start (until this rank's gather began), and its gather phase
from there to the end. (A report without ``reduce_s``, from an older daemon, falls back to the
reduce transfer's own duration, counted from its first data.) The report
counts retransmissions and says which transfers were filled at a deadline, but not when: those
instant events sit at the end of their phase.

Timestamps are wall-clock microseconds: the monotonic time plus the offset between
``time.time()`` and the monotonic clock, taken once when the recorder starts. All the ranks of
a host read the same wall clock, so their files merge into one view; across hosts the view is
as aligned as the hosts' clocks (NTP: a millisecond or better). Timestamps and durations are
whole microseconds, so a phase never pokes out of its bucket's span through rounding.

The file (``"traceEvents"``: see the Trace Event Format document) has one process per rank
(``pid`` = rank + 1, named ``rank r``: Perfetto treats pid 0 as the kernel's idle task) and in
it one thread per track: ``steps`` (tid 1: each step's communication, from its first bucket
handed over to its last one done, and failures that name no bucket) and ``bucket b`` (tid
b + 2: bucket ``b``'s span and, nested under it, its ``reduce`` and ``gather`` phases and its
instant events). One track per bucket index keeps every track's spans properly nested: a
step's buckets overlap each other in time, but bucket ``b`` of one step ends before bucket
``b`` of the next begins (DDP waits for every bucket at the end of ``backward()``).

Recording is bounded: past ``max_events`` events, new ones are counted (``dropped_events`` in
the file's ``otherData``, and a warning when it is written), not kept.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradlane.integrations.cli.command import emit
from gradlane.scheduling.errors import ConfigError, GradlaneError
from gradlane.transport.core.events import CollectiveReport, LossReport

__all__ = [
    "DEFAULT_MAX_EVENTS",
    "TIMELINE_FORMAT",
    "TIMELINE_VERSION",
    "Timeline",
    "TimelineError",
    "check_writable",
    "main",
    "merge_timelines",
    "rank_path",
    "read_timeline",
]

log = logging.getLogger(__name__)

TIMELINE_FORMAT = "gradlane-timeline"
TIMELINE_VERSION = 1
#: Events kept by default (about 300 bytes each in memory: 75 MB in all): 25 buckets a step,
#: with their phases, for over 3,000 steps.
DEFAULT_MAX_EVENTS = 250_000
#: The track of the steps (and of failures that name no bucket); bucket ``b`` is ``b + 2``.
#: Thread ids start at 1: some Perfetto versions merged tid 0 with tid 1.
STEPS_TID = 1
_BUCKET_TID = 2

# Argument names of each kind of event, shared by every event of that kind (an event keeps
# only its values: a tuple is a third the size of a dict).
_BUCKET_ARGS = ("step", "bucket", "generation", "bytes", "delivered", "retransmitted",
                "dropped", "degraded", "nonfinite")  # fmt: skip
_FAILED_BUCKET_ARGS = ("step", "bucket", "generation", "bytes", "error")
_REDUCE_ARGS = ("step", "bucket", "missing_elems", "expected_elems", "bytes_received",
                "degraded")  # fmt: skip
_GATHER_ARGS = ("step", "bucket", "shards", "missing_elems", "expected_elems", "degraded")
_RETRANSMIT_ARGS = ("step", "bucket", "chunks", "per_class")
_FILL_ARGS = ("step", "bucket", "phase", "shard", "missing_elems", "expected_elems",
              "protected_missing", "delivered")  # fmt: skip
_FAILED_ARGS = ("step", "bucket", "error")
_STEP_ARGS = ("step", "buckets", "bytes", "degraded_buckets", "failed_buckets")


class TimelineError(GradlaneError):
    """A timeline file could not be written, or what was read is not a timeline."""


@dataclass(frozen=True, slots=True)
class _Event:
    ph: str
    tid: int
    cat: str
    name: str
    ts: int
    dur: int
    arg_names: tuple[str, ...]
    args: tuple[Any, ...]


@dataclass(slots=True)
class _OpenStep:
    first: int
    submitted: int = 0
    expected: int | None = None
    done: int = 0
    last: int = 0
    bytes: int = 0
    degraded: int = 0
    failed: int = 0


def rank_path(template: str | os.PathLike[str], rank: int) -> Path:
    """Rank ``rank``'s file for the path ``template``: ``{rank}`` in it replaced by the rank,
    else ``.rank<r>`` inserted before the suffix (``t.json`` -> ``t.rank0.json``)."""
    text = os.fspath(template)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank)))
    p = Path(text)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def check_writable(path: Path, what: str = "timeline") -> None:
    """Raise a ``ConfigError`` naming ``what`` unless a file can be written at ``path``: its
    folder exists and takes a new file (tried with a probe file, removed at once), and the
    path is not a folder."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{what}: {path} is a folder; give a file path such as {path}/t.json")
    if not parent.is_dir():
        raise ConfigError(f"{what}: cannot write {path}: the folder {parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".gradlane-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"{what}: cannot write {path}: {e.strerror or e}") from e


class Timeline:
    """Records what the DDP hook did with every bucket; writes Chrome trace-event JSON.

    Thread-safe: buckets are noted ready on one thread and done on another. Times passed in
    are ``time.monotonic()`` seconds; ``clock_offset_us`` (wall-clock microseconds minus
    monotonic microseconds) is measured at construction unless given (tests). ``path``: where
    :meth:`write` writes by default; checked now (a ``ConfigError`` naming ``what``), not
    when it is written.
    """

    def __init__(
        self,
        rank: int,
        world: int = 1,
        *,
        path: str | os.PathLike[str] | None = None,
        max_events: int = DEFAULT_MAX_EVENTS,
        clock_offset_us: int | None = None,
        what: str = "timeline",
    ) -> None:
        if max_events < 1:
            raise ConfigError(f"{what}: max_events={max_events}: must be >= 1")
        self.rank = rank
        self.world = world
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            check_writable(self.path, what)
        self.max_events = max_events
        if clock_offset_us is None:
            clock_offset_us = (time.time_ns() - time.monotonic_ns()) // 1000
        self.clock_offset_us = clock_offset_us
        self._lock = threading.Lock()
        self._events: list[_Event] = []
        self._dropped = 0
        self._ready: dict[tuple[int, int], tuple[int, int]] = {}  # (step, bucket) -> (ts, bytes)
        self._steps: dict[int, _OpenStep] = {}
        self._buckets: set[int] = set()  # indices seen: one named track each

    # -- recording (the hook's threads) ----------------------------------------------------------
    def bucket_ready(self, step: int, bucket: int, nbytes: int, now: float, last: bool) -> None:
        """Bucket ``bucket`` of ``step`` (``nbytes``) handed to the hook at ``now``; ``last``:
        the step's last bucket (``bucket.is_last()``)."""
        ts = self._us(now)
        with self._lock:
            self._ready[(step, bucket)] = (ts, nbytes)
            st = self._steps.get(step)
            if st is None:
                st = self._steps[step] = _OpenStep(first=ts, last=ts)
            st.submitted += 1
            st.bytes += nbytes
            if last:
                st.expected = st.submitted

    def bucket_done(
        self,
        step: int,
        bucket: int,
        now: float,
        *,
        report: CollectiveReport | None = None,
        error: BaseException | None = None,
        generation: int = 0,
    ) -> None:
        """Bucket ``bucket`` of ``step`` ended at ``now``: all-reduced (``report``) or failed
        (``error``). A bucket never noted ready (it failed before its index was known: bucket
        -1) is drawn at ``now`` on the steps track."""
        end = self._us(now)
        with self._lock:
            noted = self._ready.pop((step, bucket), None)
        ready, nbytes = noted if noted is not None else (end, 0)
        if error is not None or report is None:
            text = _error_text(error)
            tid = self._tid(bucket)
            events = [
                _Event("i", tid, "failure", "failed", end, 0, _FAILED_ARGS, (step, bucket, text))
            ]
            if bucket >= 0:
                span = (step, bucket, generation, nbytes, text)
                events.insert(0, _Event("X", tid, "bucket", f"bucket {bucket}", ready,
                                        end - ready, _FAILED_BUCKET_ARGS, span))  # fmt: skip
        else:
            events = self._bucket_events(step, bucket, generation, nbytes, ready, end, report)
        with self._lock:
            if bucket >= 0:
                self._buckets.add(bucket)
            self._add(events)
            st = self._steps.get(step) if noted is not None else None
            if st is None:
                return
            st.done += 1
            st.last = max(st.last, end)
            st.failed += int(report is None or error is not None)
            st.degraded += int(report is not None and report.degraded)
            if st.expected is None or st.done < st.expected:
                return
            del self._steps[step]
            args = (step, st.done, st.bytes, st.degraded, st.failed)
            self._add([_Event("X", STEPS_TID, "step", f"step {step}", st.first,
                              st.last - st.first, _STEP_ARGS, args)])  # fmt: skip

    def _bucket_events(
        self,
        step: int,
        bucket: int,
        generation: int,
        nbytes: int,
        ready: int,
        end: int,
        report: CollectiveReport,
    ) -> list[_Event]:
        """The span of a bucket all-reduced, its two phases and its instant events."""
        tid = self._tid(bucket)
        sender = report.sender
        retrans = sum(sender.retransmitted)
        span = (step, bucket, generation, nbytes, round(report.delivered_fraction, 6),
                retrans, sum(sender.dropped), report.degraded, report.nonfinite_chunks)  # fmt: skip
        # Inside the bucket's span whatever the plane's clock said: the collective cannot start
        # before the bucket was handed over, and its reduce cannot outlast it.
        start = min(max(ready, end - _us_of(report.duration)), end)
        red = report.reduce
        reduce_end = min(start + _us_of(report.reduce_s or red.duration), end)
        events = [
            _Event("X", tid, "bucket", f"bucket {bucket}", ready, end - ready, _BUCKET_ARGS, span),
            _Event("X", tid, "phase", "reduce", start, reduce_end - start, _REDUCE_ARGS,
                   (step, bucket, red.missing_elems, red.expected_elems, red.bytes_received,
                    red.degraded)),
        ]  # fmt: skip
        if report.gather:
            gs = report.gather
            args = (step, bucket, len(gs), sum(x.missing_elems for x in gs),
                    sum(x.expected_elems for x in gs), any(x.degraded for x in gs))  # fmt: skip
            events.append(
                _Event(
                    "X", tid, "phase", "gather", reduce_end, end - reduce_end, _GATHER_ARGS, args
                )
            )
        if retrans:
            events.append(_Event("i", tid, "retransmit", "retransmitted", end, 0, _RETRANSMIT_ARGS,
                                 (step, bucket, retrans, list(sender.retransmitted))))  # fmt: skip
        if red.degraded:
            events.append(_fill(tid, step, bucket, "reduce", reduce_end, red))
        events.extend(
            _fill(tid, step, bucket, "gather", end, g) for g in report.gather if g.degraded
        )
        return events

    def _add(self, events: list[_Event]) -> None:
        room = self.max_events - len(self._events)
        if room >= len(events):
            self._events.extend(events)
            return
        self._events.extend(events[: max(room, 0)])
        self._dropped += len(events) - max(room, 0)

    def _us(self, now: float) -> int:
        return round(now * 1e6) + self.clock_offset_us

    @staticmethod
    def _tid(bucket: int) -> int:
        return bucket + _BUCKET_TID if bucket >= 0 else STEPS_TID

    # -- reading and writing ---------------------------------------------------------------------
    @property
    def events(self) -> int:
        """Events kept so far."""
        with self._lock:
            return len(self._events)

    @property
    def dropped(self) -> int:
        """Events not kept because ``max_events`` were already kept."""
        with self._lock:
            return self._dropped

    def trace(self) -> dict[str, Any]:
        """The whole timeline as the JSON object :meth:`write` writes."""
        events, other = self._snapshot()
        return {"traceEvents": list(events), "displayTimeUnit": "ms", "otherData": other}

    def write(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the timeline so far to ``path`` (default: the constructor's) and return where;
        the file is replaced whole (written next to it, then renamed). A ``TimelineError``
        when it cannot be written."""
        target = Path(path) if path is not None else self.path
        if target is None:
            raise TimelineError("Timeline.write: no path given, and none at construction")
        events, other = self._snapshot()
        _write_json(target, events, other)
        if other["dropped_events"]:
            log.warning(
                "rank %d: timeline %s holds the first %d events; %d later ones were dropped "
                "(raise HookConfig.timeline_events to keep more)",
                self.rank, target, other["events"], other["dropped_events"],
            )  # fmt: skip
        return target

    def _snapshot(self) -> tuple[Iterator[dict[str, Any]], dict[str, Any]]:
        with self._lock:
            kept = list(self._events)
            buckets = sorted(self._buckets)
            dropped = self._dropped
        other = {
            "format": TIMELINE_FORMAT,
            "version": TIMELINE_VERSION,
            "rank": self.rank,
            "world": self.world,
            "clock": "wall-clock microseconds: time.time() at the start plus monotonic time",
            "events": len(kept),
            "dropped_events": dropped,
            "max_events": self.max_events,
        }
        return self._dicts(kept, buckets), other

    def _dicts(self, kept: list[_Event], buckets: list[int]) -> Iterator[dict[str, Any]]:
        pid = self.rank + 1
        yield _meta(pid, STEPS_TID, "process_name", name=f"rank {self.rank}")
        yield _meta(pid, STEPS_TID, "process_sort_index", sort_index=self.rank)
        for tid, name in [(STEPS_TID, "steps")] + [(self._tid(b), f"bucket {b}") for b in buckets]:
            yield _meta(pid, tid, "thread_name", name=name)
            yield _meta(pid, tid, "thread_sort_index", sort_index=tid)
        for e in kept:
            d: dict[str, Any] = {"ph": e.ph, "pid": pid, "tid": e.tid, "cat": e.cat,
                                 "name": e.name, "ts": e.ts}  # fmt: skip
            if e.ph == "X":
                d["dur"] = e.dur
            else:
                d["s"] = "t"  # an instant of its thread, not of the whole process
            d["args"] = dict(zip(e.arg_names, e.args, strict=True))
            yield d


def _fill(tid: int, step: int, bucket: int, phase: str, ts: int, r: LossReport) -> _Event:
    """The instant event of a transfer that a deadline ended with data missing (filled)."""
    args = (step, bucket, phase, r.shard, r.missing_elems, r.expected_elems, r.protected_missing,
            {str(k): round(v, 6) for k, v in r.delivered.items()})  # fmt: skip
    return _Event("i", tid, "degraded", f"degraded fill: {phase}", ts, 0, _FILL_ARGS, args)


def _meta(pid: int, tid: int, kind: str, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": args}


def _us_of(seconds: float) -> int:
    return max(round(seconds * 1e6), 0)


def _error_text(error: BaseException | None) -> str:
    if error is None:
        return "no report"
    return f"{type(error).__name__}: {error}"


def _write_json(path: Path, events: Iterable[dict[str, Any]], other: dict[str, Any]) -> None:
    """Write a trace-event JSON object, one event per line, replacing ``path`` whole."""
    parent = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise TimelineError(f"cannot write the timeline {path}: {e.strerror or e}") from e
    try:
        # mkstemp makes the file 0600; a timeline is a result for its user's tools, like any
        # file the job writes (the umask cannot be read without changing it, thread-unsafely).
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write('{"traceEvents": [\n')
            sep = ""
            for ev in events:
                f.write(sep)
                f.write(json.dumps(ev, separators=(",", ":")))
                sep = ",\n"
            f.write('\n],\n"displayTimeUnit": "ms",\n"otherData": ')
            f.write(json.dumps(other))
            f.write("}\n")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise TimelineError(f"cannot write the timeline {path}: {e.strerror or e}") from e


# -- merging ---------------------------------------------------------------------------------------
def read_timeline(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A timeline file's JSON object; a ``TimelineError`` when it is missing or not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise TimelineError(f"cannot read the timeline {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise TimelineError(f"{path} is not JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TimelineError(f"{path} is not a trace-event file (no 'traceEvents' list)")
    return data


def merge_timelines(paths: Iterable[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Merge per-rank timeline files into one at ``out`` (replaced whole) and return it.

    Events keep their process (rank) and timestamps; ``otherData`` lists each input's and
    sums ``dropped_events``. Two inputs holding the same process (the same rank, as from two
    runs) are a ``TimelineError`` naming them: one view would mix them.
    """
    inputs = [Path(p) for p in paths]
    if not inputs:
        raise TimelineError("merge_timelines: no timelines to merge")
    events: list[dict[str, Any]] = []
    others: list[Any] = []
    owner: dict[Any, Path] = {}
    for p in inputs:
        data = read_timeline(p)
        pids = {e.get("pid") for e in data["traceEvents"] if isinstance(e, dict)}
        for pid in pids:
            if pid in owner:
                raise TimelineError(f"{owner[pid]} and {p} both hold process {pid}: one rank twice")
            owner[pid] = p
        events.extend(data["traceEvents"])
        others.append(data.get("otherData", {}))
    dropped = sum(int(o.get("dropped_events", 0)) for o in others if isinstance(o, dict))
    other = {
        "format": TIMELINE_FORMAT,
        "version": TIMELINE_VERSION,
        "merged": others,
        "dropped_events": dropped,
    }
    target = Path(out)
    _write_json(target, events, other)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradlane.integrations.timeline merge OUT IN...``: merge rank files."""
    p = argparse.ArgumentParser(
        prog="python -m gradlane.integrations.timeline",
        description="Merge the per-rank timelines of the gradlane DDP hook into one file "
        "for https://ui.perfetto.dev.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="merge per-rank timeline files into OUT")
    merge.add_argument("out", metavar="OUT", help="the merged file (replaced)")
    merge.add_argument("inputs", metavar="IN", nargs="+", help="per-rank timeline files")
    args = p.parse_args(argv)
    try:
        out = merge_timelines(args.inputs, args.out)
    except TimelineError as e:
        emit(f"gradlane timeline: {e}", err=True)
        return 1
    emit(f"gradlane timeline: merged {len(args.inputs)} file(s) into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
