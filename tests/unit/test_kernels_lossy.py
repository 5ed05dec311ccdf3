"""The lossy wire formats' kernels: a float32 shard encoded chunk by chunk
(:func:`encoding.encode_shard`, :func:`encoding.fill_headers_as`) makes packets that
:func:`~gradlane.transport.wire.header.validate` accepts, whose payloads decode to what the
encoder said (its ``decoded`` output, ``value - residual``); the receive kernels reduce and
place batches mixing formats exactly as the NumPy reference does, duplicates and forgeries
included.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.transport import kernels
from gradlane.transport.kernels._codec import E4M3_TABLE
from gradlane.transport.kernels.encoding import encode_shard, fill_headers_as
from gradlane.transport.wire.header import (
    HEADER_SIZE,
    LOSSY,
    DType,
    Phase,
    Reason,
    decode_header,
    validate,
)
from gradlane.transport.wire.tag import TagKey
from hypothesis import given
from hypothesis import strategies as st

from tests.support import naive
from tests.support.kernel_inputs import KEYED, SETTINGS, arena_of, header, session, transfer
from tests.unit.test_kernels import Receiver

_FORMATS = [int(DType.F32), int(DType.BF16), int(DType.E4M3)]


def _packets(
    src: np.ndarray, formats: np.ndarray, ce: int, key: TagKey, src_rank: int = 1, **hdr: int
) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """The datagrams of ``src`` in ``formats`` from ``src_rank``, its residual and decoded
    values."""
    residual = np.empty_like(src)
    decoded = np.empty_like(src)
    enc = encode_shard(src, formats, chunk_elems=ce, key=key, residual=residual, decoded=decoded)
    n = formats.shape[0]
    hdrs = np.empty((n, HEADER_SIZE), dtype=np.uint8)
    norms = np.linspace(0, 1, n, dtype=np.float32)
    fill_headers_as(
        hdrs, enc, norms, n_elems=src.shape[0], chunk_elems=ce,
        words=kernels.header_words(header(src=src_rank, **hdr)), key=key,
        prio=np.zeros(n, dtype=np.uint8), flags=np.zeros(n, dtype=np.uint8),
    )  # fmt: skip
    out = []
    for c in range(n):
        nb = int(enc.lengths[c]) - HEADER_SIZE
        body = enc.payload[c * enc.stride : c * enc.stride + nb]
        out.append(hdrs[c].tobytes() + body.tobytes())
    return out, residual, decoded


def _values(src: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    vals = (rng.standard_normal(src.shape[0]) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    vals[rng.random(vals.shape[0]) < 0.05] = 0.0
    return vals


@given(
    n=st.integers(1, 700),
    ce=st.sampled_from([1, 3, 8, 64, 257]),
    keyed=st.booleans(),
    seed=st.integers(0, 2**31),
)
@SETTINGS
def test_encoded_packets_validate_and_decode_to_what_the_encoder_said(n, ce, keyed, seed):
    rng = np.random.default_rng(seed)
    src = _values(np.empty(n, np.float32), rng)
    n_chunks = -(-n // ce)
    formats = rng.choice(_FORMATS, n_chunks).astype(np.uint8)
    key = KEYED if keyed else TagKey()
    packets, residual, decoded = _packets(src, formats, ce, key)
    sess = session(key)
    spec = transfer(DType.F32, n, ce)
    for c, data in enumerate(packets):
        assert validate(data, sess, spec) == Reason.OK
        h = decode_header(data)
        assert h.dtype == formats[c] and h.chunk == c
        vals = naive.payload_values(data, h)
        part = slice(c * ce, c * ce + h.count)
        # What the receivers decode is what the owner keeps, and value - residual.
        assert np.array_equal(vals.view(np.uint32), decoded[part].view(np.uint32))
        assert np.array_equal(vals + residual[part], src[part])
        if formats[c] == DType.F32:
            assert not residual[part].any()
            assert np.array_equal(vals.view(np.uint32), src[part].view(np.uint32))


@given(
    n=st.integers(1, 600),
    ce=st.sampled_from([4, 32, 100]),
    gather=st.booleans(),
    keyed=st.booleans(),
    seed=st.integers(0, 2**31),
)
@SETTINGS
def test_mixed_format_batches_reduce_and_place_as_the_reference(n, ce, gather, keyed, seed):
    rng = np.random.default_rng(seed)
    key = KEYED if keyed else TagKey()
    phase = Phase.GATHER if gather else Phase.REDUCE
    spec = transfer(DType.F32, n, ce, phase=phase, src_lo=1, src_hi=2 if gather else 4)
    senders = [1] if gather else [1, 2, 3]
    datagrams: list[bytes] = []
    for s in senders:
        formats = rng.choice(_FORMATS, spec.n_chunks).astype(np.uint8)
        src = _values(np.empty(n, np.float32), rng)
        datagrams += _packets(src, formats, ce, key, s, phase=phase)[0]
    # Duplicates, and a forgery: one payload byte flipped after the tag was made.
    datagrams += [datagrams[i] for i in rng.integers(0, len(datagrams), 3)]
    bad = bytearray(datagrams[int(rng.integers(0, len(datagrams)))])
    bad[-1] ^= 0x40
    datagrams.append(bytes(bad))
    order = rng.permutation(len(datagrams))
    arena, lengths = arena_of([datagrams[i] for i in order])
    recv = Receiver(spec, gather=gather)
    got = recv.feed(arena, lengths, session(key))
    # Every original is a distinct (sender, chunk): the three copies are duplicates, and the
    # forgery fails its tag whether its original came before it or not.
    assert got.count(int(Reason.DUPLICATE)) == 3
    assert got.count(int(Reason.BAD_TAG)) == 1
    assert got.count(int(Reason.OK)) == len(datagrams) - 4


@given(
    ce=st.sampled_from([2047, 2048, 2049, 4096, 4097]),
    n_chunks=st.integers(1, 3),
    fmt=st.sampled_from(sorted(int(d) for d in LOSSY)),
    gather=st.booleans(),
    keyed=st.booleans(),
    seed=st.integers(0, 2**31),
    bit=st.integers(0, 10**6),
)
@SETTINGS
def test_a_forged_lossy_chunk_of_fused_size_leaves_every_slot_bit_for_bit(
    ce, n_chunks, fmt, gather, keyed, seed, bit
):
    """Chunks long enough for the fused check-and-add loops (a bfloat16 one is added while its
    tag is summed, and put back on a mismatch): one with a payload bit flipped is rejected and
    leaves the accumulator as it was, bit for bit; the others add as the reference does."""
    rng = np.random.default_rng(seed)
    key = KEYED if keyed else TagKey()
    phase = Phase.GATHER if gather else Phase.REDUCE
    n = ce * n_chunks - int(rng.integers(0, ce // 2))
    spec = transfer(DType.F32, n, ce, phase=phase, src_lo=1, src_hi=3)
    formats = np.full(spec.n_chunks, fmt, dtype=np.uint8)
    datagrams = _packets(_values(np.empty(n, np.float32), rng), formats, ce, key, 1, phase=phase)[0]
    if not gather:
        other = _values(np.empty(n, np.float32), rng)
        datagrams += _packets(other, formats, ce, key, 2, phase=phase)[0]
    forged = int(rng.integers(0, len(datagrams)))
    bad = bytearray(datagrams[forged])
    at = HEADER_SIZE + bit % (len(bad) - HEADER_SIZE)
    bad[at] ^= 1 << (bit % 8)
    datagrams[forged] = bytes(bad)
    arena, lengths = arena_of(datagrams)
    recv = Receiver(spec, gather=gather)
    got = recv.feed(arena, lengths, session(key))
    assert got == [int(Reason.BAD_TAG) if i == forged else int(Reason.OK) for i in range(len(got))]


@pytest.mark.parametrize("fmt", sorted(LOSSY))
def test_a_lossy_chunk_with_nan_or_inf_decodes_as_documented(fmt):
    src = np.array([1.0, np.nan, np.inf, -np.inf, -2.0, 0.0, -0.0, 3.5], dtype=np.float32)
    formats = np.array([int(fmt)], dtype=np.uint8)
    packets, residual, decoded = _packets(src, formats, 8, TagKey(), phase=Phase.GATHER)
    vals = naive.payload_values(packets[0], decode_header(packets[0]))
    assert np.isnan(vals[1]) and not residual[1:4].any()
    if fmt == DType.BF16:
        assert vals[2] == np.inf and vals[3] == -np.inf
    else:  # no infinities in E4M3: saturated to ±448 × the finite values' scale
        scale = np.float32(3.5) / np.float32(448.0)
        assert vals[2] == E4M3_TABLE[0x7E] * scale and vals[3] == -vals[2]
    assert vals[0] == 1.0 and vals[4] == -2.0 and vals[5] == 0.0
    assert np.signbit(vals[6])
    # A chunk carrying NaN or infinity in the result is flagged by the gather's place.
    spec = transfer(DType.F32, 8, 8, phase=Phase.GATHER, src_lo=1, src_hi=2)
    arena, lengths = arena_of(packets)
    out = np.zeros(8, dtype=np.float32)
    received = np.zeros((1, 1), dtype=np.uint8)
    nonfinite = np.zeros(1, dtype=np.uint8)
    counters = np.zeros(len(Reason), dtype=np.int64)
    accepted = kernels.place_into(
        arena, lengths, out, received, session=session(), transfer=spec, counters=counters,
        nonfinite=nonfinite,
    )  # fmt: skip
    assert accepted == 1 and nonfinite[0] == 1
    assert np.array_equal(out.view(np.uint32), decoded.view(np.uint32))


def test_encode_shard_checks_its_arguments():
    src = np.ones(10, dtype=np.float32)
    with pytest.raises(ValueError, match="one code per chunk"):
        encode_shard(src, np.zeros(3, np.uint8), chunk_elems=5, key=TagKey())
    with pytest.raises(ValueError, match="codes of"):
        encode_shard(src, np.array([1, 0], np.uint8), chunk_elems=5, key=TagKey())
    with pytest.raises(ValueError, match="float32"):
        encode_shard(src.astype(np.float64), np.zeros(2, np.uint8), chunk_elems=5, key=TagKey())
    with pytest.raises(ValueError, match="residual"):
        encode_shard(
            src, np.zeros(2, np.uint8), chunk_elems=5, key=TagKey(), residual=np.empty(9, "f4")
        )
