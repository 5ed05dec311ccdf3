"""``tools/train_ddp.py`` under ``torchrun``: the hook needs no configuration of its own.

torchrun (``python -m torch.distributed.run``) runs in its own session with a timeout; on a
timeout the whole session (the agent and its workers) is killed, so nothing outlives the test.
In daemon mode the trainers start first and the host's ``gradlane daemon`` after them (they
wait for it); the daemon is stopped with SIGTERM and must leave no file behind.
"""

from __future__ import annotations

import glob
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["embedded", "daemon"])
def test_train_ddp_under_torchrun_with_two_ranks(mode: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADLANE_", "MASTER_"))}
    env["PYTHONPATH"] = str(ROOT)
    job = 400_000 + os.getpid() % 100_000
    sockdir = tempfile.mkdtemp(prefix="gl-trun-")
    sock = os.path.join(sockdir, "d.sock")
    if mode == "daemon":
        env.update({"GRADLANE_MODE": "daemon", "GRADLANE_JOB": str(job),
                    "GRADLANE_HOOK__DAEMON_SOCKET": sock})  # fmt: skip
    daemon = None
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
        if mode == "daemon":  # after the trainers: they wait for it
            daemon = subprocess.Popen(
                [sys.executable, "-m", "gradlane.integrations.cli.main", "daemon", "--job",
                str(job),
                 "--socket", sock, "--local-world", "2", "--metrics", "", "--log-level",
                 "WARNING"],
                env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            assert daemon.stdout is not None
            ready, _, _ = select.select([daemon.stdout], [], [], 120)
            assert ready and "ready" in daemon.stdout.readline()
        out, _ = proc.communicate(timeout=240)
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(60) == 0
            assert glob.glob(f"/dev/shm/gradlane-{job}-*") == [] and os.listdir(sockdir) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if daemon is not None:
            if daemon.poll() is None:
                daemon.kill()
            daemon.wait(30)
            if daemon.stdout is not None:
                daemon.stdout.close()
        for path in glob.glob(f"/dev/shm/gradlane-{job}-*"):
            os.unlink(path)
        shutil.rmtree(sockdir, ignore_errors=True)
    assert proc.returncode == 0, out
    accuracies = [float(a) for a in re.findall(r"test accuracy ([\d.]+)% after 60 steps", out)]
    assert len(accuracies) == 2, out
    assert accuracies[0] == accuracies[1] and accuracies[0] > 80.0, out  # same model on both
    assert re.search(r"step 60: loss [\d.]+, comm p50 [\d.]+ ms, delivered 1\.0000", out), out
