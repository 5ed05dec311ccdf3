"""Trace recorder: wraps any DDP comm hook and writes one JSON Lines record per (step, bucket).

The format (``gradlane-trace`` version 1) is what the bench's replay reads; docs/testbed.md
documents it.
The first line is a ``meta`` record (who recorded what); every other line is a ``bucket``
record::

    {"kind": "meta", "format": "gradlane-trace", "version": 1, "rank": 0, "world": 2,
     "hook": "allreduce_hook", "torch": "2.13.0+cpu", ...}
    {"kind": "bucket", "rank": 0, "step": 1, "bucket": 0, "bytes": 1360, "numel": 340,
     "dtype": "float32", "params": 4, "layer_span": [0.4, 1.0], "ready_s": 0.0021,
     "gap_s": 0.0004, "comm_s": 0.0007, "last": false, "ok": true}

``ready_s`` is when DDP handed the bucket to the hook, relative to the step's start: the
start of the DDP module's forward when the recorder is attached with :meth:`TraceRecorder.attach`
(or :meth:`~TraceRecorder.mark_step_start` is called), else the first bucket's ready time.
``gap_s`` is the compute between the previous bucket's ready time (or the step's start) and this
one's; ``comm_s`` is from the hook call to the wrapped hook's Future completing.
``layer_span`` is the (first, last) layer position of the bucket's parameters, 0 = the model's
first parameter, 1 = its last. ``step`` counts the synchronised backward passes (it advances on
``bucket.is_last()``).

Records are buffered as their Futures complete (on the communication thread) and written by the
hook's own thread at the next step boundary, or by :meth:`TraceRecorder.close`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from gradlane.integrations.buckets import ParamOrder

__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "TraceRecorder", "read_trace", "traced_hook"]

TRACE_FORMAT = "gradlane-trace"
TRACE_VERSION = 1

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class TraceRecorder:
    """Wraps ``hook`` (called with ``state``) and records what every bucket did.

    ``path``: write JSON Lines there (else keep the records in memory only, see
    :meth:`records`). ``model``: the module DDP wraps, for exact layer positions (else they are
    learned from the first, whole-model bucket). ``meta``: extra fields for the meta record.
    ``keep``: also keep every record in memory for :meth:`records` (default: when no ``path``).
    """

    def __init__(
        self,
        hook: Hook,
        state: Any = None,
        *,
        path: str | Path | None = None,
        rank: int | None = None,
        world: int | None = None,
        model: torch.nn.Module | None = None,
        meta: Mapping[str, Any] | None = None,
        keep: bool | None = None,
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        self.hook = hook
        self.state = state
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world = world if world is not None else (dist.get_world_size() if initialized else 1)
        self.meta: dict[str, Any] = {
            "kind": "meta",
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "rank": self.rank,
            "world": self.world,
            "hook": getattr(hook, "__name__", type(hook).__name__),
            "torch": torch.__version__,
            **(meta or {}),
        }
        self._order = ParamOrder(model.parameters() if model is not None else None)
        self._step = 0
        self._step_start: float | None = None
        self._prev_ready: float | None = None
        self._lock = threading.Lock()
        self._done: list[dict[str, Any]] = []  # completed, not yet written
        self._all: list[dict[str, Any]] = []
        self._keep = path is None if keep is None else keep
        self._file: IO[str] | None = None
        if path is not None:
            self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
            self._file.write(json.dumps(self.meta) + "\n")

    def attach(self, ddp: torch.nn.parallel.DistributedDataParallel) -> TraceRecorder:
        """Register on ``ddp`` (a DistributedDataParallel): the comm hook, and a forward
        pre-hook that marks each step's start."""
        ddp.register_forward_pre_hook(lambda _module, _args: self.mark_step_start())
        ddp.register_comm_hook(self, traced_hook)
        return self

    def mark_step_start(self) -> None:
        """The current step starts now (its forward begins)."""
        self._step_start = time.monotonic()

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Record the bucket, call the wrapped hook, time its Future."""
        ready = time.monotonic()
        if self._step_start is None:
            self._step_start = ready
        start = self._step_start
        buf = bucket.buffer()
        last = bucket.is_last()
        lo, hi = self._order.span(bucket.parameters())
        rec: dict[str, Any] = {
            "kind": "bucket",
            "rank": self.rank,
            "step": self._step,
            "bucket": bucket.index(),
            "bytes": buf.numel() * buf.element_size(),
            "numel": buf.numel(),
            "dtype": str(buf.dtype).removeprefix("torch."),
            "params": len(bucket.parameters()),
            "layer_span": [round(lo, 6), round(hi, 6)],
            "ready_s": round(ready - start, 7),
            "gap_s": round(
                ready - (self._prev_ready if self._prev_ready is not None else start), 7
            ),
            "comm_s": None,
            "last": last,
        }
        self._prev_ready = ready
        if last:
            self._step += 1
            self._step_start = self._prev_ready = None
            self.flush()
        inner = self.hook(self.state, bucket)

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            rec["comm_s"] = round(time.monotonic() - ready, 7)
            rec["ok"] = not _failed(fut)
            with self._lock:
                self._done.append(rec)
            return fut.wait()  # a failure propagates with its message

        return inner.then(done)

    def records(self) -> list[dict[str, Any]]:
        """Every completed bucket record so far, in (step, bucket) order (with ``keep``)."""
        with self._lock:
            pending = self._done if self._keep else []
            return sorted([*self._all, *pending], key=lambda r: (r["step"], r["bucket"]))

    def flush(self) -> None:
        """Write the records completed so far (called at every step boundary)."""
        with self._lock:
            done = self._take()
            if self._keep:
                self._all.extend(done)
        if self._file is not None and done:
            for rec in sorted(done, key=lambda r: (r["step"], r["bucket"])):
                self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Write what is left and close the file."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _take(self) -> list[dict[str, Any]]:
        done, self._done = self._done, []
        return done


def traced_hook(
    recorder: TraceRecorder, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``ddp.register_comm_hook(recorder, traced_hook)`` (or ``attach``)."""
    return recorder.run(bucket)


# DDP compares the hook's annotations with the real objects (this module's are strings).
traced_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


def read_trace(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(meta records, bucket records) of a trace file; other kinds are an error."""
    metas, buckets = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.get("kind")
            if kind == "meta":
                if rec.get("format") != TRACE_FORMAT or rec.get("version") != TRACE_VERSION:
                    raise ValueError(f"{path}:{n}: not a {TRACE_FORMAT} v{TRACE_VERSION} trace")
                metas.append(rec)
            elif kind == "bucket":
                buckets.append(rec)
            else:
                raise ValueError(f"{path}:{n}: unknown record kind {kind!r}")
    return metas, buckets


def _failed(fut: torch.futures.Future[torch.Tensor]) -> bool:
    try:
        fut.value()
    except Exception:
        return True
    return False
