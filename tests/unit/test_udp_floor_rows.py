"""The batched UDP floor's compiled pass (``gradlane.bench.perf.udp_floor._apply_rows``): which rows
it adds, copies, skips, and keeps for the next repetition (a DDP hook's buckets follow each other,
so a peer may already send the next bucket's datagrams)."""

from __future__ import annotations

import numpy as np
from gradlane.bench.perf.udp_floor import HDR, HDR_BYTES, _apply_rows


def _rows(specs: list[tuple[int, int, int, np.ndarray]], width: int = 64) -> np.ndarray:
    rows = np.zeros((len(specs), HDR_BYTES + 4 * width), dtype=np.uint8)
    for i, (rep, phase, off, payload) in enumerate(specs):
        HDR.pack_into(rows[i], 0, rep, phase, off, payload.shape[0])
        rows[i, HDR_BYTES : HDR_BYTES + 4 * payload.shape[0]] = payload.view(np.uint8)
    return rows


def test_rows_are_added_copied_skipped_or_kept_for_the_next_repetition():
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
        ]
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
