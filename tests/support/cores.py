"""Drivers for all-reduce cores wired in memory (:class:`tests.support.wire.Wire`).

``make`` builds one :class:`TransposeAllReduce` per rank, ``run_allreduce`` starts one
collective on every rank and runs the wire until each has completed or failed, and the
remaining helpers read or drop datagrams by their header. Everything is deterministic for a
seed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import AllReduceComplete, AllReduceFailed, Datagram
from gradlane.transport.wire.header import HEADER_DTYPE, HEADER_SIZE, Kind, Phase

from tests.support.wire import Wire

__all__ = [
    "header_of",
    "kind_of",
    "lose_first_transmission",
    "make",
    "random_datas",
    "run_allreduce",
]


def make(world: int, **cfg: Any) -> list[TransposeAllReduce]:
    """One all-reduce core per rank of ``world``; ``cfg`` overrides :class:`TransportConfig`
    fields (256-byte chunks unless given, so small buffers still span many packets)."""
    config = TransportConfig(**{"chunk_bytes": 256, **cfg})
    return [TransposeAllReduce(r, world, config) for r in range(world)]


def random_datas(world: int, n: int, seed: int) -> list[np.ndarray]:
    """One float32 buffer of ``n`` normal values per rank, seeded."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(world)]


def run_allreduce(
    eps: list[TransposeAllReduce],
    datas: list[np.ndarray],
    wire: Wire,
    *,
    step: int = 1,
    bucket: int = 0,
    dtype: Any = None,
    max_time: float = 30.0,
) -> dict[int, Any]:
    """Start ``(step, bucket)`` on every core with its rank's buffer and run ``wire`` until
    every rank has completed or failed it; each rank's last event for it, by rank."""
    for r, ep in enumerate(eps):
        ep.start(step, bucket, datas[r], layer_position=0.5, now=wire.now, dtype=dtype)

    def done() -> bool:
        return sum(
            isinstance(e, AllReduceComplete | AllReduceFailed)
            and (e.step, e.bucket) == (step, bucket)
            for _, _, e in wire.events
        ) == len(eps)

    wire.run(done, max_time=max_time)
    out = {}
    for r, _, e in wire.events:
        if e.step == step and e.bucket == bucket:
            out[r] = e
    return out


def header_of(dg: Datagram) -> np.void:
    """The decoded header record of a datagram (fields as in ``HEADER_DTYPE``)."""
    return np.frombuffer(bytes(dg.data[:HEADER_SIZE]), dtype=HEADER_DTYPE)[0]


def kind_of(dg: Datagram) -> int:
    """The packet kind of a datagram (a :class:`Kind` value)."""
    return int(header_of(dg)["kind"])


def lose_first_transmission(
    chunk: int,
) -> tuple[Callable[[int, Datagram, int], bool], list[int]]:
    """A Wire drop rule losing the first transmission of rank 0's reduce-phase ``chunk``, and
    the list of that chunk's transmissions so far (1, 2, ...)."""
    sent: list[int] = []

    def drop(src: int, dg: Datagram, q: int) -> bool:
        if src != 0 or kind_of(dg) != Kind.DATA:
            return False
        h = header_of(dg)
        if h["phase"] != Phase.REDUCE or h["chunk"] != chunk:
            return False
        sent.append(len(sent) + 1)
        return len(sent) == 1

    return drop, sent
