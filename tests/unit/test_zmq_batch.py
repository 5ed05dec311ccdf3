"""Batch frames of the ZeroMQ data plane (transport/drivers/zmq/frames): packing a run into
fixed-stride rows, viewing a frame's rows in place, and broken frames: dropped whole, never a
read out of bounds, nothing invented."""

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
    """The batch frames of ``sel``, each in a buffer of its own (the plane reuses buffers,
    so each starts as garbage here: nothing stale may survive)."""
    return _pack_segments([(run, np.asarray(sel, dtype=np.int64))], limit)


def _pack_segments(segments: list, limit: int = zb.BATCH_BYTES) -> list[np.ndarray]:
    frames = []
    for a, b, stride, total in zb.frame_bounds(segments, limit):
        out = np.full(total, 0xA5, dtype=np.uint8)
        zb.fill(segments, a, b, stride, out)
        frames.append(out)
    return frames


def _packet(run: DatagramRun, i: int) -> bytes:
    c = int(run.chunks[i])
    a, n = int(run.starts[i]), int(run.sizes[i])
    return bytes(run.hdr[c * HB : (c + 1) * HB]) + bytes(run.payload[a : a + n])


def _reference(run: DatagramRun, idx: list[int], stride: int) -> bytes:
    """The frame of positions ``idx`` built byte by byte from the documented layout."""
    out = zb.BATCH_MAGIC + len(idx).to_bytes(4, "little") + stride.to_bytes(4, "little")
    out += bytes(4)
    for i in idx:
        out += (HB + int(run.sizes[i])).to_bytes(4, "little")
    out += bytes(-len(out) % 8)
    for i in idx:
        p = _packet(run, i)
        out += p + bytes(stride - len(p))
    return out


def _declared(frame: np.ndarray) -> int:
    """The record count a frame's head declares."""
    return int(frame[4:8].view(np.uint32)[0])


def _unpack(frames: list[np.ndarray]) -> list[bytes]:
    got: list[bytes] = []
    for f in frames:
        assert zb.is_batch(f.data)
        rows, lengths = zb.rows(f)
        assert rows.shape[0] == _declared(f) > 0
        assert np.shares_memory(rows, f)  # a view: the receiver copies nothing
        got += [bytes(rows[j, : lengths[j]]) for j in range(rows.shape[0])]
    return got


@pytest.mark.parametrize("shift", [0, 1, 4])
def test_a_run_packed_and_viewed_gives_every_packet_in_order(shift):
    sizes = [64952, 100, 0, 7, 64952, 1024, 3, 64952]
    run = _run(sizes, seed=shift, payload_shift=shift)
    sel = np.array([0, 2, 3, 5, 6, 7, 1, 4])
    frames = _pack(run, sel, limit=150_000)
    assert len(frames) > 1 and all(f.shape[0] % 8 == 0 for f in frames)
    assert all(f.shape[0] <= 150_000 for f in frames)
    assert sum(_declared(f) for f in frames) == len(sel)
    assert _unpack(frames) == [_packet(run, int(i)) for i in sel]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 3000), min_size=1, max_size=40),
    st.integers(1, 6_000),
    st.integers(0, 7),
    st.randoms(use_true_random=False),
)
def test_the_compiled_fill_writes_the_documented_layout(sizes, limit, shift, rnd):
    run = _run(sizes, seed=len(sizes), payload_shift=shift)
    sel = np.array(rnd.sample(range(len(sizes)), len(sizes)), dtype=np.int64)
    bounds = zb.frame_bounds([(run, sel)], limit)
    assert [b[0] for b in bounds] == [0] + [b[1] for b in bounds[:-1]]
    assert bounds[-1][1] == len(sel)
    for (a, b, stride, total), frame in zip(bounds, _pack(run, sel, limit), strict=True):
        idx = sel[a:b].tolist()
        assert stride == max((HB + sizes[i] + 7) & ~7 for i in idx)
        assert total == zb.meta_bytes(b - a) + (b - a) * stride
        assert b - a == 1 or total <= limit  # only a lone record may exceed the limit
        assert frame.tobytes() == _reference(run, idx, stride)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2000), min_size=0, max_size=9), min_size=1, max_size=4),
    st.integers(1, 9_000),
)
def test_several_runs_share_frames_in_order(runs_sizes, limit):
    """The runs of one pass for one (peer, path) go out as one series of frames: every
    record once, in order, frames crossing from one run into the next."""
    runs = [_run(sizes or [1], seed=i, payload_shift=i) for i, sizes in enumerate(runs_sizes)]
    segments = [
        (run, np.arange(len(sizes), dtype=np.int64)[::-1].copy())
        for run, sizes in zip(runs, runs_sizes, strict=True)
    ]
    want = [_packet(run, int(i)) for run, sel in segments for i in sel]
    frames = _pack_segments(segments, limit)
    assert _unpack(frames) == want
    for f in frames:
        stride = int(f[8:12].view(np.uint32)[0])
        n = _declared(f)
        assert n == 1 or f.shape[0] <= limit
        lengths = f[16 : 16 + 4 * n].view(np.uint32)
        assert stride == max((int(x) + 7) & ~7 for x in lengths)


