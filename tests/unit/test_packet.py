"""The wire format (transport/wire/header.py) and the integrity tags (transport/wire/tag.py)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gradlane.transport.errors import ProtocolError
from gradlane.transport.wire.header import (
    HEADER_DTYPE,
    HEADER_SIZE,
    MAGIC,
    N_REASONS,
    VERSION,
    DType,
    Header,
    HeaderFields,
    Kind,
    Phase,
    Reason,
    SessionSpec,
    TransferSpec,
    decode_bitmap,
    decode_header,
    encode,
    encode_bitmap,
    header_fields,
    header_view,
    validate,
    validate_data_rows,
)
from gradlane.transport.wire.tag import (
    MAX_TAGGED_BYTES,
    NH_KEY_WORDS,
    TAG_FAST,
    TAG_KEYED,
    TagKey,
    fast_tag,
    packet_tag,
    siphash24,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(
    max_examples=200,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# SipHash-2-4, key 00..0f, message 00..n-1 for n = 0..63: vectors_sip64 of the reference
# implementation (github.com/veorq/SipHash, vectors.h), as little-endian bytes.
SIP64_VECTORS = """
310e0edd47db6f72 fd67dc93c539f874 5a4fa9d909806c0d 2d7efbd796666785
b7877127e09427cf 8da699cd64557618 cee3fe586e46c9cb 37d1018bf50002ab
6224939a79f5f593 b0e4a90bdf82009e f3b9dd94c5bb5d7a a7ad6b22462fb3f4
fbe50e86bc8f1e75 903d84c02756ea14 eef27a8e90ca23f7 e545be4961ca29a1
db9bc2577fcc2a3f 9447be2cf5e99a69 9cd38d96f0b3c14b bd6179a71dc96dbb
98eea21af25cd6be c7673b2eb0cbf2d0 883ea3e395675393 c8ce5ccd8c030ca8
94af49f6c650adb8 eab8858ade92e1bc f315bb5bb835d817 adcf6b0763612e2f
a5c91da7acaa4dde 716595876650a2a6 28ef495c53a387ad 42c341d8fa92d832
ce7cf2722f512771 e37859f94623f3a7 381205bb1ab0e012 ae97a10fd434e015
b4a31508beff4d31 81396229f0907902 4d0cf49ee5d4dcca 5c73336a76d8bf9a
d0a704536ba93e0e 925958fcd6420cad a915c29bc8067318 952b79f3bc0aa6d4
f21df2e41d4535f9 87577519048f53a9 10a56cf5dfcd9adb eb75095ccd986cd0
51a9cb9ecba312e6 96afadfc2ce666c7 72fe52975a4364ee 5a1645b276d592a1
b274cb8ebf87870a 6f9bb4203de7b381 eaecb2a30b22a87f 9924a43cc1315724
bd838d3aafbf8db7 0b1a2a3265d51aea 135079a3231ce660 932b2846e4d70666
e1915f5cb1eca46c f325965ca16d629f 575ff28e60381be5 724506eb4c328a95
""".split()  # noqa: SIM905 - laid out like vectors.h, four to a line

FIELD_RANGES = {
    "kind": st.sampled_from([int(k) for k in Kind]),
    "job": st.integers(0, 2**32 - 1),
    "step": st.integers(0, 2**32 - 1),
    "bucket": st.integers(0, 2**16 - 1),
    "shard": st.integers(0, 2**16 - 1),
    "src": st.integers(0, 2**16 - 1),
    "dst": st.integers(0, 2**16 - 1),
    "chunk": st.integers(0, 2**32 - 1),
    "count": st.integers(0, 2**32 - 1),
    "flags": st.integers(0, 255),
    "prio": st.integers(0, 255),
    "dtype": st.integers(0, 255),
    "phase": st.integers(0, 255),
    "norm": st.floats(width=32, allow_nan=False),
    "aux": st.integers(0, 2**32 - 1),
}
KEYS = st.one_of(
    st.just(TagKey()),
    st.builds(TagKey, st.just(TAG_KEYED), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
)


def _mask64(x: int) -> int:
    return x & 0xFFFFFFFFFFFFFFFF


def reference_fast_tag(packet: bytes) -> int:
    """The fast tag exactly as tag.py's docstring defines it, in plain Python integers."""
    msg = packet[:40] + packet[48:]
    msg += b"\0" * (-len(msg) % 4)
    words = [int.from_bytes(msg[i : i + 4], "little") for i in range(0, len(msg), 4)]
    a = _mask64(sum(words))
    b = _mask64(sum((i + 1) * w for i, w in enumerate(words)))
    x = a ^ _mask64((b << 32) | (b >> 32)) ^ _mask64(len(packet) * 0x9E3779B97F4A7C15)
    for mult in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        x = _mask64((x ^ (x >> 33)) * mult)
    return x ^ (x >> 33)


