"""Daemon mode across processes: two "hosts" (daemons on 127.0.0.1 and 127.0.0.2) × two ranks.

Each daemon is a real ``gradlane daemon`` process (the CLI), each rank a spawned process with
DDP on a gloo group. Fixtures stop and remove everything they start — processes, socket files,
shared-memory segments — also when a test fails. Nothing asserts on timing beyond "the error
came before the queue timeout" (a hang would be a failure, not a stuck run).
"""

from __future__ import annotations

import contextlib
import glob
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from gradlane.integrations.cli.stats import fetch, samples
from gradlane.transport.daemon import messages as ipc

from tests.multiproc import daemon_workers
from tests.multiproc.ddp_workers import WAIT_S
from tests.support.procs import RankProcs, owned

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTS = 2
READY_S = 60.0


def _free_port(host: str, kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Daemons:
    """``HOSTS`` daemon processes of one job, host h on 127.0.0.(h+1), sockets in a temp dir."""

    def __init__(self, hard_deadline_s: float = 60.0, toml: str = "") -> None:
        self.job = 100_000 + os.getpid() % 100_000
        self.dir = tempfile.mkdtemp(prefix="gl-d-")
        self.sockets = [os.path.join(self.dir, f"h{h}.sock") for h in range(HOSTS)]
        ports = [_free_port(f"127.0.0.{h + 1}", socket.SOCK_DGRAM) for h in range(HOSTS)]
        self.paths = [f"127.0.0.{h + 1}:{p}" for h, p in enumerate(ports)]
        self.hard = hard_deadline_s
        self.procs: list[subprocess.Popen[str] | None] = [None] * HOSTS
        self.metrics: list[str] = [""] * HOSTS
        self.config = ""
        if toml:  # the daemons' config file (--config)
            self.config = os.path.join(self.dir, "daemon.toml")
            with open(self.config, "w", encoding="utf-8") as f:
                f.write(toml)

    def start(self, host: int) -> None:
        """Start host ``host``'s daemon and wait (bounded) for its ready line."""
        cmd = [
            sys.executable,
            "-m",
            "gradlane.integrations.cli.main",
            "daemon",
            "--job",
            str(self.job),
            "--host-rank",
            str(host),
            "--hosts",
            str(HOSTS),
            "--socket",
            self.sockets[host],
            "--path",
            self.paths[host],
            "--peers",
            ";".join(self.paths),
            "--local-world",
            "2",
            "--hard-deadline",
            str(self.hard),
            "--metrics",
            "127.0.0.1:0",
            "--log-level",
            "WARNING",
            *(["--config", self.config] if self.config else []),
        ]
        env = {**os.environ, "PYTHONPATH": ROOT}
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.procs[host] = p
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], READY_S)
        line = p.stdout.readline() if ready else ""
        assert "gradlane daemon: ready" in line, f"daemon {host} did not start: {line!r}"
        self.metrics[host] = line.rsplit("metrics ", 1)[1].strip()

    def sample(self, host: int, name: str, **labels: str) -> float:
        """One metric of host ``host``'s daemon (0 when absent)."""
        for n, lb, v in samples(fetch(self.metrics[host])):
            if n == name and all(lb.get(k) == x for k, x in labels.items()):
                return v
        return 0.0

    def terminate(self, host: int) -> int:
        """SIGTERM and wait (bounded); returns the exit code."""
        p = self.procs[host]
        assert p is not None
        p.send_signal(signal.SIGTERM)
        return p.wait(self.hard + 30)

    def kill(self, host: int) -> None:
        """kill -9."""
        p = self.procs[host]
        assert p is not None
        p.kill()
        p.wait(30)

    def leftovers(self) -> list[str]:
        """This job's shared-memory segments and the socket directory's files."""
        return glob.glob(f"/dev/shm/gradlane-{self.job}-*") + os.listdir(self.dir)

    def cleanup(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
            if p is not None and p.stdout is not None:
                p.stdout.close()
        for path in glob.glob(f"/dev/shm/gradlane-{self.job}-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(self.dir, ignore_errors=True)


class Ranks(RankProcs):
    """Four spawned trainer ranks (two per host)."""

    def start(self, scenario: str, args: dict) -> None:
        port = _free_port("127.0.0.1")
        world = HOSTS * daemon_workers.LOCAL_WORLD
        for rank in range(world):
            self.spawn(
                daemon_workers.rank_main,
                (scenario, rank, world, port, args, self.up, self.down(rank)),
                f"gl-daemon-{scenario}-r{rank}",
            )

    def collect(self, tag: str, ranks: int) -> dict[int, Any]:
        """``ranks`` messages tagged ``tag`` (a rank's error fails the test)."""
        out: dict[int, Any] = {}
        while len(out) < ranks:
            status, rank, payload = self.up.get(timeout=WAIT_S)
            if status == "error":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            assert status == tag, (status, rank)
            out[rank] = payload
        return out

    def release(self, ranks: range) -> None:
        for r in ranks:
            self.downs[r].put("go")


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    d = Daemons(hard_deadline_s=4.0)
    try:
        yield d
    finally:
        d.cleanup()


@pytest.fixture
def ranks() -> Iterator[Ranks]:
    yield from owned(Ranks(), "go")


def _garbage(sock_path: str, job: int) -> list[tuple[list[bytes], str]]:
    """Bad messages and the reject reason each must get."""
    submit = {
        "generation": 1,
        "step": 0,
        "bucket": 0,
        "shm": "gradlane-x",
        "fd": 3,
        "offset": 0,
        "numel": 4,
        "dtype": 0,
        "layer_position": 0.5,
        "pinned": False,
    }
    hello = {"job": job, "rank": 0, "world": 4, "local_rank": 0, "local_world": 2, "pid": 1}
    return [
        ([b"\x00\xff garbage"], "malformed"),
        ([b"SUBMIT", b"{not json"], "malformed"),
        ([b"SUBMIT", b"x" * (ipc.MAX_MESSAGE_BYTES + 1)], "oversized"),
        ([b"EXPLODE", b"{}"], "unknown_kind"),
        ([b"SUBMIT", b'{"step": -1}'], "bad_field"),
        (ipc.encode("SUBMIT", **submit), "unknown_rank"),
        (ipc.encode("HELLO", **{**hello, "job": job + 1}), "foreign_job"),
        (ipc.encode("HELLO", **{**hello, "local_rank": 7}), "unknown_rank"),
        (ipc.encode("HELLO", **{**hello, "pid": os.getpid()}), "duplicate_rank"),
    ]


def _send_garbage(sock_path: str, job: int, which: slice) -> list[str]:
    """Send the bad messages ``which``, each on its own DEALER; return the answers' reasons."""
    ctx = zmq.Context.instance()
    reasons = []
    for frames, _ in _garbage(sock_path, job)[which]:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(f"ipc://{sock_path}")
            s.send_multipart(frames)
            if s.poll(int(WAIT_S * 1000)):
                kind, msg = ipc.decode(s.recv_multipart())
                reasons.append(msg["reason"] if kind == "REJECT" else kind)
            else:
                reasons.append("no answer")
        finally:
            s.close(0)
    return reasons


@pytest.mark.timeout(300)
def test_daemon_mode_equals_embedded_survives_garbage_and_sigterm_cleans_up(
    daemons: Daemons, ranks: Ranks
):
    for h in range(HOSTS):
        daemons.start(h)
    steps = 4
    ranks.start(
        "equality", {"sockets": daemons.sockets, "job": daemons.job, "steps": steps, "seed": 11}
    )
    # Garbage on host 0's socket while the ranks connect and train...
    reasons = _send_garbage(daemons.sockets[0], daemons.job, slice(None, -1))
    trained = ranks.collect("trained", 4)
    # ...and a HELLO for a local rank that a live trainer holds, once both are connected.
    reasons += _send_garbage(daemons.sockets[0], daemons.job, slice(-1, None))
    assert reasons == [why for _, why in _garbage(daemons.sockets[0], daemons.job)]
    for rank, r in trained.items():
        g = r["gaps"]
        assert max(g["embedded"]) <= 1e-5, f"rank {rank}: {g}"
        assert max(g["daemon"]) <= 1e-5, f"rank {rank}: {g}"
        assert max(g["daemon_vs_embedded"]) <= 1e-5, f"rank {rank}: {g}"
        assert r["stats"]["steps"] == steps and r["stats"]["failed_buckets"] == 0, r["stats"]
        assert r["stats"]["transport"] == "daemon"
    for why in {w for _, w in _garbage("", 0)}:
        assert daemons.sample(0, "gradlane_ipc_rejected_total", reason=why) >= 1, why
    assert daemons.sample(0, "gradlane_collectives_total", outcome="ok") >= steps
    # SIGTERM while the trainers are still connected: both exit cleanly and leave nothing.
    for h in range(HOSTS):
        assert daemons.terminate(h) == 0
    assert daemons.leftovers() == []
    ranks.release(range(4))
    for rank, after in ranks.collect("ok", 4).items():
        assert after["raised"], f"rank {rank}: a step without a daemon did not fail"
        assert "gradlane daemon" in after["message"], after["message"]
        assert after["elapsed"] < WAIT_S / 4, after


@pytest.mark.timeout(300)
def test_kill_9_of_a_daemon_mid_step_fails_every_rank_clearly(daemons: Daemons, ranks: Ranks):
    for h in range(HOSTS):
        daemons.start(h)
    ranks.start(
        "killed",
        {
            "sockets": daemons.sockets,
            "job": daemons.job,
            "good_steps": 2,
            "hard_deadline_s": daemons.hard,
            "seed": 13,
        },
    )
    ranks.collect("ready", 4)
    # Host 0's step is in flight once its daemon has launched the inter-host collective (it
    # waits for host 1, whose ranks hold back): poll its metrics, bounded.
    deadline = time.monotonic() + WAIT_S
    while daemons.sample(0, "gradlane_collectives_in_flight") < 1:
        assert time.monotonic() < deadline, "host 0's step never went in flight"
        time.sleep(0.02)
    daemons.kill(0)
    ranks.release(range(2, 4))
    results = ranks.collect("ok", 4)
    for rank, r in results.items():
        assert r["raised"], f"rank {rank}: backward() returned although daemon 0 was killed"
        text = r["message"]
        assert f"HookError: gradlane hook on rank {rank}" in text, text
        if rank < 2:  # host 0: its own daemon vanished
            assert "disconnected" in text and "host 0" in text, text
        else:  # host 1: its daemon's peer (host 0) never delivered
            assert "PeerTimeout: rank(s) 0 did not deliver" in text, text
        assert r["elapsed"] < WAIT_S / 4, r
    assert daemons.terminate(1) == 0


@pytest.mark.timeout(300)
def test_daemons_with_a_lossy_wire_precision_train_alike_and_report_it(ranks: Ranks):
    """Daemons configured with ``precision = "e4m3"``: the chunks they send each other travel
    in 8 bits; every trainer holds the same parameters, the gradients stay near the default
    hook's, and the step statistics the daemon reports back say what was compressed."""
    d = Daemons(hard_deadline_s=10.0, toml='[transport]\nprecision = "e4m3"\n')
    try:
        for h in range(HOSTS):
            d.start(h)
        steps = 4
        ranks.start("lossy", {"sockets": d.sockets, "job": d.job, "steps": steps, "seed": 13})
        results = ranks.collect("ok", 4)
    finally:
        d.cleanup()
    for rank, r in results.items():
        assert r["divergence"] == 0.0, f"rank {rank}: {r['divergence']}"
        assert max(r["gaps"]) < 0.1, f"rank {rank}: {r['gaps']}"
        # After DDP's bucket rebuild, each step sent E4M3 bytes and compressed most elements.
        assert all(fb[2] > 0 for fb in r["format_bytes"][1:]), r["format_bytes"]
        assert min(r["share"][1:]) > 0.3, r["share"]
