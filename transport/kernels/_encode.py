"""Lossy wire formats on the send side: encode a float32 shard chunk by chunk, each in its
format, and write its headers (private; see :mod:`gradlane.transport.kernels.encoding`).

Theory of operation
-------------------
A float32 transfer whose precision policy picked a lossy format for some chunks is not sent
from the caller's buffer: :func:`encode_payloads` writes every chunk's payload into a buffer of
its own, one row of ``stride`` bytes per chunk (a multiple of 8, so each payload starts on a
u64 word for the tag sums): float32 chunks copied, bfloat16 and E4M3 chunks converted
(:mod:`._codec`), in one pass per chunk that also takes the payload's tag sums while the row is
in L1 and what the rounding removed (the *residual*, for error feedback, and its energy).
It can also write the values the peers will decode: the owner of a
shard keeps exactly what it sends (``decoded`` is its result), so every replica holds the same
result.

The payload is the same for every destination; :func:`headers_as` then writes one transfer's
headers from it (each chunk's dtype, its E4M3 scale in ``aux``), like
:func:`._pack.headers` does for a float32 transfer.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._codec import (
    decode_bf16,
    decode_e4m3,
    e4m3_scale,
    encode_bf16,
    encode_e4m3,
)
from gradlane.transport.kernels._common import (
    EXACT,
    KEY_PAYLOAD,
    REDUCTION,
    fast_sums64,
    finish_packet_as,
    nh_words,
)
from gradlane.transport.wire.header import HEADER_SIZE, DType
from gradlane.transport.wire.tag import TAG_KEYED
from numba import njit

_F32 = int(DType.F32)
_BF16 = int(DType.BF16)
_E4M3 = int(DType.E4M3)
_HDR = HEADER_SIZE


@njit(**REDUCTION)
def encode_payloads(
    src32: np.ndarray,
    formats: np.ndarray,
    chunk_elems: int,
    stride: int,
    payload: np.ndarray,
    lengths: np.ndarray,
    aux: np.ndarray,
    sum_a: np.ndarray,
    sum_b: np.ndarray,
    err2: np.ndarray,
    residual: np.ndarray,
    decoded: np.ndarray,
    mode: int,
    key: np.ndarray,
) -> int:
    """Encode float32 shard ``src32`` (its u32 bits) chunk ``c`` in ``formats[c]`` into
    ``payload[c*stride:]``; returns the payload bytes written.

    Per chunk: ``lengths`` (the datagram's), ``aux`` (an E4M3 chunk's scale bits, else 0), the
    payload's tag sums under ``mode``/``key`` and ``err2`` (the squared rounding error's sum).
    ``residual`` (float32, the shard's length; empty: not kept) gets ``value - decoded`` (0 for
    float32 chunks). ``decoded`` (float32, the shard's length; empty: not wanted) gets the values
    the receivers will decode (it may be ``src32``'s own float32 view: written after each
    chunk is read).
    """
    n = src32.shape[0]
    n_chunks = formats.shape[0]
    srcf = src32.view(np.float32)
    p8 = payload
    p16 = payload.view(np.uint16)
    p32 = payload.view(np.uint32)
    p64 = payload.view(np.uint64)
    keep = residual.shape[0] > 0
    back = decoded.shape[0] > 0
    scratch = np.empty(chunk_elems, dtype=np.float32)
    total = 0
    for c in range(n_chunks):
        off = c * chunk_elems
        count = min(chunk_elems, n - off)
        fmt = formats[c]
        base = c * stride
        res = residual[off : off + count] if keep else scratch[:count]
        x = srcf[off : off + count]
        a_bits = 0
        e = 0.0
        scale = np.float32(1.0)
        if fmt == _BF16:
            nbytes = 2 * count
            e = encode_bf16(x, p16[base // 2 : base // 2 + count], res)
        elif fmt == _E4M3:
            nbytes = count
            scale = e4m3_scale(x)
            e = encode_e4m3(x, p8[base : base + count], scale, res)
            a_bits = int(np.float32(scale).view(np.uint32))
        else:
            nbytes = 4 * count
            dst = p32[base // 4 : base // 4 + count]
            s32 = src32[off : off + count]
            for j in range(count):
                dst[j] = s32[j]
            if keep:
                res[:] = 0.0
        if back:  # what the receivers decode, computed as they do (_codec's decoders)
            out = decoded[off : off + count]
            if fmt == _BF16:
                decode_bf16(out, p16[base // 2 : base // 2 + count])
            elif fmt == _E4M3:
                decode_e4m3(out, p8[base : base + count], scale)
            else:
                for j in range(count):
                    out[j] = x[j]
        words = p64[base // 8 :]
        if mode == TAG_KEYED:
            a, b = nh_words(words, nbytes, key[KEY_PAYLOAD:])
        else:
            a, b = fast_sums64(words, nbytes)
        sum_a[c] = a
        sum_b[c] = b
        aux[c] = a_bits
        err2[c] = e
        lengths[c] = _HDR + nbytes
        total += nbytes
    return total


@njit(**EXACT)
def headers_as(
    hdr64: np.ndarray,
    counts: np.ndarray,
    formats: np.ndarray,
    aux: np.ndarray,
    lengths: np.ndarray,
    tmpl: np.ndarray,
    prio: np.ndarray,
    flags: np.ndarray,
    first_chunk: int,
    norms: np.ndarray,
    sum_a: np.ndarray,
    sum_b: np.ndarray,
    mode: int,
    key: np.ndarray,
) -> None:
    """Write the header and tag of every chunk of an encoded shard (:func:`encode_payloads`'
    per-chunk formats, aux, lengths and payload sums); ``tmpl`` is a float32 header's."""
    for c in range(counts.shape[0]):
        finish_packet_as(
            hdr64[c], tmpl, flags[c], prio[c], formats[c], first_chunk + c, counts[c],
            norms[c], aux[c], lengths[c], sum_a[c], sum_b[c], mode, key,
        )  # fmt: skip
