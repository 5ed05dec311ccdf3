"""Per-batch bookkeeping of the receive path as single kernels (private to the endpoint and the
receiver core).

:func:`frame_rows`: every datagram the endpoint holds is first checked for what any gradlane
packet of this job must be — length, magic, version, kind, job token — in
:func:`gradlane.transport.wire.header.validate`'s order, the first failure winning and being
counted. The good rows are split into DATA rows and control rows, and the DATA rows' transfer key
(step, bucket, shard, phase) is compared with the first one's: a batch is almost always one
transfer's packets, which then need no grouping at all.

:func:`note_arrivals`: after the reduce or place kernel has judged a batch of one transfer's
DATA rows, the receiver's acknowledgement state follows them: per sender, the packets since its
last ACK, the newest packet (the ACK's trigger, for the sender's RTT sample) and its path, when
the ACK is due, and when the sender's first pass was seen to end (``Flags.PASS_END``).

Each is one compiled pass where NumPy would take one to two dozen operations per batch, each
paying interpreter and dispatch overhead on a few dozen rows; the pass costs about as much as one
of them.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._common import EXACT
from gradlane.transport.wire.header import HEADER_SIZE, MAGIC, VERSION, Flags, Kind, Reason
from numba import njit

_OVERSIZED = int(Reason.OVERSIZED)
_TRUNCATED = int(Reason.TRUNCATED)
_BAD_MAGIC = int(Reason.BAD_MAGIC)
_BAD_VERSION = int(Reason.BAD_VERSION)
_BAD_KIND = int(Reason.BAD_KIND)
_FOREIGN_JOB = int(Reason.FOREIGN_JOB)
_DATA = int(Kind.DATA)
_PASS_END = int(Flags.PASS_END)
_FLAGS_AT = 4  # the flags byte of a header (HEADER_DTYPE)
_MAX_KIND = int(max(Kind))
_I64 = np.int64


@njit(inline="always", **EXACT)
def _u16(row: np.ndarray, at: int) -> int:
    return _I64(row[at]) | (_I64(row[at + 1]) << 8)


@njit(inline="always", **EXACT)
def _u32(row: np.ndarray, at: int) -> int:
    return _u16(row, at) | (_u16(row, at + 2) << 16)


@njit(**EXACT)
def frame_rows(
    arena: np.ndarray,
    lengths: np.ndarray,
    n: int,
    job: int,
    counters: np.ndarray,
    data_rows: np.ndarray,
    ctrl_rows: np.ndarray,
    key: np.ndarray,
) -> tuple[int, int, bool]:
    """Check rows ``0..n-1`` of ``arena`` (uint8, one datagram per row; ``lengths`` as received,
    longer than a row = truncated by the receive call).

    A failing row adds 1 to ``counters[reason]`` and goes nowhere. A good DATA row's index goes
    to ``data_rows``, any other good row's to ``ctrl_rows``. ``key`` (int64, 4) gets the first
    DATA row's (step, bucket, shard, phase). Returns ``(n_data, n_ctrl, mixed)``, ``mixed``
    when some DATA row carries another key than the first.
    """
    if n > arena.shape[0] or n > lengths.shape[0] or n > data_rows.shape[0]:
        raise ValueError("frame_rows: more rows than the arena, lengths or data_rows hold")
    if n > ctrl_rows.shape[0] or key.shape[0] < 4:
        raise ValueError("frame_rows: ctrl_rows must hold n rows and key 4 fields")
    width = arena.shape[1]
    nd = 0
    nc = 0
    mixed = False
    for i in range(n):
        ln = lengths[i]
        if ln > width:
            counters[_OVERSIZED] += 1
            continue
        if ln < HEADER_SIZE:
            counters[_TRUNCATED] += 1
            continue
        row = arena[i]
        if _u16(row, 0) != MAGIC:
            counters[_BAD_MAGIC] += 1
            continue
        if row[2] != VERSION:
            counters[_BAD_VERSION] += 1
            continue
        kind = _I64(row[3])
        if kind < _DATA or kind > _MAX_KIND:
            counters[_BAD_KIND] += 1
            continue
        if _u32(row, 8) != job:
            counters[_FOREIGN_JOB] += 1
            continue
        if kind != _DATA:
            ctrl_rows[nc] = i
            nc += 1
            continue
        step, bucket, shard, phase = _u32(row, 12), _u16(row, 16), _u16(row, 18), _I64(row[7])
        if nd == 0:
            key[0], key[1], key[2], key[3] = step, bucket, shard, phase
        elif step != key[0] or bucket != key[1] or shard != key[2] or phase != key[3]:
            mixed = True
        data_rows[nd] = i
        nd += 1
    return nd, nc, mixed


@njit(**EXACT)
def group_rows(
    arena: np.ndarray, rows: np.ndarray, out_rows: np.ndarray, keys: np.ndarray, starts: np.ndarray
) -> int:
    """Group the DATA ``rows`` of a mixed batch by transfer key (step, bucket, shard, phase).

    Writes the distinct keys in ascending order to ``keys`` (int64, ``(len(rows), 4)``), each
    group's rows, in batch order, to ``out_rows[starts[g]:starts[g + 1]]`` (``starts``: int64,
    ``len(rows) + 1``), and returns the number of groups. A batch mixes a handful of transfers,
    so the keys are found by a scan over those seen so far and sorted by insertion.
    """
    n = rows.shape[0]
    if out_rows.shape[0] < n or keys.shape[0] < n or keys.shape[1] < 4 or starts.shape[0] <= n:
        raise ValueError("group_rows: out_rows, keys and starts must hold every row")
    group = np.empty(n, dtype=np.int64)
    n_groups = 0
    for i in range(n):
        row = arena[rows[i]]
        step, bucket, shard, phase = _u32(row, 12), _u16(row, 16), _u16(row, 18), _I64(row[7])
        g = 0
        while g < n_groups and not (
            keys[g, 0] == step and keys[g, 1] == bucket and keys[g, 2] == shard
            and keys[g, 3] == phase
        ):  # fmt: skip
            g += 1
        if g == n_groups:
            keys[g, 0], keys[g, 1], keys[g, 2], keys[g, 3] = step, bucket, shard, phase
            n_groups += 1
        group[i] = g
    # Ascending key order: rank each group by insertion into the sorted order.
    rank = np.arange(n_groups)
    for a in range(1, n_groups):
        b = a
        while b > 0 and _key_less(keys, rank[b], rank[b - 1]):
            rank[b], rank[b - 1] = rank[b - 1], rank[b]
            b -= 1
    pos = np.empty(n_groups, dtype=np.int64)  # group -> its place in the sorted order
    for k in range(n_groups):
        pos[rank[k]] = k
    count = np.zeros(n_groups + 1, dtype=np.int64)
    for i in range(n):
        count[pos[group[i]] + 1] += 1
    for k in range(n_groups):
        count[k + 1] += count[k]
    for k in range(n_groups + 1):
        starts[k] = count[k]
    for i in range(n):  # a stable counting sort: each group's rows stay in batch order
        k = pos[group[i]]
        out_rows[count[k]] = rows[i]
        count[k] += 1
    sorted_keys = keys[rank].copy()
    keys[:n_groups] = sorted_keys
    return n_groups


@njit(inline="always", **EXACT)
def _key_less(keys: np.ndarray, a: int, b: int) -> bool:
    for f in range(4):
        if keys[a, f] != keys[b, f]:
            return keys[a, f] < keys[b, f]
    return False


_OK = int(Reason.OK)
_DUPLICATE = int(Reason.DUPLICATE)


@njit(**EXACT)
def note_arrivals(
    arena: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    verdicts: np.ndarray,
    paths: np.ndarray,
    src_lo: int,
    now: float,
    ack_at: float,
    new_since_ack: np.ndarray,
    trigger: np.ndarray,
    trigger_at: np.ndarray,
    path: np.ndarray,
    ack_due: np.ndarray,
    pass_end: np.ndarray,
) -> tuple[int, int, int, int]:
    """Acknowledgement state after a judged batch: ``rows`` of ``arena`` (with ``lengths`` and
    ``paths`` per arena row) and their ``verdicts`` (Reason codes, one per item of ``rows``).

    Per accepted packet of sender row ``r = src - src_lo``: ``new_since_ack[r] += 1``, its chunk
    becomes ``trigger[r]`` (the newest arrival wins) at ``trigger_at[r] = now`` on ``path[r]``,
    and an ACK not yet due becomes due at ``ack_at``. A duplicate (our ACK was lost or late)
    makes the ACK due by ``ack_at`` at the latest. An accepted or duplicate packet flagged
    ``PASS_END`` sets ``pass_end[r] = now`` unless it is set already (not ``inf``). Returns
    ``(accepted, duplicates, bytes accepted, senders whose pass end is new)``.
    """
    if rows.shape[0] > verdicts.shape[0]:
        raise ValueError("note_arrivals: one verdict per row")
    n_src = new_since_ack.shape[0]
    if trigger.shape[0] != n_src or trigger_at.shape[0] != n_src or path.shape[0] != n_src:
        raise ValueError("note_arrivals: the per-sender arrays differ in length")
    if ack_due.shape[0] != n_src or pass_end.shape[0] != n_src:
        raise ValueError("note_arrivals: the per-sender arrays differ in length")
    n_ok = 0
    n_dup = 0
    nbytes = 0
    n_end = 0
    for j in range(rows.shape[0]):
        v = verdicts[j]
        if v not in (_OK, _DUPLICATE):
            continue
        i = rows[j]
        r = _u16(arena[i], 20) - src_lo
        if 0 <= r < n_src and arena[i, _FLAGS_AT] & _PASS_END and pass_end[r] == np.inf:
            pass_end[r] = now
            n_end += 1
        if v == _DUPLICATE:
            n_dup += 1
            if 0 <= r < n_src and ack_due[r] > ack_at:
                ack_due[r] = ack_at
            continue
        if not 0 <= r < n_src:  # cannot happen: the kernel that accepted it checked src
            raise ValueError("note_arrivals: an accepted packet from outside the transfer")
        n_ok += 1
        nbytes += lengths[i]
        new_since_ack[r] += 1
        trigger[r] = _u32(arena[i], 24)
        trigger_at[r] = now
        path[r] = paths[i]
        if ack_due[r] == np.inf:
            ack_due[r] = ack_at
    return n_ok, n_dup, nbytes, n_end


@njit(**EXACT)
def pass_end_gaps(
    received: np.ndarray,
    rows: np.ndarray,
    pass_end: np.ndarray,
    trigger_at: np.ndarray,
    fin: np.ndarray,
    drained_at: float,
    gap: np.ndarray,
) -> float:
    """Per sender row ``rows[k]`` of a receiving transfer: ``gap[k]`` when its first pass
    ended (``pass_end`` finite), a drain began at or after that and after its newest arrival
    (``drained_at >= max(pass_end, trigger_at)``), it sent no FIN, and a chunk is still
    missing from ``received`` — a gap that is loss once the reorder window has passed (the
    receiver's theory of operation). Returns the earliest such pass end (``inf``: no gap).
    One pass instead of ~10 NumPy calls: a lossy receiver asks at every drain."""
    if gap.shape[0] != rows.shape[0]:
        raise ValueError("pass_end_gaps: one gap flag per sender row")
    first = np.inf
    for k in range(rows.shape[0]):
        r = rows[k]
        ended = pass_end[r]
        g = False
        if np.isfinite(ended) and not fin[r] and drained_at >= max(ended, trigger_at[r]):
            for c in range(received.shape[1]):
                if received[r, c] == 0:
                    g = True
                    break
        gap[k] = g
        if g and ended < first:
            first = ended
    return first