def test_a_packet_larger_than_the_limit_gets_a_frame_of_its_own():
    run = _run([5000, 64952, 10])
    frames = _pack(run, np.arange(3), limit=8192)
    assert [_declared(f) for f in frames] == [1, 1, 1]
    assert _pack(run, np.empty(0, dtype=np.int64)) == []


def test_fill_refuses_a_stride_or_buffer_that_does_not_fit():
    run = _run([100, 20])
    sel = np.arange(2)
    seg = [(run, sel)]
    ((a, b, stride, total),) = zb.frame_bounds(seg, 1 << 20)
    smaller = total - 2 * 8  # two rows, each 8 bytes narrower
    with pytest.raises(ValueError, match="stride"):
        zb.fill(seg, a, b, stride - 8, np.empty(smaller, dtype=np.uint8))
    with pytest.raises(ValueError, match="bytes"):
        zb.fill(seg, a, b, stride, np.empty(total - 8, dtype=np.uint8))


def _field(frame: np.ndarray, word: int, value: int) -> np.ndarray:
    frame[4 * word : 4 * word + 4].view(np.uint32)[0] = value
    return frame


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda f: f[:-8], id="cut-short"),
        pytest.param(lambda f: np.concatenate([f, np.zeros(8, np.uint8)]), id="trailing-bytes"),
        pytest.param(lambda f: _field(f, 0, int.from_bytes(b"GLB\x01", "little")), id="v1"),
        pytest.param(lambda f: _field(f, 1, 0), id="no-records"),
        pytest.param(lambda f: _field(f, 1, 4), id="count-disagrees"),
        pytest.param(lambda f: _field(f, 1, 1 << 31), id="huge-count"),
        pytest.param(lambda f: _field(f, 2, 77), id="stride-not-words"),
        pytest.param(lambda f: _field(f, 2, 8), id="stride-below-a-header"),
        pytest.param(lambda f: _field(f, 3, 1), id="reserved-word-set"),
        pytest.param(lambda f: _field(f, 5, 1 << 20), id="length-past-its-row"),
        pytest.param(lambda f: f[:12], id="head-only"),
    ],
)
def test_a_broken_frame_is_dropped_whole(damage):
    run = _run([40, 41, 42])
    (frame,) = _pack(run, np.arange(3))
    bad = np.ascontiguousarray(damage(frame.copy()))
    rows, lengths = zb.rows(bad)
    assert rows.shape[0] == 0 and lengths.shape[0] == 0


def test_short_lengths_pass_to_the_core_which_rejects_them():
    run = _run([40, 41])
    (frame,) = _pack(run, np.arange(2))
    _field(frame, 4, 3)  # a 3-byte packet: the core counts it, the frame is still well formed
    _, lengths = zb.rows(frame)
    assert lengths.tolist() == [3, HB + 41]


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=700), st.integers(0, 9), st.integers(0, 200))
def test_random_bytes_never_escape_the_frame(body, count, stride):
    head = zb.BATCH_MAGIC + count.to_bytes(4, "little") + (8 * stride).to_bytes(4, "little")
    frame = np.frombuffer(head + bytes(4) + body, dtype=np.uint8)
    rows, lengths = zb.rows(frame)
    k = rows.shape[0]
    assert lengths.shape[0] == k
    if k:
        assert np.shares_memory(rows, frame) and rows.shape == (count, 8 * stride)
        assert zb.meta_bytes(count) + rows.size == frame.shape[0]
        assert all(0 <= n <= rows.shape[1] for n in lengths.tolist())


def test_a_lone_packet_is_not_a_batch_frame():
    packet = MAGIC.to_bytes(2, "little") + bytes(HB)
    assert not zb.is_batch(packet)
    assert not zb.is_batch(zb.BATCH_MAGIC[:3])
    assert zb.is_batch(zb.BATCH_MAGIC + bytes(12))
