"""Argument checks of the public kernel wrappers in :mod:`gradlane.transport.kernels` (private).

Every wrapper turns what it is given into exactly the arrays its compiled kernel expects —
dtype, dimensions, contiguity, alignment, writability, value ranges — or raises a ValueError
that says what is wrong and how to fix it. A numba kernel does not check its arguments: a
wrong shape there reads or writes out of bounds.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from gradlane.transport.wire.header import HEADER_SIZE, DType
from gradlane.transport.wire.tag import TAG_FAST, TAG_KEYED, TagKey

_U8_MAX = 0xFF
_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF
_NO_F32 = np.empty(0, dtype=np.float32)
_NO_U8 = np.empty(0, dtype=np.uint8)
_NO_U16 = np.empty(0, dtype=np.uint16)
#: One-element arrays for every u8 value, for per-chunk fields given as a scalar (step 0).
_U8_SCALARS = np.arange(256, dtype=np.uint8).reshape(256, 1)
_U8_SCALARS.flags.writeable = False

#: dtypes a shard or output may have for each wire dtype (all raw bit views for 16-bit types).
_SRC_DTYPES = {
    DType.F32: (np.dtype(np.float32),),
    DType.F16: (np.dtype(np.float16), np.dtype(np.uint16), np.dtype(np.int16)),
    DType.BF16: (np.dtype(np.uint16), np.dtype(np.int16)),
}
_OUT_DTYPES = {
    DType.F32: (np.dtype(np.float32), np.dtype(np.uint32)),
    DType.F16: _SRC_DTYPES[DType.F16],
    DType.BF16: _SRC_DTYPES[DType.BF16],
}


def _wire_dtype(dtype: int) -> DType:
    """A shard's (a transfer's) dtype: E4M3 is only a lossy format of a float32 one's chunks."""
    try:
        wire = DType(int(dtype))
    except ValueError:
        wire = None
    if wire not in _SRC_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not a shard dtype; use one of {list(_SRC_DTYPES)}")
    return wire


def _array(name: str, a: object, ndim: int, *, writeable: bool = False) -> np.ndarray:
    """``a`` as an aligned, C-contiguous ndarray of ``ndim`` dimensions, or ValueError."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; pass np.ascontiguousarray({name})")
    if not a.flags.aligned:
        raise ValueError(f"{name} is not aligned to its itemsize; copy it into a fresh array")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{name} is read-only; the kernel writes into it")
    return a


def _typed(
    name: str, a: object, dtype: type, shape: tuple[int, ...], *, writeable: bool = True
) -> np.ndarray:
    arr = _array(name, a, len(shape), writeable=writeable)
    if arr.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype.name}")
    if arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    return arr


def _shard(name: str, src: object, dtype: DType) -> np.ndarray:
    """The shard as its raw uint32 (F32) or uint16 (F16/BF16) bits, without copying."""
    arr = _array(name, src, 1)
    allowed = _SRC_DTYPES[dtype]
    if arr.dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise ValueError(f"{name} for {dtype.name} must be one of ({names}), got {arr.dtype.name}")
    return _readonly(arr.view(np.uint32 if dtype == DType.F32 else np.uint16))


def _chunked(src: np.ndarray, dtype: int, chunk_elems: int) -> tuple[DType, np.ndarray, int, int]:
    """A shard split into chunks: (wire dtype, its raw bits, chunk_elems, number of chunks)."""
    wire = _wire_dtype(dtype)
    bits = _shard("src", src, wire)
    chunk_elems = int(chunk_elems)
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems={chunk_elems} must be >= 1")
    return wire, bits, chunk_elems, -(-bits.shape[0] // chunk_elems)


def _arena(arena: object, *, writeable: bool) -> np.ndarray:
    arr = _array("arena", arena, 2, writeable=writeable)
    if arr.dtype != np.uint8:
        raise ValueError(f"arena must be uint8 (one datagram per row), got {arr.dtype.name}")
    if arr.shape[1] % 8 or arr.shape[1] < HEADER_SIZE:
        raise ValueError(
            f"arena rows must be a multiple of 8 bytes and at least {HEADER_SIZE}, got "
            f"{arr.shape[1]}; round the slot width up to a multiple of 8"
        )
    if arr.shape[0] and arr.ctypes.data % 8:
        raise ValueError("arena must start on an 8-byte boundary; allocate it with np.zeros")
    return arr


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (no copy).

    Every input-only array reaches the kernels read-only: numba compiles a separate kernel for
    read-only and writable arrays of the same type, so mixing them would multiply the
    signatures (and the compile time) of each kernel.
    """
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


def _per_chunk_u8(name: str, value: np.ndarray | int, n_chunks: int) -> tuple[np.ndarray, int]:
    """A per-chunk u8 field as (array, step): step 0 broadcasts a scalar."""
    if isinstance(value, np.ndarray):
        arr = _array(name, value, 1)
        if arr.dtype.kind not in "ui":
            raise ValueError(f"{name} must be an integer array, got {arr.dtype.name}")
        if arr.shape[0] < n_chunks:
            raise ValueError(f"{name} has {arr.shape[0]} entries for {n_chunks} chunks")
        if arr.dtype != np.uint8:
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _U8_MAX):
                raise ValueError(f"{name} values must be in 0..255")
            arr = arr.astype(np.uint8)
        return _readonly(arr), 1
    v = int(value)
    if not 0 <= v <= _U8_MAX:
        raise ValueError(f"{name}={v} must be in 0..255")
    return _U8_SCALARS[v], 0


def _optional_f32(name: str, a: np.ndarray | None, n_chunks: int) -> np.ndarray:
    if a is None:
        return _NO_F32
    arr = _array(name, a, 1, writeable=True)
    if arr.dtype != np.float32 or arr.shape[0] < n_chunks:
        raise ValueError(
            f"{name} must be float32 with at least {n_chunks} entries, got "
            f"{arr.dtype.name}{arr.shape}"
        )
    return arr


def _in_range(name: str, value: int, hi: int) -> int:
    v = int(value)
    if not 0 <= v <= hi:
        raise ValueError(f"{name}={v} is outside 0..{hi}")
    return v


@lru_cache(maxsize=64)
def _key_parts(key: TagKey) -> tuple[int, np.ndarray]:
    """``(mode, key words)`` as the kernels take them, checked once per key."""
    if key.mode not in (TAG_FAST, TAG_KEYED):
        raise ValueError(f"TagKey.mode={key.mode} must be TAG_FAST or TAG_KEYED")
    _in_range("key.k0", key.k0, _U64_MAX)
    _in_range("key.k1", key.k1, _U64_MAX)
    return int(key.mode), key.words
