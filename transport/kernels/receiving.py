"""The receiver's checked kernel wrappers: validate a batch of datagrams, then reduce or place.

:func:`prepare_receive` checks once per transfer what every batch would otherwise check;
:func:`receive_rows` runs a batch with that plan. :func:`reduce_into` (reduce phase, adds into
a float32 accumulator) and :func:`place_into` (gather phase, copies bit-exactly) do both in one
call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from gradlane.transport.kernels import _receive as _rx
from gradlane.transport.kernels import _verdict as _vd
from gradlane.transport.kernels._checks import (
    _NO_U8,
    _NO_U16,
    _OUT_DTYPES,
    _U16_MAX,
    _arena,
    _array,
    _key_parts,
    _readonly,
    _typed,
    _wire_dtype,
)
from gradlane.transport.kernels.sending import _NO_STATS, ChunkStats
from gradlane.transport.wire.header import (
    N_REASONS,
    DType,
    SessionSpec,
    TransferSpec,
)

# _spec writes the fields in index order, one array: the layout it relies on.
assert tuple(range(_vd.SPEC_LEN)) == (
    _vd.S_JOB, _vd.S_ME, _vd.S_WORLD, _vd.S_STEP_LO, _vd.S_STEP_HI, _vd.S_N_BUCKETS,
    _vd.S_MAX_DATAGRAM, _vd.S_MODE, _vd.S_T_STEP, _vd.S_T_BUCKET, _vd.S_T_SHARD, _vd.S_T_PHASE,
    _vd.S_T_DTYPE, _vd.S_T_N_ELEMS, _vd.S_T_CHUNK_ELEMS, _vd.S_T_SRC_LO, _vd.S_T_SRC_HI,
    _vd.S_T_N_CHUNKS,
), "spec layout changed"  # fmt: skip


@lru_cache(maxsize=256)
def _spec(session: SessionSpec, transfer: TransferSpec) -> tuple[np.ndarray, np.ndarray]:
    """The int64 spec array the receive kernels read, and the tag key's words (cached)."""
    _wire_dtype(transfer.dtype)
    if transfer.chunk_elems < 1 or transfer.n_elems < 0:
        raise ValueError(
            f"transfer needs chunk_elems >= 1 and n_elems >= 0, got {transfer.chunk_elems} "
            f"and {transfer.n_elems}"
        )
    if not 0 <= transfer.src_lo < transfer.src_hi <= _U16_MAX + 1:
        raise ValueError(
            f"transfer ranks src_lo={transfer.src_lo}, src_hi={transfer.src_hi} must satisfy "
            "0 <= src_lo < src_hi <= 65536"
        )
    mode, key = _key_parts(session.key)
    t = transfer
    spec = np.array(
        (session.job, session.me, session.world, session.step_lo, session.step_hi,
         session.n_buckets, session.max_datagram, mode, t.step, t.bucket, t.shard, t.phase,
         t.dtype, t.n_elems, t.chunk_elems, t.src_lo, t.src_hi, t.n_chunks),
        dtype=np.int64,
    )  # fmt: skip
    spec.flags.writeable = False
    return spec, key


_all_rows = np.arange(1024, dtype=np.int64)

_all_rows.flags.writeable = False


def _identity_rows(n: int) -> np.ndarray:
    """``arange(n)`` as int64, from a shared read-only cache (the batch without ``rows``)."""
    global _all_rows  # noqa: PLW0603 - a grow-only cache; replacing the array is atomic
    table = _all_rows
    if table.shape[0] < n:
        table = np.arange(max(n, 2 * table.shape[0]), dtype=np.int64)
        table.flags.writeable = False
        _all_rows = table
    return table[:n]


_NO_U32 = np.empty(0, dtype=np.uint32)
_NO_I32 = np.empty(0, dtype=np.int32)
_NO_STAGE = np.empty((0, 0), dtype=np.float32)
_NO_STAGED = np.empty((0, 0), dtype=np.uint8)

_ONE = np.float32(1.0)


