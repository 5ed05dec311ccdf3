"""The injected-loss arena (``UdpPlane(rx_tap=InjectedLoss(...))``): a seeded random part of
each received batch is dropped before the endpoint sees it; the kept datagrams reach it intact,
in order, in consecutive rows, with their lengths."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.transport.drivers.udp.plane import InjectedLoss, LossyArena
from gradlane.transport.errors import ConfigError


class _Arena:
    """The endpoint's side of :class:`gradlane.transport.drivers.udp.sockets.RxArena`: rows, the
    first free one, and what was committed."""

    def __init__(self, rows: int, width: int) -> None:
        self.rx_arena = np.zeros((rows, width), dtype=np.uint8)
        self.rx_free = 0
        self.committed: list[tuple[np.ndarray, int]] = []

    def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
        self.committed.append((lengths.copy(), path))
        self.rx_free += int(lengths.shape[0])


def _fill(arena: _Arena, first: int, lengths: np.ndarray, tag: int) -> None:
    """What a receive writes: datagram i of the batch is ``lengths[i]`` bytes of its id."""
    for i, n in enumerate(lengths.tolist()):
        arena.rx_arena[first + i, : min(n, arena.rx_arena.shape[1])] = (tag + i) % 251


@pytest.mark.parametrize("rate", [0.05, 0.3, 0.9])
def test_kept_datagrams_reach_the_endpoint_intact_and_in_order(rate: float) -> None:
    arena = _Arena(4096, 64)
    lossy = LossyArena(arena, rate, np.random.default_rng(7))
    rng = np.random.default_rng(1)
    sent = 0
    for batch in range(40):
        k = int(rng.integers(1, 64))
        lengths = rng.integers(48, 80, size=k)  # some longer than a row: truncated datagrams
        first = arena.rx_free
        _fill(arena, first, lengths, sent)
        before = lossy.dropped
        lossy.commit_datagrams(lengths, path=batch % 2, now=0.0)
        got, path = arena.committed[-1]
        assert path == batch % 2
        assert lossy.dropped - before == k - got.shape[0]
        ids = [(int(arena.rx_arena[first + j, 0]), int(n)) for j, n in enumerate(got.tolist())]
        sent_ids = [((sent + i) % 251, int(n)) for i, n in enumerate(lengths.tolist())]
        # The kept ones are a subsequence of what arrived, in arrival order, with their lengths.
        it = iter(sent_ids)
        assert all(x in it for x in ids), (ids, sent_ids)
        for j, n in enumerate(got.tolist()):  # each row whole, not only its first byte
            row = arena.rx_arena[first + j, : min(n, 64)]
            assert (row == row[0]).all()
        sent += k
    total = sum(c[0].shape[0] for c in arena.committed)
    assert total + lossy.dropped == sent
    assert abs(lossy.dropped / sent - rate) < 0.1


def test_no_drop_leaves_the_batch_alone_and_a_full_drop_commits_nothing() -> None:
    arena = _Arena(16, 64)
    never = LossyArena(arena, 1e-12, np.random.default_rng(0))
    lengths = np.array([60, 50, 40])
    _fill(arena, 0, lengths, 10)
    before = arena.rx_arena.copy()
    never.commit_datagrams(lengths, 0, 0.0)
    assert (arena.rx_arena == before).all() and arena.committed[-1][0].tolist() == [60, 50, 40]
    always = LossyArena(arena, 1.0, np.random.default_rng(0))
    always.commit_datagrams(np.array([60, 60]), 1, 0.0)
    assert always.dropped == 2 and arena.committed[-1][0].shape[0] == 0 and arena.rx_free == 3


def test_the_drops_are_seeded() -> None:
    def run(seed: int) -> list[list[int]]:
        arena = _Arena(1024, 56)
        lossy = LossyArena(arena, 0.2, np.random.default_rng(seed))
        for _ in range(10):
            lengths = np.full(32, 56)
            _fill(arena, arena.rx_free, lengths, arena.rx_free)
            lossy.commit_datagrams(lengths, 0, 0.0)
        return [c[0].tolist() for c in arena.committed] + [[lossy.dropped]]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_one_datagram_at_a_time_is_dropped_too() -> None:
    """Where a burst brings a single datagram (one commit of one row), the same rate of them
    is dropped, and the rest committed as they came."""
    arena = _Arena(4096, 64)
    lossy = LossyArena(arena, 0.25, np.random.default_rng(2))
    for i in range(2000):
        lossy.commit_datagrams(np.array([48 + i % 16]), path=i % 2, now=0.0)
    kept = [int(c[0][0]) for c in arena.committed if c[0].shape[0]]
    assert len(kept) + lossy.dropped == 2000
    assert abs(lossy.dropped / 2000 - 0.25) < 0.04
    assert all(48 <= n < 64 for n in kept)


def test_injected_loss_seeds_each_rank_and_is_validated() -> None:
    """Rank r of ``InjectedLoss(rate, seed)`` drops exactly what a generator seeded with
    ``[seed, r, 0x10557]`` picks: the same seed and rank drop the same datagrams."""
    loss = InjectedLoss(0.3, seed=5)
    lengths = np.full(64, 56)
    for rank in (0, 1):
        arena = _Arena(128, 56)
        tap = loss.wrap(arena, rank)
        tap.commit_datagrams(lengths, 0, 0.0)
        want = LossyArena(_Arena(128, 56), 0.3, np.random.default_rng([5, rank, 0x10557]))
        want.commit_datagrams(lengths, 0, 0.0)
        assert tap.dropped == want.dropped and tap.stats() == {"injected_drops": tap.dropped}
        assert arena.committed[-1][0].shape[0] == 64 - tap.dropped
    assert InjectedLoss(0.0).rate == 0.0
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="inject_loss"):
            InjectedLoss(bad)
