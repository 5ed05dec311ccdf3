"""Batch frames of the ZeroMQ data plane (transport/zmq_batch): packing a run, splitting frames
into arena rows across calls, and broken frames — never a read or write out of bounds, the
packets before a fault kept, nothing invented."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.transport.core.events import DatagramRun
from gradlane.transport.drivers.zmq import frames as zb
from gradlane.transport.wire.header import HEADER_SIZE, MAGIC
from hypothesis import given, settings
from hypothesis import strategies as st

HB = HEADER_SIZE


def _run(sizes: list[int], seed: int = 0, payload_shift: int = 0) -> DatagramRun:
    """A run of len(sizes) datagrams with random header rows and payload slices (the payload
    starting ``payload_shift`` bytes into its buffer, so not word-aligned)."""
    rng = np.random.default_rng(seed)
    n = len(sizes)
    hdr = rng.integers(0, 256, n * HB, dtype=np.uint8)
    starts = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
    raw = rng.integers(0, 256, payload_shift + int(sum(sizes)) + 1, dtype=np.uint8)
    payload = raw[payload_shift:]
    return DatagramRun(
        hdr.data, HB, payload.data, np.arange(n, dtype=np.int64)[::-1].copy(), starts,
        np.asarray(sizes, dtype=np.int64), 1, np.zeros(n, dtype=np.int64), 0,
    )  # fmt: skip


def _pack(run: DatagramRun, sel: np.ndarray, limit: int = zb.BATCH_BYTES) -> list[np.ndarray]:
    """The batch frames of ``sel``, each in a buffer of its own (the plane reuses buffers)."""
    sel = np.asarray(sel, dtype=np.int64)
    frames = []
    for a, b, total in zb.frame_bounds(run, sel, limit):
        out = np.empty(total, dtype=np.uint8)
        zb.fill(run, sel, a, b, out)
        frames.append(out)
    return frames


def _packet(run: DatagramRun, i: int) -> bytes:
    c = int(run.chunks[i])
    a, n = int(run.starts[i]), int(run.sizes[i])
    return bytes(run.hdr[c * HB : (c + 1) * HB]) + bytes(run.payload[a : a + n])


def _split_all(frames: list[np.ndarray], rows: int, width: int) -> tuple[list[bytes], int]:
    """Every frame split through an arena of ``rows`` rows (emptied whenever it fills, as the
    endpoint's flush does); the packets in order and the number of split calls."""
    arena = np.zeros((rows, width), dtype=np.uint8)
    lengths = np.zeros(rows, dtype=np.int64)
    got: list[bytes] = []
    calls = 0
    for f in frames:
        assert zb.is_batch(f.data)
        pos, first = zb.FRAME_HEADER, 0
        while True:
            k, pos, state = zb.split(f, pos, arena, first, lengths)
            calls += 1
            got += [bytes(arena[first + j, : lengths[j]]) for j in range(k)]
            first += k
            if state == zb.SPLIT_DONE:
                break
            assert state == zb.SPLIT_ARENA_FULL
            first = 0
    return got, calls


@pytest.mark.parametrize("shift", [0, 1, 4])
def test_a_run_packed_and_split_gives_every_packet_in_order(shift):
    sizes = [64952, 100, 0, 7, 64952, 1024, 3, 64952]
    run = _run(sizes, seed=shift, payload_shift=shift)
    sel = np.array([0, 2, 3, 5, 6, 7, 1, 4])
    frames = _pack(run, sel, limit=150_000)
    assert len(frames) > 1 and all(f.shape[0] % 8 == 0 for f in frames)
    assert all(f.shape[0] <= 150_000 for f in frames)
    assert sum(zb.record_count(f) for f in frames) == len(sel)
    got, _ = _split_all(frames, rows=3, width=65008)
    assert got == [_packet(run, int(i)) for i in sel]


def test_a_packet_larger_than_the_limit_gets_a_frame_of_its_own():
    run = _run([5000, 64952, 10])
    frames = _pack(run, np.arange(3), limit=8192)
    assert [zb.record_count(f) for f in frames] == [1, 1, 1]
    assert _pack(run, np.empty(0, dtype=np.int64)) == []


def test_the_arena_filling_mid_frame_resumes_where_it_stopped():
    run = _run([100] * 5)
    (frame,) = _pack(run, np.arange(5))
    arena = np.zeros((3, 256), dtype=np.uint8)
    lengths = np.zeros(8, dtype=np.int64)
    k, pos, state = zb.split(frame, zb.FRAME_HEADER, arena, 1, lengths)
    assert (k, state) == (2, zb.SPLIT_ARENA_FULL)
    assert [bytes(arena[1 + j, : lengths[j]]) for j in range(2)] == [
        _packet(run, j) for j in range(2)
    ]
    k, pos, state = zb.split(frame, pos, arena, 0, lengths)
    assert (k, state, pos) == (3, zb.SPLIT_DONE, frame.shape[0])
    assert [bytes(arena[j, : lengths[j]]) for j in range(3)] == [_packet(run, j) for j in (2, 3, 4)]


def test_a_packet_longer_than_a_row_reads_as_oversized_and_the_next_is_intact():
    run = _run([300, 20])
    (frame,) = _pack(run, np.arange(2))
    arena = np.zeros((2, 128), dtype=np.uint8)
    lengths = np.zeros(2, dtype=np.int64)
    k, _, state = zb.split(frame, zb.FRAME_HEADER, arena, 0, lengths)
    assert (k, state) == (2, zb.SPLIT_DONE)
    assert lengths.tolist() == [129, HB + 20]  # width + 1: the endpoint counts it as oversized
    assert bytes(arena[0]) == _packet(run, 0)[:128]
    assert bytes(arena[1, : HB + 20]) == _packet(run, 1)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda f: f[:-9], id="cut-in-the-last-record"),
        pytest.param(lambda f: f[:-3], id="cut-in-the-padding"),
        pytest.param(lambda f: _with_length(f, 1, HB - 1), id="length-below-a-header"),
        pytest.param(lambda f: _with_length(f, 1, 1 << 40), id="length-past-the-end"),
        pytest.param(lambda f: _with_length(f, 1, -5), id="negative-length"),
    ],
)
def test_a_broken_frame_keeps_the_packets_before_the_fault(damage):
    run = _run([40, 41, 42])
    (frame,) = _pack(run, np.arange(3))
    bad = np.ascontiguousarray(damage(frame.copy()))
    arena = np.zeros((4, 128), dtype=np.uint8)
    lengths = np.zeros(4, dtype=np.int64)
    k, _, state = zb.split(bad, zb.FRAME_HEADER, arena, 0, lengths)
    assert state == zb.SPLIT_MALFORMED
    assert 1 <= k <= 2
    assert [bytes(arena[j, : lengths[j]]) for j in range(k)] == [_packet(run, j) for j in range(k)]