class SumOrder(NamedTuple):
    """What a reduce needs to add contributions in a fixed order of senders (deterministic
    sums): ``order`` the sender rows (``src - src_lo``) in the order they are added, ``pos`` the
    next one due per chunk, ``stage`` (float32, ``(src_hi - src_lo, n_elems)``) where a
    contribution that came early waits, and ``staged`` its flags. Build it with
    :func:`sum_order`."""

    order: np.ndarray
    pos: np.ndarray
    stage: np.ndarray
    staged: np.ndarray


_NO_ORDER = SumOrder(_NO_I32, _NO_I32, _NO_STAGE, _NO_STAGED)


def sum_order(
    rows: Sequence[int], n_src: int, n_elems: int, n_chunks: int, stage: np.ndarray | None = None
) -> SumOrder:
    """A :class:`SumOrder` adding sender rows ``rows`` in that order, for a transfer of
    ``n_src`` sender rows, ``n_elems`` elements and ``n_chunks`` chunks. ``stage`` may be a
    float32 C-contiguous buffer of at least ``n_src * n_elems`` elements to reuse (its content
    does not matter): a fresh one costs a page fault per page it stages into."""
    order = np.asarray(rows, dtype=np.int32)
    if order.ndim != 1 or len(set(order.tolist())) != order.shape[0]:
        raise ValueError(f"rows must be distinct sender rows, got {list(rows)}")
    if order.size and not (int(order.min()) >= 0 and int(order.max()) < n_src):
        raise ValueError(f"rows {order.tolist()} must lie in 0..{n_src - 1}")
    need = n_src * n_elems
    if stage is None:
        buf = np.empty(need, dtype=np.float32)
    else:
        buf = _array("stage", stage, 1, writeable=True)
        if buf.dtype != np.float32 or buf.shape[0] < need or not buf.flags.c_contiguous:
            raise ValueError(f"stage must be C-contiguous float32 with >= {need} elements")
    return SumOrder(
        order,
        np.zeros(n_chunks, dtype=np.int32),
        buf[:need].reshape(n_src, n_elems),
        np.zeros((n_src, n_chunks), dtype=np.uint8),
    )


def session_checks(
    arena: np.ndarray, lengths: np.ndarray, rows: np.ndarray, session: SessionSpec
) -> np.ndarray:
    """Each listed row's first failing reason (int64; ``Reason.OK``: none) among
    :func:`~gradlane.transport.wire.header.validate`'s checks against ``session`` alone, in its
    order, the tag included: one compiled pass over a batch, so that packets failing them (a
    flood of forged or garbled ones) never cost Python per packet. ``arena`` is the receive
    arena (uint8 rows), ``lengths`` int64 per row."""
    spec = _session_spec(session)
    rows_a = _readonly(_arena(arena, writeable=False))
    lens = _readonly(np.ascontiguousarray(lengths, dtype=np.int64))
    idx = _readonly(np.ascontiguousarray(rows, dtype=np.int64))
    out = np.empty(idx.shape[0], dtype=np.int64)
    _vd.session_verdicts(rows_a, lens, idx, spec, _key_parts(session.key)[1], out)
    return out


@lru_cache(maxsize=64)
def _session_spec(session: SessionSpec) -> np.ndarray:
    """The receive kernels' spec of ``session`` with a transfer no packet names."""
    spec = _spec(session, TransferSpec(0, 0, 0, 0, DType.F32, 0, 1, 0, 1))[0].copy()
    spec[_vd.S_T_STEP] = -1
    spec.flags.writeable = False
    return spec


def flush_order(plan: ReceivePlan) -> int:
    """Add every contribution still staged by an ordered reduce, in its order (a chunk that
    completed without some sender); returns how many. Call it when the transfer completes."""
    o = plan.order
    if o.order.shape[0] == 0:
        return 0
    return int(
        _rx.flush_ordered(plan.target, plan.transfer.chunk_elems, o.order, o.pos, o.stage, o.staged)
    )


