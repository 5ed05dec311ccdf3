"""Inputs for the kernel tests: shards, transfer and session specs, packed arenas, guarded
output buffers.

Every receive test runs as rank ``ME`` of job ``JOB`` in a world of ``WORLD``; outputs sit
between ``GUARD`` elements of sentinel so a write outside its slot is caught.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport import kernels
from gradlane.transport.wire.header import DType, Header, Kind, Phase, SessionSpec, TransferSpec
from gradlane.transport.wire.tag import TagKey
from hypothesis import HealthCheck, settings

from tests.support import naive

#: Hypothesis settings of the kernel property tests: derandomized, no deadline.
SETTINGS = settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ITEM = {DType.F32: 4, DType.F16: 2, DType.BF16: 2}
KEYED = TagKey.from_secret("kernel-tests")
JOB, ME, WORLD = 7, 0, 4
GUARD = 16  # elements of sentinel around every output array


def shard(rng: np.random.Generator, n: int, dtype: DType) -> np.ndarray:
    """Gradient-like values in the dtype's source form (bf16: raw bits of rounded f32)."""
    values = rng.standard_normal(n).astype(np.float32) * np.float32(rng.uniform(0.01, 10))
    if dtype == DType.F32:
        return values
    if dtype == DType.F16:
        return values.astype(np.float16)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def row_width(chunk_elems: int, dtype: DType, extra: int = 0) -> int:
    """Bytes of an arena row holding one chunk (plus ``extra``), rounded up to 8."""
    need = 48 + chunk_elems * ITEM[dtype] + extra
    return need + (-need) % 8


def arena_of(datagrams: list[bytes], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A receive arena holding ``datagrams`` one per row, garbage after each datagram."""
    longest = max((len(d) for d in datagrams), default=48)
    width = width or longest + (-longest) % 8
    arena = np.full((len(datagrams), max(width, 48)), 0xA5, dtype=np.uint8)
    lengths = np.zeros(len(datagrams), dtype=np.int64)
    for i, d in enumerate(datagrams):
        arena[i, : len(d)] = np.frombuffer(d, dtype=np.uint8)
        lengths[i] = len(d)
    return arena, lengths


def guarded(n: int, dtype: type, fill: float | int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(buffer, view): ``view`` is ``n`` elements in the middle of a sentinel-filled buffer."""
    buf: np.ndarray = np.zeros(n + 2 * GUARD, dtype=dtype)
    buf.view(np.uint8)[:] = 0xC3
    view = buf[GUARD : GUARD + n]
    view[:] = fill
    return buf, view


def assert_guards(buf: np.ndarray) -> None:
    """Fail if anything wrote into the sentinel bytes around a :func:`guarded` view."""
    raw = buf.view(np.uint8)
    edge = GUARD * buf.itemsize
    assert np.all(raw[:edge] == 0xC3) and np.all(raw[-edge:] == 0xC3), "wrote outside its slot"


def session(key: TagKey | None = None, **kw: int) -> SessionSpec:
    """The receiving rank's session: job ``JOB``, rank ``ME`` of ``WORLD``."""
    return SessionSpec(job=JOB, me=ME, world=WORLD, key=key or TagKey(), **kw)


def transfer(dtype: DType, n_elems: int, chunk_elems: int, **kw: int) -> TransferSpec:
    """Step 5, bucket 2, shard 0, reduce phase, every rank a sender unless ``kw`` says."""
    fields = {"step": 5, "bucket": 2, "shard": 0, "phase": Phase.REDUCE, "src_lo": 0}
    fields.update({"src_hi": WORLD, **kw})
    return TransferSpec(dtype=dtype, n_elems=n_elems, chunk_elems=chunk_elems, **fields)


def header(src: int = 1, **kw: int) -> Header:
    """A DATA header from ``src`` to ``ME`` matching :func:`session` and :func:`transfer`."""
    fields = {"kind": Kind.DATA, "job": JOB, "step": 5, "bucket": 2, "shard": 0, "dst": ME}
    fields.update(kw)
    return Header(src=src, **fields)


def pack_all(
    src: np.ndarray, dtype: DType, chunk_elems: int, key: TagKey, hdr: Header, **kw
) -> list[bytes]:
    """``src`` packed by the kernel into one datagram per chunk, as byte strings."""
    n_chunks = -(-naive.wire_bits(src, dtype).shape[0] // chunk_elems)
    arena = np.zeros((max(n_chunks, 1), row_width(chunk_elems, dtype)), dtype=np.uint8)
    lengths = np.zeros(max(n_chunks, 1), dtype=np.int64)
    n = kernels.pack(
        src, arena, lengths, dtype=dtype, header=hdr, chunk_elems=chunk_elems, key=key, **kw
    )
    assert n == n_chunks
    return [arena[c, : lengths[c]].tobytes() for c in range(n)]
