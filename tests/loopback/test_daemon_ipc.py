"""The daemon and its IPC clients on one host: lifecycle and bad input, with real sockets,
real shared memory (sealed memfds) and (for kill -9 and restart) a real daemon process.

Every client and daemon is closed, every process killed and every file removed by the fixtures,
also on failure; every wait has a timeout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
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
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from gradlane.integrations.cli.stats import fetch, samples
from gradlane.scheduling.errors import GradlaneError
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.config import loopback_config
from gradlane.transport.core.collective import from_f32
from gradlane.transport.daemon import messages as ipc
from gradlane.transport.daemon.client import DaemonPlane, DaemonUnavailable
from gradlane.transport.daemon.config import DaemonConfig
from gradlane.transport.daemon.server import Daemon, DaemonError
from gradlane.transport.daemon.shm import Segment
from gradlane.transport.wire.header import DType

from tests.support.checks import check_pinned_goes_in_class_0

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT_S = 60.0
#: A descriptor number no test process holds (far above any soft RLIMIT_NOFILE).
NO_FD = 0x7FFFFFFF


class Host:
    """One host's sockets, daemons and clients for a test; :meth:`cleanup` removes them all."""

    def __init__(self) -> None:
        self.job = 200_000 + os.getpid() % 100_000
        self.dir = tempfile.mkdtemp(prefix="gl-ipc-")
        self.socket = os.path.join(self.dir, "d.sock")
        self.daemons: list[Daemon] = []
        self.clients: list[DaemonPlane] = []
        self.procs: list[subprocess.Popen[str]] = []

    def config(self, **kw: Any) -> DaemonConfig:
        loss = LossConfig(hard_deadline_s=kw.pop("hard", 10.0))
        return DaemonConfig(job=self.job, socket=self.socket, metrics="", local_world=2,
                            transport=loopback_config(n_paths=1, loss=loss), **kw)  # fmt: skip

    def daemon(self, **kw: Any) -> Daemon:
        d = Daemon(self.config(**kw))
        self.daemons.append(d)
        return d.start()

    def client(self, local_rank: int, start: bool = True, **kw: Any) -> DaemonPlane:
        c = DaemonPlane(self.socket, job=self.job, rank=local_rank, world=2,
                         local_rank=local_rank, local_world=2, **kw)  # fmt: skip
        self.clients.append(c)
        return c.start() if start else c

    def process(self, *extra: str, socket: str = "", wait: bool = True) -> subprocess.Popen[str]:
        """A ``gradlane daemon`` process (on this host's socket, 2 local ranks, unless ``extra``
        flags say otherwise); with ``wait``, returns once it says it is ready."""
        cmd = [sys.executable, "-m", "gradlane.integrations.cli.main", "daemon", "--job",
        str(self.job),
               "--socket", socket or self.socket, "--local-world", "2", "--metrics", "",
               "--log-level", "WARNING", *extra]  # fmt: skip
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
        self.procs.append(p)
        if wait:
            self.ready(p)
        return p

    @staticmethod
    def ready(p: subprocess.Popen[str], needle: str = "gradlane daemon: ready") -> None:
        """Wait (bounded) for the process's first line, which must hold ``needle`` (the
        daemon's ready line by default)."""
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], WAIT_S)
        line = p.stdout.readline() if ready else ""
        assert needle in line, line

    def leftovers(self) -> list[str]:
        """Files left in /dev/shm under this job's name (segments are memfds: never any) and
        in the socket directory."""
        return glob.glob(f"/dev/shm/gradlane-{self.job}-*") + os.listdir(self.dir)

    def cleanup(self) -> None:
        for c in self.clients:
            c.close()
        for d in self.daemons:
            d.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()
        for path in glob.glob(f"/dev/shm/gradlane-{self.job}-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def host() -> Iterator[Host]:
    h = Host()
    try:
        yield h
    finally:
        h.cleanup()


def _pair_step(clients: list[DaemonPlane], step: int, n: int = 1000) -> list[np.ndarray]:
    xs = [np.arange(n, dtype=np.float32) * (i + 1) for i in range(len(clients))]
    futs = [c.submit(step, 0, x.copy()) for c, x in zip(clients, xs, strict=True)]
    out = [f.result(WAIT_S)[0] for f in futs]
    for r in out:
        np.testing.assert_array_equal(r, sum(xs))
    return out


def test_no_daemon_is_a_clear_error(host: Host):
    with pytest.raises(DaemonUnavailable, match=r"no gradlane daemon at ipc://.*gradlane daemon"):
        host.client(0, connect_timeout_s=0.3)


def test_trainers_may_start_before_the_daemon(host: Host):
    """Trainers whose connect timeout is shorter than the daemon's start (its first start on
    a fresh install compiles the kernels for about a minute) keep waiting while it lives."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(host.client, r, connect_timeout_s=1.0, start_wait_s=600.0) for r in (0, 1)
        ]
        host.daemon()
        clients = [f.result(700.0) for f in starting]
    _pair_step(clients, 0)


def test_a_live_daemon_that_never_answers_is_named_after_the_start_wait(host: Host):
    # A process (this one) holds the socket's lock file, as a starting daemon does, but
    # nothing serves the socket.
    with open(ipc.lock_path(host.socket), "w") as f:
        f.write(f"{os.getpid()}\n")
    with pytest.raises(DaemonUnavailable, match=rf"daemon \(pid {os.getpid()}\) .* did not answer"):
        host.client(0, connect_timeout_s=0.2, start_wait_s=0.5)


def test_a_stale_lock_of_a_dead_daemon_is_not_waited_for(host: Host):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    with open(ipc.lock_path(host.socket), "w") as f:
        f.write(f"{gone.pid}\n")
    # A live pid would make the client wait the full start_wait_s (and the test time out).
    with pytest.raises(DaemonUnavailable, match="no gradlane daemon at ipc://"):
        host.client(0, connect_timeout_s=0.2, start_wait_s=600.0)


def test_second_daemon_on_the_same_socket_is_refused(host: Host):
    host.daemon()
    assert os.stat(host.socket).st_mode & 0o777 == 0o600  # only this user may connect
    with pytest.raises(DaemonError, match="already serves"):
        host.daemon()
    _pair_step([host.client(0), host.client(1)], 0)  # the first one keeps serving


@pytest.mark.skipif(os.geteuid() != 0, reason="a daemon of another user needs root to start")
def test_a_daemon_that_cannot_reach_the_trainers_descriptors_refuses_its_hello(host: Host):
    """A daemon of another user (it drops to nobody once it serves) cannot open /proc/<pid>/fd
    of this trainer: the HELLO is refused and the trainer's start says what is needed."""
    code = (
        "import os, sys\n"
        "from gradlane.transport.config import loopback_config\n"
        "from gradlane.transport.daemon.config import DaemonConfig\n"
        "from gradlane.transport.daemon.server import Daemon\n"
        f"cfg = DaemonConfig(job={host.job}, socket={host.socket!r}, metrics='', local_world=2,\n"
        "                   transport=loopback_config(n_paths=1))\n"
        "d = Daemon(cfg).start()\n"
        "os.setgid(65534)\n"
        "os.setuid(65534)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    host.procs.append(p)
    host.ready(p, "ready")
    with pytest.raises(DaemonUnavailable) as info:
        host.client(0)
    text = str(info.value)
    assert "segment_access" in text and f"trainer pid {os.getpid()}" in text, text
    assert "run the daemon as the trainers' user" in text, text
    assert p.poll() is None  # it refused one trainer and serves on


def test_bad_submissions_fail_clearly_and_the_daemon_keeps_serving(host: Host):
    d = host.daemon(max_segment_bytes=1 << 20)
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    seg = None
    try:
        s.connect(f"ipc://{host.socket}")

        def ask(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
            s.send_multipart(ipc.encode(kind, **fields))
            assert s.poll(int(WAIT_S * 1000)), f"no answer to {kind}"
            return ipc.decode(s.recv_multipart())

        kind, welcome = ask("HELLO", job=host.job, rank=0, world=2, local_rank=0, local_world=2,
                            pid=os.getpid())  # fmt: skip
        assert kind == "WELCOME"
        gen, prefix = welcome["generation"], welcome["prefix"]
        sub = {"generation": gen, "step": 0, "bucket": 0, "shm": f"{prefix}b0.0-9",
               "fd": NO_FD, "offset": 0, "numel": 16, "dtype": 0, "layer_position": 0.0,
               "pinned": False}  # fmt: skip
        cases = [
            ({}, f"descriptor {NO_FD} of trainer pid {os.getpid()} does not exist"),
            ({"shm": "gradlane-someone-else"}, "is not local rank 0's"),
            ({"generation": gen + 1}, "restarted"),
            ({"numel": 1 << 20}, "max_segment_bytes"),
        ]
        for change, needle in cases:
            kind, msg = ask("SUBMIT", **{**sub, **change})
            assert kind == "FAIL" and needle in msg["error"], (change, msg)
        rejected = d.stats()["rejected"]
        assert rejected["bad_segment"] == 2 and rejected["stale_generation"] == 1
        assert rejected["oversized"] == 1
        # A good submission from the same trainer still goes through (its partner joins).
        seg = Segment.create(f"{prefix}b0.0-1", 64)
        seg.array(np.float32, 16)[:] = 1.0
        partner = host.client(1)
        fut = partner.submit(0, 0, np.full(16, 2.0, dtype=np.float32))
        kind, msg = ask("SUBMIT", **{**sub, "shm": seg.name, "fd": seg.fd})
        assert kind == "DONE", msg
        assert (seg.array(np.float32, 16) == 3.0).all()
        assert (fut.result(WAIT_S)[0] == 3.0).all()
    finally:
        s.close(0)
        if seg is not None:
            seg.close()


def test_dead_trainer_slot_times_out_and_is_freed(host: Host):
    host.daemon(slot_timeout_s=0.5)
    a, b = host.client(0), host.client(1)
    lonely = a.submit(0, 0, np.ones(100, dtype=np.float32))
    with pytest.raises(Exception, match=r"local rank\(s\) \[1\].*did not submit step 0 bucket 0"):
        lonely.result(WAIT_S)
    _pair_step([a, b], 1)  # the slot was freed: the next step works


def test_sigterm_drain_fails_what_is_filling_and_removes_everything(host: Host):
    d = host.daemon()
    a, b = host.client(0), host.client(1)
    _pair_step([a, b], 0)
    filling = a.submit(1, 0, np.ones(100, dtype=np.float32))
    d.stop()  # what SIGTERM does
    assert d.wait(WAIT_S)
    with pytest.raises(Exception, match=r"shutting down|disconnected"):
        filling.result(WAIT_S)
    assert host.leftovers() == []


def _mapped(pid: int, marker: str) -> list[str]:
    """The memfd segments process ``pid`` maps whose name holds ``marker``."""
    with open(f"/proc/{pid}/maps") as f:
        return [line.split()[-2] for line in f if "/memfd:" in line and marker in line]


def _until(what: str, done: Callable[[], bool]) -> None:
    """Wait, bounded, for ``done()``: the daemon drops mappings on its own loop's schedule."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_daemon_unmaps_a_trainers_segments_when_it_leaves_or_dies(host: Host):
    """Nothing outlives a trainer: the daemon's mappings of its memfds go with its BYE, or
    (kill -9) within a second or so of its death; nothing is ever named in /dev/shm."""
    p = host.process()
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from gradlane.transport.daemon.client import DaemonPlane\n"
        f"c = DaemonPlane({host.socket!r}, job={host.job}, rank=1, world=2, local_rank=1,\n"
        "                local_world=2).start()\n"
        "r = c.submit(0, 0, np.arange(1000, dtype=np.float32) * 2).result(60)[0]\n"
        "print('summed', float(r[1]), flush=True)\n"
        "sys.stdin.read()\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    host.procs.append(trainer)
    here = host.client(0)
    x = np.arange(1000, dtype=np.float32)
    assert (here.submit(0, 0, x).result(WAIT_S)[0] == 3 * x).all()
    host.ready(trainer, "summed 3.0")
    prefix = f"/memfd:gradlane-{host.job}-"
    assert _mapped(p.pid, "-l0-") and _mapped(p.pid, "-l1-"), _mapped(p.pid, prefix)
    here.close()  # BYE
    _until("local rank 0's segments stay mapped after its BYE", lambda: not _mapped(p.pid, "-l0-"))
    trainer.kill()
    trainer.wait(WAIT_S)
    _until("a dead trainer's segments stay mapped", lambda: not _mapped(p.pid, prefix))
    assert p.poll() is None and glob.glob(f"/dev/shm/gradlane-{host.job}-*") == []


def test_restarted_daemon_fails_in_flight_steps_then_serves_the_next(host: Host):
    first = host.process()
    a, b = host.client(0), host.client(1)
    _pair_step([a, b], 0)
    gen = a.generation
    in_flight = a.submit(1, 0, np.ones(100, dtype=np.float32))  # b holds back: a slot fills
    first.kill()
    first.wait(30)
    with pytest.raises(Exception, match=r"disconnected .* crashed"):
        in_flight.result(WAIT_S)
    host.process()  # the stale socket and lock of the killed one are taken over
    _pair_step([a, b], 2)  # submissions wait for the new daemon's WELCOME, then go through
    assert a.generation != gen and a.generation == b.generation


def test_two_daemons_meet_in_a_tcpstore(host: Host):
    port = _free_port("127.0.0.1")
    sockets = [os.path.join(host.dir, f"h{h}.sock") for h in range(2)]
    # Host 1 first: it waits for host 0, which serves the store.
    procs = [
        host.process("--hosts", "2", "--host-rank", str(h), "--local-world", "1",
                     "--path", f"127.0.0.{h + 1}", "--rendezvous", "store",
                     "--store", f"127.0.0.1:{port}", socket=sockets[h], wait=False)
        for h in (1, 0)
    ]  # fmt: skip
    for p in procs:
        host.ready(p)
    clients = []
    for h in range(2):
        c = DaemonPlane(sockets[h], job=host.job, rank=h, world=2, local_rank=0, local_world=1)
        host.clients.append(c)
        clients.append(c.start())
    _pair_step(clients, 0)
    # A pinned bucket reaches the daemons' engines: every chunk goes in class 0.
    xs = [np.random.default_rng(h).standard_normal(100_000).astype(np.float32) for h in range(2)]
    check_pinned_goes_in_class_0(clients, xs, WAIT_S)
    for p in procs:
        p.send_signal(signal.SIGTERM)
        assert p.wait(WAIT_S) == 0
    assert host.leftovers() == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_buckets_are_summed_in_float32_and_rounded_once(host: Host, dtype: str):
    host.daemon()
    a, b = host.client(0), host.client(1)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(5000).astype(np.float32) for _ in range(2)]
    if dtype == "float16":
        words, wire = [x.astype(np.float16) for x in xs], None
        ref = (words[0].astype(np.float32) + words[1].astype(np.float32)).astype(np.float16)
    else:
        words = [(x.view(np.uint32) >> 16).astype(np.uint16) for x in xs]
        wire = DType.BF16
        total = sum((w.astype(np.uint32) << 16).view(np.float32) for w in words)
        ref = np.empty(5000, dtype=np.uint16)
        from_f32(total, DType.BF16, ref)
    futs = [c.submit(0, 0, w.copy(), dtype=wire) for c, w in zip((a, b), words, strict=True)]
    for f in futs:
        result, _ = f.result(WAIT_S)
        assert result.dtype == words[0].dtype
        np.testing.assert_array_equal(result, ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_scale_is_applied_as_the_sum_is_copied_out(host: Host, dtype: type):
    host.daemon()
    a, b = host.client(0), host.client(1)
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(5000).astype(dtype) for _ in range(2)]
    outs = [np.empty_like(x) for x in xs]
    futs = [c.submit(0, 0, x, out=o, scale=0.5) for c, x, o in zip((a, b), xs, outs, strict=True)]
    expect = (xs[0].astype(np.float64) + xs[1].astype(np.float64)) * 0.5
    tol = 1e-6 if dtype == np.float32 else 2e-3
    for f, o in zip(futs, outs, strict=True):
        result, _ = f.result(WAIT_S)
        assert result is o
        np.testing.assert_allclose(o.astype(np.float64), expect, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="finite"):
        a.submit(1, 0, xs[0], scale=float("nan")).result(WAIT_S)


def test_a_hung_daemon_fails_submissions_at_the_request_timeout(host: Host):
    p = host.process()
    a = host.client(0, request_timeout_s=0.5)
    b = host.client(1, request_timeout_s=0.5)
    _pair_step([a, b], 0)
    p.send_signal(signal.SIGSTOP)
    try:
        futs = [c.submit(1, 0, np.ones(10, dtype=np.float32)) for c in (a, b)]
        for f in futs:
            with pytest.raises(Exception, match=r"did not answer step 1 bucket 0 within 0.5s"):
                f.result(WAIT_S)
    finally:
        p.send_signal(signal.SIGCONT)
    _pair_step([a, b], 2)  # once it runs again, fresh segments carry the next step


def test_a_new_trainer_session_counts_steps_from_zero_again(host: Host):
    """Two daemons (hosts) that outlive a job: the next job's steps start at 0 again, far
    behind the newest step their engines saw (the window is 4 steps here)."""
    ports = [_free_port(f"127.0.0.{h + 1}", socket.SOCK_DGRAM) for h in range(2)]
    paths = [f"127.0.0.{h + 1}:{p}" for h, p in enumerate(ports)]
    sockets = [os.path.join(host.dir, f"h{h}.sock") for h in range(2)]
    for h in range(2):
        cfg = DaemonConfig(
            job=host.job,
            host_rank=h,
            hosts=2,
            socket=sockets[h],
            paths=(paths[h],),
            peers=((paths[0],), (paths[1],)),
            local_world=1,
            metrics="",
            transport=loopback_config(n_paths=1, step_window=4),
        )
        host.daemons.append(Daemon(cfg).start())

    def session(steps: range) -> None:
        clients = [DaemonPlane(sockets[h], job=host.job, rank=h, world=2, local_rank=0,
                                local_world=1).start() for h in range(2)]  # fmt: skip
        try:
            for step in steps:
                xs = [np.full(64, h + 1.0, dtype=np.float32) for h in range(2)]
                futs = [c.submit(step, 0, x) for c, x in zip(clients, xs, strict=True)]
                for f in futs:
                    assert (f.result(WAIT_S)[0] == 3.0).all()
        finally:
            for c in clients:
                c.close()

    session(range(12))
    session(range(3))  # a new job on the same daemons


def test_metrics_endpoint_serves_this_daemons_registry_and_frees_its_port(host: Host):
    """Port 0 is resolved to the bound port; each daemon has its own registry (two in one
    process: no clash); closing the daemon stops the endpoint and frees the port."""
    cfg = dataclasses.replace(host.config(), metrics="127.0.0.1:0")
    d = Daemon(cfg)
    host.daemons.append(d)
    other = Daemon(dataclasses.replace(cfg, socket=os.path.join(host.dir, "other.sock")))
    host.daemons.append(other)
    d.start()
    other.start()
    url = d.metrics_url
    assert url is not None and not url.endswith(":0/metrics") and url != other.metrics_url
    _pair_step([host.client(0), host.client(1)], 0)

    def value(u: str, name: str, **labels: str) -> float | None:
        got = [v for n, lb, v in samples(fetch(u)) if n == name and lb == labels]
        return got[0] if got else None

    assert value(url, "gradlane_collectives_total", outcome="ok") == 1.0
    assert value(url, "gradlane_local_ranks") == 2.0
    assert value(url, "gradlane_generation") == d.generation
    assert value(url, "gradlane_step_latency_seconds_count") == 1.0
    assert other.metrics_url is not None
    assert value(other.metrics_url, "gradlane_collectives_total", outcome="ok") is None
    d.close()
    with pytest.raises(GradlaneError, match="no gradlane metrics at"):
        fetch(url, timeout_s=5.0)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:  # free again (a restarted daemon may take it)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as HTTP servers do
        s.bind(("127.0.0.1", port))
        s.listen()


def _free_port(host: str, kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
