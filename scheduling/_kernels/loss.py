"""Compiled loss decisions for a receiver's uniform layout (private; see
:mod:`gradlane.scheduling.loss`).

A receiving transfer holds its senders' chunks as rows of one matrix: every sender sends the
same chunks of the same shard, so one ``counts`` row gives the elements of every chunk.
:meth:`LossPolicy.decide` takes per-sender lists of any lengths and answers with some sixty
NumPy operations, each paying interpreter and dispatch overhead on arrays of a few dozen entries,
several times per lossy collective and rank. These kernels compute the same per-sender sums and
the same ordered ``need`` rows in one pass each.

The arithmetic is that of ``_Flat`` exactly (integer sums, the same order), for a receiver that
knows no classes (its chunks all rank as the unknown class), and the tests hold
:meth:`LossPolicy.decide_rows` to :meth:`LossPolicy.decide` on random inputs.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["need_rows", "tally"]


@njit(cache=True, nogil=True)
def tally(
    received: np.ndarray, counts: np.ndarray, protected: np.ndarray, known: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, bool, int]:
    """Per sender (row): missing elements, expected elements and their ratio (0 where nothing
    is expected); then the chunks missing in all, whether a sender with chunks missing blocks
    completion (its protected set unknown, or a protected chunk among them), and the most
    elements any sender misses."""
    n_src, n = received.shape
    per_sender = np.int64(0)
    for c in range(n):
        if counts[c] < 1:
            raise ValueError("every chunk holds at least one element")
        per_sender += np.int64(counts[c])
    missing_elems = np.zeros(n_src, dtype=np.int64)
    expected = np.full(n_src, per_sender, dtype=np.int64)
    frac = np.zeros(n_src, dtype=np.float64)
    n_missing = 0
    blocked = False
    worst = np.int64(0)
    for s in range(n_src):
        for c in range(n):
            if not received[s, c]:
                n_missing += 1
                missing_elems[s] += np.int64(counts[c])
                if not known[s] or protected[s, c]:
                    blocked = True
        if per_sender > 0:
            frac[s] = missing_elems[s] / per_sender
        worst = max(worst, missing_elems[s])
    return missing_elems, expected, frac, n_missing, blocked, worst


@njit(cache=True, nogil=True)
def need_rows(
    received: np.ndarray,
    counts: np.ndarray,
    protected: np.ndarray,
    known: np.ndarray,
    budget: int,
    every: bool,
) -> np.ndarray:
    """``(k, 2)`` rows (sender, chunk) of the chunks to ask for, most important first.

    ``every``: every missing chunk. Otherwise ``_Flat.needed``: every missing protected chunk,
    every missing chunk of a sender whose set is unknown, and per known sender the shortest
    prefix of its other missing chunks, in chunk order, whose recovery brings its missing
    elements within ``budget`` once the protected ones came. Order (``_Flat.need`` with every
    class unknown): protected (known) first, then chunk, then sender — two scans in that
    order, no sort.
    """
    n_src, n = received.shape
    take = np.zeros((n_src, n), dtype=np.bool_)
    m = 0
    for s in range(n_src):
        excess = np.int64(-budget)
        for c in range(n):
            if received[s, c]:
                continue
            if every or not known[s] or protected[s, c]:
                take[s, c] = True
                m += 1
            else:
                excess += np.int64(counts[c])
        if every or not known[s] or excess <= 0:
            continue
        before = np.int64(0)
        for c in range(n):
            if before >= excess:
                break
            if not received[s, c] and not protected[s, c]:
                take[s, c] = True
                m += 1
                before += np.int64(counts[c])
    out = np.empty((m, 2), dtype=np.int64)
    i = 0
    for first in (True, False):
        for c in range(n):
            for s in range(n_src):
                if take[s, c] and (known[s] and protected[s, c]) == first:
                    out[i, 0] = s
                    out[i, 1] = c
                    i += 1
    return out
