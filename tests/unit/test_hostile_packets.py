"""Hostile control packets, in the cores wired in memory: a well-formed packet of any kind, in
any state, is handled or counted and dropped, never raised; early control packets for
transfers that never start are held within the early buffer and expire with no collective
running; a bitmap claiming more chunks than its transfer has is rejected before it is
unpacked, so the work a packet causes does not grow with the count it claims."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import AllReduceComplete, flat
from gradlane.transport.core.receiver import CONTROL_OVERHEAD, CONTROL_SHARE
from gradlane.transport.wire.header import BITMAP_KINDS, Kind, Phase

from tests.support.cores import make, random_datas
from tests.support.wire import Wire, forge

STEP = 1


def _forge(config: TransportConfig, kind: int, *, src: int, dst: int, **fields: int) -> bytes:
    """:func:`~tests.support.wire.forge` about step :data:`STEP` unless ``fields`` say another."""
    return forge(config, kind, src=src, dst=dst, **{"step": STEP, **fields})


def _every_kind(config: TransportConfig, src: int, dst: int) -> list[bytes]:
    """A HELLO about the running bucket, and one packet of every Kind value about bucket 5, which
    never runs (DATA for it is held as early data and expires)."""
    out = [_forge(config, Kind.HELLO, src=src, dst=dst, bucket=0)]
    for kind in Kind:
        count = 1 if kind == Kind.DATA or kind in BITMAP_KINDS else 0
        out.append(_forge(config, kind, src=src, dst=dst, bucket=5, shard=dst, count=count))
    return out


def _run(eps: list[TransposeAllReduce], datas: list[np.ndarray], wire: Wire) -> dict:
    for r, ep in enumerate(eps):
        ep.start(STEP, 0, datas[r], layer_position=0.5, now=wire.now)
    wire.run(lambda: sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == len(eps))
    return {r: e for r, _, e in wire.events}


@pytest.mark.parametrize("secret", [None, "the job's secret"])
def test_a_packet_of_any_kind_never_fails_a_collective(secret):
    """A HELLO (the control plane's kind) on the data plane, correctly signed when the job has
    a secret, and one packet of every other kind, land on both ranks while they reduce: each
    is counted (HELLO as an unexpected kind), and both collectives complete exactly."""
    eps = make(2, secret=secret)
    datas = random_datas(2, 3000, seed=4)
    wire = Wire(eps)
    for dst in range(2):
        for i, packet in enumerate(_every_kind(eps[dst].config, src=1 - dst, dst=dst)):
            wire.inject(dst, packet, delay=20e-6 * (i + 1))  # amid the reduce phase
    out = _run(eps, datas, wire)
    for r in range(2):
        np.testing.assert_array_equal(out[r].result, datas[0] + datas[1])
        assert not out[r].report.degraded
        assert eps[r].stats()["rejected"].get("unexpected_kind") == 1


def test_every_kind_in_an_idle_endpoint_is_handled_or_counted():
    """With nothing running (no transfer in either direction), every kind is taken or counted:
    nothing raises, and what is not taken is under a reject reason in stats()."""
    ep = make(2)[0]
    packets = [
        _forge(ep.config, k, src=1, dst=0, count=1 if k in BITMAP_KINDS else 0) for k in Kind
    ]
    for packet in packets:
        ep.receive_datagram(packet, 0, 0.0)
    flat(ep.datagrams_to_send(0.0))
    stats = ep.stats()
    assert stats["rejected"].get("unexpected_kind") == 1  # HELLO
    # Every control packet is counted; the DATA one is held as early data (counted when a
    # transfer replays it, or expired).
    assert stats["accepted"] + sum(stats["rejected"].values()) == len(packets) - 1
    assert ep.endpoint.receiver.early


def test_forged_early_control_is_held_within_the_budget_and_expires_with_nothing_running():
    """MANIFEST and FIN for transfers that never start (a flood of forged keys) take no more
    than their share of ``early_buffer_bytes``; the rest is dropped and counted, and what was
    held is released once the expiry time passes, by the endpoint's own timer with no
    collective running."""
    budget = 1 << 20
    eps = make(2, chunk_bytes=8192, early_buffer_bytes=budget)
    rx, ep = eps[1].endpoint.receiver, eps[1]
    n, bits = 400, 8 * 6000  # 400 packets of a 6000-byte bitmap, each a different transfer
    for i in range(n):
        kind = Kind.MANIFEST if i % 2 else Kind.FIN
        ep.receive_datagram(
            _forge(ep.config, kind, src=0, dst=1, bucket=100 + i, shard=1, count=bits), 0, 0.0
        )
    flat(ep.datagrams_to_send(0.0))
    charge = 6000 + 48 + CONTROL_OVERHEAD
    held = sum(len(v) for v in rx.early_control.values())
    assert held == budget // CONTROL_SHARE // charge
    assert rx.early_control_bytes == held * charge <= budget // CONTROL_SHARE
    assert rx.early_bytes + rx.early_control_bytes <= budget
    assert ep.stats()["early_control_dropped"] == n - held
    # Nothing runs, yet the endpoint asks to be woken when the held packets expire...
    limit = max(ep.config.loss.hard_deadline_s, ep.config.linger_s)
    assert ep.get_timer() == pytest.approx(limit)
    wire = Wire([ep])
    wire.run(lambda: not rx.early_control, max_time=2 * limit)
    # ...and then nothing is held.
    assert rx.early_control_bytes == 0 and rx.early_bytes == 0
    assert wire.now == pytest.approx(limit)


def test_a_legitimate_early_manifest_still_reaches_its_transfer():
    """Early control within the budget keeps working: rank 1 holds rank 0's MANIFEST (and data)
    until it starts, and the collective completes exactly with nothing held afterwards."""
    eps = make(2, loss=LossConfig(loss_bound=0.05))  # a lossy phase: its sender's MANIFEST
    datas = random_datas(2, 3000, seed=9)
    eps[0].start(STEP, 0, datas[0], layer_position=0.5, now=0.0)
    for dg in flat(eps[0].datagrams_to_send(0.0)):
        eps[1].receive_datagram(dg.wire(), dg.path, 0.0)
    flat(eps[1].datagrams_to_send(0.0))
    rx = eps[1].endpoint.receiver
    assert rx.early_control and rx.early_control_bytes > 0
    eps[1].start(STEP, 0, datas[1], layer_position=0.5, now=0.0)
    wire = Wire(eps)
    wire.run(lambda: sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == 2)
    for _, _, e in wire.events:
        np.testing.assert_array_equal(e.result, datas[0] + datas[1])
    assert rx.early_control == {} and rx.early_control_bytes == 0


@pytest.fixture
def unpacked(monkeypatch) -> list[int]:
    """The number of bits of every bitmap unpacked (``np.unpackbits``' count) while it is on."""
    counts: list[int] = []
    real = np.unpackbits

    def spy(a, *args, **kwargs):
        counts.append(int(kwargs.get("count", -1)))
        return real(a, *args, **kwargs)

    monkeypatch.setattr(np, "unpackbits", spy)
    return counts


@pytest.mark.parametrize("kind", [Kind.ACK, Kind.NACK])
def test_a_sender_rejects_a_bitmap_beyond_its_transfer_before_unpacking_it(kind, unpacked):
    """ACK/NACK bitmaps claiming 480,000 chunks of a transfer that has a handful are counted
    (``bitmap_range``) and dropped without unpacking a bit: nothing is acknowledged or resent
    and the work per packet does not grow with the count claimed."""
    eps = make(2, chunk_bytes=65000)
    ep = eps[0]
    ep.start(STEP, 0, np.ones(100_000, np.float32), layer_position=0.5, now=0.0)
    flat(ep.datagrams_to_send(0.0))
    key = next(k for k in ep.endpoint.sender.transfers if k.dst == 1)
    n_chunks = ep.endpoint.sender.n_chunks(key)
    assert n_chunks is not None and 0 < n_chunks < 10
    claimed = 8 * 60_000
    f = {"step": key.step, "bucket": key.bucket, "shard": key.shard, "phase": key.phase}
    for base in (0, n_chunks - 1, 1 << 31):
        ep.receive_datagram(
            _forge(ep.config, kind, src=1, dst=0, chunk=base, count=claimed, **f), 0, 0.001
        )
    # One bit past the end, from a chunk inside the transfer, is as much out of range.
    ep.receive_datagram(
        _forge(ep.config, kind, src=1, dst=0, chunk=1, count=n_chunks, **f), 0, 0.001
    )
    flat(ep.datagrams_to_send(0.001))
    assert ep.stats()["rejected"] == {"bitmap_range": 4}
    assert max(unpacked, default=0) <= n_chunks
    assert ep.owed() == {(STEP, 0)}  # nothing acknowledged: the transfer still runs


@pytest.mark.parametrize("kind", [Kind.MANIFEST, Kind.FIN])
def test_a_receiver_rejects_a_bitmap_beyond_its_transfer_before_unpacking_it(kind, unpacked):
    """MANIFEST/FIN for a running incoming transfer claiming more chunks than it has are
    counted (``bitmap_range``) and dropped without unpacking; the collective completes
    exactly (a FIN taken would have given chunks up)."""
    eps = make(2)
    datas = random_datas(2, 3000, seed=12)
    wire = Wire(eps)
    claimed = 8 * 200
    for i in range(20):
        forged = _forge(
            eps[1].config, kind, src=0, dst=1, shard=1, phase=Phase.REDUCE, count=claimed
        )
        wire.inject(1, forged, delay=1e-6 * (i + 1))  # before it completes
    out = _run(eps, datas, wire)
    for r in range(2):
        np.testing.assert_array_equal(out[r].result, datas[0] + datas[1])
    assert eps[1].stats()["rejected"].get("bitmap_range") == 20
    n_chunks = -(-1500 * 4 // 256)
    assert claimed > n_chunks and max(unpacked, default=0) <= n_chunks
