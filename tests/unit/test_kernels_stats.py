"""The float32 reduce kernel's finishing step (``prepare_receive(stats=, final=, scale=)``): a
chunk whose last contribution lands is scaled once and gets exactly ``chunk_stats``' norm and
tag sums; the arguments are checked."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.transport import kernels
from gradlane.transport.wire.header import N_REASONS, DType
from gradlane.transport.wire.tag import TagKey
from hypothesis import given
from hypothesis import strategies as st

from tests.support.kernel_inputs import (
    KEYED,
    SETTINGS,
    WORLD,
    arena_of,
    header,
    pack_all,
    session,
    shard,
    transfer,
)


@SETTINGS
@given(
    n=st.integers(1, 700),
    chunk_elems=st.sampled_from([1, 3, 32, 100]),
    senders=st.integers(1, 3),
    scale=st.sampled_from([1.0, 0.25, 1 / 3]),
    key=st.sampled_from([TagKey(), KEYED]),
    data=st.data(),
)
def test_reduce_takes_the_statistics_of_each_chunk_its_last_contribution_completes(
    n: int, chunk_elems: int, senders: int, scale: float, key: TagKey, data
) -> None:
    """With ``stats``, a chunk whose contributor count reaches ``final`` is multiplied by
    ``scale`` once and carries exactly chunk_stats' norm and tag sums of the result; every
    other chunk is neither scaled nor given statistics. (Wrong sums would make every gather
    datagram fail its tag; a wrong norm, mis-prioritise.)"""
    rng = np.random.default_rng(n * 31 + chunk_elems * 7 + senders)
    shards = [shard(rng, n, DType.F32) for _ in range(senders)]
    packets = [
        p
        for s in range(senders)
        for p in pack_all(shards[s], DType.F32, chunk_elems, key, header(src=s))
    ]
    picks = data.draw(st.lists(st.integers(0, len(packets) - 1), max_size=2 * len(packets)))
    n_chunks = -(-n // chunk_elems)
    spec = transfer(DType.F32, n, chunk_elems, src_lo=0, src_hi=senders)
    accum = rng.standard_normal(n).astype(np.float32)  # this rank's own contribution
    contrib = np.ones(n_chunks, dtype=np.uint16)
    received = np.zeros((senders, n_chunks), dtype=np.uint8)
    counters = np.zeros(N_REASONS, dtype=np.int64)
    sentinel = (np.float32(-7.0), np.uint64(0xDEAD), np.uint64(0xBEEF))
    stats = kernels.ChunkStats(*(np.full(n_chunks, v) for v in sentinel))
    own = accum.copy()
    plan = kernels.prepare_receive(session(key), spec, accum, contrib, received, counters,
                                   place=False, stats=stats, final=senders + 1,
                                   scale=scale)  # fmt: skip
    # Two batches: a chunk may complete in either, and its statistics must follow the last add.
    cut = data.draw(st.integers(0, len(picks)))
    for part in (picks[:cut], picks[cut:]):
        if part:
            arena, lengths = arena_of([packets[i] for i in part])
            kernels.receive_rows(plan, arena, lengths)
    done = contrib == senders + 1
    # The sums in float32, in arrival order as the kernel adds them; finished ones scaled once.
    ref = own.copy()
    seen = np.zeros((senders, n_chunks), dtype=bool)
    flat = [(s, c) for s in range(senders) for c in range(n_chunks)]  # packets' (sender, chunk)
    for i in picks:
        s, c = flat[i]
        if not seen[s, c]:
            seen[s, c] = True
            a, b = c * chunk_elems, min((c + 1) * chunk_elems, n)
            ref[a:b] += shards[s][a:b]
    for c in np.flatnonzero(done):
        a, b = c * chunk_elems, min((c + 1) * chunk_elems, n)
        ref[a:b] *= np.float32(scale)
    assert np.array_equal(accum.view(np.uint32), ref.view(np.uint32))
    want = kernels.chunk_stats(accum, dtype=DType.F32, chunk_elems=chunk_elems, key=key)
    for got, ref, fill in zip(stats, want, sentinel, strict=True):
        assert np.array_equal(got[done].view(np.uint8), ref[done].view(np.uint8))
        assert np.all(got[~done] == fill)


def test_reduce_statistics_arguments_are_checked() -> None:
    spec = transfer(DType.F32, 10, 4)
    accum, contrib = np.zeros(10, np.float32), np.ones(3, np.uint16)
    received, counters = np.zeros((WORLD, 3), np.uint8), np.zeros(N_REASONS, np.int64)
    good = kernels.ChunkStats(np.zeros(3, np.float32), np.zeros(3, np.uint64),
                              np.zeros(3, np.uint64))  # fmt: skip
    with pytest.raises(ValueError, match="final"):
        kernels.prepare_receive(session(), spec, accum, contrib, received, counters,
                                place=False, stats=good, final=0)  # fmt: skip
    short_b = good._replace(sum_b=np.zeros(2, np.uint64))
    with pytest.raises(ValueError, match=r"stats\.sum_b"):
        kernels.prepare_receive(session(), spec, accum, contrib, received, counters,
                                place=False, stats=short_b, final=2)  # fmt: skip
    with pytest.raises(ValueError, match="F32 reduce"):
        kernels.prepare_receive(session(), spec, accum, contrib, received, counters, place=True,
                                stats=good, final=2)  # fmt: skip
    with pytest.raises(ValueError, match="needs stats"):
        kernels.prepare_receive(session(), spec, accum, contrib, received, counters,
                                place=False, scale=0.5)  # fmt: skip
    with pytest.raises(ValueError, match="finite"):
        kernels.prepare_receive(session(), spec, accum, contrib, received, counters,
                                place=False, stats=good, final=2, scale=float("nan"))  # fmt: skip
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.prepare_receive(session(), spec, np.zeros(20, np.float32)[::2], contrib,
                                received, counters, place=False, stats=good, final=2)  # fmt: skip


@pytest.mark.parametrize("place", [False, True])
def test_replan_for_a_new_session_equals_a_fresh_plan(place: bool) -> None:
    """A receiver whose step window moved on re-derives only the spec (``kernels.replan``): the
    result is the plan prepare_receive makes for the new session, and a batch run with it
    lands as with a fresh one (a spec of the old window would reject steps past it)."""
    n, chunk_elems = 300, 32
    rng = np.random.default_rng(3)
    spec = transfer(DType.F32, n, chunk_elems, src_lo=1, src_hi=2, step=70)
    n_chunks = -(-n // chunk_elems)
    old, new = session(step_lo=0, step_hi=63), session(step_lo=7, step_hi=70)

    def arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.zeros(n, np.float32), np.ones(n_chunks, np.uint16),
            np.zeros((1, n_chunks), np.uint8), np.zeros(N_REASONS, np.int64),
        )  # fmt: skip

    results = []
    for make in ("replan", "fresh"):
        target, contrib, received, counters = arrays()
        plan = kernels.prepare_receive(
            old if make == "replan" else new, spec, target, contrib, received, counters,
            place=place,
        )  # fmt: skip
        if make == "replan":
            plan = kernels.replan(plan, new)
        assert plan.session is new
        results.append((plan, target, received, counters))
    (a, *got), (b, *want) = results
    np.testing.assert_array_equal(a.spec, b.spec)
    np.testing.assert_array_equal(a.key, b.key)
    assert not a.spec.flags.writeable
    data = shard(rng, n, DType.F32)
    packets = pack_all(data, DType.F32, chunk_elems, TagKey(), header(src=1, step=70))
    for plan, (_target, received, counters) in ((a, got), (b, want)):
        arena, lengths = arena_of(packets)
        assert kernels.receive_rows(plan, arena, lengths) == n_chunks
        assert received.all() and counters[0] == n_chunks
    np.testing.assert_array_equal(got[0], want[0])
