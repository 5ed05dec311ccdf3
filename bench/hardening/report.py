"""The campaign's report: the summary's targets and which were met, the table, the JSON.

Every summary key a phase produced is compared with its target (:data:`TARGETS`, the issue's);
a key a phase did not produce (the phase was not chosen, or failed) is met as ``None``. Some
keys are *correctness* keys (:data:`CORRECTNESS`): a result that was not exact, a datagram not
accounted for, a daemon that died. The campaign's exit code is 1 when one of those is missed;
counts and timings below their targets are reported, not failed (``--quick`` runs small counts).
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable
from typing import Any

from gradlane.integrations.cli.command import emit

__all__ = ["CORRECTNESS", "TARGETS", "check", "print_table", "targets", "write_json"]

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
}


def targets(hard_deadline_s: float) -> dict[str, tuple[str, float | bool]]:
    """Every summary key with a target: ``(operator, value)``; the kill-rank bound depends on
    the hard deadline of the faults phase."""
    return {
        "datagrams_sent": (">=", 1_000_000),
        "spray_collectives": (">=", 500),
        "collectives_exact_fraction": ("==", 1.0),
        "collectives_failed_by_injection": ("==", 0),
        "unaccounted_datagrams": ("==", 0),
        "rss_growth_mb_under_flood": ("<=", 64),
        "rss_after_flood_mb_over_baseline": ("<=", 16),
        "flood_slowdown_p50": ("<=", 3),
        "quiet_exact_after_flood": ("==", True),
        "daemon_messages_sent": (">=", 100_000),
        "daemon_unanswered": ("==", 0),
        "daemon_bad_answers": ("==", 0),
        "daemon_crashes": ("==", 0),
        "daemon_truncation_ok": ("==", True),
        "daemon_exact_after": ("==", True),
        "kill_rank_error_s": ("<=", hard_deadline_s + 0.5),
        "kill_rank_named": ("==", True),
        "kill_daemon_error_s": ("<=", 1.0),
        "kill_daemon_named": ("==", True),
        "kill_daemon_restart_exact": ("==", True),
        "kill_trainer_named": ("==", True),
        "kill_trainer_rejoin_exact": ("==", True),
        "path_death_failed_steps": ("==", 0),
        "path_death_moved_rtts": ("<=", 10),
        "soak_steps": (">=", 10_000),
        "soak_exact_fraction": ("==", 1.0),
        "soak_rss_growth_mb": ("<=", 8),
        "soak_fd_growth": ("<=", 0),
        "keyed_vs_unkeyed_2x25": ("<=", 1.15),
    }


#: The default targets (a 2 s hard deadline in the faults phase).
TARGETS = targets(2.0)
#: Keys whose miss is a defect, not a slow or small run: they set the exit code.
CORRECTNESS = (
    "collectives_exact_fraction",
    "collectives_failed_by_injection",
    "unaccounted_datagrams",
    "quiet_exact_after_flood",
    "daemon_unanswered",
    "daemon_bad_answers",
    "daemon_crashes",
    "daemon_truncation_ok",
    "daemon_exact_after",
    "kill_rank_named",
    "kill_daemon_named",
    "kill_daemon_restart_exact",
    "kill_trainer_named",
    "kill_trainer_rejoin_exact",
    "path_death_failed_steps",
    "soak_exact_fraction",
)


def check(
    summary: dict[str, Any], goals: dict[str, tuple[str, float | bool]]
) -> dict[str, bool | None]:
    """Per target key: met (True), missed (False) or not measured (None)."""
    met: dict[str, bool | None] = {}
    for key, (op, value) in goals.items():
        got = summary.get(key)
        if got is None or (isinstance(got, float) and math.isnan(got)):
            met[key] = None
        else:
            met[key] = bool(_OPS[op](got, value))
    return met


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(doc: dict[str, Any]) -> None:
    """The summary as one table: key, value, target, met (through :func:`emit`)."""
    summary, met, goals = doc["summary"], doc["targets_met"], doc["targets"]
    host = doc["host"]
    emit(
        f"gradlane hardening campaign: {host.get('cpu_model')} ({host.get('cpus')} cores), "
        f"load {host.get('load_start')} -> {host.get('load_end')}"
    )
    if host.get("warning"):
        emit(f"WARNING: {host['warning']}")
    head = f"{'key':<36}{'value':>16}  {'target':<14}{'met':<5}"
    emit(head)
    emit("-" * len(head))
    keys = [k for k in summary if k not in ("targets", "targets_met")]
    for key in keys:
        goal = goals.get(key)
        target = f"{goal['op']} {_shown(goal['value'])}" if goal else ""
        flag = {True: "ok", False: "MISS", None: "-"}[met.get(key)] if goal else ""
        if goal and key in CORRECTNESS and met.get(key) is False:
            flag = "FAIL"
        emit(f"{key:<36}{_shown(summary[key]):>16}  {target:<14}{flag:<5}")
    for phase, seconds in doc.get("phase_seconds", {}).items():
        emit(f"  phase {phase}: {seconds:.1f}s")
    for note in doc.get("notes", []):
        emit(f"note: {note}")


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` as indented JSON (NaN written as null)."""

    def _clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): _clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [_clean(v) for v in x]
        return x

    with open(path, "w") as f:
        json.dump(_clean(doc), f, indent=1)
        f.write("\n")