class ReceivePlan(NamedTuple):
    """A receiving transfer's checked kernel arguments, everything but the batch
    (:func:`prepare_receive`); :func:`receive_rows` runs a batch with it."""

    session: SessionSpec
    transfer: TransferSpec
    spec: np.ndarray
    key: np.ndarray  # TagKey.words
    place: bool
    target: np.ndarray  # float32 accumulator (reduce) or the output's raw bits (place)
    contrib: np.ndarray
    received: np.ndarray
    counters: np.ndarray
    nonfinite: np.ndarray = _NO_U8  # per chunk, set when its data holds NaN/inf (place; empty: off)
    stats: ChunkStats = _NO_STATS  # per-chunk statistics of completed sums (F32 reduce; empty: off)
    final: int = 0  # the contributor count that completes a chunk
    target_bits: np.ndarray = _NO_U32  # the accumulator's u32 view (F32 reduce with stats)
    scale: np.float32 = _ONE  # what a completed sum is multiplied by (F32 reduce with stats)
    order: SumOrder = _NO_ORDER  # a fixed order of senders for the reduce (empty: arrival order)


def replan(plan: ReceivePlan, session: SessionSpec) -> ReceivePlan:
    """``plan`` for another session of the same receiver (its step window moved on): only the
    spec changes, the arrays were checked when the plan was made (:func:`prepare_receive`)."""
    spec, key = _spec(session, plan.transfer)
    return plan._replace(session=session, spec=spec, key=key)


def prepare_receive(
    session: SessionSpec,
    transfer: TransferSpec,
    target: np.ndarray,
    contrib: np.ndarray | None,
    received: np.ndarray,
    counters: np.ndarray,
    *,
    place: bool,
    stats: ChunkStats | None = None,
    final: int = 0,
    scale: float = 1.0,
    nonfinite: np.ndarray | None = None,
    order: SumOrder | None = None,
) -> ReceivePlan:
    """Check once what :func:`reduce_into` (``place=False``: ``target`` is ``accum``) or
    :func:`place_into` (``target`` is ``out``) would check on every call, except the batch.

    A receiver makes one per transfer (again when its session's step window moves): a batch
    then costs a few attribute checks instead of some twenty NumPy operations.

    ``stats`` (F32 reduce only: arrays of one entry per chunk) asks the kernel for the
    :func:`chunk_stats` of every chunk whose ``contrib`` reaches ``final`` (>= 1), computed from
    the finished sum as the last contribution lands: a sender of the reduced shard then needs
    no pass over it. Entries of chunks that never reach ``final`` are left as they were. Such a
    finished chunk is first multiplied by ``scale`` (float32; e.g. ``1 / world`` for a mean),
    in the same pass; the other chunks are not.

    ``nonfinite`` (place only: uint8, one per chunk) gets 1 for every chunk whose placed data
    holds a NaN or an infinity, checked in the copy loop.

    ``order`` (reduce only; :func:`sum_order`) adds the contributions in a fixed order of
    senders instead of as they arrive, so the float32 sums are the same bits on every run; a
    chunk that completes without some sender needs :func:`flush_order` at the end.
    """
    spec, key = _spec(session, transfer)
    recv = _array("received", received, 2, writeable=True)
    if recv.dtype == np.bool_:
        recv = recv.view(np.uint8)
    want = (transfer.src_hi - transfer.src_lo, transfer.n_chunks)
    if recv.dtype != np.uint8 or recv.shape != want:
        raise ValueError(
            f"received must be uint8 of shape (src_hi - src_lo, n_chunks) = {want}, got "
            f"{recv.dtype.name}{recv.shape}"
        )
    _typed("counters", counters, np.int64, (N_REASONS,))
    shape0 = (transfer.n_chunks,)
    wire = DType(transfer.dtype)
    if stats is not None and (place or wire != DType.F32):
        raise ValueError("stats are computed by the F32 reduce only")
    if scale != 1.0 and stats is None:
        raise ValueError("scale applies to finished chunks: it needs stats")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if place:
        out_a = _array("out", target, 1, writeable=True)
        if out_a.dtype not in _OUT_DTYPES[wire] or out_a.shape != (transfer.n_elems,):
            names = ", ".join(d.name for d in _OUT_DTYPES[wire])
            raise ValueError(
                f"out for {wire.name} must be one of ({names}) with shape ({transfer.n_elems},), "
                f"got {out_a.dtype.name}{out_a.shape}"
            )
        tgt = out_a.view(np.uint32 if wire == DType.F32 else np.uint16)
        con = _NO_U16  # optional in the gather phase
        if contrib is not None:
            con = _typed("contrib", contrib, np.uint16, (transfer.n_chunks,))
        if nonfinite is not None:
            nonf = _typed("nonfinite", nonfinite, np.uint8, (transfer.n_chunks,), writeable=True)
    else:
        if nonfinite is not None:
            raise ValueError("nonfinite is found by the place (gather) kernel only")
        tgt = _typed("accum", target, np.float32, (transfer.n_elems,))
        assert contrib is not None
        con = _typed("contrib", contrib, np.uint16, (transfer.n_chunks,))
    plan = ReceivePlan(
        session=session,
        transfer=transfer,
        spec=spec,
        key=key,
        place=bool(place),
        target=tgt,
        contrib=con,
        received=recv,
        counters=counters,
    )
    if place and nonfinite is not None:
        plan = plan._replace(nonfinite=nonf)
    if order is not None:
        if place:
            raise ValueError("a sum order applies to the reduce only")
        n_src = want[0]
        if (
            order.stage.shape != (n_src, transfer.n_elems)
            or order.pos.shape != shape0
            or (order.staged.shape != (n_src, transfer.n_chunks))
        ):
            raise ValueError("order was built for another transfer (see sum_order)")
        plan = plan._replace(order=order)
    if stats is None:
        return plan
    shape = (transfer.n_chunks,)
    if not 1 <= final <= _U16_MAX:
        raise ValueError(f"final must be a contributor count in [1, {_U16_MAX}], got {final}")
    if not tgt.flags.c_contiguous:
        raise ValueError("accum must be C-contiguous to compute chunk statistics")
    st = ChunkStats(
        _typed("stats.norms", stats.norms, np.float32, shape, writeable=True),
        _typed("stats.sum_a", stats.sum_a, np.uint64, shape, writeable=True),
        _typed("stats.sum_b", stats.sum_b, np.uint64, shape, writeable=True),
    )
    return plan._replace(
        stats=st, final=final, target_bits=tgt.view(np.uint32), scale=np.float32(scale)
    )


