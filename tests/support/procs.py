"""Spawned rank processes for the multi-process tests: queues, and clean-up that always runs.

Every rank shares one ``up`` queue to the parent and has its own ``down`` queue. ``shutdown``
releases ranks still waiting (a failed test), joins or kills every process and closes every
queue; ``owned`` is the pytest fixture body that calls it and then fails on an abnormal exit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

CTX = mp.get_context("spawn")
JOIN_S = 30.0


class RankProcs:
    """Spawned processes sharing one ``up`` queue, each rank with its own ``down`` queue."""

    def __init__(self) -> None:
        self.up: Any = CTX.Queue()
        self.procs: list[Any] = []
        self.downs: dict[int, Any] = {}

    def down(self, rank: int) -> Any:
        """A new ``down`` queue for ``rank``."""
        q = self.downs[rank] = CTX.Queue()
        return q

    def results(self, wait_s: float, n: int | None = None) -> dict[int, Any]:
        """The ``("ok", rank, payload)`` messages of ``n`` ranks (default: all) by rank, each
        awaited at most ``wait_s``; a rank's error message fails the test."""
        n = len(self.procs) if n is None else n
        out: dict[int, Any] = {}
        while len(out) < n:
            status, rank, payload = self.up.get(timeout=wait_s)
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
        return out

    def spawn(self, target: Any, args: tuple, name: str) -> None:
        """Start ``target(*args)`` in a daemon process named ``name``."""
        p = CTX.Process(target=target, args=args, name=name, daemon=True)
        p.start()
        self.procs.append(p)

    def shutdown(self, message: Any) -> None:
        """Send ``message`` to every rank, then join (or kill) every process; close the queues."""
        for q in self.downs.values():
            q.put(message)
        for p in self.procs:
            p.join(JOIN_S)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(JOIN_S)
        self.up.close()
        for q in self.downs.values():
            q.close()


P = TypeVar("P", bound=RankProcs)


def owned(procs: P, message: Any) -> Iterator[P]:
    """Fixture body: yield ``procs``, shut them down with ``message`` whatever happened, and
    fail if a rank process exited abnormally."""
    try:
        yield procs
    finally:
        procs.shutdown(message)
    codes = {p.name: p.exitcode for p in procs.procs}
    assert all(c == 0 for c in codes.values()), f"rank processes exited abnormally: {codes}"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_in_session(
    cmd: list[str], timeout_s: float, *, cwd: Path, env: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Run ``cmd`` in a session of its own (stdout and stderr together) and return its exit
    code and output; past ``timeout_s`` its whole process group (ranks, daemons, everything it
    started) is killed and the test fails with the output's tail."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"{cmd[:4]} ran past {timeout_s:.0f}s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    return proc.returncode, out
