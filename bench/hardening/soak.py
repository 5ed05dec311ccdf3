"""Phase 4, the soak: two ranks all-reduce a small bucket for ``steps`` steps back to back, every
result checked; memory (apart from the preallocated receive arena) and open descriptors are
read after a warm-up and after each of a few stretches, and must not grow.

The warm-up lasts longer than anything finished is remembered (a transfer's tombstone answers
late packets for the linger time, at least the hard deadline): before that, state that is
bounded by the step rate times that time is still filling up, which is not a leak."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from gradlane.bench.hardening.common import Budget, engine_config, fd_count, memory_mb
from gradlane.bench.hardening.ranks import RankGroup
from gradlane.transport.core.endpoint import RX_BATCH

__all__ = ["run_soak"]

#: Steps per stretch of the warm-up (first buffers, caches, tombstones filling up).
WARM_STEPS = 200
#: Stretches of the soak, with a memory reading after each.
STRETCHES = 5


def _net(m: tuple[float, float] | None) -> float:
    """Resident memory apart from the receive arena (NaN for a process that is gone)."""
    return m[0] - m[1] if m is not None else float("nan")


def run_soak(
    steps: int,
    budget: Budget,
    *,
    elems: int = 4096,
    secret: str | None = None,
    hard_deadline_s: float = 5.0,
) -> dict[str, Any]:
    """Run the phase; returns its JSON section."""
    arena = RX_BATCH * engine_config(secret, hard_deadline_s).slot_bytes
    common = {"n": elems, "seed": 3, "wait_s": hard_deadline_s * 3}
    with RankGroup(2, secret, hard_deadline_s) as ranks:
        pids = ranks.pids
        hold = max(hard_deadline_s, engine_config(secret, hard_deadline_s).linger_s) + 1.0
        first, t0 = 1, time.monotonic()
        while first == 1 or time.monotonic() - t0 < hold:
            ranks.send_all("loop", {"first_step": first, "max_steps": WARM_STEPS, **common})
            for r in range(2):
                ranks.receive(r, "loop", budget.left())
            first += WARM_STEPS
        before = {p: memory_mb(p, arena) for p in pids}
        fds_before = {p: fd_count(p) for p in pids}
        # In stretches, memory read after each: a leak shows as a steady climb.
        answers: list[dict[str, Any]] = [
            {"steps": 0, "exact": 0, "error": None, "times_s": []} for _ in range(2)
        ]
        curve = [[_net(before[p]) for p in pids]]
        for i in range(STRETCHES):
            count = steps // STRETCHES + (i < steps % STRETCHES)
            budget.check(f"soak stretch {i}")
            ranks.send_all("loop", {"first_step": first, "max_steps": count, **common})
            for r in range(2):
                a = ranks.receive(r, "loop", budget.left())
                answers[r]["steps"] += a["steps"]
                answers[r]["exact"] += a["exact"]
                answers[r]["times_s"] += a["times_s"]
                answers[r]["error"] = answers[r]["error"] or a["error"]
            first += count
            now = {p: memory_mb(p, arena) for p in pids}
            curve.append([_net(now[p]) for p in pids])
            if any(a["error"] is not None for a in answers):
                break
        after = {p: memory_mb(p, arena) for p in pids}
        fds_after = {p: fd_count(p) for p in pids}
    done = min(a["steps"] for a in answers)
    exact = min(a["exact"] for a in answers)
    errors = [a["error"] for a in answers if a["error"] is not None]

    growth = max(_net(after[p]) - _net(before[p]) for p in pids)
    fd_growth = max((fds_after[p] or 0) - (fds_before[p] or 0) for p in pids)
    times = [max(a, b) for a, b in zip(answers[0]["times_s"], answers[1]["times_s"], strict=False)]
    return {
        "elems": elems,
        "memory_mb": {
            "before": [before[p] for p in pids],
            "after": [after[p] for p in pids],
            "curve": curve,
            "note": "resident apart from the receive arena, per rank, after each stretch",
        },
        "fds": {"before": [fds_before[p] for p in pids], "after": [fds_after[p] for p in pids]},
        "errors": errors,
        "median_s": float(np.median(times)) if times else None,
        "summary": {
            "soak_steps": done,
            "soak_exact_fraction": exact / done if done else None,
            "soak_failed": len(errors),
            "soak_rss_growth_mb": growth,
            "soak_fd_growth": fd_growth,
        },
    }
