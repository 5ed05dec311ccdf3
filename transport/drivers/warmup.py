"""Compile the numba kernels before the first collective, one process per host at a time.

Theory of operation
-------------------
numba compiles a kernel at its first call, for the argument types of that call, and caches
the machine code on disk (``__pycache__`` beside the sources). A first compile inside a
collective stalls it for seconds while the peers' timers run. So the drivers (the UDP engine,
the ZeroMQ plane) call :func:`warm_up` before they serve. It runs a small two-rank all-reduce
in memory that takes every path a real collective takes, and the UDP adapter's table filler.
``tests/loopback/test_warm_up.py`` checks, in a fresh interpreter, that no real collective
compiles anything after it.

On a fresh install the compile takes about a minute of one core. Ranks of one host start
together (``torchrun``, the demo, the tests), and each would compile the same kernels side by
side, sharing the cores: slower than one compile. So the first process to arrive takes a
host-wide lock (``flock`` on a file in the temporary directory, named after this copy of the
package) and compiles; the others wait for it, bounded, then load what it cached (well under a
second), side by side. With a warm cache the first one only loads, and the others' wait is that
short: a wait says that another process is compiling (INFO) only once it lasts
:data:`QUIET_S`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator

import numpy as np
from gradlane.scheduling.loss import LossConfig, LossPolicy
from gradlane.scheduling.pacing import PacingConfig
from gradlane.scheduling.precision import PrecisionConfig
from gradlane.transport import kernels
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import AllReduceComplete, AllReduceFailed, flat
from gradlane.transport.drivers.udp import mmsg as _mmsg
from gradlane.transport.drivers.zmq import frames as zmq_batch
from gradlane.transport.kernels.batch import group_rows, pass_end_gaps
from gradlane.transport.wire.header import (
    N_REASONS,
    DType,
    Phase,
    SessionSpec,
    TransferSpec,
    header_fields,
)

try:
    import fcntl
except ImportError:  # not POSIX: every process compiles for itself
    fcntl = None  # type: ignore[assignment]

__all__ = ["QUIET_S", "WAIT_S", "lock_path", "warm_up"]

log = logging.getLogger(__name__)

#: Longest wait for another process's compile before compiling here anyway.
WAIT_S = 600.0
#: A wait for the lock this long means its holder compiles (loading a warm cache is shorter).
QUIET_S = 2.0
_POLL_S = 0.05

_warm: set[str] = set()  # what this process has compiled already


def warm_up(*, udp: bool = False, zmq: bool = False) -> None:
    """Compile (or load from numba's cache) every kernel a collective uses, off the clock.

    Once per process. The tag's mode is a run-time argument of the kernels, so the warm-up
    all-reduce compiles the keyed path too. ``udp`` adds the UDP adapter's ``sendmmsg`` table
    filler (where the batched calls exist); ``zmq`` the ZeroMQ plane's batch-frame split. On a
    host where another process is compiling them, waits for it first (see the module docstring).
    """
    todo = [name for name, wanted in (("all-reduce", True), ("udp", udp and _mmsg.AVAILABLE),
                                      ("zmq", zmq))
            if wanted and name not in _warm]  # fmt: skip
    if not todo:
        return
    with _compile_turn():
        for name in todo:
            {"all-reduce": _warm_all_reduce, "udp": _mmsg.warm_up,
             "zmq": zmq_batch.warm_up}[name]()  # fmt: skip
            _warm.add(name)


def lock_path() -> str:
    """The lock file of this copy of the package (its kernels share one numba cache)."""
    here = os.path.dirname(os.path.abspath(__file__))
    tag = hashlib.sha1(here.encode()).hexdigest()[:12]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"gradlane-warm-{uid}-{tag}.lock")


@contextlib.contextmanager
def _compile_turn(wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold the host's lock while warming up if it is free; else wait (at most ``wait_s``)
    until its holder is done, and warm up without it: the cache is then filled."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:  # no lock, no harm: only the compile time is at stake
        log.debug("no warm-up lock (%s): compiling without it", e)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.debug("another process on this host holds the warm-up lock; waiting")
            started = time.monotonic()
            said = False
            while True:  # polled, so that the wait is bounded
                time.sleep(_POLL_S)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    waited = time.monotonic() - started
                    if waited >= wait_s:
                        log.warning(
                            "waited %.1f s for another process's compile; compiling", waited
                        )
                        break
                    if not said and waited >= QUIET_S:
                        log.info(
                            "another process on this host is compiling gradlane's kernels; waiting"
                        )
                        said = True
                    continue
                fcntl.flock(fd, fcntl.LOCK_UN)  # its turn is over: load side by side
                break
        yield
    finally:
        os.close(fd)  # releases the lock if held


def _warm_all_reduce() -> None:
    # Two paths, a clock that moves and lost first transmissions: the exchange then runs what a
    # real collective runs beyond its first pass (path spraying, ACK scans, RACK and timeout
    # recovery, path ticks). Reliable mode only: bounded mode runs the same kernels with the
    # same types (the probe test's bounded collectives compile nothing more), so warming it too
    # would double the start-up for nothing. A kernel it misses compiles inside the first real
    # collective instead, stalling it for seconds with a cold cache while the peers' timers run
    # (tests/loopback/test_warm_up.py guards coverage).
    cfg = TransportConfig(
        n_paths=2,
        chunk_bytes=256,
        rotate=True,
        rotate_block=64,
        burst_packets=256,  # a whole transfer in one pass, so "the last one sent" is known
        pacing=PacingConfig(controller="fixed", initial_rate_Bps=1e10, burst_bytes=1 << 20),
    )
    x = np.linspace(-1.0, 1.0, 2000, dtype=np.float32)
    for dtype, data in (
        (None, x),
        (None, x.astype(np.float16)),
        (DType.BF16, np.arange(2000, dtype=np.uint16)),
    ):
        _warm_exchange(cfg, dtype, data)
    # Lossy wire formats (a precision policy): chunks in float32, bfloat16 and E4M3 at once,
    # encoded, reduced and placed; with a cold cache their first compile would otherwise land
    # in the first steps of a job that turns them on.
    mixed = PrecisionConfig(policy="adaptive", initial_level=1.5)
    _warm_exchange(dataclasses.replace(cfg, rotate=False, precision=mixed), None, x)
    _warm_receiver_checks()


def _warm_receiver_checks() -> None:
    # Receiver checks the exchange does not reach: the compiled loss decision runs only past a
    # soft deadline (0.5 s before any history), which its clock never reaches, and the pass-end
    # gaps only once a first pass's last datagram came (the exchange loses it). Called as the
    # receiver calls them, the decision past its deadline (its kernels then both run).
    policy = LossPolicy(LossConfig(loss_bound=0.1))
    received = np.zeros((2, 3), dtype=np.uint8)
    received[0, 0] = 1
    times = np.zeros(2, dtype=np.float64)
    gap = np.empty(2, dtype=bool)
    pass_end_gaps(received, np.arange(2), times, times, np.zeros(2, dtype=bool), 0.0, gap)
    policy.decide_rows(
        gather=False,
        received=received,
        counts=np.ones(3, dtype=np.int64),
        protected=np.zeros((2, 3), dtype=bool),
        known=np.ones(2, dtype=bool),
        started=0.0,
        now=1.0,
    )
    # A batch whose DATA belongs to several transfers (two buckets, or a peer's reduce and
    # gather data read together): the exchange's senders send a collective's reduce data
    # before its gather data, so its batches never mix them. Typed as the endpoint calls it.
    arena = np.zeros((2, 64), dtype=np.uint8)
    rows = np.arange(2, dtype=np.int64)
    group_rows(
        arena, rows, np.empty(2, np.int64), np.empty((2, 4), np.int64), np.empty(3, np.int64)
    )
    # The ordered reduce's flush of what a missing sender left staged: only a degraded
    # completion with three ranks or more calls it (the two-rank exchange orders nothing).
    spec = TransferSpec(0, 0, 0, Phase.REDUCE, DType.F32, 4, 2, 0, 3)
    plan = kernels.prepare_receive(
        SessionSpec(job=1, me=0, world=3), spec, np.zeros(4, dtype=np.float32),
        np.ones(2, dtype=np.uint16), np.zeros((3, 2), dtype=np.uint8),
        np.zeros(N_REASONS, dtype=np.int64), place=False, order=kernels.sum_order([1, 2], 3, 4, 2),
    )  # fmt: skip
    kernels.flush_order(plan)


def _warm_exchange(cfg: TransportConfig, dtype: int | None, data: np.ndarray) -> None:
    """Two ranks all-reduce ``data`` in memory; each first pass loses its second datagram (a
    later ACK exposes it: RACK) and its last (nothing follows it: the timeout and its probe)."""
    ranks = [TransposeAllReduce(r, 2, cfg) for r in range(2)]
    for r in ranks:
        r.start(0, 0, data, 0.5, 0.0, dtype=dtype)
    passed: set[tuple[int, int]] = set()  # (rank, phase) whose first pass went out
    done, now = 0, 0.0
    for _ in range(100_000):  # ~100 ms of clock finish it; the bound only guards a bug
        for me, r in enumerate(ranks):
            when = r.get_timer()
            if when is not None and when <= now:
                r.handle_timer(now)
            out = list(flat(r.datagrams_to_send(now)))
            data_at = [i for i, dg in enumerate(out) if dg.payload is not None]
            lose: set[int] = set()
            if data_at:
                phase = header_fields(np.frombuffer(out[data_at[0]].data, np.uint8)).phase
                if (me, phase) not in passed and len(data_at) > 2:
                    passed.add((me, phase))
                    lose = {data_at[1], data_at[-1]}
            for i, dg in enumerate(out):
                if i not in lose:
                    ranks[dg.peer].receive_datagram(dg.wire(), dg.path, now)
            while (ev := r.next_event()) is not None:
                done += isinstance(ev, AllReduceComplete | AllReduceFailed)
        if done == 2 and not any(r.owed() for r in ranks):
            break
        now += 1e-4
    if done != 2:  # a bug in the core: say so at start-up, not at the first collective
        raise RuntimeError(f"the warm-up all-reduce ({dtype or data.dtype}) did not complete")