def reference_keyed_tag(packet: bytes, key: TagKey) -> int:
    """The keyed tag exactly as tag.py's docstring defines it, in plain Python integers (its
    SipHash-2-4 is held to the published test vectors below)."""
    k01 = key.k0.to_bytes(8, "little") + key.k1.to_bytes(8, "little")
    stream = hashlib.shake_256(b"gradlane-nh-v1" + k01).digest(8 * NH_KEY_WORDS)
    kw = [int.from_bytes(stream[8 * i : 8 * i + 8], "little") for i in range(NH_KEY_WORDS)]
    msg = packet + b"\0" * (-len(packet) % 8)
    h1 = h2 = 0
    for i in range(len(msg) // 8):
        if i == 5:  # the tag field
            continue
        m = int.from_bytes(msg[8 * i : 8 * i + 8], "little")
        for shift, acc in ((0, 1), (2, 2)):
            k = kw[i + shift]
            v = ((m + k) & 0xFFFFFFFF) * (((m >> 32) + (k >> 32)) & 0xFFFFFFFF)
            if acc == 1:
                h1 = _mask64(h1 + v)
            else:
                h2 = _mask64(h2 + v)
    words = h1.to_bytes(8, "little") + h2.to_bytes(8, "little") + len(packet).to_bytes(8, "little")
    return siphash24(k01, words)


# --- encode / decode --------------------------------------------------------------------------


@SETTINGS
@given(fields=st.fixed_dictionaries(FIELD_RANGES), payload=st.binary(max_size=200), key=KEYS)
def test_encode_decode_round_trip(fields: dict, payload: bytes, key: TagKey) -> None:
    header = Header(**fields)
    data = encode(header, payload, key)
    assert len(data) == HEADER_SIZE + len(payload)
    assert data[HEADER_SIZE:] == payload
    got = decode_header(data)
    assert got == header.with_(tag=packet_tag(data, key))
    assert got.magic == MAGIC and got.version == VERSION


@SETTINGS
@given(
    fields=st.fixed_dictionaries(
        {k: FIELD_RANGES[k] for k in ("kind", "step", "bucket", "shard", "phase", "dst", "chunk")}
        | {k: FIELD_RANGES[k] for k in ("count", "aux", "flags", "norm")}
    ),
    payload=st.binary(max_size=64),
)
def test_control_packets_encode_as_their_header_says(fields: dict, payload: bytes) -> None:
    """The endpoint builds control packets from plain values (no Header per packet): the bytes
    are encode()'s for the same Header, and header_fields() reads every field back."""
    from gradlane.transport.config import TransportConfig
    from gradlane.transport.core.endpoint import Endpoint

    ep = Endpoint(2, 4, TransportConfig(job=77))
    f = dict(fields)
    key = (f.pop("step"), f.pop("bucket"), f.pop("shard"), f.pop("phase"))
    dst = f.pop("dst")
    got = ep._encode_to(f.pop("kind"), key, dst, payload=payload, **f)
    header = Header(**fields, job=77, src=2)
    assert got == encode(header, payload, ep.key)
    back = header_fields(np.frombuffer(got, dtype=np.uint8))
    assert back._replace(tag=0) == HeaderFields._make(
        getattr(header, name) for name in HEADER_DTYPE.names or ()
    )._replace(norm=back.norm, tag=0)
    assert back.norm == np.float32(header.norm)


@SETTINGS
@given(fields=st.fixed_dictionaries(FIELD_RANGES), payload=st.binary(max_size=64))
def test_header_view_sees_encoded_fields(fields: dict, payload: bytes) -> None:
    data = encode(Header(**fields), payload)
    arena = np.zeros((2, HEADER_SIZE + 64 + (-(HEADER_SIZE + 64)) % 8), dtype=np.uint8)
    arena[1, : len(data)] = np.frombuffer(data, dtype=np.uint8)
    view = header_view(arena)
    for name in ("job", "step", "bucket", "chunk", "count", "aux"):
        assert int(view[1][name]) == fields[name]
    assert int(view[0]["magic"]) == 0


def test_header_dtype_is_the_documented_48_bytes() -> None:
    assert HEADER_DTYPE.itemsize == HEADER_SIZE == 48
    assert HEADER_DTYPE.fields is not None
    offsets = {name: HEADER_DTYPE.fields[name][1] for name in HEADER_DTYPE.names or ()}
    assert offsets["job"] == 8 and offsets["chunk"] == 24 and offsets["norm"] == 32
    assert offsets["tag"] == 40


# --- tags ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(64))
def test_siphash24_reference_vectors(n: int) -> None:
    expected = int.from_bytes(bytes.fromhex(SIP64_VECTORS[n]), "little")
    assert siphash24(bytes(range(16)), bytes(range(n))) == expected


def test_siphash24_first_vector_is_the_papers() -> None:
    assert siphash24(bytes(range(16)), b"") == 0x726FDB47DD0E0E31


def test_siphash24_rejects_a_short_key() -> None:
    with pytest.raises(ValueError, match="16-byte"):
        siphash24(b"short", b"")


@SETTINGS
@given(fields=st.fixed_dictionaries(FIELD_RANGES), payload=st.binary(max_size=300))
def test_fast_tag_is_the_documented_formula(fields: dict, payload: bytes) -> None:
    data = encode(Header(**fields), payload)
    assert packet_tag(data, TagKey()) == reference_fast_tag(data)
    arr = np.frombuffer(data, dtype=np.uint8)
    assert int(fast_tag(arr, len(data))) == reference_fast_tag(data)


@SETTINGS
@given(
    fields=st.fixed_dictionaries(FIELD_RANGES),
    payload=st.binary(min_size=1, max_size=300),
    key=KEYS,
)
def test_keyed_tag_is_the_documented_formula(fields: dict, payload: bytes, key: TagKey) -> None:
    data = encode(Header(**fields), payload, key)
    if key.keyed:
        assert packet_tag(data, key) == reference_keyed_tag(data, key)
    assert int.from_bytes(data[40:48], "little") == packet_tag(data, key)


def _words(data: bytes) -> list[tuple[int, int]]:
    """(start, end) byte spans of the message's u32 words: header [0, 40), payload [48, ...)."""
    spans = [(i, i + 4) for i in range(0, 40, 4)]
    spans += [(i, min(i + 4, len(data))) for i in range(48, len(data), 4)]
    return spans


@SETTINGS
@given(
    fields=st.fixed_dictionaries(FIELD_RANGES),
    payload=st.binary(min_size=0, max_size=256),
    data=st.data(),
)
def test_fast_tag_catches_every_single_word_error(fields: dict, payload: bytes, data) -> None:
    packet = bytearray(encode(Header(**fields), payload))
    tag = packet_tag(bytes(packet), TagKey())
    spans = _words(bytes(packet))
    start, end = spans[data.draw(st.integers(0, len(spans) - 1))]
    flip = data.draw(st.integers(1, 2 ** (8 * (end - start)) - 1))
    old = int.from_bytes(packet[start:end], "little")
    packet[start:end] = (old ^ flip).to_bytes(end - start, "little")
    assert packet_tag(bytes(packet), TagKey()) != tag


@SETTINGS
@given(
    fields=st.fixed_dictionaries(FIELD_RANGES),
    payload=st.binary(min_size=8, max_size=256),
    data=st.data(),
)
def test_fast_tag_catches_every_swap_of_two_different_words(
    fields: dict, payload: bytes, data
) -> None:
    packet = bytearray(encode(Header(**fields), payload))
    tag = packet_tag(bytes(packet), TagKey())
    full = [s for s in _words(bytes(packet)) if s[1] - s[0] == 4]
    i, j = data.draw(st.lists(st.integers(0, len(full) - 1), min_size=2, max_size=2, unique=True))
    (a0, a1), (b0, b1) = full[i], full[j]
    wa, wb = bytes(packet[a0:a1]), bytes(packet[b0:b1])
    if wa == wb:
        return
    packet[a0:a1], packet[b0:b1] = wb, wa
    assert packet_tag(bytes(packet), TagKey()) != tag


def test_tag_key_from_secret() -> None:
    assert TagKey.from_secret(None) == TagKey() == TagKey.from_secret("")
    assert not TagKey().keyed
    key = TagKey.from_secret("s3cret")
    assert key.keyed and key.mode == TAG_KEYED
    assert key == TagKey.from_secret(b"s3cret")
    assert key != TagKey.from_secret("other")
    assert TagKey().mode == TAG_FAST


# --- validation ---------------------------------------------------------------------------------

SESSION = SessionSpec(job=7, me=1, world=4, step_lo=10, step_hi=20, n_buckets=8, max_datagram=1500)
TRANSFER = TransferSpec(
    step=12, bucket=3, shard=1, phase=Phase.REDUCE, dtype=DType.F32, n_elems=100,
    chunk_elems=32, src_lo=0, src_hi=4,
)  # fmt: skip
GOOD = Header(kind=Kind.DATA, job=7, step=12, bucket=3, shard=1, src=2, dst=1, chunk=1, count=32)


def _data(header: Header = GOOD, n_payload: int | None = None, key: TagKey | None = None) -> bytes:
    n = header.count * 4 if n_payload is None else n_payload
    return encode(header, bytes(range(256)) * (n // 256) + bytes(range(n % 256)), key)


def _retag(packet: bytes, key: TagKey | None = None) -> bytes:
    buf = bytearray(packet)
    buf[40:48] = packet_tag(bytes(buf), key or TagKey()).to_bytes(8, "little")
    return bytes(buf)


def _crafted() -> dict[Reason, bytes]:
    """One datagram per Reason that ``validate`` can return, each failing only that check."""
    magic = bytearray(_data())
    magic[0] ^= 0xFF
    version = bytearray(_data())
    version[2] = 9
    bad_kind = bytearray(_data())
    bad_kind[3] = 200
    bad_tag = bytearray(_data())
    bad_tag[60] ^= 1
    return {
        Reason.OK: _data(),
        Reason.TRUNCATED: _data()[:47],
        Reason.OVERSIZED: _data(GOOD.with_(count=400)),
        Reason.BAD_MAGIC: _retag(bytes(magic)),
        Reason.BAD_VERSION: _retag(bytes(version)),
        Reason.BAD_KIND: _retag(bytes(bad_kind)),
        Reason.FOREIGN_JOB: _data(GOOD.with_(job=8)),
        Reason.BAD_TAG: bytes(bad_tag),
        Reason.STALE_STEP: _data(GOOD.with_(step=9)),
        Reason.BAD_BUCKET: _data(GOOD.with_(bucket=8)),
        Reason.BAD_PHASE: _data(GOOD.with_(phase=4)),
        Reason.BAD_RANK: _data(GOOD.with_(dst=2)),
        Reason.BAD_SHARD: _data(GOOD.with_(shard=4)),
        Reason.BAD_DTYPE: _data(GOOD.with_(dtype=3)),
        Reason.COUNT_MISMATCH: _data(GOOD, n_payload=127),
        Reason.UNKNOWN_TRANSFER: _data(GOOD.with_(step=13)),
        Reason.CHUNK_RANGE: _data(GOOD.with_(chunk=4)),
    }


@pytest.mark.parametrize("reason", list(_crafted()))
def test_every_reason_is_reachable_with_a_crafted_packet(reason: Reason) -> None:
    assert validate(_crafted()[reason], SESSION, TRANSFER) == reason


def test_crafted_packets_cover_every_reason_but_duplicate() -> None:
    # DUPLICATE needs receiver state; the kernel tests reach it (test_kernels.py).
    # UNEXPECTED_KIND and BITMAP_RANGE need an endpoint's state (test_hostile_packets.py).
    endpoint = {Reason.UNEXPECTED_KIND, Reason.BITMAP_RANGE}
    assert set(_crafted()) == set(Reason) - {Reason.DUPLICATE} - endpoint


def test_validate_checks_ranks_shape_and_dtype_against_the_transfer() -> None:
    cases = {
        Reason.BAD_RANK: GOOD.with_(src=4),
        Reason.COUNT_MISMATCH: GOOD.with_(chunk=3, count=32),
    }
    for reason, header in cases.items():
        assert validate(_data(header), SESSION, TRANSFER) == reason
    narrow = TransferSpec(**{**TRANSFER.__dict__, "src_lo": 0, "src_hi": 2})
    assert validate(_data(), SESSION, narrow) == Reason.BAD_RANK
    f16 = GOOD.with_(dtype=DType.F16)
    assert validate(_data(f16, n_payload=64), SESSION, TRANSFER) == Reason.BAD_DTYPE
    assert validate(_data(), SESSION) == Reason.OK


def test_validate_checks_bitmap_lengths_of_control_packets() -> None:
    ack = GOOD.with_(kind=Kind.ACK, count=20)
    assert validate(encode(ack, encode_bitmap(np.ones(20, bool))), SESSION) == Reason.OK
    assert validate(encode(ack, b"\0" * 4), SESSION) == Reason.COUNT_MISMATCH


def test_keyed_session_rejects_fast_tags_and_accepts_its_own() -> None:
    key = TagKey.from_secret("job-secret")
    keyed = SessionSpec(**{**SESSION.__dict__, "key": key})
    assert validate(_data(key=key), keyed, TRANSFER) == Reason.OK
    assert validate(_data(), keyed, TRANSFER) == Reason.BAD_TAG
    assert validate(_data(key=TagKey.from_secret("other")), keyed, TRANSFER) == Reason.BAD_TAG


@SETTINGS
@given(data=st.binary(max_size=200))
def test_random_bytes_never_crash_decode_or_validate(data: bytes) -> None:
    try:
        decode_header(data)
    except ProtocolError as exc:
        assert exc.reason in set(Reason)
    assert validate(data, SESSION, TRANSFER) in set(Reason)
    assert validate(data, SESSION) in set(Reason)


@SETTINGS
@given(fields=st.fixed_dictionaries(FIELD_RANGES), payload=st.binary(max_size=200))
def test_any_header_with_a_good_tag_gets_a_reason(fields: dict, payload: bytes) -> None:
    data = encode(Header(**fields), payload)
    assert validate(data, SESSION, TRANSFER) in set(Reason)
    if fields["job"] != SESSION.job:
        assert validate(data, SESSION, TRANSFER) == Reason.FOREIGN_JOB


# Data headers near the session's limits, so every session-level check both passes and fails.
NEAR_FIELDS = {
    "kind": st.just(int(Kind.DATA)),
    "job": st.just(SESSION.job),
    "step": st.integers(8, 22),
    "bucket": st.integers(6, 9),
    "shard": st.integers(2, 5),
    "src": st.integers(2, 5),
    "dst": st.integers(0, 2),
    "chunk": st.integers(0, 5),
    "count": st.integers(0, 70),
    "dtype": st.integers(0, 4),
    "phase": st.integers(0, 5),
}


@SETTINGS
@given(
    packets=st.lists(
        st.tuples(st.fixed_dictionaries(NEAR_FIELDS), st.integers(0, 280)), min_size=1, max_size=12
    )
)
def test_batch_data_validation_equals_validate_without_the_tag(packets: list) -> None:
    """validate_data_rows (the early-data path's batch check) gives, for every packet, the
    reason validate(..., tag=False) gives, for headers that pass the framing checks."""
    wires = [encode(Header(**f), bytes(n)) for f, n in packets]
    arena = np.zeros((len(wires), max(map(len, wires))), dtype=np.uint8)
    for i, w in enumerate(wires):
        arena[i, : len(w)] = np.frombuffer(w, np.uint8)
    lengths = np.array([len(w) for w in wires], dtype=np.int32)
    session = SessionSpec(**{**SESSION.__dict__, "max_datagram": 4096})
    got = validate_data_rows(header_view(arena), lengths, session)
    assert got.tolist() == [int(validate(w, session, tag=False)) for w in wires]


_FRAMING = (
    Reason.OVERSIZED,
    Reason.TRUNCATED,
    Reason.BAD_MAGIC,
    Reason.BAD_VERSION,
    Reason.BAD_KIND,
    Reason.FOREIGN_JOB,
)


@SETTINGS
@given(
    packets=st.lists(
        st.tuples(
            st.fixed_dictionaries(
                {
                    **NEAR_FIELDS,
                    "kind": st.one_of(st.just(int(Kind.DATA)), st.integers(0, 12)),
                    "job": st.sampled_from([7, 7, 7, 8]),
                    # few keys, so DATA rows that differ in one field only are common
                    **{k: st.integers(1, 2) for k in ("step", "bucket", "shard", "phase")},
                }
            ),
            st.integers(0, 40),  # payload bytes
            st.one_of(st.just(-1), st.integers(0, 11)),  # header byte to corrupt (-1: none)
            st.one_of(st.just(0), st.integers(-60, 8)),  # change of the received length
        ),
        min_size=1,
        max_size=16,
    )
)
def test_batch_framing_equals_validate(packets: list) -> None:
    """The endpoint's one-pass framing kernel counts, for every datagram failing one of
    validate()'s framing checks, the reason validate gives; every other datagram lands in the
    DATA or control list by its kind, and the DATA rows' key says whether they mix transfers."""
    from gradlane.transport.kernels.batch import frame_rows

    width = HEADER_SIZE + 40
    arena = np.zeros((len(packets), width), dtype=np.uint8)
    lengths = np.zeros(len(packets), dtype=np.int32)
    wires = []
    for i, (f, n, flip, grow) in enumerate(packets):
        w = bytearray(encode(Header(**f), bytes(n)))
        if flip >= 0:
            w[flip] ^= 0x5A
        target = max(0, len(w) + grow)  # what the datagram really is on the wire
        w = w[:target] + bytes(max(0, target - len(w)))
        lengths[i] = target  # a receive call reports the whole length, past the row's end too
        arena[i, : min(target, width)] = np.frombuffer(bytes(w[:width]), np.uint8)
        wires.append(bytes(w))
    counters = np.zeros(N_REASONS, dtype=np.int64)
    data, ctrl = (np.full(len(packets), -1, np.int64) for _ in range(2))
    key = np.zeros(4, np.int64)
    nd, nc, mixed = frame_rows(arena, lengths, len(packets), SESSION.job, counters, data, ctrl, key)
    session = SessionSpec(**{**SESSION.__dict__, "max_datagram": width})
    want = np.zeros(N_REASONS, dtype=np.int64)
    want_data, want_ctrl, keys = [], [], set()
    for i, w in enumerate(wires):
        why = validate(w, session, tag=False)
        if why in _FRAMING:
            want[why] += 1
        elif w[3] == Kind.DATA:
            want_data.append(i)
            h = np.frombuffer(w[:HEADER_SIZE], HEADER_DTYPE)[0]
            keys.add((int(h["step"]), int(h["bucket"]), int(h["shard"]), int(h["phase"])))
        else:
            want_ctrl.append(i)
    assert counters.tolist() == want.tolist()
    assert data[:nd].tolist() == want_data and ctrl[:nc].tolist() == want_ctrl
    assert mixed == (len(keys) > 1)
    if want_data:
        h = np.frombuffer(wires[want_data[0]][:HEADER_SIZE], HEADER_DTYPE)[0]
        assert key.tolist() == [int(h[k]) for k in ("step", "bucket", "shard", "phase")]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0, 1, 7, 2**31, 2**32 - 1]),  # step (the whole u32 range)
            st.sampled_from([0, 3, 2**16 - 1]),  # bucket
            st.sampled_from([0, 1, 2**16 - 1]),  # shard
            st.integers(0, 1),  # phase
        ),
        min_size=1,
        max_size=40,
    ),
    st.randoms(use_true_random=False),
)
def test_mixed_batch_groups_by_transfer_in_batch_order(keys: list, rnd) -> None:
    """The endpoint splits a batch's DATA rows by transfer key: one group per distinct key, in
    key order, each group's rows in batch order (no two keys share a packed value)."""
    from gradlane.transport.core.endpoint import Endpoint

    arena = np.zeros((len(keys) + 3, HEADER_SIZE), dtype=np.uint8)
    hv = np.frombuffer(arena, HEADER_DTYPE)  # one header record per row
    rows = np.array(sorted(rnd.sample(range(arena.shape[0]), len(keys))), dtype=np.int64)
    for r, (step, bucket, shard, phase) in zip(rows.tolist(), keys, strict=True):
        hv[r]["step"], hv[r]["bucket"], hv[r]["shard"], hv[r]["phase"] = step, bucket, shard, phase
    want: dict[tuple, list[int]] = {}
    for r, k in zip(rows.tolist(), keys, strict=True):
        want.setdefault(k, []).append(r)
    got = Endpoint._groups(arena, rows)
    assert [(tuple(k), g.tolist()) for k, g in got] == sorted(want.items())


