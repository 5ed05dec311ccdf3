"""The numba kernels (transport/kernels/__init__.py) against their NumPy references
(tests/support/naive.py).

Deterministic: seeded generators and derandomized Hypothesis. Everything a kernel writes is
compared with the reference; everything it must not write is compared with its old bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.transport import kernels
from gradlane.transport.errors import ConfigError
from gradlane.transport.wire.header import (
    N_REASONS,
    SHARD_DTYPES,
    DType,
    Flags,
    Header,
    Kind,
    Phase,
    Reason,
    SessionSpec,
    TransferSpec,
    encode,
    encode_bitmap,
    packet_tag,
)
from gradlane.transport.wire.tag import TagKey
from hypothesis import given
from hypothesis import strategies as st

from tests.support import naive
from tests.support.kernel_inputs import (
    ITEM,
    JOB,
    KEYED,
    ME,
    SETTINGS,
    WORLD,
    arena_of,
    assert_guards,
    guarded,
    header,
    pack_all,
    row_width,
    session,
    shard,
    transfer,
)


class Receiver:
    """The receive-side arrays of one transfer, kernel and reference side by side."""

    def __init__(self, spec: TransferSpec, *, gather: bool = False) -> None:
        self.spec = spec
        self.gather = gather
        n, nc, ns = spec.n_elems, spec.n_chunks, spec.src_hi - spec.src_lo
        if gather:
            wire = np.uint32 if spec.dtype == DType.F32 else np.uint16
            self.buf, self.out = guarded(n, wire, 0x7E7E)
            self.ref_out = self.out.copy()
        else:
            self.buf, self.out = guarded(n, np.float32, 0.5)
            self.ref_out = self.out.copy()
        self.contrib = np.zeros(nc, dtype=np.uint16)
        self.received = np.zeros((ns, nc), dtype=np.uint8)
        self.counters = np.zeros(N_REASONS, dtype=np.int64)
        self.ref_contrib = self.contrib.copy()
        self.ref_received = self.received.copy()
        self.ref_counters = self.counters.copy()

    def snapshot(self) -> tuple[bytes, ...]:
        return (self.buf.tobytes(), self.contrib.tobytes(), self.received.tobytes())

    def feed(
        self,
        arena: np.ndarray,
        lengths: np.ndarray,
        sess: SessionSpec,
        rows: np.ndarray | None = None,
    ) -> list[int]:
        """Run the kernel and the reference on the same batch; returns the kernel's verdicts."""
        order = np.arange(arena.shape[0]) if rows is None else rows
        verdicts = np.full(order.shape[0], 255, dtype=np.uint8)
        kw = {"session": sess, "transfer": self.spec, "counters": self.counters, "rows": rows}
        if self.gather:
            out = self.out if self.spec.dtype == DType.F32 else self.out.view(np.uint16)
            if self.spec.dtype == DType.F32:
                out = self.out.view(np.float32)
            accepted = kernels.place_into(
                arena, lengths, out, self.received, contrib=self.contrib, verdicts=verdicts, **kw
            )
        else:
            accepted = kernels.reduce_into(
                arena, lengths, self.out, self.contrib, self.received, verdicts=verdicts, **kw
            )
        # A negative length is a datagram shorter than a header; one longer than its row did
        # not fit its slot, which the reference sees as a datagram over max_datagram.
        datagrams = [
            b""
            if lengths[r] < 0
            else b"\0" * (sess.max_datagram + 1)
            if lengths[r] > arena.shape[1]
            else arena[r, : lengths[r]].tobytes()
            for r in order
        ]
        ref_kw = {"session": sess, "transfer": self.spec, "counters": self.ref_counters}
        if self.gather:
            ref = naive.place(
                datagrams, self.ref_out, self.ref_received, contrib=self.ref_contrib, **ref_kw
            )
        else:
            ref = naive.reduce(
                datagrams, self.ref_out, self.ref_contrib, self.ref_received, **ref_kw
            )
        got = [int(v) for v in verdicts]
        assert got == [int(r) for r in ref]
        assert accepted == sum(1 for r in ref if r == Reason.OK)
        assert np.array_equal(self.out.view(np.uint8), self.ref_out.view(np.uint8))
        assert np.array_equal(self.contrib, self.ref_contrib)
        assert np.array_equal(self.received, self.ref_received)
        assert np.array_equal(self.counters, self.ref_counters)
        assert_guards(self.buf)
        return got


# --- pack ---------------------------------------------------------------------------------------

PACK_SHAPES = [(1, 1), (7, 3), (100, 32), (257, 64), (1001, 100), (4096, 2048), (5000, 352)]


