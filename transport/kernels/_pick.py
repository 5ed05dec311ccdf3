"""The sender's per-batch choice of chunks, compiled (private; see
:meth:`gradlane.transport.core.sender.SenderCore._send_batch`).

Theory of operation
-------------------
A sending pass serves one transfer and class at a time: the class's retransmissions first,
then the next new chunks in the transfer's send order while they stay within the classes the
pass may send, cut to the tokens the peer has. Written with NumPy (``tests/support/naive.py``
keeps that formulation as the reference) that is a dozen small-array operations per batch,
and after the send two more to number the datagrams and move the transfer's cursor; here it
is :func:`pick_chunks` before and :func:`after_sent` after, each one pass (the cursor's move,
:func:`advance_cursor`, is also the transfer's own).

The chunk states are :mod:`gradlane.transport.core.outgoing`'s (tests check they agree).
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._common import EXACT
from numba import njit

PENDING, LOST = 0, 2


@njit(**EXACT)
def pick_chunks(
    state: np.ndarray,
    prio: np.ndarray,
    order: np.ndarray,
    cursor: int,
    n_lost: int,
    cls: int,
    last: int,
    budget: int,
    out: np.ndarray,
) -> tuple[int, int]:
    """Write into ``out`` (at least ``budget`` long) the chunks a batch of class ``cls`` may
    take: the LOST chunks of class ``cls`` in index order (at most ``budget``; scanned only
    with ``n_lost``), then the new chunks from ``order[cursor:]`` while their class is within
    ``cls .. last``, up to ``budget`` in all. Returns (retransmissions, new chunks)."""
    n_retx = 0
    if n_lost:
        for c in range(state.shape[0]):
            if n_retx >= budget:
                break
            if state[c] == LOST and prio[c] == cls:
                out[n_retx] = c
                n_retx += 1
    n_fresh = 0
    n_chunks = order.shape[0]
    if n_retx < budget and cursor < n_chunks:
        end = min(cursor + (budget - n_retx), n_chunks)
        for i in range(cursor, end):
            c = order[i]
            p = prio[c]
            if p < cls or p > last:
                break
            out[n_retx + n_fresh] = c
            n_fresh += 1
    return n_retx, n_fresh


@njit(**EXACT)
def fit_chunks(lengths: np.ndarray, chunks: np.ndarray, avail: int) -> int:
    """How many of ``chunks`` (in order) fit in ``avail`` bytes of datagrams: all when they
    do, else those whose running total stays within it, and at least one (the pacer then
    takes one datagram of debt, so a pass always makes progress). 0 for no chunks."""
    total = 0
    for i in range(chunks.shape[0]):
        total += np.int64(lengths[chunks[i]])
        if total > avail:
            return max(i, 1)
    return chunks.shape[0]


@njit(**EXACT)
def advance_cursor(state: np.ndarray, order: np.ndarray, cursor: int) -> int:
    """``cursor`` moved past every chunk of ``order`` no longer PENDING (sent or skipped)."""
    n_chunks = order.shape[0]
    while cursor < n_chunks and state[order[cursor]] != PENDING:
        cursor += 1
    return cursor


@njit(**EXACT)
def after_sent(
    state: np.ndarray,
    order: np.ndarray,
    cursor: int,
    tx_seq: np.ndarray,
    next_seq: int,
    chunks: np.ndarray,
    lengths: np.ndarray,
    chunk_bytes: int,
    header_bytes: int,
    starts: np.ndarray,
    sizes: np.ndarray,
) -> int:
    """After a batch went out: number its datagrams (``tx_seq`` of ``chunks[i]`` is
    ``next_seq + i``), write each one's payload offset and size (``starts``, ``sizes``: the
    :class:`~gradlane.transport.core.events.DatagramRun` fields), and return the transfer's
    cursor moved past every chunk of ``order`` no longer PENDING."""
    for i in range(chunks.shape[0]):
        c = chunks[i]
        tx_seq[c] = next_seq + i
        starts[i] = np.int64(c) * chunk_bytes
        sizes[i] = np.int64(lengths[c]) - header_bytes
    return advance_cursor(state, order, cursor)