def receive_rows(
    plan: ReceivePlan,
    arena: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray | None = None,
    verdicts: np.ndarray | None = None,
) -> int:
    """Run one batch (``arena`` rows, or those listed in ``rows``) with a prepared plan: the
    reduce or place of :func:`reduce_into` / :func:`place_into`. Returns the accepted count."""
    rows_a = _readonly(_arena(arena, writeable=False))
    n_rows = rows_a.shape[0]
    lens = _array("lengths", lengths, 1)
    if lens.dtype.kind not in "ui" or lens.shape[0] != n_rows:
        raise ValueError(
            f"lengths must be an integer array with one entry per arena row ({n_rows}), got "
            f"{lens.dtype.name}{lens.shape}"
        )
    lens = _readonly(lens.astype(np.int64, copy=False))
    if rows is None:
        idx = _identity_rows(n_rows)
    else:
        idx = _array("rows", rows, 1)
        if idx.dtype.kind not in "ui":
            raise ValueError(f"rows must be an integer array, got {idx.dtype.name}")
        idx = _readonly(idx.astype(np.int64, copy=False))  # each row's range: the kernel's check
    verd = _NO_U8 if verdicts is None else _typed("verdicts", verdicts, np.uint8, (idx.shape[0],))
    return _run(plan, rows_a, lens, idx, verd)


def receive_batch(
    plan: ReceivePlan,
    arena: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    verdicts: np.ndarray,
) -> int:
    """:func:`receive_rows` for a caller whose arrays are its own and well-formed, checked
    once when it made them: ``arena`` uint8, 2-D, C-contiguous, 8-byte aligned, rows a
    multiple of 8 bytes; ``lengths`` int64, one per arena row; ``rows`` int64; ``verdicts``
    uint8, one per row of ``rows``. Those properties are not checked here (a few µs a batch,
    on the receiver's hot path); what the datagrams hold still is, by the kernel, which also
    checks every row index and every length against its row.
    """
    return _run(plan, _readonly(arena), _readonly(lengths), _readonly(rows), verdicts)