def test_decode_header_raises_typed_errors() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_header(b"\0" * 10)
    assert info.value.reason == Reason.TRUNCATED
    with pytest.raises(ProtocolError) as info:
        decode_header(b"\0" * 48)
    assert info.value.reason == Reason.BAD_MAGIC


# --- bitmaps ------------------------------------------------------------------------------------


@SETTINGS
@given(bits=st.lists(st.booleans(), max_size=300))
def test_bitmap_round_trip(bits: list[bool]) -> None:
    arr = np.array(bits, dtype=bool)
    payload = encode_bitmap(arr)
    assert len(payload) == -(-len(bits) // 8)
    assert np.array_equal(decode_bitmap(payload, len(bits)), arr)


def test_bitmap_is_little_endian_and_length_checked() -> None:
    assert encode_bitmap(np.array([1, 0, 0, 0, 0, 0, 0, 0, 1], bool)) == b"\x01\x01"
    with pytest.raises(ProtocolError) as info:
        decode_bitmap(b"\x01", 9)
    assert info.value.reason == Reason.COUNT_MISMATCH


def test_keyed_key_words_come_from_k0_k1_only_and_are_read_only() -> None:
    key = TagKey.from_secret("s3cret")
    words = key.words
    assert words.dtype == np.uint64 and words.shape == (2 + NH_KEY_WORDS,)
    assert not words.flags.writeable
    assert (TagKey(TAG_KEYED, key.k0, key.k1).words == words).all()
    other = TagKey(TAG_KEYED, key.k0, key.k1 ^ 1).words
    assert (other[2:] != words[2:]).mean() > 0.99
    assert TagKey().words.tolist() == [0, 0]


def test_a_keyed_tag_refuses_a_message_longer_than_its_key_stream() -> None:
    with pytest.raises(ValueError, match="at most"):
        packet_tag(bytes(MAX_TAGGED_BYTES + 1), TagKey.from_secret("s"))


@SETTINGS
@given(
    fields=st.fixed_dictionaries(FIELD_RANGES),
    payload=st.binary(min_size=0, max_size=256),
    data=st.data(),
)
def test_keyed_tag_changes_with_any_bit_length_or_key(fields: dict, payload: bytes, data) -> None:
    key = TagKey.from_secret("s3cret")
    good = encode(Header(**fields), payload, key)
    tag = packet_tag(good, key)
    packet = bytearray(good)
    pos = data.draw(st.sampled_from([i for i in range(len(packet)) if not 40 <= i < 48]))
    packet[pos] ^= 1 << data.draw(st.integers(0, 7))
    assert packet_tag(bytes(packet), key) != tag
    assert packet_tag(good + b"\0", key) != tag  # zero padding is bound by the length
    assert packet_tag(good, TagKey.from_secret("other")) != tag
