"""Hostile datagrams sent to an engine's UDP port on loopback while collectives run: a HELLO
(the control plane's kind) and one well-formed datagram of every Kind, with a valid tag (signed
with the job's key when it has a secret), plus ACK/NACK bitmaps claiming far more chunks than
the transfer has. Each is counted or handled; every collective still completes exactly.

Every engine is closed by the fixture, every wait is a Future with a timeout, and every test
has a pytest timeout, so a hang is a failure, never a stuck run.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
from gradlane.transport.config import TransportConfig
from gradlane.transport.drivers.peers import StaticPeers
from gradlane.transport.drivers.udp.plane import UdpPlane
from gradlane.transport.wire.header import BITMAP_KINDS, DType, Header, Kind, Phase, encode
from gradlane.transport.wire.tag import TagKey

from tests.support.wire import forge

WAIT_S = 60.0
BITS = 8 * 60_000  # a bitmap claiming 480,000 chunks, in one 60 KB datagram


def _hostile(config: TransportConfig, step: int) -> list[bytes]:
    """A HELLO about the running collective; one datagram of every Kind about bucket 5, which
    never runs; ACK and NACK about rank 0's running reduce-phase shard to rank 1 whose bitmaps
    claim far more chunks than it has."""
    out = [forge(config, Kind.HELLO, step=step)]
    for kind in Kind:
        count = 1 if kind == Kind.DATA or kind in BITMAP_KINDS else 0
        out.append(forge(config, kind, step=step, bucket=5, count=count))
    running = {"step": step, "bucket": 0, "shard": 1, "phase": Phase.REDUCE}
    out += [forge(config, k, count=BITS, **running) for k in (Kind.ACK, Kind.NACK)]
    return out


def _wait_counted(engine: UdpPlane, reason: str, count: int) -> None:
    """Until ``engine`` has counted ``count`` datagrams as ``reason`` (fails after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while engine.stats()["rejected"].get(reason, 0) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{reason} never reached {count}: {engine.stats()['rejected']}")


@pytest.fixture
def pair(request) -> Iterator[list[UdpPlane]]:
    """Two started, connected engines on loopback (``request.param``: the job's secret)."""
    cfg = TransportConfig(chunk_bytes=65000, secret=request.param)
    engines = [UdpPlane(r, 2, cfg) for r in range(2)]
    try:
        rdv = StaticPeers({r: e.start() for r, e in enumerate(engines)})
        for e in engines:
            e.set_peers(rdv)
        yield engines
    finally:
        for e in engines:
            e.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pair", [None, "the job's secret"], indirect=True)
def test_hostile_datagrams_never_fail_a_collective(pair: list[UdpPlane]):
    e0, e1 = pair
    cfg = e0.config
    rng = np.random.default_rng(3)
    n = 300_000  # about 10 chunks per shard
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for step in (1, 2, 3):
            data = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
            f0 = e0.submit(step, 0, data[0])
            # Rank 0 runs (its share sent, waiting for rank 1's) when the datagrams land: stats
            # runs on the engine's loop after the submit did.
            assert e0.stats()["in_flight"] == 1
            for packet in _hostile(cfg, step):
                for addr in e0.bound:
                    s.sendto(packet, addr)
            # Rank 0 has judged them all before rank 1 starts: its reduce transfer is still
            # running then (rank 1's gather would end it), as the bitmaps' count assumes.
            _wait_counted(e0, "bitmap_range", 2 * step * len(e0.bound))
            f1 = e1.submit(step, 0, data[1])
            for res, rep in (f0.result(WAIT_S), f1.result(WAIT_S)):
                np.testing.assert_array_equal(res, data[0] + data[1])
                assert not rep.degraded
    rejected = e0.stats()["rejected"]
    sent = 3 * len(e0.bound)
    assert rejected.get("unexpected_kind", 0) == 2 * sent  # each HELLO, twice: HELLO and Kind
    assert rejected.get("bitmap_range", 0) == 2 * sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pair", [None, "the job's secret"], indirect=True)
def test_forged_nan_data_is_flagged_without_a_secret_and_rejected_with_one(pair: list[UdpPlane]):
    """DATA forged as rank 1's first chunk of rank 0's shard, NaN payload, valid checksum:
    without a secret it is summed (the checksum is no defence) but every rank's report says
    the result holds non-finite chunks; with one it fails its tag and the sum is exact."""
    e0, e1 = pair
    cfg = e0.config
    n = 300_000
    count = cfg.chunk_elems(DType.F32)
    nan = np.full(count, np.nan, np.float32)
    head = Header(kind=Kind.DATA, job=cfg.job, step=1, bucket=0, shard=0, src=1, dst=0,
                  phase=Phase.REDUCE, dtype=DType.F32, chunk=0, count=count)  # fmt: skip
    forged = encode(head, nan, TagKey())  # the unkeyed checksum: anyone can compute it
    data = [np.ones(n, np.float32), np.full(n, 2.0, np.float32)]
    f0 = e0.submit(1, 0, data[0])
    assert e0.stats()["in_flight"] == 1
    assert cfg.n_paths == 1  # one socket: the forgery is queued before rank 1's first chunk
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(forged, e0.bound[0])
    f1 = e1.submit(1, 0, data[1])
    (r0, rep0), (r1, rep1) = f0.result(WAIT_S), f1.result(WAIT_S)
    if cfg.secret:
        np.testing.assert_array_equal(r0, np.full(n, 3.0, np.float32))
        assert rep0.nonfinite_chunks == rep1.nonfinite_chunks == 0
        assert e0.stats()["rejected"].get("bad_tag", 0) == 1
    else:
        assert np.isnan(r0[:count]).all() and np.array_equal(r0, r1, equal_nan=True)
        assert rep0.nonfinite_chunks == rep0.reduce.nonfinite_chunks == 1
        assert rep1.nonfinite_chunks == 1 and rep1.reduce.nonfinite_chunks == 0
