"""Rank processes that talk to their parent through pipes only: one JSON job in, JSON lines out.

The replay (:mod:`gradlane.bench.replay.run`) and the testbed demo
(:mod:`gradlane.bench.demo.testbed`) start their ranks where they must run — a local process, or
inside a testbed host's network namespace (``Host.popen``) — so nothing but the pipes joins a rank
to its parent. Protocol: the parent writes one JSON object (the job) and a newline to the rank's
stdin and closes it; the rank writes JSON objects, one per line, to stdout: any ``type`` its parent
understands, then ``{"type": "done"}`` when it finished, or ``{"type": "error", "message": ...,
"tb": ...}`` before it exits non-zero. stderr goes to a temporary file per rank, whose tail is
quoted when a rank fails.

:class:`RankPipes` is a context manager: every rank is stopped (SIGTERM, then SIGKILL) and every
file closed on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

__all__ = ["RankError", "RankPipes", "say"]

#: Seconds a rank gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0

Popen = Callable[..., subprocess.Popen[Any]]


class RankError(RuntimeError):
    """A rank failed, exited early or went silent; the message quotes its error and stderr."""


def say(**msg: Any) -> None:
    """Rank side: write one message line to stdout (flushed at once)."""
    sys.stdout.write(json.dumps(msg, separators=(",", ":"), default=float) + "\n")
    sys.stdout.flush()


class RankPipes:
    """The rank processes of one run (see the module docstring)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        self._stack = contextlib.ExitStack()
        self._errs: list[IO[bytes]] = []

    def __enter__(self) -> RankPipes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, popens: Sequence[Popen], module: str, jobs: Sequence[dict[str, Any]]) -> None:
        """Start ``python -m module`` for every rank with ``popens[rank]`` and hand it its job."""
        env = dict(os.environ)
        for popen, job in zip(popens, jobs, strict=True):
            err = self._stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115
            self._errs.append(err)
            p = popen(
                [sys.executable, "-m", module],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
            self.procs.append(p)
            assert p.stdin is not None
            p.stdin.write((json.dumps(job) + "\n").encode())
            p.stdin.close()

    def messages(self, timeout_s: float, silence_s: float) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(rank, message)`` as they come, until every rank said ``done``.

        Raises :class:`RankError` on an ``error`` message, a rank that exits before ``done``,
        no message from any rank for ``silence_s``, or ``timeout_s`` in all.
        """
        deadline = time.monotonic() + timeout_s
        heard = time.monotonic()
        done: set[int] = set()
        partial = {p.stdout.fileno(): b"" for p in self.procs if p.stdout is not None}
        with selectors.DefaultSelector() as sel:
            for rank, p in enumerate(self.procs):
                assert p.stdout is not None
                sel.register(p.stdout, selectors.EVENT_READ, rank)
            while len(done) < len(self.procs):
                now = time.monotonic()
                if now > deadline:
                    raise RankError(f"the ranks did not finish within {timeout_s:.0f}s")
                if now - heard > silence_s:
                    raise RankError(f"no word from the ranks for {silence_s:.0f}s{self.tails()}")
                for key, _ in sel.select(timeout=1.0):
                    rank = key.data
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        if rank not in done:
                            code = self.procs[rank].wait(STOP_GRACE_S * 2)
                            raise RankError(
                                f"rank {rank} exited (status {code}) before it finished"
                                f"{self.tails([rank])}"
                            )
                        continue
                    heard = time.monotonic()
                    *lines, partial[key.fd] = (partial[key.fd] + chunk).split(b"\n")
                    for line in lines:
                        msg = json.loads(line)
                        if msg.get("type") == "error":
                            raise RankError(
                                f"rank {msg.get('rank', rank)} failed: {msg.get('message')}\n"
                                f"{msg.get('tb', '')}"
                            )
                        if msg.get("type") == "done":
                            done.add(rank)
                        yield rank, msg

    def tails(self, ranks: Sequence[int] | None = None, lines: int = 15) -> str:
        """The last ``lines`` lines each rank wrote to stderr."""
        out = []
        for rank in ranks if ranks is not None else range(len(self._errs)):
            e = self._errs[rank]
            e.seek(0)
            text = e.read().decode(errors="replace").strip().splitlines()[-lines:]
            if text:
                out.append(f"\n--- rank {rank} stderr ---\n" + "\n".join(text))
        return "".join(out)

    def close(self) -> None:
        """Stop every rank still running (SIGTERM, then SIGKILL); close every pipe and file."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(STOP_GRACE_S)
            if p.stdout is not None:
                p.stdout.close()
        self._stack.close()
