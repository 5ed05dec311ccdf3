"""UDP engines in real processes on loopback (spawn), one process per rank.

The parent only relays the bound addresses and checks the results; workers live in
``tests.multiproc.workers`` so spawned children can import them. Every process is joined or
killed in a ``finally``, every hand-off has a timeout, and each test has a pytest timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.multiproc import workers
from tests.support.procs import RankProcs, owned


class Ranks(RankProcs):
    """Live and dead rank processes of one engine test."""

    def live(self, rank: int, *args: Any) -> None:
        self.spawn(workers.run_rank, (rank, *args, self.up, self.down(rank)), f"gl-rank-{rank}")

    def dead(self, rank: int) -> None:
        self.spawn(workers.run_dead_rank, (rank, self.up), f"gl-rank-{rank}")

    def exchange(self, world: int) -> None:
        """Collect every rank's bound addresses and send the table to the live ranks."""
        table: dict[int, list] = {}
        while len(table) < world:
            msg = self.up.get(timeout=workers.WAIT_S)
            if msg[0] != "addrs":
                pytest.fail(f"rank {msg[1]} failed before the exchange: {msg}")
            table[msg[1]] = [tuple(a) for a in msg[2]]
        for down in self.downs.values():
            down.put(table)

    def results(self) -> dict[int, tuple]:
        out = {}
        while len(out) < len(self.downs):
            msg = self.up.get(timeout=workers.WAIT_S)
            out[msg[1]] = msg
        for down in self.downs.values():  # every rank is done: the live ones may close
            down.put("close")
        return out


@pytest.fixture
def ranks() -> Iterator[Ranks]:
    yield from owned(Ranks(), "close")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("dtype", "n"), [("float32", 786_433), ("float16", 300_001)])
def test_reliable_allreduce_equals_numpy_sum(ranks: Ranks, world: int, dtype: str, n: int):
    seed = 1000 * world + n
    for r in range(world):
        ranks.live(r, world, n, dtype, seed, 30.0)
    ranks.exchange(world)
    inputs = [workers.rank_input(seed, r, n, dtype) for r in range(world)]
    ref32 = np.sum(np.stack([x.astype(np.float32) for x in inputs]), axis=0, dtype=np.float32)
    for r, msg in sorted(ranks.results().items()):
        assert msg[0] == "ok", f"rank {r}: {msg}"
        _, _, res, delivered, degraded = msg
        assert res.dtype == np.dtype(dtype) and res.shape == (n,)
        assert delivered == 1.0 and not degraded
        if dtype == "float16":  # the f16 sum is one rounding of the f32 sum of the inputs
            np.testing.assert_array_equal(res, ref32.astype(np.float16))
        elif world == 2:  # a + b is the same in either order
            np.testing.assert_array_equal(res, ref32)
        else:  # arrival order sets the summation order
            np.testing.assert_allclose(res, ref32, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_rank_that_never_starts_fails_the_others_with_peer_timeout(ranks: Ranks, world: int):
    hard = 1.0
    dead = world - 1
    for r in range(dead):
        ranks.live(r, world, 100_003, "float32", 7, hard)
    ranks.dead(dead)
    ranks.exchange(world)
    for r, msg in sorted(ranks.results().items()):
        assert msg[0] == "error" and msg[2] == "PeerTimeout", f"rank {r}: {msg}"
        _, _, _, failed, text, elapsed = msg
        assert dead in failed, f"rank {r}: {text}"
        assert f"rank(s) {dead}" in text or f", {dead}" in text, text
        assert "step 1 bucket 0" in text
        # Fails at the hard deadline, not at the worker's much longer Future timeout.
        assert hard <= elapsed < workers.WAIT_S / 4, f"rank {r} failed after {elapsed:.2f}s"
