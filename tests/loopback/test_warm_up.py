"""The start-up warm-up compiles every kernel a real collective uses.

A kernel it misses compiles (or loads from numba's cache) inside the first collective: with a
cold cache that stalled a 2-rank 25 MB all-reduce for 4.5 s while its peer's timers ran. The
check runs real UDP collectives (reliable and bounded, with injected loss, so recovery runs
too) in a fresh interpreter and lists the signatures compiled after ``Engine.start()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_no_kernel_compiles_inside_a_collective():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "tests.loopback.lazy_compile_probe"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["kernels"] >= 20, got  # the probe sees the project's kernels at all
    assert got["warmed"] >= 20, got
    assert got["new"] == {}, f"compiled inside a collective, not by the warm-up: {got['new']}"
