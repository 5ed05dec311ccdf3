"""One IPC message, or one trainer's segment, must not stop the daemon: hostile messages are
answered with a counted REJECT, a descriptor that is not a sealed memfd with a counted FAIL, and
a trainer cannot shrink its segment at all, after which a real all-reduce through the same
daemon is exact; a daemon whose loop does fail exits non-zero.

The attacks whose counters are checked run against an in-process daemon; the truncating trainer
against a ``gradlane daemon`` process, where a SIGBUS would show as the process dying.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from gradlane.transport.daemon import messages as ipc
from gradlane.transport.daemon.shm import Segment

from tests.loopback.test_daemon_ipc import NO_FD, ROOT, WAIT_S, Host, _pair_step

ANSWER_S = 20.0
#: Elements of a bucket: several pages, so a truncate could cut whole pages off a mapping.
N = 16384
HELLO = {"rank": 0, "world": 2, "local_rank": 0, "local_world": 2}


@pytest.fixture
def host() -> Iterator[Host]:
    h = Host()
    try:
        yield h
    finally:
        h.cleanup()


class Raw:
    """A bare DEALER on the daemon's socket: sends any frames, reads one answer (bounded)."""

    def __init__(self, socket_path: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{socket_path}")

    def ask(self, frames: list[bytes]) -> tuple[str, dict[str, Any]]:
        self.sock.send_multipart(frames)
        assert self.sock.poll(int(ANSWER_S * 1000)), "the daemon did not answer"
        return ipc.decode(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)


def _hello(job: int, raw_rank: str | None = None, **extra: Any) -> bytes:
    body = json.dumps({"job": job, **HELLO, "pid": os.getpid(), **extra})
    if raw_rank is not None:  # JSON text that json.dumps would not write
        body = body.replace('"rank": 0', f'"rank": {raw_rank}', 1)
    return body.encode()


def _attacks(job: int) -> list[tuple[str, list[bytes], str]]:
    """(name, frames, reason) of each message that stopped the daemon, and relatives."""
    return [
        ("5000-character key", [b"HELLO", _hello(job, **{"k" * 5000: 1})], "bad_field"),
        ("5000-character int", [b"HELLO", _hello(job, json.dumps("s" * 5000))], "bad_field"),
        ("3000-element int", [b"HELLO", _hello(job, json.dumps(list(range(3000))))], "bad_field"),
        ("5000-digit integer", [b"HELLO", _hello(job, "9" * 5000)], "malformed"),
        ("2000-deep array", [b"HELLO", _hello(job, "[" * 2000 + "]" * 2000)], "malformed"),
        ("NaN", [b"HELLO", _hello(job, "NaN")], "malformed"),
        ("body over the maximum", [b"HELLO", b" " * (ipc.MAX_MESSAGE_BYTES + 1)], "oversized"),
        ("three frames", [b"HELLO", b"{}", b"{}"], "malformed"),
        ("not UTF-8", [b"BYE", b"\xff\xfe"], "malformed"),
        ("a reply kind", [b"DONE", b"{}"], "bad_field"),
    ]


def test_each_hostile_message_is_rejected_and_the_daemon_keeps_summing_exactly(host: Host):
    d = host.daemon()
    clients = [host.client(0), host.client(1)]
    raw = Raw(host.socket)
    try:
        for step, (name, frames, why) in enumerate(_attacks(host.job)):
            kind, answer = raw.ask(frames)
            assert (kind, answer["reason"]) == ("REJECT", why), (name, answer)
            assert len(answer["detail"]) <= ipc.MAX_DETAIL, name
            assert d.error is None and not d.wait(0), name
            _pair_step(clients, step)  # exact: _pair_step compares with the NumPy sum
        rejected = d.stats()["rejected"]
        assert rejected["bad_field"] == 4 and rejected["malformed"] == 5
        assert rejected["oversized"] == 1 and rejected["reply_failed"] == 0
    finally:
        raw.close()


def _submit(raw: Raw, welcome: dict[str, Any], step: int, name: str, fd: int) -> None:
    """Send local rank 0's SUBMIT of bucket 0 (``N`` float32) naming ``name`` at ``fd``."""
    sub = {"generation": welcome["generation"], "step": step, "bucket": 0, "shm": name, "fd": fd,
           "offset": 0, "numel": N, "dtype": 0, "layer_position": 0.0,
           "pinned": False}  # fmt: skip
    raw.sock.send_multipart(ipc.encode("SUBMIT", **sub))


def _answer(raw: Raw, p: subprocess.Popen[str] | None = None) -> tuple[str, dict[str, Any]]:
    """The daemon's next answer to ``raw`` (bounded); ``p``: the daemon process, if any."""
    if not raw.sock.poll(int(WAIT_S * 1000)):
        pytest.fail("no answer" + ("" if p is None else f"; daemon exit code {p.poll()}"))
    return ipc.decode(raw.sock.recv_multipart())


def test_a_trainer_truncating_its_segment_in_a_loop_cannot_kill_the_daemon(host: Host):
    """The owner's truncates (shrink, grow, through its descriptor or a fresh open of it) all
    fail with EPERM while the daemon reads and writes the segment, step after step; each step
    is the exact sum, and the daemon process lives on."""
    p = host.process()
    raw = Raw(host.socket)
    partner = host.client(1)
    seg: Segment | None = None
    stop, tried = threading.Event(), threading.Event()
    errnos: list[int] = []
    hammer: threading.Thread | None = None

    def truncate_in_a_loop(fd: int) -> None:
        while not stop.is_set():
            for size in (0, 100, 8 * N):
                for how in (os.ftruncate, lambda fd, n: os.truncate(f"/proc/self/fd/{fd}", n)):
                    try:
                        how(fd, size)
                        errnos.append(0)
                    except OSError as e:
                        errnos.append(e.errno or -1)
            tried.set()

    try:
        kind, welcome = raw.ask([b"HELLO", _hello(host.job)])
        assert kind == "WELCOME", welcome
        seg = Segment.create(f"{welcome['prefix']}b0.0-1", 4 * N)
        hammer = threading.Thread(target=truncate_in_a_loop, args=(seg.fd,), daemon=True)
        hammer.start()
        assert tried.wait(WAIT_S)
        for step in range(4):
            mine = np.arange(N, dtype=np.float32) * (step + 1)
            theirs = np.full(N, 2.0 * step, dtype=np.float32)
            seg.array(np.float32, N)[:] = mine
            _submit(raw, welcome, step, seg.name, seg.fd)
            fut = partner.submit(step, 0, theirs)
            kind, done = _answer(raw, p)
            assert kind == "DONE", done
            np.testing.assert_array_equal(seg.array(np.float32, N), mine + theirs)
            np.testing.assert_array_equal(fut.result(WAIT_S)[0], mine + theirs)
        stop.set()
        hammer.join(WAIT_S)
        assert errnos and set(errnos) == {errno.EPERM}, set(errnos)
        assert os.fstat(seg.fd).st_size == 4 * N
        assert p.poll() is None, f"the daemon died with exit code {p.returncode}"
    finally:
        stop.set()
        if hammer is not None:
            hammer.join(WAIT_S)  # before the descriptor it truncates is closed
        raw.close()
        if seg is not None:
            seg.close()


def _held_by_a_child(host: Host, prefix: str, fd: int) -> subprocess.Popen[str]:
    """A process holding a sealed segment named under ``prefix`` at descriptor ``fd``."""
    code = (
        "import os, sys\n"
        "from gradlane.transport.daemon.shm import Segment\n"
        f"seg = Segment.create({prefix + 'b0.0-7'!r}, {4 * N})\n"
        f"os.dup2(seg.fd, {fd}, inheritable=False)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    host.procs.append(child)
    host.ready(child, "ready")
    return child


def test_a_submit_naming_anything_but_a_sealed_memfd_gets_a_counted_fail(host: Host):
    """Each SUBMIT is answered FAIL naming why (counted ``bad_segment``); the same trainer's
    sound segment is then summed exactly."""
    d = host.daemon()
    raw = Raw(host.socket)
    partner = host.client(1)
    opened: list[int] = []
    seg: Segment | None = None
    try:
        kind, welcome = raw.ask([b"HELLO", _hello(host.job)])
        assert kind == "WELCOME", welcome
        prefix = welcome["prefix"]
        unsealed = os.memfd_create(f"{prefix}b0.0-1", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        opened.append(unsealed)
        os.ftruncate(unsealed, 4 * N)
        path = f"/dev/shm/{prefix}b0.0-2"  # a plain shared-memory file: its owner may truncate it
        plain = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        opened.append(plain)
        os.unlink(path)
        os.ftruncate(plain, 4 * N)
        pipe = os.pipe()
        opened += pipe
        # A descriptor number this process does not hold, where another process holds a
        # sealed segment named under this rank's prefix: the daemon looks only in this one's.
        theirs = next(n for n in range(900, 1000) if not _holds(n))
        _held_by_a_child(host, prefix, theirs)
        cases = [
            (f"{prefix}b0.0-1", unsealed, "is not sealed against shrinking"),
            (f"{prefix}b0.0-2", plain, "not the memfd"),
            (f"{prefix}b0.0-3", pipe[0], r"is not a memfd \(pipe:"),
            (f"{prefix}b0.0-7", theirs, f"descriptor {theirs} of trainer pid {os.getpid()} does"),
            (f"{prefix}b0.0-4", NO_FD, "does not exist"),
        ]
        for step, (name, fd, why) in enumerate(cases):
            _submit(raw, welcome, step, name, fd)
            kind, fail = _answer(raw)
            assert kind == "FAIL" and re.search(why, fail["error"]), (why, fail)
            assert d.error is None and not d.wait(0)
        assert d.stats()["rejected"]["bad_segment"] == len(cases)
        seg = Segment.create(f"{prefix}b0.0-5", 4 * N)
        seg.array(np.float32, N)[:] = 1.0
        step = len(cases)
        _submit(raw, welcome, step, seg.name, seg.fd)
        fut = partner.submit(step, 0, np.full(N, 2.0, dtype=np.float32))
        kind, done = _answer(raw)
        assert kind == "DONE", done
        assert (seg.array(np.float32, N) == 3.0).all()
        assert (fut.result(WAIT_S)[0] == 3.0).all()
    finally:
        raw.close()
        for fd in opened:
            os.close(fd)
        if seg is not None:
            seg.close()


def _holds(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_daemon_whose_loop_fails_exits_non_zero(host: Host):
    """The CLI's exit code says the loop stopped on an error (an error is injected into it)."""
    code = (
        "import sys\n"
        "from gradlane.transport.daemon.server import Daemon\n"
        "def fail(self): raise RuntimeError('injected loop failure')\n"
        "Daemon._serve = fail\n"
        "from gradlane.integrations.cli.main import main\n"
        f"sys.exit(main(['daemon', '--job', '{host.job}', '--socket', '{host.socket}',"
        " '--local-world', '2', '--metrics', '', '--log-level', 'ERROR']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=WAIT_S * 2,
        check=False,
    )
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "failed" in out.stderr and "injected loop failure" in out.stderr
    assert host.leftovers() == []  # it still cleaned up after itself