@pytest.mark.parametrize("dtype", list(SHARD_DTYPES))
@pytest.mark.parametrize("keyed", [False, True], ids=["fast", "keyed"])
@pytest.mark.parametrize(("n", "chunk_elems"), PACK_SHAPES)
def test_pack_matches_naive_byte_for_byte(
    dtype: DType, keyed: bool, n: int, chunk_elems: int
) -> None:
    rng = np.random.default_rng(n * 31 + chunk_elems)
    src = shard(rng, n, dtype)
    n_chunks = -(-n // chunk_elems)
    prio = rng.integers(0, 8, n_chunks).astype(np.uint8)
    flags = rng.integers(0, 32, n_chunks).astype(np.uint8)
    key = KEYED if keyed else TagKey()
    arena = np.full((n_chunks + 2, row_width(chunk_elems, dtype, extra=8)), 0xEE, np.uint8)
    lengths = np.full(n_chunks + 2, -1, dtype=np.int64)
    norms = np.full(n_chunks + 1, -1, dtype=np.float32)
    maxabs = np.full(n_chunks + 1, -1, dtype=np.float32)
    hdr = header(src=3, phase=Phase.GATHER)
    count = kernels.pack(
        src, arena, lengths, dtype=dtype, header=hdr, chunk_elems=chunk_elems, key=key,
        prio=prio, flags=flags, first_chunk=9, norms=norms, maxabs=maxabs,
    )  # fmt: skip
    assert count == n_chunks
    ref_norms, ref_max = naive.chunk_norms(src, dtype, chunk_elems)
    np.testing.assert_allclose(norms[:n_chunks], ref_norms, rtol=1e-5)
    assert np.array_equal(maxabs[:n_chunks], ref_max)
    assert norms[n_chunks] == -1 and maxabs[n_chunks] == -1
    expected = naive.pack(
        src, dtype=dtype, header=hdr, chunk_elems=chunk_elems, key=key, prio=prio,
        flags=flags, first_chunk=9, norms=norms,
    )  # fmt: skip
    for c, want in enumerate(expected):
        assert lengths[c] == len(want) == 48 + min(chunk_elems, n - c * chunk_elems) * ITEM[dtype]
        assert arena[c, : lengths[c]].tobytes() == want
    assert np.all(arena[n_chunks:] == 0xEE) and np.all(lengths[n_chunks:] == -1)


@SETTINGS
@given(
    dtype=st.sampled_from(list(SHARD_DTYPES)),
    n=st.integers(0, 700),
    chunk_elems=st.integers(1, 200),
    first=st.integers(0, 2**32 - 801),
    keyed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_headers_plus_payload_views_are_the_packed_datagrams(
    dtype: DType, n: int, chunk_elems: int, first: int, keyed: bool, seed: int
) -> None:
    """Zero-copy sending: ``write_headers`` row ``c`` followed by the source bytes of chunk
    ``c`` is byte for byte the datagram the naive packer builds (fast and keyed tags), and
    ``chunk_stats`` norms are the numpy norms."""
    rng = np.random.default_rng(seed)
    src = shard(rng, n, dtype)
    n_chunks = -(-n // chunk_elems)
    prio = rng.integers(0, 8, n_chunks).astype(np.uint8)
    flags = rng.integers(0, 32, n_chunks).astype(np.uint8)
    key = KEYED if keyed else TagKey()
    stats = kernels.chunk_stats(src, dtype=dtype, chunk_elems=chunk_elems, key=key)
    ref_norms, _ = naive.chunk_norms(src, dtype, chunk_elems)
    np.testing.assert_allclose(stats.norms, ref_norms, rtol=1e-5)
    rows = np.full((n_chunks, 48), 0xEE, dtype=np.uint8)
    hdr = header(src=3, phase=Phase.REDUCE)
    got = kernels.write_headers(
        rows, src, stats, dtype=dtype, header=hdr, chunk_elems=chunk_elems, key=key,
        prio=prio, flags=flags, first_chunk=first,
    )  # fmt: skip
    assert got == n_chunks
    want = naive.pack(
        src, dtype=dtype, header=hdr, chunk_elems=chunk_elems, key=key, prio=prio,
        flags=flags, first_chunk=first, norms=stats.norms,
    )  # fmt: skip
    raw = src.view(np.uint8)
    step = chunk_elems * ITEM[dtype]
    for c, w in enumerate(want):
        assert rows[c].tobytes() + raw[c * step : c * step + len(w) - 48].tobytes() == w


def test_write_headers_rejects_wrong_shapes() -> None:
    src = np.ones(100, np.float32)
    stats = kernels.chunk_stats(src, dtype=DType.F32, chunk_elems=32, key=TagKey())
    args = {"dtype": DType.F32, "header": header(), "key": TagKey()}
    prio = np.zeros(4, np.uint8)
    with pytest.raises(ValueError, match="hdr must be uint8"):
        kernels.write_headers(np.zeros((3, 48), np.uint8), src, stats, chunk_elems=32,
                              prio=prio, flags=prio, **args)  # fmt: skip
    seven = np.zeros(7, np.uint8)
    with pytest.raises(ValueError, match=r"stats\.norms"):
        kernels.write_headers(np.zeros((7, 48), np.uint8), src, stats, chunk_elems=16,
                              prio=seven, flags=seven, **args)  # fmt: skip


@pytest.mark.parametrize("dtype", list(SHARD_DTYPES))
def test_pack_scalar_prio_and_flags_and_source_views(dtype: DType) -> None:
    rng = np.random.default_rng(1)
    src = shard(rng, 300, dtype)
    views = {DType.F32: [src], DType.F16: [src, src.view(np.uint16), src.view(np.int16)]}
    views[DType.BF16] = [src, src.view(np.int16)]
    hdr = header()
    want = naive.pack(src, dtype=dtype, header=hdr, chunk_elems=64, key=TagKey(), prio=5,
                      flags=int(Flags.PROTECTED))  # fmt: skip
    for view in views[dtype]:
        got = pack_all(view, dtype, 64, TagKey(), hdr, prio=5, flags=int(Flags.PROTECTED))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g[:32] == w[:32] and g[36:40] == w[36:40] and g[48:] == w[48:]


@SETTINGS
@given(
    dtype=st.sampled_from(list(SHARD_DTYPES)),
    n=st.integers(0, 700),
    chunk_elems=st.integers(1, 200),
    first=st.integers(0, 2**32 - 801),
    keyed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pack_any_shape_matches_naive(
    dtype: DType, n: int, chunk_elems: int, first: int, keyed: bool, seed: int
) -> None:
    src = shard(np.random.default_rng(seed), n, dtype)
    key = KEYED if keyed else TagKey()
    n_chunks = -(-n // chunk_elems)
    arena = np.zeros((max(n_chunks, 1), row_width(chunk_elems, dtype)), dtype=np.uint8)
    lengths = np.zeros(max(n_chunks, 1), dtype=np.int32)
    norms = np.zeros(max(n_chunks, 1), dtype=np.float32)
    hdr = header(src=2)
    got = kernels.pack(src, arena, lengths, dtype=dtype, header=hdr, chunk_elems=chunk_elems,
                       key=key, first_chunk=first, norms=norms)  # fmt: skip
    assert got == n_chunks
    want = naive.pack(src, dtype=dtype, header=hdr, chunk_elems=chunk_elems, key=key,
                      first_chunk=first, norms=norms)  # fmt: skip
    assert [arena[c, : lengths[c]].tobytes() for c in range(n_chunks)] == want


def test_pack_and_chunk_stats_norms_of_special_values() -> None:
    src = np.array([1.0, -np.inf, 2.0, np.nan, 3.0, 4.0, -0.0, 0.0], dtype=np.float32)
    norms = np.empty(4, np.float32)
    maxabs = np.empty(4, np.float32)
    pack_all(src, DType.F32, 2, TagKey(), header(), norms=norms, maxabs=maxabs)
    stats = kernels.chunk_stats(src, dtype=DType.F32, chunk_elems=2, key=TagKey())
    for got in (norms, stats.norms):
        assert np.isinf(got[0]) and np.isnan(got[1]) and got[2] == 5.0 and got[3] == 0.0
    assert np.isinf(maxabs[0]) and np.isnan(maxabs[1]) and maxabs[2] == 4.0
    assert maxabs[3] == 0.0 and not np.signbit(maxabs[3])
    bf = np.array([0x3F80, 0xBFC0, 0x7FC0, 0x0000], dtype=np.uint16)  # 1, -1.5, nan, 0
    stats = kernels.chunk_stats(bf, dtype=DType.BF16, chunk_elems=2, key=TagKey())
    assert np.isclose(stats.norms[0], np.sqrt(3.25)) and np.isnan(stats.norms[1])


@pytest.mark.parametrize("dtype", list(SHARD_DTYPES))
@pytest.mark.parametrize(("n", "chunk_elems"), [(0, 4), (1, 1), (1000, 33), (4097, 1024)])
def test_chunk_stats_norms_match_numpy(dtype: DType, n: int, chunk_elems: int) -> None:
    src = shard(np.random.default_rng(n), n, dtype)
    stats = kernels.chunk_stats(src, dtype=dtype, chunk_elems=chunk_elems, key=KEYED)
    ref_norms, _ = naive.chunk_norms(src, dtype, chunk_elems)
    assert stats.norms.dtype == np.float32 and stats.sum_a.dtype == np.uint64
    np.testing.assert_allclose(stats.norms, ref_norms, rtol=1e-5)


# --- reduce / place: delivery in any order, with loss and duplicates -------------------------


@SETTINGS
@given(
    dtype=st.sampled_from(list(SHARD_DTYPES)),
    n=st.integers(1, 400),
    chunk_elems=st.integers(1, 96),
    senders=st.integers(1, WORLD),
    keyed=st.booleans(),
    use_rows=st.booleans(),
    data=st.data(),
)
def test_reduce_any_subset_and_order_matches_naive(
    dtype: DType, n: int, chunk_elems: int, senders: int, keyed: bool, use_rows: bool, data
) -> None:
    key = KEYED if keyed else TagKey()
    rng = np.random.default_rng(n * 7 + chunk_elems)
    shards = [shard(rng, n, dtype) for _ in range(senders)]
    packets = [(s, p) for s in range(senders) for p in pack_all(shards[s], dtype, chunk_elems,
                                                                key, header(src=s))]  # fmt: skip
    n_chunks = -(-n // chunk_elems)
    picks = data.draw(st.lists(st.integers(0, len(packets) - 1), max_size=2 * len(packets)))
    chosen = [packets[i][1] for i in picks]
    width = row_width(chunk_elems, dtype, extra=data.draw(st.sampled_from([0, 8, 64])))
    spec = transfer(dtype, n, chunk_elems)
    rx = Receiver(spec)
    if use_rows and chosen:
        arena, lengths = arena_of([*chosen[::-1], b"\0" * 48], width)
        rows = np.arange(len(chosen) - 1, -1, -1)
        verdicts = rx.feed(arena, lengths, session(key), rows=rows)
    else:
        arena, lengths = arena_of(chosen, width) if chosen else arena_of([], width)
        if not chosen:
            arena, lengths = arena[:0], lengths[:0]
        verdicts = rx.feed(arena, lengths, session(key))
    # Exactly the delivered (sender, chunk) pairs, each once, whatever the order and repeats.
    delivered = {packets[i] for i in picks}
    assert int(rx.received.sum()) == len(delivered) == verdicts.count(Reason.OK)
    assert verdicts.count(Reason.DUPLICATE) == len(picks) - len(delivered)
    expected = np.full(n, 0.5, dtype=np.float64)
    contrib = np.zeros(n_chunks, dtype=np.int64)
    for s in range(senders):
        values = naive.as_float32(naive.wire_bits(shards[s], dtype), dtype).astype(np.float64)
        for c in range(n_chunks):
            if rx.received[s, c]:
                expected[c * chunk_elems : (c + 1) * chunk_elems] += values[
                    c * chunk_elems : (c + 1) * chunk_elems
                ]
                contrib[c] += 1
    np.testing.assert_allclose(rx.out, expected, rtol=1e-5, atol=1e-4)
    assert np.array_equal(rx.contrib, contrib)


@SETTINGS
@given(
    dtype=st.sampled_from(list(SHARD_DTYPES)),
    n=st.integers(1, 300),
    chunk_elems=st.integers(1, 64),
    keyed=st.booleans(),
    data=st.data(),
)
def test_place_any_subset_and_order_is_bit_exact(
    dtype: DType, n: int, chunk_elems: int, keyed: bool, data
) -> None:
    key = KEYED if keyed else TagKey()
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 2 ** (8 * ITEM[dtype]), n, dtype=np.uint64)  # NaN payloads included
    src = bits.astype(np.uint32).view(np.float32) if dtype == DType.F32 else bits.astype(np.uint16)
    hdr = header(src=2, phase=Phase.GATHER)
    packets = pack_all(src, dtype, chunk_elems, key, hdr)
    picks = data.draw(st.lists(st.integers(0, len(packets) - 1), max_size=2 * len(packets)))
    spec = transfer(dtype, n, chunk_elems, phase=Phase.GATHER)
    rx = Receiver(spec, gather=True)
    if picks:
        arena, lengths = arena_of([packets[i] for i in picks])
        rx.feed(arena, lengths, session(key))
    wire = naive.wire_bits(src, dtype)
    for c in range(spec.n_chunks):
        part = slice(c * chunk_elems, (c + 1) * chunk_elems)
        if c in picks:
            assert np.array_equal(rx.out[part], wire[part])
            assert rx.contrib[c] == 1 and rx.received[2, c] == 1
        else:
            assert np.all(rx.out[part] == 0x7E7E) and rx.contrib[c] == 0


@pytest.mark.parametrize("dtype", list(SHARD_DTYPES))
def test_place_accepts_the_documented_output_views(dtype: DType) -> None:
    src = shard(np.random.default_rng(3), 50, dtype)
    packets = pack_all(src, dtype, 16, TagKey(), header(src=1))
    arena, lengths = arena_of(packets)
    spec = transfer(dtype, 50, 16)
    views = {
        DType.F32: [np.float32, np.uint32],
        DType.F16: [np.float16, np.uint16, np.int16],
        DType.BF16: [np.uint16, np.int16],
    }
    for view in views[dtype]:
        out = np.zeros(50, dtype=view)
        received = np.zeros((WORLD, spec.n_chunks), dtype=bool)
        counters = np.zeros(N_REASONS, dtype=np.int64)
        got = kernels.place_into(arena, lengths, out, received, session=session(),
                                 transfer=spec, counters=counters)  # fmt: skip
        assert got == len(packets) and received[1].all()
        assert out.tobytes() == naive.wire_bits(src, dtype).tobytes()


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16])
def test_every_16_bit_pattern_converts_like_numpy(dtype: DType) -> None:
    bits = np.arange(65536, dtype=np.uint16)  # zeros, subnormals, normals, inf, every NaN
    packets = pack_all(bits, dtype, 4096, TagKey(), header(src=1))
    arena, lengths = arena_of(packets)
    accum = np.full(65536, -0.0, dtype=np.float32)  # x + (-0.0) == x, bit for bit
    received = np.zeros((WORLD, 16), dtype=np.uint8)
    got = kernels.reduce_into(arena, lengths, accum, np.zeros(16, np.uint16), received,
                              session=session(), transfer=transfer(dtype, 65536, 4096),
                              counters=np.zeros(N_REASONS, np.int64))  # fmt: skip
    assert got == 16
    with np.errstate(invalid="ignore"):  # signalling NaNs among the patterns
        want = naive.as_float32(bits, dtype) + np.float32(-0.0)
    assert np.array_equal(accum.view(np.uint32), want.view(np.uint32))


def test_duplicates_within_one_batch_and_across_batches() -> None:
    src = shard(np.random.default_rng(4), 64, DType.F32)
    packets = pack_all(src, DType.F32, 16, TagKey(), header(src=1))
    rx = Receiver(transfer(DType.F32, 64, 16))
    arena, lengths = arena_of([packets[0], packets[1], packets[0]])
    assert rx.feed(arena, lengths, session()) == [Reason.OK, Reason.OK, Reason.DUPLICATE]
    before = rx.snapshot()
    assert rx.feed(arena, lengths, session()) == [Reason.DUPLICATE] * 3
    assert rx.snapshot() == before
    assert rx.counters[Reason.DUPLICATE] == 4 and rx.counters[Reason.OK] == 2


# --- every bad input has its own counter and is never written --------------------------------

SPEC = transfer(DType.F32, 100, 32)
BASE = header(src=1, chunk=1, count=32)


def _enc(h: Header = BASE, n_payload: int | None = None, key: TagKey | None = None) -> bytes:
    n = h.count * 4 if n_payload is None else n_payload
    payload = np.arange(n, dtype=np.uint8)
    return encode(h, payload, key)


def _retag(data: bytes, at: int, value: int) -> bytes:
    buf = bytearray(data)
    buf[at] = value
    buf[40:48] = packet_tag(bytes(buf), TagKey()).to_bytes(8, "little")
    return bytes(buf)


def _flip(data: bytes, at: int) -> bytes:
    buf = bytearray(data)
    buf[at] ^= 0x10
    return bytes(buf)


BAD = {
    "truncated": (_enc()[:40], Reason.TRUNCATED),
    "header_only": (_enc(BASE.with_(count=0)), Reason.COUNT_MISMATCH),
    "oversized": (_enc(BASE.with_(count=400)), Reason.OVERSIZED),
    "bad_magic": (_retag(_enc(), 1, 0x00), Reason.BAD_MAGIC),
    "bad_version": (_retag(_enc(), 2, 2), Reason.BAD_VERSION),
    "bad_kind_byte": (_retag(_enc(), 3, 99), Reason.BAD_KIND),
    "control_kind": (
        encode(BASE.with_(kind=Kind.ACK, count=9), encode_bitmap(np.ones(9, bool))),
        Reason.BAD_KIND,
    ),
    "foreign_job": (_enc(BASE.with_(job=JOB + 1)), Reason.FOREIGN_JOB),
    "bad_tag_payload": (_flip(_enc(), 100), Reason.BAD_TAG),
    "bad_tag_header": (_flip(_enc(), 20), Reason.BAD_TAG),
    "bad_tag_field": (_flip(_enc(), 44), Reason.BAD_TAG),
    "keyed_tag_on_fast_session": (_enc(key=KEYED), Reason.BAD_TAG),
    "stale_step": (_enc(BASE.with_(step=2)), Reason.STALE_STEP),
    "bad_bucket": (_enc(BASE.with_(bucket=9)), Reason.BAD_BUCKET),
    "bad_phase": (_enc(BASE.with_(phase=7)), Reason.BAD_PHASE),
    "src_outside_world": (_enc(BASE.with_(src=WORLD)), Reason.BAD_RANK),
    "wrong_dst": (_enc(BASE.with_(dst=ME + 1)), Reason.BAD_RANK),
    "bad_shard": (_enc(BASE.with_(shard=WORLD)), Reason.BAD_SHARD),
    "bad_dtype_value": (_enc(BASE.with_(dtype=5)), Reason.BAD_DTYPE),
    "wrong_dtype": (_enc(BASE.with_(dtype=DType.F16, count=32), n_payload=64), Reason.BAD_DTYPE),
    "e4m3_no_scale": (_enc(BASE.with_(dtype=DType.E4M3, count=32), n_payload=32), Reason.BAD_DTYPE),
    "e4m3_nan_scale": (
        _enc(BASE.with_(dtype=DType.E4M3, count=32, aux=0x7FC00000), n_payload=32),
        Reason.BAD_DTYPE,
    ),
    "e4m3_inf_scale": (
        _enc(BASE.with_(dtype=DType.E4M3, count=32, aux=0x7F800000), n_payload=32),
        Reason.BAD_DTYPE,
    ),
    # Lossy-format chunks of the float32 transfer that pass every check but one.
    "bf16_bad_tag": (_flip(_enc(BASE.with_(dtype=DType.BF16), n_payload=64), 90), Reason.BAD_TAG),
    "e4m3_bad_tag": (
        _flip(_enc(BASE.with_(dtype=DType.E4M3, aux=0x3F800000), n_payload=32), 70),
        Reason.BAD_TAG,
    ),
    "bf16_float32_length": (_enc(BASE.with_(dtype=DType.BF16)), Reason.COUNT_MISMATCH),
    "e4m3_bf16_length": (
        _enc(BASE.with_(dtype=DType.E4M3, aux=0x3F800000), n_payload=64),
        Reason.COUNT_MISMATCH,
    ),
    "bf16_other_step": (
        _enc(BASE.with_(dtype=DType.BF16, step=6), n_payload=64),
        Reason.UNKNOWN_TRANSFER,
    ),
    "bf16_chunk_range": (
        _enc(BASE.with_(dtype=DType.BF16, chunk=4, count=4), n_payload=8),
        Reason.CHUNK_RANGE,
    ),
    "count_vs_payload": (_enc(BASE, n_payload=124), Reason.COUNT_MISMATCH),
    "count_vs_chunk": (_enc(BASE.with_(chunk=3, count=32)), Reason.COUNT_MISMATCH),
    "short_count": (_enc(BASE.with_(count=31)), Reason.COUNT_MISMATCH),
    "chunk_range": (_enc(BASE.with_(chunk=4, count=4)), Reason.CHUNK_RANGE),
    "huge_chunk": (_enc(BASE.with_(chunk=2**32 - 1, count=4)), Reason.CHUNK_RANGE),
    "other_step": (_enc(BASE.with_(step=6)), Reason.UNKNOWN_TRANSFER),
    "other_bucket": (_enc(BASE.with_(bucket=3)), Reason.UNKNOWN_TRANSFER),
    "other_shard": (_enc(BASE.with_(shard=1)), Reason.UNKNOWN_TRANSFER),
    "other_phase": (_enc(BASE.with_(phase=Phase.GATHER)), Reason.UNKNOWN_TRANSFER),
}


@pytest.mark.parametrize("gather", [False, True], ids=["reduce", "place"])
@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_input_is_rejected_counted_and_never_written(case: str, gather: bool) -> None:
    data, reason = BAD[case]
    spec = SPEC  # place_into validates against the transfer it is given, whatever its phase
    sess = session(step_lo=4, step_hi=9, n_buckets=8, max_datagram=1024)
    rx = Receiver(spec, gather=gather)
    before = rx.snapshot()
    arena, lengths = arena_of([data], width=2048)
    assert rx.feed(arena, lengths, sess) == [reason]
    assert rx.snapshot() == before
    assert rx.counters[reason] == 1 and rx.counters.sum() == 1


def test_narrowed_sender_range_is_bad_rank_and_duplicate_has_its_own_counter() -> None:
    rx = Receiver(transfer(DType.F32, 100, 32, src_lo=2, src_hi=4))
    arena, lengths = arena_of([_enc(), _enc(BASE.with_(src=2)), _enc(BASE.with_(src=2))])
    assert rx.feed(arena, lengths, session()) == [Reason.BAD_RANK, Reason.OK, Reason.DUPLICATE]
    assert rx.received[0, 1] == 1 and rx.contrib[1] == 1


def test_lengths_beyond_the_row_or_negative_are_rejected_not_read() -> None:
    rx = Receiver(SPEC)
    arena, lengths = arena_of([_enc(), _enc(), _enc()], width=176)
    lengths[:] = [177, -5, 10**12]
    assert rx.feed(arena, lengths, session()) == [
        Reason.OVERSIZED, Reason.TRUNCATED, Reason.OVERSIZED,
    ]  # fmt: skip
    assert rx.out[0] == 0.5 and rx.contrib.sum() == 0


@pytest.mark.parametrize("gather", [False, True], ids=["reduce", "place"])
def test_a_well_formed_packet_longer_than_its_slot_or_the_limit_is_oversized(gather: bool) -> None:
    data = _enc()  # 176 bytes, valid in every field
    rx = Receiver(SPEC, gather=gather)
    arena, lengths = arena_of([data], width=176)
    assert rx.feed(arena, lengths, session(max_datagram=175)) == [Reason.OVERSIZED]
    narrow = np.ascontiguousarray(arena[:, :168])  # the slot is 8 bytes short of the datagram
    assert rx.feed(narrow, lengths, session()) == [Reason.OVERSIZED]
    assert rx.feed(arena, lengths, session(max_datagram=176)) == [Reason.OK]


def test_keyed_session_accepts_its_key_only() -> None:
    rx = Receiver(SPEC)
    good, fast = _enc(key=KEYED), _enc()
    other = _enc(key=TagKey.from_secret("someone else"))
    arena, lengths = arena_of([fast, other, good, _flip(good, 60)])
    assert rx.feed(arena, lengths, session(KEYED)) == [
        Reason.BAD_TAG, Reason.BAD_TAG, Reason.OK, Reason.BAD_TAG,
    ]  # fmt: skip


@SETTINGS
@given(
    dtype=st.sampled_from(list(SHARD_DTYPES)),
    gather=st.booleans(),
    keyed=st.booleans(),
    # Short rows are checked before they are written; from FUSE_MIN_ITEMS floats' worth of
    # bytes on, the fused loops write first and undo.
    count=st.one_of(st.integers(1, 37), st.sampled_from([2047, 2048, 2049, 2231, 4096])),
    seed=st.integers(0, 2**32 - 1),
    bit=st.integers(0, 10**6),
)
def test_a_forged_payload_leaves_every_slot_bit_for_bit(
    dtype: DType, gather: bool, keyed: bool, count: int, seed: int, bit: int
) -> None:
    """The fused loops write a slot while they check the tag and put it back on a mismatch: the
    slot must come back bit for bit, whatever bits it holds (NaN payloads, -0.0, infinities)."""
    rng = np.random.default_rng(seed)
    key = KEYED if keyed else TagKey()
    spec = transfer(dtype, count * 3, count)
    item = ITEM[dtype]
    payload = rng.integers(0, 256, count * item, dtype=np.uint8)
    good = encode(header(src=1, chunk=1, count=count, dtype=dtype), payload, key)
    bad = bytearray(good)
    at = 48 + (bit // 8) % (count * item)
    bad[at] ^= 1 << (bit % 8)
    wire = np.uint32 if dtype == DType.F32 else np.uint16
    slot = rng.integers(0, np.iinfo(wire).max, count * 3, dtype=wire, endpoint=True)
    if gather or dtype == DType.F32:
        out = slot.copy()
    else:  # 16-bit contributions add into a float32 accumulator
        out = rng.integers(0, 2**32 - 1, count * 3, dtype=np.uint32, endpoint=True)
    before = out.copy()
    received = np.zeros((WORLD, 3), dtype=np.uint8)
    contrib = np.zeros(3, dtype=np.uint16)
    counters = np.zeros(N_REASONS, dtype=np.int64)
    arena, lengths = arena_of([bytes(bad)], width=row_width(count, dtype, 8))
    kw = {"session": session(key), "transfer": spec, "counters": counters}
    if gather:
        target = out.view(np.float32) if dtype == DType.F32 else out
        accepted = kernels.place_into(arena, lengths, target, received, **kw)
    else:
        accepted = kernels.reduce_into(
            arena, lengths, out.view(np.float32), contrib, received, **kw
        )
    assert accepted == 0 and counters[Reason.BAD_TAG] == 1
    assert out.tobytes() == before.tobytes()
    assert not received.any() and not contrib.any()


# --- fuzzing: random bytes and well-tagged random headers --------------------------------------


@SETTINGS
@given(
    dtype=st.sampled_from(list(SHARD_DTYPES)),
    gather=st.booleans(),
    rows=st.lists(
        st.tuples(st.binary(min_size=0, max_size=200), st.integers(-3, 260)), min_size=1,
        max_size=6,
    ),
)  # fmt: skip
def test_random_bytes_never_crash_and_never_write(
    dtype: DType, gather: bool, rows: list[tuple[bytes, int]]
) -> None:
    arena = np.zeros((len(rows), 208), dtype=np.uint8)
    lengths = np.zeros(len(rows), dtype=np.int64)
    for i, (raw, length) in enumerate(rows):
        arena[i, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        lengths[i] = length
    rx = Receiver(transfer(dtype, 150, 40), gather=gather)
    before = rx.snapshot()
    verdicts = rx.feed(arena, lengths, session())
    assert Reason.OK not in verdicts
    assert rx.snapshot() == before


HEADER_FUZZ = st.fixed_dictionaries(
    {
        "kind": st.sampled_from([Kind.DATA] * 4 + [Kind.ACK, Kind.STOP, 0, 9]),
        "job": st.sampled_from([JOB] * 5 + [0, JOB + 1, 2**32 - 1]),
        "step": st.sampled_from([5] * 5 + [4, 6, 0, 2**32 - 1]),
        "bucket": st.sampled_from([2] * 5 + [0, 3, 2**16 - 1]),
        "shard": st.sampled_from([0] * 5 + [1, WORLD, 2**16 - 1]),
        "src": st.integers(0, WORLD + 1),
        "dst": st.sampled_from([ME] * 5 + [ME + 1, 2**16 - 1]),
        "phase": st.sampled_from([Phase.REDUCE] * 4 + [Phase.GATHER, 4, 255]),
        "dtype": st.integers(0, 4),
        "chunk": st.sampled_from([0, 1, 2, 3, 4, 5, 2**31, 2**32 - 1]),
        "count": st.sampled_from([0, 1, 4, 31, 32, 33, 64, 2**31]),
        "flags": st.integers(0, 255),
        "prio": st.integers(0, 255),
        # An E4M3 chunk's scale: none, valid, the largest valid, infinity, NaN.
        "aux": st.sampled_from([0, 0x3F800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000]),
    }
)


@SETTINGS
@given(
    dtype=st.sampled_from(list(SHARD_DTYPES)),
    gather=st.booleans(),
    keyed=st.booleans(),
    packets=st.lists(
        st.tuples(HEADER_FUZZ, st.sampled_from([None, 0, 3, 62, 64, 128, 130])),
        min_size=1, max_size=8,
    ),
)  # fmt: skip
def test_well_tagged_random_headers_match_validate_and_write_only_their_slot(
    dtype: DType, gather: bool, keyed: bool, packets: list
) -> None:
    key = KEYED if keyed else TagKey()
    spec = transfer(dtype, 100, 32)
    datagrams = []
    for fields, claimed in packets:
        h = Header(**fields)
        item = (4, 2, 2, 1)[h.dtype] if h.dtype < 4 else 4
        n_payload = min(h.count, 200) * item if claimed is None else claimed
        datagrams.append(encode(h, np.arange(n_payload, dtype=np.uint8), key))
    arena, lengths = arena_of(datagrams, width=row_width(32, DType.F32, extra=800))
    rx = Receiver(spec, gather=gather)
    rx.feed(arena, lengths, session(key, step_lo=3, step_hi=6, n_buckets=4, max_datagram=600))


# --- Hadamard -----------------------------------------------------------------------------------

HAD_SIZES = [1, 2, 3, 5, 64, 100, 1024, 1025, 2048 + 700, 5000]


@pytest.mark.parametrize("n", HAD_SIZES)
@pytest.mark.parametrize("block", [1, 4, 256, 1024])
def test_hadamard_matches_naive_and_inverts(n: int, block: int) -> None:
    rng = np.random.default_rng(n + block)
    x = rng.standard_normal(n).astype(np.float32)
    y = x.copy()
    kernels.hadamard_forward(y, seed=42, block=block)
    np.testing.assert_allclose(y, naive.hadamard_forward(x, seed=42, block=block), atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(y), np.linalg.norm(x), rtol=1e-5)
    z = y.copy()
    kernels.hadamard_inverse(z, seed=42, block=block)
    np.testing.assert_allclose(z, naive.hadamard_inverse(y, seed=42, block=block), atol=2e-5)
    np.testing.assert_allclose(z, x, atol=1e-5)


def test_hadamard_is_linear_so_it_commutes_with_the_sum() -> None:
    rng = np.random.default_rng(5)
    buckets = [rng.standard_normal(3000).astype(np.float32) for _ in range(4)]
    rotated = [b.copy() for b in buckets]
    for b in rotated:
        kernels.hadamard_forward(b, seed=7, block=512)
    total = np.sum(buckets, axis=0, dtype=np.float64).astype(np.float32)
    kernels.hadamard_forward(total, seed=7, block=512)
    np.testing.assert_allclose(np.sum(rotated, axis=0), total, atol=1e-4)
    kernels.hadamard_inverse(total, seed=7, block=512)
    np.testing.assert_allclose(total, np.sum(buckets, axis=0), atol=1e-4)


def test_hadamard_is_orthonormal_on_basis_vectors_and_seeded() -> None:
    for i in (0, 5, 63, 64, 200, 255):
        e = np.zeros(256, dtype=np.float32)
        e[i] = 1.0
        kernels.hadamard_forward(e, seed=3, block=256)
        np.testing.assert_allclose(np.abs(e), 1 / 16, rtol=1e-6)  # spreads over the block
    a = np.ones(1000, dtype=np.float32)
    b = a.copy()
    c = a.copy()
    kernels.hadamard_forward(a, seed=1)
    kernels.hadamard_forward(b, seed=1)
    kernels.hadamard_forward(c, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_hadamard_signs_follow_the_counter_hash() -> None:
    x = np.ones(300, dtype=np.float32)
    kernels.hadamard_forward(x, seed=2**64 - 1, block=1)  # blocks of 1: y = D x
    assert np.array_equal(x, naive.signs(300, 2**64 - 1).astype(np.float32))


def test_hadamard_empty_is_a_no_op_with_checked_arguments() -> None:
    """An empty vector is left as it is and nothing around it is written (an empty view into
    a buffer); its dtype and block are still checked."""
    buf = np.arange(8, dtype=np.float32)
    empty = buf[4:4]
    kernels.hadamard_forward(empty, seed=0)
    kernels.hadamard_inverse(empty, seed=0, block=1)
    assert empty.shape == (0,)
    np.testing.assert_array_equal(buf, np.arange(8, dtype=np.float32))
    with pytest.raises(ValueError, match="float32"):
        kernels.hadamard_forward(np.zeros(0, dtype=np.float64), seed=0)
    with pytest.raises(ValueError, match="power of two"):
        kernels.hadamard_inverse(np.zeros(0, dtype=np.float32), seed=0, block=3)


# --- checked wrappers ---------------------------------------------------------------------------


def test_pack_rejects_bad_arguments_with_actionable_messages() -> None:
    src = np.zeros(64, dtype=np.float32)
    arena = np.zeros((4, 128), dtype=np.uint8)
    lengths = np.zeros(4, dtype=np.int64)
    kw = {"dtype": DType.F32, "header": header(), "chunk_elems": 16, "key": TagKey()}
    cases = [
        ({"src": src.astype(np.float64)}, "float32"),
        ({"src": np.zeros((8, 8), np.float32)}, "1-D"),
        ({"src": np.zeros(128, np.float32)[::2]}, "C-contiguous"),
        ({"arena": np.zeros((4, 124), np.uint8)}, "multiple of 8"),
        ({"arena": np.zeros((4, 96), np.uint8)}, "cannot hold"),
        ({"arena": np.zeros((3, 128), np.uint8)}, "cannot hold"),
        ({"arena": np.zeros((4, 16), np.uint32)}, "uint8"),
        ({"lengths": np.zeros(4, np.float64)}, "int64 or int32"),
        ({"chunk_elems": 0}, ">= 1"),
        ({"prio": 256}, "0..255"),
        ({"prio": np.zeros(2, np.uint8)}, "2 entries for 4 chunks"),
        ({"flags": np.full(4, 300)}, "0..255"),
        ({"norms": np.zeros(4, np.float64)}, "float32"),
        ({"header": header(bucket=2**16)}, "header.bucket"),
        ({"dtype": 7}, "shard dtype"),
        ({"src": np.zeros(64, np.float16), "dtype": DType.BF16}, "uint16, int16"),
        ({"first_chunk": 2**32 - 2}, "u32"),
    ]
    for change, message in cases:
        args = {"src": src, "arena": arena, "lengths": lengths, **kw, **change}
        with pytest.raises(ValueError, match=message):
            kernels.pack(args.pop("src"), args.pop("arena"), args.pop("lengths"), **args)
    ro = arena.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernels.pack(src, ro, lengths, **kw)


def test_receive_wrappers_reject_bad_arguments() -> None:
    arena, lengths = arena_of([_enc()])
    good = {
        "accum": np.zeros(100, np.float32),
        "contrib": np.zeros(4, np.uint16),
        "received": np.zeros((WORLD, 4), np.uint8),
    }
    kw = {"session": session(), "transfer": SPEC, "counters": np.zeros(N_REASONS, np.int64)}
    cases = [
        ({"accum": np.zeros(99, np.float32)}, r"shape \(100,\)"),
        ({"accum": np.zeros(100, np.float64)}, "float32"),
        ({"contrib": np.zeros(4, np.int32)}, "uint16"),
        ({"received": np.zeros((3, 4), np.uint8)}, "src_hi - src_lo"),
        ({"lengths": np.zeros(2, np.int64)}, "one entry per arena row"),
        ({"rows": np.array([1])}, "rows must index"),
        ({"verdicts": np.zeros(2, np.uint8)}, r"shape \(1,\)"),
        ({"counters": np.zeros(3, np.int64)}, "counters"),
    ]
    for change, message in cases:
        args = {**good, "lengths": lengths, **kw, **change}
        with pytest.raises(ValueError, match=message):
            kernels.reduce_into(arena, args.pop("lengths"), args.pop("accum"),
                                args.pop("contrib"), args.pop("received"), **args)  # fmt: skip
    with pytest.raises(ValueError, match="chunk_elems >= 1"):
        kernels.reduce_into(arena, lengths, **good, **{**kw, "transfer": transfer(DType.F32, 9, 0)})
    with pytest.raises(ValueError, match="out for BF16"):
        kernels.place_into(arena, lengths, np.zeros(100, np.float16), good["received"],
                           **{**kw, "transfer": transfer(DType.BF16, 100, 32)})  # fmt: skip


def test_hadamard_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="power of two"):
        kernels.hadamard_forward(np.zeros(8, np.float32), seed=0, block=3)
    with pytest.raises(ValueError, match="float32"):
        kernels.hadamard_forward(np.zeros(8, np.float64), seed=0)
    with pytest.raises(ValueError, match="seed"):
        kernels.hadamard_inverse(np.zeros(8, np.float32), seed=-1)


def test_kernel_config_from_env() -> None:
    assert kernels.KernelConfig.from_env({}).fastmath
    assert not kernels.KernelConfig.from_env({"GRADLANE_FASTMATH": "0"}).fastmath
    assert kernels.KernelConfig.from_env({"GRADLANE_FASTMATH": " On "}).fastmath
    with pytest.raises(ConfigError, match="GRADLANE_FASTMATH"):
        kernels.KernelConfig.from_env({"GRADLANE_FASTMATH": "maybe"})
    strict = kernels.KernelConfig(fastmath=False).reduction_jit()
    assert strict["fastmath"] is False and strict["cache"] is False and strict["nogil"]
    assert kernels.KernelConfig().reduction_jit()["cache"] is True


def test_a_receiving_transfer_checks_packets_against_the_current_step_window() -> None:
    """The receiver prepares its kernel arguments once per transfer; when the session's step
    window moves (a new session), the next batch is judged by the new window, not the one the
    arguments were prepared with."""
    from gradlane.scheduling.loss import LossPolicy
    from gradlane.transport.config import TransportConfig
    from gradlane.transport.core.incoming import InKey
    from gradlane.transport.core.receiver import ReceiverCore

    cfg = TransportConfig(job=JOB)
    events: list = []
    rc = ReceiverCore(ME, WORLD, cfg, LossPolicy(cfg.loss), lambda *a, **k: b"", events.append, 0)
    accum, contrib = np.zeros(100, np.float32), np.zeros(4, np.uint16)
    received = np.zeros((WORLD, 4), np.uint8)
    received[ME] = 1
    early = session(step_lo=0, step_hi=10)
    t = rc.expect(InKey(5, 2, 0, Phase.REDUCE), SPEC, (1, 2, 3), accum, contrib, received, 0.0,
                  early)  # fmt: skip
    for chunk, sess, accepted in ((0, early, 1), (1, session(step_lo=6, step_hi=16), 0)):
        arena, lengths = arena_of([_enc(header(src=1, chunk=chunk, count=32))])
        before = int(rc.counters[Reason.STALE_STEP])
        rc.on_data(t, arena, lengths, np.array([0]), np.zeros(1, np.int64), 0.0, sess)
        assert int(received[1, chunk]) == accepted
        assert int(rc.counters[Reason.STALE_STEP]) - before == 1 - accepted


@SETTINGS
@given(
    dtype=st.sampled_from(list(SHARD_DTYPES)),
    n=st.integers(1, 300),
    chunk_elems=st.integers(1, 64),
    specials=st.lists(st.tuples(st.integers(0, 299), st.sampled_from(["nan", "inf", "-inf"]))),
)
def test_place_flags_exactly_the_chunks_holding_nan_or_inf(
    dtype: DType, n: int, chunk_elems: int, specials: list[tuple[int, str]]
) -> None:
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 1e3
    for i, v in specials:
        if i < n:
            values[i] = float(v)
    src = values if dtype != DType.F16 else values.astype(np.float16).view(np.uint16)
    if dtype == DType.BF16:
        src = (values.view(np.uint32) >> 16).astype(np.uint16)
    packets = pack_all(src, dtype, chunk_elems, TagKey(), header(src=2, phase=Phase.GATHER))
    spec = transfer(dtype, n, chunk_elems, phase=Phase.GATHER)
    arena, lengths = arena_of(packets)
    out = np.zeros(n, dtype=np.float32 if dtype == DType.F32 else np.uint16)
    received = np.zeros((WORLD, spec.n_chunks), dtype=np.uint8)
    nonfinite = np.zeros(spec.n_chunks, dtype=np.uint8)
    kernels.place_into(
        arena, lengths, out, received, session=session(), transfer=spec,
        counters=np.zeros(N_REASONS, np.int64), nonfinite=nonfinite,
    )  # fmt: skip
    as32 = naive.as_float32(naive.wire_bits(src, dtype), dtype)
    want = [not np.isfinite(as32[c * chunk_elems : (c + 1) * chunk_elems]).all()
            for c in range(spec.n_chunks)]  # fmt: skip
    assert nonfinite.astype(bool).tolist() == want


@SETTINGS
@given(st.integers(0, 300), st.integers(0, 300), st.integers(0, 300), st.integers(0, 2**32 - 1))
def test_copy_bytes_equals_a_slice_copy_and_writes_nothing_else(a, k, pad, seed):
    """``copy_bytes`` (one ``memcpy`` intrinsic) against the NumPy slice copy: the ``k`` bytes
    land at the start of ``dst``, at any source offset (word-aligned or not), and the bytes
    around them keep their values."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, a + k + 1, dtype=np.uint8)
    dst = rng.integers(0, 256, k + pad + 1, dtype=np.uint8)
    want = dst.copy()
    want[:k] = src[a : a + k]
    kernels.copy_bytes(dst, src, a, k)
    np.testing.assert_array_equal(dst, want)
