"""The batched UDP floor (``gradlane.bench.perf.udp_floor``): its compiled pass ``_apply_rows``
(which rows it adds, copies, skips, and keeps for the next repetition: a DDP hook's buckets follow
each other, so a peer may already send the next bucket's datagrams), and whole exchanges of two
ranks on loopback at several datagram sizes, with and without UDP GSO, and with GRO where the
datagrams are small enough for it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gradlane.bench.perf.udp_floor import (
    GRO_MAX_DATAGRAM,
    HDR,
    HDR_BYTES,
    _apply_rows,
    _exchange,
    _MmsgFloor,
    check_chunk_bytes,
    floor_socket,
)


def _rows(specs: list[tuple[int, int, int, np.ndarray]], width: int = 64) -> np.ndarray:
    rows = np.zeros((len(specs), HDR_BYTES + 4 * width), dtype=np.uint8)
    for i, (rep, phase, off, payload) in enumerate(specs):
        HDR.pack_into(rows[i], 0, rep, phase, off, payload.shape[0])
        rows[i, HDR_BYTES : HDR_BYTES + 4 * payload.shape[0]] = payload.view(np.uint8)
    return rows


@pytest.mark.parametrize("width", [4, 64, 2243])  # payload floats per row (2243: 8972 bytes)
def test_rows_are_added_copied_skipped_or_kept_for_the_next_repetition(width):
    one = np.ones(4, dtype=np.float32)
    rows = _rows(
        [
            (7, 0, 0, 2 * one),  # added into 0..3
            (7, 1, 8, 5 * one),  # copied into 8..11
            (8, 0, 4, one),  # next repetition: kept, not applied
            (6, 0, 4, one),  # an older one: dropped
            (7, 0, 4, one),  # wrong length (below): dropped
            (7, 2, 4, one),  # no such phase: dropped
            (7, 0, 14, one),  # past the buffer's end: dropped
        ],
        width,
    )
    lengths = np.full(rows.shape[0], HDR_BYTES + 16, dtype=np.int64)
    lengths[4] -= 4
    buf = np.ones(16, dtype=np.float32)
    got = np.zeros(2, dtype=np.int64)
    early = np.zeros(rows.shape[0], dtype=np.bool_)
    n = _apply_rows(rows.view(np.uint32), rows.view(np.float32), lengths, buf, 7, got, early)
    assert n == 1 and early.tolist() == [False, False, True, False, False, False, False]
    assert got.tolist() == [1, 1]
    want = np.ones(16, dtype=np.float32)
    want[0:4] = 3.0
    want[8:12] = 5.0
    np.testing.assert_array_equal(buf, want)


def _reference(data: list[np.ndarray]) -> np.ndarray:
    """The all-reduce in plain NumPy: the sum over ranks, rank by rank."""
    out = np.zeros_like(data[0])
    for d in data:
        out += d
    return out


def _two_ranks(chunk_bytes: int, run) -> tuple[list[np.ndarray], list[np.ndarray], list[bool]]:
    """``run(rank, sock, ports, bounds, buf)`` on a thread per rank (the system calls and the
    compiled pass release the GIL), over a length that is no multiple of the datagram's
    elements (a short last one); every socket closed after. Returns the inputs, the results
    and what each ``run`` returned."""
    world, n = 2, 3 * (chunk_bytes // 4) * 5 + 7
    socks = [floor_socket() for _ in range(world)]
    ports = [int(s.getsockname()[1]) for s in socks]
    bounds = np.linspace(0, n, world + 1).astype(np.int64)
    data = [np.random.default_rng([r, n]).standard_normal(n).astype(np.float32) for r in range(2)]
    bufs = [d.copy() for d in data]
    ok = [False] * world

    def rank(r: int) -> None:
        ok[r] = run(r, socks[r], ports, bounds, bufs[r])

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
    finally:
        for s in socks:
            s.close()
    return data, bufs, ok


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gso", [True, False])
@pytest.mark.parametrize("chunk_bytes", [1024, 8972, 64984])
def test_two_ranks_reduce_to_the_sum_at_every_datagram_size(chunk_bytes, gso):
    floors: list[_MmsgFloor] = []

    def run(r, sock, ports, bounds, buf):
        floor = _MmsgFloor(sock, ports, r, bounds, chunk_bytes, gso)
        floors.append(floor)
        return floor.exchange(buf, 3)

    data, bufs, ok = _two_ranks(chunk_bytes, run)
    assert ok == [True, True]
    want = _reference(data)
    for buf in bufs:
        np.testing.assert_allclose(buf, want, rtol=1e-6, atol=1e-6)
    if not gso:
        assert not any(f.gso for f in floors)
    if HDR_BYTES + chunk_bytes > GRO_MAX_DATAGRAM:  # GRO only where datagrams are small
        assert not any(f.gro for f in floors)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk_bytes", [1024, 64984])
def test_the_per_datagram_floor_reduces_to_the_sum_too(chunk_bytes):
    def run(r, sock, ports, bounds, buf):
        return _exchange(sock, ports, r, buf, bounds, 5, chunk_bytes)

    data, bufs, ok = _two_ranks(chunk_bytes, run)
    assert ok == [True, True]
    for buf in bufs:
        np.testing.assert_allclose(buf, _reference(data), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk_bytes", [0, 6, 65492])
def test_a_payload_the_floor_cannot_carry_is_refused(chunk_bytes):
    with pytest.raises(ValueError, match="multiple of 4"):
        check_chunk_bytes(chunk_bytes)
