"""The sender's compiled batch choice (kernels/_pick.py) against the NumPy it replaced in
SenderCore._send_batch (tests/support/naive.py): which chunks a batch takes, how many fit the
tokens, and the bookkeeping after it went out. Derandomized Hypothesis draws the shapes; a seeded
generator fills the arrays."""

from __future__ import annotations

import numpy as np
from gradlane.transport.core import outgoing
from gradlane.transport.kernels import _pick
from gradlane.transport.wire.header import HEADER_SIZE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import naive

SETTINGS = settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_the_states_agree_with_the_sender_s():
    assert (_pick.PENDING, _pick.LOST) == (outgoing.PENDING, outgoing.LOST)


def _transfer(seed: int, n: int, n_classes: int) -> dict:
    rng = np.random.default_rng(seed)
    prio = rng.integers(0, n_classes, n).astype(np.uint8)
    return {
        "state": rng.choice([0, 0, 0, 1, 2, 3, 4], n).astype(np.uint8),
        "prio": prio,
        "order": np.argsort(prio, kind="stable").astype(np.int64),
        "lengths": rng.integers(HEADER_SIZE + 4, 9000, max(n, 1)).astype(np.int32),
    }


@SETTINGS
@given(
    n=st.integers(1, 80),
    n_classes=st.integers(1, 4),
    budget=st.integers(1, 100),
    seed=st.integers(0, 2**31),
)
def test_pick_and_fit_equal_the_numpy_choice(n, n_classes, budget, seed):
    t = _transfer(seed, n, n_classes)
    rng = np.random.default_rng(seed + 1)
    cursor = int(rng.integers(0, n + 1))
    n_lost = int((t["state"] == outgoing.LOST).sum()) if rng.random() < 0.8 else 0
    cls = int(rng.integers(0, n_classes))
    last = int(rng.integers(cls, n_classes + 1))
    out = np.full(budget, -1, dtype=np.int64)
    n_retx, n_fresh = _pick.pick_chunks(
        t["state"], t["prio"], t["order"], cursor, n_lost, cls, last, budget, out
    )
    retx, fresh = naive.pick_chunks(
        t["state"], t["prio"], t["order"], cursor, n_lost, cls, last, budget
    )
    assert out[:n_retx].tolist() == retx.tolist()
    assert out[n_retx : n_retx + n_fresh].tolist() == fresh.tolist()
    chunks = out[: n_retx + n_fresh]
    for avail in (0, 1, int(rng.integers(0, 60_000)), 1 << 40):
        assert _pick.fit_chunks(t["lengths"], chunks, avail) == naive.fit_chunks(
            t["lengths"], chunks, avail
        ), avail


@SETTINGS
@given(n=st.integers(1, 80), seed=st.integers(0, 2**31))
def test_after_sent_equals_the_numpy_bookkeeping(n, seed):
    t = _transfer(seed, n, 3)
    rng = np.random.default_rng(seed + 2)
    cursor = int(rng.integers(0, n + 1))
    chunks = rng.permutation(n)[: int(rng.integers(1, n + 1))].astype(np.int64)
    t["state"][chunks] = outgoing.INFLIGHT  # as note_sent leaves them
    seq, want_seq = np.zeros(n, np.int64), np.zeros(n, np.int64)
    starts, sizes = np.empty(chunks.size, np.int64), np.empty(chunks.size, np.int64)
    got = _pick.after_sent(
        t["state"], t["order"], cursor, seq, 7, chunks, t["lengths"], 8924, HEADER_SIZE,
        starts, sizes,
    )  # fmt: skip
    want, want_starts, want_sizes = naive.after_sent(
        t["state"], t["order"], cursor, want_seq, 7, chunks, t["lengths"], 8924
    )
    assert got == want
    assert seq.tolist() == want_seq.tolist()
    assert starts.tolist() == want_starts.tolist() and sizes.tolist() == want_sizes.tolist()
