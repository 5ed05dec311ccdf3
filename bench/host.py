"""What machine a benchmark ran on, and how busy it was: every benchmark's JSON ``host``.

Timing ratios are only worth something on a quiet machine: a test suite or a second benchmark
beside one distorts every ratio it prints. :class:`HostWatch` reads the load averages when a
benchmark starts and when it ends, warns at once (on stderr, and in the JSON) when the
1-minute load at the start exceeds :data:`QUIET_LOAD_PER_CORE` per core, and records the CPU
model and core count beside them.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any, TextIO

__all__ = ["CPU_KINDS", "QUIET_LOAD_PER_CORE", "HostWatch", "cpu_model", "cpu_times"]

#: The 1-minute load average per core above which a benchmark's start counts as busy.
QUIET_LOAD_PER_CORE = 0.5


#: The kinds of CPU time ``/proc/stat`` counts, in its order (the first eight).
CPU_KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times() -> dict[str, int]:
    """The whole machine's CPU time so far by kind (:data:`CPU_KINDS`, in ticks, from Linux's
    ``/proc/stat``); empty where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1 : 1 + len(CPU_KINDS)]]
    except (OSError, ValueError):
        return {}
    return dict(zip(CPU_KINDS, vals, strict=False))


def cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class HostWatch:
    """Load averages at a benchmark's start (read here) and end (:meth:`record`), the CPU model
    and core count; warns on ``out`` at once when the start is busy."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.cores = os.cpu_count() or 1
        self.load_start = [round(x, 2) for x in os.getloadavg()]
        limit = QUIET_LOAD_PER_CORE * self.cores
        self.warning: str | None = None
        if self.load_start[0] > limit:
            self.warning = (
                f"busy machine: 1-minute load average {self.load_start[0]:.2f} at the start, "
                f"above {limit:.2f} ({QUIET_LOAD_PER_CORE} per core on {self.cores} cores); "
                "timing ratios from this run are distorted"
            )
            print(f"WARNING: {self.warning}", file=out or sys.stderr)

    @property
    def quiet(self) -> bool:
        """True when the start was quiet (no warning)."""
        return self.warning is None

    def record(self) -> dict[str, Any]:
        """The ``host`` entry of a benchmark's JSON, with the load averages at its end."""
        return {
            "cpu_model": cpu_model(),
            "cpus": self.cores,
            "load_start": self.load_start,
            "load_end": [round(x, 2) for x in os.getloadavg()],
            "quiet": self.quiet,
            "warning": self.warning,
        }
