"""Per-step statistics of a DDP hook: what each training step's buckets cost and lost.

The hook notes each bucket when DDP hands it over (:meth:`StepLedger.note_start`) and when its
all-reduce ends (:meth:`StepLedger.note_done`, on the plane's thread); a step is complete when
its last bucket (``bucket.is_last()``) and every one before it are done. Complete steps become
:class:`StepStats`, kept in a bounded history, summed into totals and logged every
``log_every`` steps; a step whose result holds NaN or infinite values is logged as a warning
(the first, then every hundredth such step): a diverging job, or forged data without a secret.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from gradlane.transport.core.events import CollectiveReport

__all__ = ["StepLedger", "StepStats"]

log = logging.getLogger("gradlane.integrations.ddp")

#: After the first step with non-finite values, warn again every this many such steps.
_NONFINITE_EVERY = 100


@dataclass(frozen=True)
class StepStats:
    """What one training step's buckets cost and lost, at this rank."""

    step: int
    generation: int
    buckets: int
    bytes: int
    comm_s: float
    """From the first bucket handed to the hook to the last one all-reduced."""
    delivered_fraction: float
    """The smallest delivered fraction over the step's buckets (1.0 = nothing lost)."""
    degraded_buckets: int
    retransmitted: int
    """Chunks this rank's sender retransmitted for the step."""
    failed_buckets: int
    nonfinite_chunks: int = 0
    """Chunks of the step's results holding NaN or infinite values
    (:attr:`~gradlane.transport.core.events.CollectiveReport.nonfinite_chunks`)."""
    format_bytes: tuple[int, int, int] = (0, 0, 0)
    """Payload bytes this rank started sending, by wire format: uncompressed (the bucket's
    own type), bfloat16, E4M3."""
    compressed_share: float = 0.0
    """Share of the elements this rank sent in a lossy wire format."""
    rel_error: float = 0.0
    """Relative error of what this rank sent: ``sqrt(Σ rounding error² / Σ value²)``."""
    precision_level: float = 0.0
    """The adaptive wire-precision level the step's buckets started with (the largest)."""


@dataclass
class _OpenStep:
    generation: int
    first_ready: float
    submitted: int = 0
    expected: int | None = None
    done: int = 0
    bytes: int = 0
    last_done: float = 0.0
    delivered: float = 1.0
    degraded: int = 0
    retransmitted: int = 0
    failed: int = 0
    nonfinite: int = 0
    format_bytes: tuple[int, int, int] = (0, 0, 0)
    lossy_elems: int = 0
    elems: int = 0
    err2: float = 0.0
    norm2: float = 0.0
    level: float = 0.0


