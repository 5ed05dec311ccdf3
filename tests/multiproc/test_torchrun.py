"""``tools/train_ddp.py`` under ``torchrun``: the hook needs no configuration of its own.

torchrun (``python -m torch.distributed.run``) runs in its own session with a timeout; on a
timeout the whole session (the agent and its workers) is killed, so nothing outlives the test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_train_ddp_under_torchrun_with_two_ranks():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADLANE_", "MASTER_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "tools" / "train_ddp.py"),
        "--steps",
        "60",
        "--log-every",
        "20",
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out
    accuracies = [float(a) for a in re.findall(r"test accuracy ([\d.]+)% after 60 steps", out)]
    assert len(accuracies) == 2, out
    assert accuracies[0] == accuracies[1] and accuracies[0] > 80.0, out  # same model on both
    assert re.search(r"step 60: loss [\d.]+, comm p50 [\d.]+ ms, delivered 1\.0000", out), out
