"""Ordered reduce (``prepare_receive(order=kernels.sum_order(...))``): whatever the arrival order,
duplicates and missing senders, the float32 sums are bit for bit those of adding the senders'
contributions in the given order (then, at completion, the staged ones past a gap)."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.transport import kernels
from gradlane.transport.wire.header import N_REASONS, SHARD_DTYPES, DType
from gradlane.transport.wire.tag import TagKey
from hypothesis import given
from hypothesis import strategies as st

from tests.support import naive
from tests.support.kernel_inputs import (
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
    dtype=st.sampled_from(list(SHARD_DTYPES)),
    n=st.integers(1, 400),
    chunk_elems=st.integers(1, 96),
    order=st.permutations(list(range(1, WORLD))),
    batches=st.integers(1, 3),
    data=st.data(),
)
def test_ordered_reduce_is_the_ordered_sum_whatever_the_arrival_order(
    dtype: DType, n: int, chunk_elems: int, order: list[int], batches: int, data
) -> None:
    rng = np.random.default_rng(n * 13 + chunk_elems)
    shards = {s: shard(rng, n, dtype) for s in order}
    packets = [
        (s, c, p)
        for s in order
        for c, p in enumerate(pack_all(shards[s], dtype, chunk_elems, TagKey(), header(src=s)))
    ]
    picks = data.draw(st.lists(st.integers(0, len(packets) - 1), max_size=2 * len(packets)))
    spec = transfer(dtype, n, chunk_elems, src_lo=0, src_hi=WORLD)
    own = rng.standard_normal(n).astype(np.float32) * np.float32(1e3)  # rank 0's contribution
    accum = own.copy()
    contrib = np.ones(spec.n_chunks, dtype=np.uint16)
    received = np.zeros((WORLD, spec.n_chunks), dtype=np.uint8)
    received[0] = 1
    counters = np.zeros(N_REASONS, dtype=np.int64)
    so = kernels.sum_order(order, WORLD, n, spec.n_chunks)
    plan = kernels.prepare_receive(session(), spec, accum, contrib, received, counters,
                                   place=False, order=so)  # fmt: skip
    cuts = sorted(data.draw(st.lists(st.integers(0, len(picks)), min_size=batches - 1,
                                     max_size=batches - 1)))  # fmt: skip
    for a, b in zip([0, *cuts], [*cuts, len(picks)], strict=True):
        if b > a:
            arena, lengths = arena_of([packets[i][2] for i in picks[a:b]])
            kernels.receive_rows(plan, arena, lengths)
    kernels.flush_order(plan)
    # The reference: own, then each sender in ``order`` whose chunk arrived, in float32.
    came = {(packets[i][0], packets[i][1]) for i in picks}
    ref = own.copy()
    for s in order:
        values = naive.as_float32(naive.wire_bits(shards[s], dtype), dtype)
        for c in range(spec.n_chunks):
            if (s, c) in came:
                part = slice(c * chunk_elems, (c + 1) * chunk_elems)
                ref[part] = (ref[part] + values[part]).astype(np.float32)
    assert np.array_equal(accum.view(np.uint32), ref.view(np.uint32))
    assert int(contrib.sum()) == spec.n_chunks + len(came)
    assert not so.staged.any()


def test_sum_order_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="distinct"):
        kernels.sum_order([1, 1], 3, 10, 2)
    with pytest.raises(ValueError, match="lie in"):
        kernels.sum_order([1, 3], 3, 10, 2)
    with pytest.raises(ValueError, match="float32"):
        kernels.sum_order([1, 2], 3, 10, 2, stage=np.empty(29, np.float32))
    spec = transfer(DType.F32, 10, 4)
    so = kernels.sum_order([1, 2], 3, 10, 3)  # 3 sender rows, but the transfer has WORLD
    with pytest.raises(ValueError, match="another transfer"):
        kernels.prepare_receive(
            session(), spec, np.zeros(10, np.float32), np.ones(3, np.uint16),
            np.zeros((WORLD, 3), np.uint8), np.zeros(N_REASONS, np.int64), place=False, order=so,
        )  # fmt: skip
