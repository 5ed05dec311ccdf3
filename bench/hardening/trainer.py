"""A trainer of the daemon phases, as a process of its own: a
:class:`~gradlane.transport.daemon.client.DaemonPlane` (the public client API) driven by JSON
lines on stdin, answering with JSON lines on stdout.

    python -m gradlane.bench.hardening.trainer --socket PATH --job J --local-rank L

Commands: ``{"cmd": "submit", "step": S, "n": N}`` all-reduces local rank ``L``'s bucket
(``(L + 1) * arange(N)`` as float32) and answers ``result`` (exact or not, or the error);
``{"cmd": "truncate", "step": S, "n": N}`` submits the same, truncates this process's
shared-memory segments once the submission has gone to the daemon (a trainer that shrinks
its segment after SUBMIT, which must fail that request and not the daemon), answers
``truncated`` (what it truncated, or what refused to be truncated: a sealed segment), then
``result``; ``{"cmd": "exit"}`` closes the client. The segments are found the way any process
finds its own memory (``/proc/self/maps`` and ``/proc/self/fd``), so the case does not depend
on how the client names or creates them. Being a process of its own, it can be killed with -9.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
from gradlane.bench.hardening.common import die_with_parent
from gradlane.transport.daemon.client import DaemonPlane

__all__ = ["bucket", "main", "truncate_own_segments"]

#: Longest wait for a result or for the submission to leave.
WAIT_S = 60.0


def bucket(local_rank: int, n: int) -> np.ndarray:
    """Local rank ``local_rank``'s bucket: ``(local_rank + 1) * arange(n)``, float32 (sums of
    such buckets are exact)."""
    return np.arange(n, dtype=np.float32) * np.float32(local_rank + 1)


def truncate_own_segments(size: int = 100) -> dict[str, list[Any]]:
    """Truncate every gradlane shared-memory segment this process maps (named files) or holds
    open (memfds) to ``size`` bytes: ``truncated`` lists those that shrank, ``refused`` those
    the kernel refused (a sealed memfd answers EPERM), with the reason."""
    done: list[Any] = []
    refused: list[Any] = []
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and "gradlane-" in parts[5]:
                paths.add(parts[5].strip())
    for path in sorted(paths):
        if not path.startswith("/") or path.startswith("/memfd:") or path.endswith("(deleted)"):
            continue  # memfds are reached through their descriptors below
        try:
            os.truncate(path, size)
            done.append(path)
        except OSError as e:
            refused.append([path, e.strerror])
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:") and "gradlane" in target:
            try:
                os.ftruncate(int(fd), size)
                done.append(target)
            except OSError as e:
                refused.append([target, e.strerror])
    return {"truncated": done, "refused": refused}


def _say(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _result(fut: Any, local_rank: int, local_world: int, n: int) -> None:
    try:
        result, _ = fut.result(WAIT_S)
    except Exception as e:  # the finding is the error, reported as such
        _say(event="result", ok=False, error=f"{type(e).__name__}: {e}", t_error=time.monotonic())
        return
    want = sum(bucket(r, n) for r in range(local_world))
    _say(event="result", ok=True, exact=bool(np.array_equal(result, want)))


def main(argv: list[str] | None = None) -> int:
    """Serve commands until ``exit`` or the end of stdin."""
    ap = argparse.ArgumentParser(prog="python -m gradlane.bench.hardening.trainer")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--local-rank", type=int, required=True)
    ap.add_argument("--local-world", type=int, default=2)
    args = ap.parse_args(argv)
    die_with_parent()
    lr, lw = args.local_rank, args.local_world
    client = DaemonPlane(
        args.socket,
        job=args.job,
        rank=lr,
        world=lw,
        local_rank=lr,
        local_world=lw,
        connect_timeout_s=WAIT_S,
        request_timeout_s=WAIT_S,
    )
    try:
        client.start()
        _say(event="ready", pid=os.getpid())
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            n = int(cmd["n"])
            before = client.stats()["submitted"]
            fut = client.submit(int(cmd["step"]), 0, bucket(lr, n))
            if cmd["cmd"] == "truncate":
                deadline = time.monotonic() + WAIT_S
                while client.stats()["submitted"] == before and time.monotonic() < deadline:
                    time.sleep(0.001)  # the I/O thread copies the bucket in, then sends SUBMIT
                if client.stats()["submitted"] == before:  # never sent: nothing to shrink
                    _say(event="truncated", truncated=[], refused=[], note="not submitted")
                else:
                    _say(event="truncated", **truncate_own_segments())
            _result(fut, lr, lw, n)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