def _run(
    p: ReceivePlan, rows_a: np.ndarray, lens: np.ndarray, idx: np.ndarray, verd: np.ndarray
) -> int:
    """The reduce or place kernel of ``p`` over checked, read-only batch arrays."""
    args = (p.spec, p.key)
    if p.place:
        words = rows_a.view(np.uint32 if p.target.dtype == np.uint32 else np.uint16)
        return int(_rx.place_rows(rows_a, words, lens, idx, *args, p.target, p.contrib,
                                  p.nonfinite, p.received, p.counters, verd))  # fmt: skip
    if p.transfer.dtype == DType.F32:
        return int(_rx.reduce_f32(rows_a, lens, idx, *args, p.target, p.contrib, p.received,
                                  p.counters, verd, p.target_bits, *p.stats, p.final,
                                  p.scale, *p.order))  # fmt: skip
    return int(_rx.reduce_u16(rows_a, lens, idx, *args, p.target, p.contrib, p.received,
                              p.counters, verd, p.transfer.dtype == DType.BF16,
                              *p.order))  # fmt: skip


def reduce_into(
    arena: np.ndarray,
    lengths: np.ndarray,
    accum: np.ndarray,
    contrib: np.ndarray,
    received: np.ndarray,
    *,
    session: SessionSpec,
    transfer: TransferSpec,
    counters: np.ndarray,
    rows: np.ndarray | None = None,
    verdicts: np.ndarray | None = None,
) -> int:
    """Validate a batch of received datagrams and add the good DATA payloads; returns accepted.

    The batch is every arena row, or the rows listed in ``rows``; ``lengths`` has one datagram
    length per arena row. Each is checked exactly like
    :func:`~gradlane.transport.wire.header.validate` ``(data, session, transfer)`` (same Reason,
    same order); a packet it accepts that is not DATA gets BAD_KIND (route control packets
    elsewhere), and one whose ``received[src - transfer.src_lo, chunk]`` is set
    gets DUPLICATE. A good packet is added into ``accum`` (float32, ``transfer.n_elems``; f16/bf16
    converted) at ``chunk * chunk_elems``, ``contrib[chunk] += 1`` (uint16, one per chunk) and its
    ``received`` entry (uint8 or bool, ``(src_hi - src_lo, n_chunks)``) is set. ``counters``
    (int64, one per Reason) gets +1 at each item's Reason (OK counts accepted); ``verdicts``
    (uint8, one per item, optional) gets it too. A datagram longer than its row is OVERSIZED.
    """
    plan = prepare_receive(session, transfer, accum, contrib, received, counters, place=False)
    return receive_rows(plan, arena, lengths, rows, verdicts)


def place_into(
    arena: np.ndarray,
    lengths: np.ndarray,
    out: np.ndarray,
    received: np.ndarray,
    *,
    session: SessionSpec,
    transfer: TransferSpec,
    counters: np.ndarray,
    contrib: np.ndarray | None = None,
    rows: np.ndarray | None = None,
    verdicts: np.ndarray | None = None,
    nonfinite: np.ndarray | None = None,
) -> int:
    """Gather phase of :func:`reduce_into`: copy each good payload bit-exactly into ``out``.

    ``out`` has ``transfer.n_elems`` elements of the wire type: float32 (or uint32 bits) for F32;
    uint16/int16/float16 for F16; uint16/int16 for BF16. Validation, ``received``, ``counters``,
    ``verdicts`` and ``rows`` are as in :func:`reduce_into`; ``contrib`` and ``nonfinite`` (see
    :func:`prepare_receive`) are optional.
    """
    plan = prepare_receive(
        session, transfer, out, contrib, received, counters, place=True, nonfinite=nonfinite
    )
    return receive_rows(plan, arena, lengths, rows, verdicts)
