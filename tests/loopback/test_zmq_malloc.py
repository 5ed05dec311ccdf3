"""The ZeroMQ plane's malloc tuning (transport/drivers/zmq/malloc.py): libzmq's receive buffers
stay mapped, so a rank's steady all-reduces stop faulting every received page in afresh.

The tuning is process-wide and cannot be undone, so each measurement runs in a fresh Python
process: two planes over ipc:// all-reduce the same 4 MB bucket again and again, and the
process's minor page faults over the later rounds are counted (``getrusage``), with the tuning
and with ``GRADLANE_NO_MALLOC_TUNING=1``. Counts, not times: nothing here depends on the
machine's speed.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
from gradlane.transport.drivers.zmq import malloc
from gradlane.transport.drivers.zmq.plane import ZmqPlane, zmq_config

pytestmark = pytest.mark.timeout(120)

GLIBC = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

ELEMS = 1 << 20  # 4 MB of float32 per rank: 2 MB received per rank and round
# Enough rounds that the faults the tuning leaves (a constant: the planes' own buffers,
# Python's) are small against those it removes (one per received page, every round).
ROUNDS, WARM = 40, 8

_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from concurrent.futures import ThreadPoolExecutor
    import numpy as np
    from gradlane.transport.drivers.zmq.plane import ZmqPlane, zmq_config

    ipc, elems, rounds, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    eps = [f"ipc://{ipc}/d{r}" for r in range(2)]
    planes = [ZmqPlane(r, 2, zmq_config(), eps).start() for r in range(2)]
    xs = [np.full(elems, r + 1, dtype=np.float32) for r in range(2)]
    outs = [np.empty(elems, dtype=np.float32) for _ in range(2)]
    faults = 0
    try:
        with ThreadPoolExecutor(2) as pool:
            for step in range(rounds):
                if step == warm:
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                futs = [p.submit(step, 0, x, out=o) for p, x, o in zip(planes, xs, outs)]
                for f in futs:
                    result, _ = f.result(60)
                    assert float(result[0]) == 3.0 and float(result[-1]) == 3.0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        tuned = [p.stats()["malloc_tuned"] for p in planes]
    finally:
        for p in planes:
            p.close()
    print(json.dumps({"faults": faults, "tuned": tuned}))
    """
)


def _measure(tune: bool) -> dict:
    env = dict(os.environ)
    env.pop("GRADLANE_NO_MALLOC_TUNING", None)
    if not tune:
        env["GRADLANE_NO_MALLOC_TUNING"] = "1"
    with tempfile.TemporaryDirectory(prefix="gl-zm-", dir="/tmp") as ipc:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, ipc, str(ELEMS), str(ROUNDS), str(WARM)],
            env=env,
            capture_output=True,
            text=True,
            timeout=100,
            check=False,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the tuning is glibc's mallopt")
def test_tuned_planes_stop_faulting_their_received_frames_in():
    tuned, plain = _measure(tune=True), _measure(tune=False)
    assert tuned["tuned"] == [True, True] and plain["tuned"] == [False, False]
    # Each round every rank receives 2 MB in batch frames: 512 pages, 1024 for the two ranks.
    received_pages = (ROUNDS - WARM) * 2 * (ELEMS * 4 // 2) // 4096
    # Untuned, many of libzmq's frame buffers go back to the kernel and fault in again as they
    # are reused (glibc's own threshold keeps some: 23-68% of the received pages faulted in, in
    # 8 runs beside a busy loop); the measurement is meaningful only if that happens here...
    assert plain["faults"] > received_pages // 8, plain
    # ...tuned, they stay mapped: what is left does not grow with the rounds (the planes' own
    # buffers, Python's, more of them under load; at most 7% of the received pages in the same
    # runs, and at most an eighth of the untuned faults).
    assert tuned["faults"] < received_pages // 10, (tuned, plain)
    assert tuned["faults"] * 4 < plain["faults"], (tuned, plain)


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("GRADLANE_NO_MALLOC_TUNING", "1")
    assert malloc.retain_freed_memory() is False
    monkeypatch.setenv("GRADLANE_NO_MALLOC_TUNING", "0")  # "0" is not a request to skip it
    assert malloc.retain_freed_memory() is GLIBC
    assert malloc.retain_freed_memory() is GLIBC  # once per process, the same answer after


def test_a_plane_told_not_to_leaves_malloc_alone():
    with tempfile.TemporaryDirectory(prefix="gl-zm-", dir="/tmp") as ipc:
        plane = ZmqPlane(0, 1, zmq_config(), [f"ipc://{ipc}/d0"], tune_malloc=False).start()
        try:
            assert plane.stats()["malloc_tuned"] is False
        finally:
            plane.close()