def _with_length(frame: np.ndarray, record: int, n: int) -> np.ndarray:
    """``frame`` with record ``record``'s length field set to ``n`` (as u64)."""
    pos = zb.FRAME_HEADER
    for _ in range(record):
        m = int(frame[pos : pos + 8].view(np.uint64)[0])
        pos += 8 + ((m + 7) & ~7)
    frame[pos : pos + 8].view(np.int64)[0] = n
    return frame


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=600), st.integers(1, 5))
def test_random_bytes_never_escape_the_frame_or_the_arena(body, rows):
    frame = np.frombuffer(zb.BATCH_MAGIC + b"\x03\x00\x00\x00" + body, dtype=np.uint8)
    arena = np.zeros((rows + 2, 64), dtype=np.uint8)
    guard = arena[rows:].copy()
    lengths = np.zeros(rows, dtype=np.int64)
    pos, seen = zb.FRAME_HEADER, 0
    for _ in range(len(body) + 2):  # each call consumes a record or stops
        k, nxt, state = zb.split(frame, pos, arena[:rows], 0, lengths)
        assert 0 <= k <= rows and pos <= nxt <= frame.shape[0]
        assert all(HB <= n <= 65 for n in lengths[:k].tolist())
        seen += k
        if state != zb.SPLIT_ARENA_FULL:
            break
        pos = nxt
    else:
        pytest.fail("split never finished")
    np.testing.assert_array_equal(arena[rows:], guard)
    assert seen * (8 + HB) <= len(body)


def test_a_lone_packet_is_not_a_batch_frame():
    packet = MAGIC.to_bytes(2, "little") + bytes(HB)
    assert not zb.is_batch(packet)
    assert not zb.is_batch(zb.BATCH_MAGIC[:3])
    assert zb.is_batch(zb.BATCH_MAGIC + bytes(4))


def test_split_refuses_arrays_it_cannot_read():
    frame = np.zeros(16, dtype=np.uint8)
    arena = np.zeros((2, 64), dtype=np.uint8)
    lengths = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="frame"):
        zb.split(frame.view(np.uint16), 8, arena, 0, lengths)
    with pytest.raises(ValueError, match="arena"):
        zb.split(frame, 8, np.zeros((2, 60), dtype=np.uint8), 0, lengths)
    with pytest.raises(ValueError, match="lengths"):
        zb.split(frame, 8, arena, 0, lengths.astype(np.int32))
    with pytest.raises(ValueError, match="outside"):
        zb.split(frame, 8, arena, 3, lengths)
