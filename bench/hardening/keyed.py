"""What authentication costs: the loopback all-reduce benchmark with a keyed engine beside the
unkeyed one, run as a subprocess, and its ``summary["udp_keyed_vs_unkeyed"]["2x25@65000"]``
read back.

Where the benchmark cannot give the ratio (a flag it does not know yet, a failure, a timeout)
the section says why instead, and the key stays absent. It is a timing ratio, so it first waits
(up to :data:`SETTLE_S`) for the load the earlier phases left to decay to a quiet machine's
(:data:`~gradlane.bench.host.QUIET_LOAD_PER_CORE`), and records the load it started at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from gradlane.bench.host import QUIET_LOAD_PER_CORE

__all__ = ["KEY", "run_keyed"]

#: The ratio read from the benchmark's summary: 2 ranks, 25 MB, 65000-byte datagrams.
KEY = "2x25@65000"
#: Longest wait for the load to settle before the benchmark starts.
SETTLE_S = 120.0


def settle(limit_s: float = SETTLE_S) -> float:
    """Wait until the 1-minute load average is a quiet machine's (at most ``limit_s``); the
    seconds waited."""
    t0 = time.monotonic()
    quiet = QUIET_LOAD_PER_CORE * (os.cpu_count() or 1)
    pause = threading.Event()
    while os.getloadavg()[0] > quiet and time.monotonic() - t0 < limit_s:
        pause.wait(2.0)  # the load average moves every few seconds: nothing to wake on
    return time.monotonic() - t0


def run_keyed(timeout_s: float, *, sizes: str = "25", reps: int = 9) -> dict[str, Any]:
    """Run ``python -m gradlane.bench.perf.allreduce --ranks 2 --sizes SIZES --reps REPS
    --no-zmq --keyed-compare --json TMP`` (bounded by ``timeout_s``); returns the section with
    ``summary.keyed_vs_unkeyed_2x25`` when the benchmark gave it, else a ``note``."""
    fd, path = tempfile.mkstemp(prefix="gl-keyed-", suffix=".json")
    os.close(fd)
    cmd = [
        sys.executable, "-m", "gradlane.bench.perf.allreduce", "--ranks", "2", "--sizes", sizes,
        "--reps", str(reps), "--no-zmq", "--keyed-compare", "--json", path,
    ]  # fmt: skip
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "summary": {}}
    out["settled_s"] = round(settle(min(SETTLE_S, timeout_s / 2)), 1)
    try:
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            out["note"] = f"the benchmark did not finish within {timeout_s:.0f}s"
            return out
        out["returncode"] = done.returncode
        if done.returncode != 0:
            tail = (done.stderr or done.stdout)[-1500:]
            if "--keyed-compare" in tail and "unrecognized" in tail:
                out["note"] = "the all-reduce benchmark has no --keyed-compare flag yet"
            else:
                out["note"] = f"the benchmark failed (exit {done.returncode})"
            out["stderr_tail"] = tail
            return out
        try:
            with open(path) as f:
                doc = json.load(f)
            ratios = doc["summary"]["udp_keyed_vs_unkeyed"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            out["note"] = f"no summary.udp_keyed_vs_unkeyed in the benchmark's JSON ({e!r})"
            return out
        out["ratios"] = ratios
        out["host"] = doc.get("host")
        if KEY in ratios:
            out["summary"]["keyed_vs_unkeyed_2x25"] = float(ratios[KEY])
        else:
            out["note"] = f"summary.udp_keyed_vs_unkeyed has no {KEY!r} (sizes {sizes})"
        return out
    finally:
        os.unlink(path)