class StepLedger:
    """The open steps, the kept history and the totals of one hook state (thread-safe)."""

    def __init__(self, rank: int, history: int, log_every: int) -> None:
        self.rank = rank
        self.log_every = log_every
        self.lock = threading.Lock()
        self._open: dict[int, _OpenStep] = {}
        self._history: deque[StepStats] = deque(maxlen=history)
        self._nonfinite_steps = 0
        self.totals = {"steps": 0, "buckets": 0, "bytes": 0, "failed_buckets": 0,
                       "degraded_buckets": 0, "retransmitted": 0,
                       "nonfinite_chunks": 0}  # fmt: skip

    def note_start(self, step: int, generation: int, nbytes: int, ready: float, last: bool) -> None:
        """A bucket of ``step`` handed to the hook at ``ready`` (``last``: the step's last)."""
        with self.lock:
            o = self._open.get(step)
            if o is None:
                o = self._open[step] = _OpenStep(generation, ready)
            o.submitted += 1
            o.bytes += nbytes
            if last:
                o.expected = o.submitted

    def note_done(
        self, step: int, generation: int, report: CollectiveReport | None, failed: bool
    ) -> None:
        """A bucket of ``step`` all-reduced (``report``) or failed."""
        now = time.monotonic()
        with self.lock:
            o = self._open.get(step)
            if o is None:
                return
            o.done += 1
            o.last_done = max(o.last_done, now)
            o.generation = generation
            if failed:
                o.failed += 1
            if report is not None:
                o.delivered = min(o.delivered, report.delivered_fraction)
                o.degraded += int(report.degraded)
                o.retransmitted += sum(report.sender.retransmitted)
                o.nonfinite += report.nonfinite_chunks
                snd = report.sender
                fb = snd.format_bytes
                o.format_bytes = (o.format_bytes[0] + fb[0], o.format_bytes[1] + fb[1],
                                  o.format_bytes[2] + fb[2])  # fmt: skip
                o.lossy_elems += snd.lossy_elems
                o.elems += snd.elems
                o.err2 += snd.err2
                o.norm2 += snd.norm2
                o.level = max(o.level, report.precision_level)
            if o.expected is None or o.done < o.expected:
                return
            del self._open[step]
            st = StepStats(
                step=step,
                generation=o.generation,
                buckets=o.done,
                bytes=o.bytes,
                comm_s=o.last_done - o.first_ready,
                delivered_fraction=o.delivered,
                degraded_buckets=o.degraded,
                retransmitted=o.retransmitted,
                failed_buckets=o.failed,
                nonfinite_chunks=o.nonfinite,
                format_bytes=o.format_bytes,
                compressed_share=o.lossy_elems / o.elems if o.elems else 0.0,
                rel_error=float(np.sqrt(o.err2 / o.norm2)) if o.norm2 > 0 else 0.0,
                precision_level=o.level,
            )
            self._history.append(st)
            t = self.totals
            t["steps"] += 1
            for name, value in (("buckets", st.buckets), ("bytes", st.bytes),
                                ("failed_buckets", st.failed_buckets),
                                ("degraded_buckets", st.degraded_buckets),
                                ("retransmitted", st.retransmitted),
                                ("nonfinite_chunks", st.nonfinite_chunks)):  # fmt: skip
                t[name] += value
            steps = t["steps"]
            warn = False
            if st.nonfinite_chunks:
                warn = self._nonfinite_steps % _NONFINITE_EVERY == 0
                self._nonfinite_steps += 1
        if warn:
            log.warning(
                "rank %d step %d: %d chunk(s) of the all-reduced gradients hold NaN or infinite "
                "values (%d step(s) so far): a diverging job, or, without a job secret, forged "
                "packets",
                self.rank,
                st.step,
                st.nonfinite_chunks,
                self._nonfinite_steps,
            )
        if self.log_every and steps % self.log_every == 0:
            log.info(
                "rank %d step %d: %d bucket(s), %.1f MB, comm %.2f ms, delivered %.4f, "
                "%d retransmitted, %d degraded, %d failed",
                self.rank,
                st.step,
                st.buckets,
                st.bytes / 1e6,
                st.comm_s * 1e3,
                st.delivered_fraction,
                st.retransmitted,
                st.degraded_buckets,
                st.failed_buckets,
            )

    def history(self) -> list[StepStats]:
        """The kept per-step statistics, oldest first (complete steps only)."""
        with self.lock:
            return list(self._history)

    def summary(self) -> dict[str, Any]:
        """The totals, and the communication time and delivered fraction over the history."""
        with self.lock:
            hist = list(self._history)
            out: dict[str, Any] = dict(self.totals)
        comm = np.array([s.comm_s for s in hist]) if hist else np.zeros(0)
        delivered = np.array([s.delivered_fraction for s in hist]) if hist else np.ones(1)
        out["comm_s"] = {
            "p50": float(np.percentile(comm, 50)) if comm.size else None,
            "p99": float(np.percentile(comm, 99)) if comm.size else None,
            "max": float(comm.max()) if comm.size else None,
        }
        out["delivered_fraction"] = {"min": float(delivered.min()), "mean": float(delivered.mean())}
        out["last"] = dataclasses.asdict(hist[-1]) if hist else None
        return out
