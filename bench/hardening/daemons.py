"""Processes of the daemon phases: a ``gradlane daemon`` (:class:`DaemonProc`) and a trainer
(:class:`TrainerProc`, running :mod:`gradlane.bench.hardening.trainer`), each a child process
whose every wait is bounded and which :meth:`close` always ends (SIGTERM, then SIGKILL).

A daemon runs with one host and two local ranks on an ``ipc://`` socket in a fresh temporary
directory, logs at ERROR to a file (the phase reads it when the daemon fails), and serves its
Prometheus metrics on a free loopback port, from which :meth:`DaemonProc.rejected` reads the
IPC rejections by reason.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from gradlane.bench.hardening.common import PR_SET_PDEATHSIG
from gradlane.bench.hardening.trainer import bucket
from gradlane.integrations.cli.stats import fetch, samples
from gradlane.transport.daemon.client import DaemonPlane

__all__ = [
    "DaemonProc",
    "TrainerProc",
    "daemon_clients",
    "exact_step",
    "job_token",
    "remove_segments",
]

#: How long a daemon or trainer may take to say it is ready (a first start compiles kernels).
READY_S = 180.0


def job_token() -> int:
    """A job token of this run (the pid in it), so concurrent runs never share a daemon."""
    return 0x6A7D0000 | (os.getpid() & 0xFFFF)


def remove_segments(job: int) -> list[str]:
    """Remove whatever shared-memory files of ``job`` are left (a daemon killed with -9 leaves
    its trainers' segments); returns their paths."""
    gone = []
    for path in glob.glob(
        os.path.join(os.environ.get("GRADLANE_SHM_DIR", "/dev/shm"), f"gradlane-{job}-*")
    ):
        with contextlib.suppress(OSError):
            os.unlink(path)
            gone.append(path)
    return gone


#: Runs a command line (the rest of argv) after asking to die with its parent: the daemon is
#: not this package's code, so the request is made by this launcher, and survives ``execv``.
_LAUNCHER = (
    "import ctypes, os, signal, sys; "
    f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, int(signal.SIGTERM)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _read_line(stream: Any, timeout_s: float) -> str:
    """One line of ``stream`` within ``timeout_s`` ('' on timeout or end of file)."""
    ready, _, _ = select.select([stream], [], [], max(timeout_s, 0.0))
    return stream.readline() if ready else ""


class DaemonProc:
    """One ``gradlane daemon`` process (1 host, ``local_world`` local ranks) on a socket of its
    own; :meth:`start` returns once it says it is ready."""

    def __init__(
        self,
        job: int,
        *,
        local_world: int = 2,
        hard_deadline_s: float = 5.0,
        socket_dir: str | None = None,
    ) -> None:
        self.job = job
        self.local_world = local_world
        self.hard_deadline_s = hard_deadline_s
        self._own_dir = socket_dir is None
        self.dir = socket_dir or tempfile.mkdtemp(prefix="gl-hard-")
        self.socket = os.path.join(self.dir, "d.sock")
        self.log = os.path.join(self.dir, "daemon.log")
        self.proc: subprocess.Popen[str] | None = None
        self.metrics_url: str | None = None
        self.generation: str | None = None

    def start(self) -> DaemonProc:
        """Start the process and wait (bounded) for its ready line; on any failure (Ctrl-C
        included) the process and its directory are gone when this raises."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> DaemonProc:
        launch = (
            [sys.executable, "-c", _LAUNCHER]
            if sys.platform.startswith("linux")
            else [sys.executable]
        )
        cmd = [
            *launch, "-m", "gradlane.integrations.cli.main", "daemon",
            "--job", str(self.job), "--socket", self.socket,
            "--local-world", str(self.local_world), "--metrics", "127.0.0.1:0",
            "--hard-deadline", str(self.hard_deadline_s), "--log-level", "ERROR",
        ]  # fmt: skip
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.proc.stdout is not None
        line = _read_line(self.proc.stdout, READY_S)
        if "gradlane daemon: ready" not in line:
            code = self.proc.poll()
            raise RuntimeError(f"the daemon did not start (exit {code}): {line!r}; {self.tail()}")
        words = line.split()
        self.generation = words[words.index("generation") + 1]
        url = words[words.index("metrics") + 1]
        self.metrics_url = None if url == "None" else url
        return self

    @property
    def pid(self) -> int:
        """The daemon's pid."""
        assert self.proc is not None
        return int(self.proc.pid)

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        """The exit code, once it has exited."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> float:
        """SIGKILL the daemon; returns the ``time.monotonic()`` of the kill."""
        assert self.proc is not None
        self.proc.kill()
        t = time.monotonic()
        self.proc.wait(30.0)
        return t

    def rejected(self) -> dict[str, float]:
        """``gradlane_ipc_rejected_total`` by reason, from the metrics endpoint."""
        if self.metrics_url is None:
            return {}
        out: dict[str, float] = {}
        for name, labels, value in samples(fetch(self.metrics_url)):
            if name == "gradlane_ipc_rejected_total":
                out[labels.get("reason", "?")] = value
        return out

    def tail(self, lines: int = 20) -> str:
        """The last lines of the daemon's log."""
        try:
            with open(self.log) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> int | None:
        """SIGTERM (drain and clean up), SIGKILL if it does not exit; returns the exit code.
        Removes the socket directory when this object made it."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(self.hard_deadline_s + 30.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(30.0)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return code


class TrainerProc:
    """A trainer process (:mod:`gradlane.bench.hardening.trainer`) of a daemon: JSON lines of
    commands on its stdin, of events on its stdout."""

    def __init__(self, socket_path: str, job: int, local_rank: int, local_world: int = 2) -> None:
        cmd = [
            sys.executable, "-m", "gradlane.bench.hardening.trainer", "--socket", socket_path,
            "--job", str(job), "--local-rank", str(local_rank),
            "--local-world", str(local_world),
        ]  # fmt: skip
        # Its log goes to a file: a pipe nobody reads could fill and stop it.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    @property
    def pid(self) -> int:
        """The trainer's pid."""
        return int(self.proc.pid)

    def send(self, **cmd: Any) -> None:
        """Send one command."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        """The next event, which must be ``event``, within ``timeout_s``."""
        assert self.proc.stdout is not None
        line = _read_line(self.proc.stdout, timeout_s)
        if not line:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30.0)
            self.log.seek(0)
            log = self.log.read()[-2000:]
            raise RuntimeError(f"the trainer sent no {event!r} (exit {self.proc.poll()}): {log}")
        got = json.loads(line)
        if got.get("event") != event:
            raise RuntimeError(f"the trainer sent {got!r}, expected {event!r}")
        return dict(got)

    def kill(self) -> float:
        """SIGKILL the trainer; returns the ``time.monotonic()`` of the kill."""
        self.proc.kill()
        t = time.monotonic()
        self.proc.wait(30.0)
        return t

    def close(self) -> None:
        """Ask it to exit, then kill it if it does not."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send(cmd="exit")
            try:
                self.proc.wait(30.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30.0)
        for stream in (self.proc.stdin, self.proc.stdout, self.log):
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    stream.close()


def daemon_clients(socket: str, job: int, ranks: tuple[int, ...]) -> list[DaemonPlane]:
    """Started clients of a two-local-rank job on the daemon at ``socket``, one per local rank
    in ``ranks``; if one fails to start, those already started are closed."""
    clients: list[DaemonPlane] = []
    try:
        for r in ranks:
            clients.append(
                DaemonPlane(
                    socket,
                    job=job,
                    rank=r,
                    world=2,
                    local_rank=r,
                    local_world=2,
                    connect_timeout_s=60.0,
                    request_timeout_s=60.0,
                ).start()
            )
    except BaseException:
        for c in clients:
            c.close()
        raise
    return clients


def exact_step(clients: list[DaemonPlane], step: int, n: int, timeout_s: float) -> bool:
    """Each client submits its local rank's :func:`bucket` of ``n`` elements as bucket 0 of
    ``step``: True when every result is the exact sum of local ranks 0 and 1's buckets (a step
    that fails is not exact)."""
    futs = [c.submit(step, 0, bucket(c.local_rank, n)) for c in clients]
    want = bucket(0, n) + bucket(1, n)
    try:
        return all(np.array_equal(f.result(timeout_s)[0], want) for f in futs)
    except Exception:  # a failed step is not exact: reported as such
        return False
