"""Rank processes for the multi-process tests (importable by ``spawn`` children).

Each rank binds its UDP paths on loopback (port 0), sends the bound addresses to the parent on
``up``, receives the whole table on its own ``down`` queue, all-reduces one bucket, reports back
on ``up`` and closes its engine at once (the close drains what peers still need). Nothing
sleeps: every hand-off is a queue ``get`` with a timeout, so a lost peer is a test failure,
never a hang. Exceptions are reported as plain tuples because gradlane's errors carry keyword
state that does not survive pickling.
"""

from __future__ import annotations

import socket
import time
import traceback
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.drivers.peers import StaticPeers
from gradlane.transport.drivers.udp.plane import UdpPlane
from gradlane.transport.errors import PeerTimeout

#: Longest any rank waits for a queue hand-off or a Future.
WAIT_S = 120.0
N_PATHS = 2


def config(hard_deadline_s: float = 30.0) -> TransportConfig:
    """Two loopback paths, 65000-byte chunks, exact all-reduce, fail at the hard deadline."""
    soft = min(0.5, hard_deadline_s)
    return TransportConfig(
        n_paths=N_PATHS,
        chunk_bytes=65000,
        loss=LossConfig(
            loss_bound=0.0,
            hard_deadline_s=hard_deadline_s,
            soft_deadline_max_s=soft,
            on_hard_deadline="raise",
        ),
    )


def rank_input(seed: int, rank: int, n: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s bucket: seeded, so the parent can rebuild every input for the reference."""
    x = np.random.default_rng([seed, rank]).standard_normal(n).astype(np.float32)
    return x.astype(np.dtype(dtype))


def run_rank(
    rank: int,
    world: int,
    n: int,
    dtype: str,
    seed: int,
    hard_deadline_s: float,
    up: Queue,
    down: Queue,
) -> None:
    """A live rank: start the engine, exchange addresses, all-reduce step 1 bucket 0, report.

    Reports ``("ok", rank, result, delivered_fraction, degraded)`` or
    ``("error", rank, type_name, failed_ranks, message, elapsed_s)``.
    """
    try:
        with UdpPlane(rank, world, config(hard_deadline_s)) as engine:
            up.put(("addrs", rank, engine.bound))
            table = down.get(timeout=WAIT_S)
            engine.set_peers(StaticPeers(table))
            data = rank_input(seed, rank, n, dtype)
            t0 = time.monotonic()
            fut = engine.submit(1, 0, data)
            try:
                result, report = fut.result(WAIT_S)
            except PeerTimeout as e:
                up.put(("error", rank, "PeerTimeout", e.ranks, str(e), time.monotonic() - t0))
            else:
                up.put(("ok", rank, result, report.delivered_fraction, report.degraded))
            # Close at once, as a job's last step does: a Future resolves once this rank has
            # received everything, not once peers have what it sent; UdpPlane.close() drains
            # those outgoing transfers, so no peer is stranded waiting for a retransmission.
    except BaseException as e:  # report, then let the process exit non-zero
        up.put(("error", rank, type(e).__name__, (), traceback.format_exc(), -1.0))
        raise


def run_dead_rank(rank: int, up: Queue) -> None:
    """A rank that publishes addresses and exits without ever starting an engine.

    The sockets close when the process exits, so the live ranks' packets to it are refused
    (ICMP port unreachable on loopback) and nothing ever answers.
    """
    addrs: list[Any] = []
    for p in range(N_PATHS):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((f"127.0.0.{1 + p}", 0))
        addrs.append(s.getsockname())
    up.put(("addrs", rank, addrs))
