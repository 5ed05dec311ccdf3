"""The wire precision of one rank's collectives: which float32 buckets travel partly in fewer
bits, each bucket's error-feedback residual, and the adaptive amount, fed once per step.

Theory of operation
-------------------
The precision policy (:mod:`gradlane.scheduling.precision`) picks each chunk's wire format
when its transfer starts; this module holds what lives longer than a transfer:

* **Error feedback.** What a rank's rounding removed from what it sent (its *residual*: the
  reduce phase's shards toward their owners, and, as their owner, the gather phase's rounding
  of its own shard) is added to its next contribution to the same bucket, so no gradient mass
  is lost over time (error-feedback SGD: Seide et al. 2014, Karimireddy et al. ICML'19). One
  float32 buffer per bucket, the bucket's length: the shards are disjoint, so both phases'
  residuals fit in it. It is reset when the bucket's length changes. The gather phase rounds
  sums that carry the result's ``scale``; its residual is stored divided by it, in the units of
  a contribution.
* **The adaptive amount.** Steps are told apart by the step numbers collectives start with.
  When a step's collectives are all over and a later step has begun, the step is judged: its
  exposed communication is the time from its last collective's start (the trainer's backward
  pass has handed over its last bucket: it waits from there) to the end of its last
  collective; its length runs from its first start to the next step's first start; its
  relative error is ``sqrt(Σ err² / Σ |x|²)`` over what this rank sent. The
  :class:`~gradlane.scheduling.precision.AdaptiveController` moves the level from those.

Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from gradlane.scheduling.precision import (
    AdaptiveController,
    AdaptivePolicy,
    PrecisionPolicy,
    make_precision_policy,
    relative_error,
)
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import SenderReport
from gradlane.transport.wire.header import DType

__all__ = ["RESIDUAL_STEPS", "WirePrecision"]

#: Steps judged or pending kept at most (a trainer that skips step numbers leaves gaps).
_MAX_STEPS = 64
#: A bucket's residual is dropped once it has not contributed for this many steps.
RESIDUAL_STEPS = 16


@dataclass
class _Step:
    first: float
    last_start: float
    last_done: float = -np.inf
    running: int = 0
    err2: float = 0.0
    norm2: float = 0.0


class WirePrecision:
    """A rank's wire-precision state (module docstring), owned by its collective layer."""

    def __init__(self, config: TransportConfig) -> None:
        pc = config.precision
        self.policy: PrecisionPolicy = make_precision_policy(pc)
        self.feedback = bool(pc.error_feedback) and self.policy.lossy
        # A fixed policy has no controller, and then no step needs judging.
        self.controller = (
            AdaptiveController(pc, self.policy) if isinstance(self.policy, AdaptivePolicy) else None
        )
        self._residuals: dict[int, np.ndarray] = {}
        self._used: dict[int, int] = {}  # bucket -> the last step it contributed to
        self._steps: dict[int, _Step] = {}

    @property
    def level(self) -> float:
        """The adaptive level now (0: all float32); a fixed policy's is not adaptive: 0."""
        return self.controller.level if self.controller is not None else 0.0

    def applies(self, dtype: int, rotated: bool, world: int) -> bool:
        """Whether a collective of this dtype may send lossy chunks: float32, not rotated (the
        residual would be in another step's rotation), with peers."""
        return self.policy.lossy and dtype == DType.F32 and not rotated and world > 1

    def contribution(
        self, step: int, bucket: int, wire: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """What this rank contributes to ``bucket`` at ``step`` (float32 ``wire``), and the
        residual buffer its transfers write (None without error feedback): ``wire`` plus last
        time's residual, in a new array, or ``wire`` itself. The residual of a bucket not
        used for :data:`RESIDUAL_STEPS` steps is dropped (a caller that numbers its buckets
        afresh must not grow memory without bound)."""
        if not self.feedback:
            return wire, None
        self._used[bucket] = step
        stale = [b for b, s in self._used.items() if s < step - RESIDUAL_STEPS]
        for b in stale:
            del self._used[b]
            self._residuals.pop(b, None)
        res = self._residuals.get(bucket)
        if res is None or res.shape != wire.shape:
            res = np.zeros(wire.shape, dtype=np.float32)  # a new layout: nothing to make up
            self._residuals[bucket] = res
        return wire + res, res

    def owner_units(self, residual: np.ndarray, scale: float) -> None:
        """Turn the gather's residual (sums times ``scale``) into a contribution's units."""
        if scale not in (1.0, 0.0):
            residual *= np.float32(1.0 / scale)

    def on_start(self, step: int, now: float) -> None:
        """A collective of ``step`` starts at ``now``: may judge earlier steps."""
        if self.controller is None:
            return
        rec = self._steps.get(step)
        if rec is None:
            rec = self._steps[step] = _Step(first=now, last_start=now)
            self._judge()
        rec.last_start = max(rec.last_start, now)
        rec.running += 1

    def on_end(self, step: int, now: float, sender: SenderReport | None) -> None:
        """A collective of ``step`` ended at ``now`` (completed, with its sender's report, or
        failed, without)."""
        if self.controller is None:
            return
        rec = self._steps.get(step)
        if rec is None:
            return
        rec.running -= 1
        rec.last_done = max(rec.last_done, now)
        if sender is not None:
            rec.err2 += sender.err2
            rec.norm2 += sender.norm2
        self._judge()

    def _judge(self) -> None:
        """Feed the controller every step that is over and followed by a started step."""
        steps = sorted(self._steps)
        for s, nxt in itertools.pairwise(steps):
            rec = self._steps[s]
            if rec.running > 0:
                continue
            if self.controller is not None and np.isfinite(rec.last_done):  # (for mypy)
                self.controller.update(
                    exposed_s=max(rec.last_done - rec.last_start, 0.0),
                    step_s=max(self._steps[nxt].first - rec.first, 0.0),
                    rel_error=relative_error(rec.err2, rec.norm2),
                )
            del self._steps[s]
        while len(self._steps) > _MAX_STEPS:
            del self._steps[min(self._steps)]
