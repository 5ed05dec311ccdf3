"""Early data: DATA for a collective a rank has not started yet is checked, held within
``early_buffer_bytes`` (full-size datagrams in place in the receive arena, small ones copied),
and replayed (the kernels check every packet) when it starts; forged early data is counted and
never held; what does not fit is dropped, counted, and recovered like any loss."""

from __future__ import annotations

import numpy as np
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import AllReduceComplete, DatagramRun, flat
from gradlane.transport.wire.header import HEADER_SIZE, Header, Kind, Phase, Reason, encode

from tests.support.wire import Wire


def _ranks(**cfg) -> list[TransposeAllReduce]:
    config = TransportConfig(**{"chunk_bytes": 256, **cfg})
    return [TransposeAllReduce(r, 2, config) for r in range(2)]


def _early_into_rank1(eps, x0, mangle=lambda b: b) -> int:
    """Rank 0 starts and everything it sends reaches rank 1, which has not started."""
    eps[0].start(1, 0, x0, 0.5, 0.0)
    n = 0
    for dg in flat(eps[0].datagrams_to_send(0.0)):
        eps[1].receive_datagram(mangle(dg.wire()), dg.path, 0.0)
        n += 1
    eps[1].datagrams_to_send(0.0)  # processes the received batch
    return n


def _finish(eps, datas) -> dict[int, AllReduceComplete]:
    eps[1].start(1, 0, datas[1], 0.5, 0.0)
    wire = Wire(eps)
    wire.run(lambda: sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == 2)
    return {r: e for r, _, e in wire.events}


