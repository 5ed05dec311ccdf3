"""One IPC message, or one trainer's segment, must not stop the daemon: hostile messages are
answered with a counted REJECT and a truncated segment fails its request, after which a real
all-reduce through the same daemon is exact; a daemon whose loop does fail exits non-zero.

The message attacks run against an in-process daemon (its counters are visible); the segment
attack against a ``gradlane daemon`` process, where a SIGBUS would show as the process dying.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from gradlane.transport.daemon import messages as ipc
from gradlane.transport.daemon.shm import Segment

from tests.loopback.test_daemon_ipc import ROOT, WAIT_S, Host, _pair_step

ANSWER_S = 20.0
#: Elements of the truncated bucket: its pages past the new end fault when touched through a
#: mapping (a truncate inside the last page would leave that page readable).
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


def test_a_segment_truncated_after_submit_fails_that_request_not_the_daemon(host: Host):
    p = host.process()
    raw = Raw(host.socket)
    partner = host.client(1)
    segs: list[Segment] = []
    try:
        kind, welcome = raw.ask([b"HELLO", _hello(host.job)])
        assert kind == "WELCOME", welcome

        def submit(step: int, serial: int) -> Segment:
            seg = Segment.create(f"{welcome['prefix']}b0.0-{serial}", 4 * N)
            segs.append(seg)
            seg.array(np.float32, N)[:] = 1.0
            sub = {"generation": welcome["generation"], "step": step, "bucket": 0,
                   "shm": seg.name, "offset": 0, "numel": N, "dtype": 0,
                   "layer_position": 0.0, "pinned": False}  # fmt: skip
            raw.sock.send_multipart(ipc.encode("SUBMIT", **sub))
            # The daemon reads one connection in order: once this probe is answered, the
            # SUBMIT has been taken (checked and queued in its slot).
            assert raw.ask([b"BYE", b"{"])[0] == "REJECT"
            return seg

        seg = submit(0, 1)
        seg.close()  # the test must not touch the mapping of a file it truncates
        os.truncate(seg.path, 100)
        fut = partner.submit(0, 0, np.full(N, 2.0, dtype=np.float32))  # the slot fills
        assert raw.sock.poll(int(WAIT_S * 1000)), f"no answer; daemon exit code {p.poll()}"
        kind, fail = ipc.decode(raw.sock.recv_multipart())
        assert kind == "FAIL" and "truncated by its owner to 100 B" in fail["error"], fail
        with pytest.raises(Exception, match=r"local rank 0: .*truncated"):
            fut.result(WAIT_S)
        assert p.poll() is None, f"the daemon died with exit code {p.returncode}"

        seg = submit(1, 2)  # the same trainer, a sound segment: served as usual
        fut = partner.submit(1, 0, np.full(N, 2.0, dtype=np.float32))
        assert (fut.result(WAIT_S)[0] == 3.0).all()
        assert raw.sock.poll(int(WAIT_S * 1000))
        kind, done = ipc.decode(raw.sock.recv_multipart())
        assert kind == "DONE", done
        assert (seg.array(np.float32, N) == 3.0).all()
        assert p.poll() is None
    finally:
        raw.close()
        for s in segs:
            s.close()
            s.unlink()


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
