"""The sender's per-ACK pass over one outgoing transfer, checked (:func:`apply_ack`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from gradlane.transport.kernels import _ack


class AckResult(NamedTuple):
    """What :func:`apply_ack` found, in the order the sender passes it on.

    ``idx`` are the newly acknowledged chunks (ascending); ``sizes``, ``rtt`` (first
    transmissions only, NaN otherwise), ``paths`` and ``counted`` (bytes that leave the
    outstanding bytes: INFLIGHT chunks only) are per acknowledged chunk, the arguments of
    ``PathSet.on_acked``. ``n_lost``, ``n_inflight`` and ``abandoned_elems`` are what left those
    states. ``trigger_first``: the trigger chunk is among them, as a first transmission.
    ``path_bytes``/``path_hit``: acknowledged bytes per path, and the paths that had any.
    ``lost``: the chunks RACK declares lost (ascending).
    """

    idx: np.ndarray
    sizes: np.ndarray
    rtt: np.ndarray
    paths: np.ndarray
    counted: np.ndarray
    n_lost: int
    n_inflight: int
    abandoned_elems: int
    trigger_first: bool
    path_bytes: np.ndarray
    path_hit: np.ndarray
    lost: np.ndarray


class SentChunks(NamedTuple):
    """The per-chunk arrays of one outgoing transfer that :func:`apply_ack` reads (an
    :class:`~gradlane.transport.core.outgoing.OutTransfer`'s): 1-D, one entry per chunk, any
    strides; ``lengths`` may be longer than the others. ``state`` is written: chunks an ACK
    newly acknowledges become ACKED."""

    state: np.ndarray  # uint8 chunk states (outgoing.INFLIGHT, LOST, ACKED, ABANDONED)
    tx: np.ndarray  # uint8 transmissions so far (1: the RTT sample is clean, Karn)
    sent_at: np.ndarray  # float64 time of the last transmission
    path: np.ndarray  # int16 path of the last transmission
    prio: np.ndarray  # uint8 priority class
    counts: np.ndarray  # int64 elements per chunk
    lengths: np.ndarray  # int32 datagram length per chunk


#: The dtype of each :class:`SentChunks` array, in field order, then the bitmap's.

_ACK_DTYPES: tuple[np.dtype[Any], ...] = (
    np.dtype(np.uint8),
    np.dtype(np.uint8),
    np.dtype(np.float64),
    np.dtype(np.int16),
    np.dtype(np.uint8),
    np.dtype(np.int64),
    np.dtype(np.int32),
    np.dtype(np.bool_),
)


def _ack_arguments(
    chunks: tuple[object, ...], bits: object, base: int, n_paths: int, n_classes: int
) -> None:
    """Raise the ValueError that says what is wrong with :func:`apply_ack`'s arguments."""
    state = chunks[0]
    n = state.shape[0] if isinstance(state, np.ndarray) and state.ndim == 1 else -1
    for name, dt, a in zip(SentChunks._fields, _ACK_DTYPES, chunks, strict=False):
        if (
            not isinstance(a, np.ndarray)
            or a.dtype != dt
            or a.ndim != 1
            or (a.shape[0] != n and not (name == "lengths" and a.shape[0] >= n))
        ):
            got = f"{a.dtype.name} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"{name} must be a 1-D {dt.name} array of state's length; got {got}")
    if isinstance(state, np.ndarray) and not state.flags.writeable:
        raise ValueError("state is read-only; apply_ack marks acknowledged chunks in it")
    if not isinstance(bits, np.ndarray) or bits.dtype != np.bool_ or bits.ndim != 1:
        raise ValueError("bits must be a 1-D bool array (the ACK bitmap)")
    raise ValueError(
        f"base={base}, n_paths={n_paths}, n_classes={n_classes}: base >= 0, "
        "at least one path and one class"
    )


def apply_ack(
    chunks: SentChunks,
    bits: np.ndarray,
    *,
    base: int,
    trigger: int,
    now: float,
    n_paths: int,
    n_classes: int,
    reorder_window_s: float,
) -> AckResult:
    """Apply an ACK bitmap ``bits`` (bool, chunks ``base ..``) to one outgoing transfer.

    ``chunks`` are the transfer's per-chunk arrays (:class:`SentChunks`; ``state`` is written).
    Returns an :class:`AckResult`; ``trigger`` is the chunk whose arrival sent the ACK, and the
    RACK scan uses lanes of ``n_paths`` × ``n_classes`` and ``reorder_window_s``. Raises
    ValueError on wrong dtypes, shapes, a negative ``base``, or a chunk's path or class out of
    range.
    """
    state, tx, sent_at, path, prio, counts, lengths = chunks
    try:  # one cheap test per ACK; _ack_arguments says what is wrong when it fails
        dtypes = (state.dtype, tx.dtype, sent_at.dtype, path.dtype, prio.dtype, counts.dtype)
        ok = (*dtypes, lengths.dtype, bits.dtype) == _ACK_DTYPES and (
            state.ndim == lengths.ndim == bits.ndim == 1
            and state.shape == tx.shape == sent_at.shape == path.shape == prio.shape
            and state.shape == counts.shape
            and lengths.shape[0] >= state.shape[0]
            and state.flags.writeable
            and base >= 0
            and n_paths >= 1
            and n_classes >= 1
        )
    except AttributeError:
        ok = False
    if not ok:
        _ack_arguments(chunks, bits, base, n_paths, n_classes)
    idx, sizes, rtt, paths, counted, n_lost, n_inflight, abandoned, first, pbytes, hit, lost = (
        _ack.ack_scan(
            state,
            tx,
            sent_at,
            path,
            prio,
            counts,
            lengths,
            bits,
            base,
            trigger,
            float(now),
            n_paths,
            n_classes,
            float(reorder_window_s),
        )
    )
    # int()/bool(): already Python scalars when compiled; numpy ones under NUMBA_DISABLE_JIT.
    return AckResult(
        idx=idx,
        sizes=sizes,
        rtt=rtt,
        paths=paths,
        counted=counted,
        n_lost=int(n_lost),
        n_inflight=int(n_inflight),
        abandoned_elems=int(abandoned),
        trigger_first=bool(first),
        path_bytes=pbytes,
        path_hit=hit,
        lost=lost,
    )