def test_early_data_is_held_then_replayed_exactly():
    rng = np.random.default_rng(5)
    datas = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    eps = _ranks()
    sent = _early_into_rank1(eps, datas[0])
    rx = eps[1].endpoint.receiver
    held = sum(h.rows.shape[0] for entries in rx.early.values() for h in entries)
    assert sent == -(-1500 * 4 // 256) and held == sent  # all of rank 1's shard, held
    assert rx.early_bytes == sum(h.nbytes for entries in rx.early.values() for h in entries)
    out = _finish(eps, datas)
    expect = datas[0] + datas[1]
    for r in range(2):
        np.testing.assert_allclose(out[r].result, expect, rtol=1e-6)
    assert rx.early == {} and rx.early_bytes == 0


def test_forged_early_data_is_counted_and_never_held():
    datas = [np.ones(3000, np.float32), np.ones(3000, np.float32)]
    eps = _ranks()

    def wrong_rank(b: bytes) -> bytes:  # addressed to rank 3 of a 2-rank job
        buf = bytearray(b)
        if buf[3] == 1:  # DATA
            buf[22:24] = (3).to_bytes(2, "little")
        return bytes(buf)

    _early_into_rank1(eps, datas[0], wrong_rank)
    rx = eps[1].endpoint.receiver
    assert rx.early == {} and rx.early_bytes == 0
    assert eps[1].endpoint.counters[Reason.BAD_RANK] > 0


def test_early_data_beyond_the_buffer_is_dropped_counted_and_recovered():
    rng = np.random.default_rng(6)
    datas = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    eps = _ranks(early_buffer_bytes=4 * (256 + HEADER_SIZE))
    _early_into_rank1(eps, datas[0])
    rx = eps[1].endpoint.receiver
    assert rx.early_dropped > 0
    assert 0 < rx.early_bytes <= 4 * (256 + HEADER_SIZE)
    out = _finish(eps, datas)
    for r in range(2):
        np.testing.assert_allclose(out[r].result, datas[0] + datas[1], rtol=1e-6)


def test_early_data_of_a_collective_that_never_starts_expires():
    """Held data a rank never uses (a peer's stale step) is dropped once a transfer could no
    longer be alive, so it cannot keep newer early data out of the buffer for good."""
    eps = _ranks()
    _early_into_rank1(eps, np.ones(3000, np.float32))
    rx = eps[1].endpoint.receiver
    held = rx.early_bytes
    assert held > 0
    limit = max(eps[1].config.loss.hard_deadline_s, eps[1].config.linger_s)
    rx.handle_timer(limit * 0.5)
    assert rx.early_bytes == held and rx.early_expired == 0
    rx.handle_timer(limit + 0.001)
    assert rx.early == {} and rx.early_bytes == 0
    assert rx.early_expired == -(-1500 * 4 // 256)
    assert eps[1].endpoint.stats()["early_expired"] == rx.early_expired


def test_tiny_early_datagrams_count_what_they_occupy():
    """Held early data is charged by the memory its blocks take, so datagrams a few bytes long
    (each in an arena row as wide as the largest datagram) cannot hold more than
    ``early_buffer_bytes``: a flood of them is dropped and counted once the buffer is full."""
    eps = _ranks(chunk_bytes=4096, early_buffer_bytes=8192)
    ep = eps[1].endpoint
    for step in range(2, 40):  # collectives rank 1 has not started: early
        hdr = Header(kind=Kind.DATA, job=ep.config.job, step=step, bucket=0, shard=1,
                     phase=Phase.REDUCE, src=0, dst=1, count=1)  # fmt: skip
        for chunk in range(8):
            ep.receive_datagram(encode(hdr.with_(chunk=chunk), bytes(4), ep.key), 0, 0.0)
    ep.datagrams_to_send(0.0)  # processes the batch
    rx = ep.receiver
    occupied = sum(h.nbytes for entries in rx.early.values() for h in entries)
    assert rx.early_bytes == occupied <= 8192
    # 38 x 8 datagrams of 56 B each: 8192 // 56 = 146 of them fit, the rest are dropped
    assert rx.early_dropped == 38 * 8 - 146
    # compact copies, not arena rows held in place: tiny datagrams are not worth a whole row
    assert all(
        h.arena.shape[1] == 56 and not _in_place(ep, h)
        for entries in rx.early.values()
        for h in entries
    )


def _in_place(ep, h) -> bool:
    """The held rows are in one of the endpoint's own arenas (not a copy)."""
    return any(np.shares_memory(h.arena, a) for a in ep._arenas)


def _held(rx) -> list:
    return [h for entries in rx.early.values() for h in entries]


def test_early_data_is_held_in_place_and_never_overwritten():
    """Full-size early datagrams stay in the endpoint's receive arena (no copy): later batches
    go into the rows above them, so what is held is bit for bit what arrived, and the replay
    uses it (nothing is rejected or resent)."""
    rng = np.random.default_rng(7)
    datas = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    eps = _ranks()
    _early_into_rank1(eps, datas[0])
    ep = eps[1].endpoint
    held = _held(ep.receiver)
    assert held and all(_in_place(ep, h) for h in held)
    before = [h.arena[h.rows].copy() for h in held]
    base = ep.rx_free
    assert base >= max(h.rows.max() for h in held) + 1  # the next batch starts above them
    # More datagrams arrive (a collective rank 1 has not started either) and are processed.
    eps[0].start(2, 0, datas[0], 0.5, 0.0)
    for dg in flat(eps[0].datagrams_to_send(0.0)):
        ep.receive_datagram(dg.wire(), dg.path, 0.0)
    ep.datagrams_to_send(0.0)
    assert all((h.arena[h.rows] == b).all() for h, b in zip(held, before, strict=True))
    out = _finish(eps, datas)
    for r in range(2):
        np.testing.assert_allclose(out[r].result, datas[0] + datas[1], rtol=1e-6)
    assert ep.counters[Reason.BAD_TAG] == 0
    assert sum(out[0].report.sender.retransmitted) == 0  # rank 0 resent nothing


def _pile_up_early(eps, datas) -> int:
    """Collectives rank 1 has not started, one after another (their data held early), until
    some early data is a copy, not held in place; every batch leaves room for the next.
    Returns the last step."""
    from gradlane.transport.core.endpoint import MIN_ROOM, RX_BATCH

    ep = eps[1].endpoint
    _early_into_rank1(eps, datas[0])
    step = 1
    while all(_in_place(ep, h) for h in _held(ep.receiver)):
        step += 1
        assert step < 60  # within the receiver's step window
        eps[0].start(step, 0, datas[0], 0.5, 0.0)
        for dg in flat(eps[0].datagrams_to_send(0.0)):
            ep.receive_datagram(dg.wire(), dg.path, 0.0)
        ep.datagrams_to_send(0.0)
        assert RX_BATCH - ep.rx_free >= MIN_ROOM  # room for the next batch, always
    return step


def test_early_data_moves_to_another_arena_before_it_is_copied():
    """Held batches stay in place while at least MIN_ROOM rows are left above them; then the
    next batches go to an arena that holds nothing, up to RX_ARENAS of them, and only then is
    early data copied out. Everything stays exact, and the copies are counted."""
    from gradlane.transport.core.endpoint import RX_ARENAS

    rng = np.random.default_rng(8)
    # ~94 datagrams a step: every arena fills well within the receiver's step window
    datas = [rng.standard_normal(12000).astype(np.float32) for _ in range(2)]
    eps = _ranks()
    ep = eps[1].endpoint
    first = ep.rx_arena
    _pile_up_early(eps, datas)
    held = _held(ep.receiver)
    assert ep.stats()["rx_arenas"] == RX_ARENAS and ep.rx_arena is not first
    # every arena holds some batch in place, and the newest early data is a copy
    for a in ep._arenas:
        assert any(np.shares_memory(h.arena, a) for h in held)
    assert not _in_place(ep, held[-1]) and ep.stats()["early_copied"] == held[-1].rows.shape[0]
    assert ep.receiver.early_bytes == sum(h.nbytes for h in held)
    out = _finish(eps, datas)  # step 1: its data held in place, replayed
    for r in range(2):
        np.testing.assert_allclose(out[r].result, datas[0] + datas[1], rtol=1e-6)


def test_one_arena_when_the_early_budget_has_no_room_for_another():
    """The extra arenas come out of early_buffer_bytes: with a budget smaller than an arena,
    there is one, and early data beyond its spare rows is copied out (and counted)."""
    from gradlane.transport.core.endpoint import RX_BATCH

    rng = np.random.default_rng(8)
    datas = [rng.standard_normal(12000).astype(np.float32) for _ in range(2)]
    slot = TransportConfig(chunk_bytes=256).slot_bytes  # _ranks' datagrams
    eps = _ranks(early_buffer_bytes=RX_BATCH * slot - 1)
    ep = eps[1].endpoint
    first = ep.rx_arena
    _pile_up_early(eps, datas)
    assert ep.rx_arena is first and ep.stats()["rx_arenas"] == 1
    assert ep.stats()["early_copied"] > 0


def test_a_start_sends_before_it_processes_waiting_input():
    """Datagrams that arrived before a collective starts wait, unprocessed, until its first
    datagrams are out (datagrams_to_send with process_input=False); then they count as usual."""
    rng = np.random.default_rng(9)
    datas = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    eps = _ranks()
    eps[0].start(1, 0, datas[0], 0.5, 0.0)
    for dg in flat(eps[0].datagrams_to_send(0.0)):
        eps[1].receive_datagram(dg.wire(), dg.path, 0.0)  # waiting in rank 1's arena
    ep = eps[1].endpoint
    eps[1].start(1, 0, datas[1], 0.5, 0.0)
    first = eps[1].datagrams_to_send(0.0, process_input=False)
    assert any(isinstance(d, DatagramRun) for d in first)  # rank 1's shard for rank 0
    assert ep.rx_free > 0 and not ep.receiver.early  # the batch is still waiting
    for dg in flat(first):
        eps[0].receive_datagram(dg.wire(), dg.path, 0.0)
    wire = Wire(eps)
    wire.run(lambda: sum(isinstance(e, AllReduceComplete) for _, _, e in wire.events) == 2)
    for _, _, e in wire.events:
        np.testing.assert_allclose(e.result, datas[0] + datas[1], rtol=1e-6)


def test_held_data_left_over_when_the_replay_completes_the_transfer_is_counted_late() -> None:
    """A shard held twice (the original and a resend, both before the collective starts here):
    the first copy completes the transfer on replay, the second is counted as late, not lost
    from every counter."""
    cfg = TransportConfig(chunk_bytes=256)
    eps = [TransposeAllReduce(r, 2, cfg) for r in range(2)]
    x = np.ones(3000, np.float32)
    eps[0].start(1, 0, x, layer_position=0.5, now=0.0)
    dgs = [d.wire() for d in flat(eps[0].datagrams_to_send(0.0)) if d.peer == 1]
    for t in (0.0, 0.001):
        for d in dgs:
            eps[1].receive_datagram(d, 0, t)
        list(flat(eps[1].datagrams_to_send(t)))
    eps[1].start(1, 0, x, layer_position=0.5, now=0.002)
    list(flat(eps[1].datagrams_to_send(0.002)))
    st = eps[1].stats()
    rejected = sum(st["rejected"].values())
    assert st["accepted"] + rejected + st["late"] == 2 * len(dgs), st
    assert st["accepted"] == len(dgs) and st["late"] >= 1


def _as_rows(datagrams: list[bytes], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Datagrams laid out one per row of ``width`` bytes in a fresh buffer (a driver's own
    buffer, as a ZeroMQ batch frame is), and their lengths."""
    rows = np.zeros((len(datagrams), width), dtype=np.uint8)
    for i, d in enumerate(datagrams):
        rows[i, : len(d)] = np.frombuffer(d, dtype=np.uint8)
    return rows, np.array([len(d) for d in datagrams], dtype=np.int64)


def test_early_data_received_in_rows_is_held_in_the_drivers_buffer():
    """Early data handed over with ``receive_rows`` is held as views of the driver's buffer
    (nothing copied, the views keep it alive); the replay uses it exactly."""
    rng = np.random.default_rng(9)
    datas = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    eps = _ranks()
    eps[0].start(1, 0, datas[0], 0.5, 0.0)
    by_path: dict[int, list[bytes]] = {}
    for dg in flat(eps[0].datagrams_to_send(0.0)):
        by_path.setdefault(dg.path, []).append(dg.wire())
    buffers = []
    for path, dgs in by_path.items():
        rows, lengths = _as_rows(dgs, eps[1].rx_arena.shape[1])
        eps[1].receive_rows(rows, lengths, path, 0.0)
        buffers.append(rows)
    ep = eps[1].endpoint
    held = _held(ep.receiver)
    assert sum(h.rows.shape[0] for h in held) == sum(len(d) for d in by_path.values())
    assert all(any(np.shares_memory(h.arena, b) for b in buffers) for h in held)
    del buffers, rows
    out = _finish(eps, datas)
    for r in range(2):
        np.testing.assert_allclose(out[r].result, datas[0] + datas[1], rtol=1e-6)
    assert ep.counters[Reason.BAD_TAG] == 0 and ep.receiver.early == {}
    assert sum(out[0].report.sender.retransmitted) == 0
