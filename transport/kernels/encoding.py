"""The checked wrappers of the lossy wire formats' send side: encode a float32 shard, each
chunk in the format its precision policy chose, and write a transfer's headers for it.

A shard with lossy chunks is sent from a payload buffer of its own (:class:`Encoded`), made
once whatever the number of destinations (the gather phase sends one shard to every peer);
each destination's transfer then writes its headers from it (:func:`fill_headers_as`). The
compiled kernels are :mod:`._encode`'s; the conversions are :mod:`._codec`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gradlane.transport.kernels import _encode as _en
from gradlane.transport.kernels._checks import _NO_F32, _array, _key_parts, _readonly, _shard
from gradlane.transport.kernels._common import header_template
from gradlane.transport.wire.header import HEADER_SIZE, ITEMSIZE, LOSSY, DType, chunk_counts
from gradlane.transport.wire.tag import TagKey

__all__ = ["Encoded", "encode_shard", "fill_headers_as"]

_FORMATS = np.array(sorted({int(DType.F32), *(int(d) for d in LOSSY)}), dtype=np.uint8)


class Encoded(NamedTuple):
    """A float32 shard's chunks in their wire formats, ready for any destination.

    ``formats`` (uint8 :class:`~gradlane.transport.wire.header.DType` codes), ``lengths``
    (int32 datagram bytes), ``aux`` (uint32: an E4M3 chunk's scale bits, else 0), the payload's
    tag sums ``sum_a``/``sum_b`` (uint64, under the key it was encoded with) and ``err2``
    (float64: each chunk's squared rounding error, summed) per chunk; ``payload`` holds chunk
    ``c`` at byte ``c * stride``; ``payload_bytes`` is their total.
    """

    formats: np.ndarray
    lengths: np.ndarray
    aux: np.ndarray
    sum_a: np.ndarray
    sum_b: np.ndarray
    err2: np.ndarray
    payload: np.ndarray
    stride: int
    payload_bytes: int


def encode_shard(
    src: np.ndarray,
    formats: np.ndarray,
    *,
    chunk_elems: int,
    key: TagKey,
    residual: np.ndarray | None = None,
    decoded: np.ndarray | None = None,
) -> Encoded:
    """Encode float32 ``src`` (1-D) chunk ``c`` (``chunk_elems`` elements, the last may be
    short) in ``formats[c]`` (F32, BF16 or E4M3).

    ``residual`` (float32, ``src``'s shape, written): what each element's rounding removed
    (``value - decoded``; 0 in float32 chunks), for error feedback. ``decoded`` (float32,
    ``src``'s shape, written; may be ``src`` itself): the values the receivers will decode.
    """
    bits = _shard("src", src, DType.F32)
    chunk_elems = int(chunk_elems)
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems={chunk_elems} must be >= 1")
    n = bits.shape[0]
    n_chunks = -(-n // chunk_elems)
    fmt = _array("formats", formats, 1)
    if fmt.dtype != np.uint8 or fmt.shape[0] != n_chunks:
        raise ValueError(
            f"formats must be uint8 with one code per chunk ({n_chunks}), got "
            f"{fmt.dtype.name}{fmt.shape}"
        )
    if not np.isin(fmt, _FORMATS).all():
        raise ValueError(f"formats must be codes of {[DType(int(f)).name for f in _FORMATS]}")
    res = _float_out("residual", residual, n)
    dec = _float_out("decoded", decoded, n)
    stride = -(-chunk_elems * ITEMSIZE[DType.F32] // 8) * 8
    payload = np.empty(max(n_chunks, 1) * stride, dtype=np.uint8)
    lengths = np.empty(n_chunks, dtype=np.int32)
    aux = np.empty(n_chunks, dtype=np.uint32)
    sum_a = np.empty(n_chunks, dtype=np.uint64)
    sum_b = np.empty(n_chunks, dtype=np.uint64)
    err2 = np.empty(n_chunks, dtype=np.float64)
    mode, kw = _key_parts(key)
    total = _en.encode_payloads(
        bits, _readonly(fmt), chunk_elems, stride, payload, lengths, aux, sum_a, sum_b, err2,
        res, dec, mode, kw,
    )  # fmt: skip
    return Encoded(fmt, lengths, aux, sum_a, sum_b, err2, payload, stride, int(total))


def _float_out(name: str, a: np.ndarray | None, n: int) -> np.ndarray:
    if a is None:
        return _NO_F32
    arr = _array(name, a, 1, writeable=True)
    if arr.dtype != np.float32 or arr.shape[0] != n:
        raise ValueError(f"{name} must be float32 of shape ({n},), got {arr.dtype.name}{arr.shape}")
    return arr


def fill_headers_as(
    hdr: np.ndarray,
    encoded: Encoded,
    norms: np.ndarray,
    *,
    n_elems: int,
    chunk_elems: int,
    words: np.ndarray,
    key: TagKey,
    prio: np.ndarray,
    flags: np.ndarray,
    first_chunk: int = 0,
) -> None:
    """Write the DATA header of every chunk of an :class:`Encoded` shard of ``n_elems``
    elements into the rows of ``hdr`` (uint8 ``(n_chunks, 48)``, C-contiguous): row ``c``
    followed by ``encoded.payload[c * stride:]``'s first ``lengths[c] - 48`` bytes is the
    datagram. ``norms`` (float32) go to the headers' norm field; ``words`` is a float32
    header's :func:`~gradlane.transport.kernels.header_words`; ``prio``/``flags`` uint8 per
    chunk; ``key`` the one the shard was encoded under."""
    counts = chunk_counts(int(n_elems), int(chunk_elems))
    n = counts.shape[0]
    rows = _array("hdr", hdr, 2, writeable=True)
    if rows.dtype != np.uint8 or rows.shape != (n, HEADER_SIZE):
        raise ValueError(f"hdr must be uint8 of shape ({n}, {HEADER_SIZE}), got {rows.shape}")
    for name, arr in (("formats", encoded.formats), ("norms", norms), ("prio", prio),
                      ("flags", flags), ("lengths", encoded.lengths)):  # fmt: skip
        if np.asarray(arr).shape != (n,):
            raise ValueError(f"{name} must have one entry per chunk ({n}), got {arr.shape}")
    if int(words[1]) >> 16 & 0xFF != DType.F32:
        raise ValueError("words must be a float32 header's (the chunks carry their own dtype)")
    tmpl = header_template(words)
    tmpl.flags.writeable = False
    mode, kw = _key_parts(key)
    _en.headers_as(
        rows.view(np.uint64), counts, encoded.formats, _readonly(encoded.aux),
        _readonly(encoded.lengths), tmpl, _readonly(np.ascontiguousarray(prio, dtype=np.uint8)),
        _readonly(np.ascontiguousarray(flags, dtype=np.uint8)), int(first_chunk),
        _readonly(np.ascontiguousarray(norms, dtype=np.float32)), _readonly(encoded.sum_a),
        _readonly(encoded.sum_b), mode, kw,
    )  # fmt: skip
