"""The gradlane wire format: one fixed 48-byte little-endian header before every payload.

Theory of operation
-------------------
Every packet is self-describing: it names its job, step, bucket, shard, phase, sender, receiver
and chunk, so packets can travel any path in any order and still land in the right place.

======  ======  ========  =====================================================================
offset  size    field     meaning
======  ======  ========  =====================================================================
0       u16     magic     ``0x474C`` ("GL"); anything else is dropped and counted
2       u8      version   1
3       u8      kind      :class:`Kind`
4       u8      flags     :class:`Flags`
5       u8      prio      priority class, 0 = most urgent
6       u8      dtype     :class:`DType` of the payload elements (DATA)
7       u8      phase     :class:`Phase`
8       u32     job       job token: packets of other jobs are dropped
12      u32     step      training step
16      u16     bucket    DDP bucket index
18      u16     shard     shard of the bucket (transpose all-reduce: rank i owns shard i)
20      u16     src       sending rank (host rank for daemons)
22      u16     dst       receiving rank
24      u32     chunk     DATA: chunk index in the shard (element offset = chunk × chunk_elems);
                          bitmap kinds: index of the first chunk the bitmap covers
28      u32     count     DATA: elements in the payload; bitmap kinds: bits in the bitmap
32      f32     norm      DATA: L2 norm of the payload (magnitude, computed while packing)
36      u32     aux       ACK: the chunk whose arrival triggered it (RTT sample); PROBE: sequence;
                          DATA in E4M3: the chunk's scale (float32 bits, positive and finite)
40      u64     tag       integrity tag over bytes [0:40] and the payload
(:mod:`gradlane.transport.wire.tag`)
======  ======  ========  =====================================================================

The payload starts at byte 48, so it is 8-byte aligned in any arena whose slots are.
A float32 transfer's chunks may each travel in a lossy wire format (:data:`LOSSY`: bfloat16,
or E4M3 with a per-chunk scale); the chunk's element count and offset stay those of the
float32 transfer, only its payload is shorter (:func:`wire_format_ok`).
ACK, NACK, MANIFEST and FIN carry a little-endian bitmap (``np.packbits(bitorder="little")``):
ACK = chunks received, NACK = chunks the receiver needs now, MANIFEST = the sender's protected
chunks, FIN = the chunks the sender gave up (within its loss budget). STOP (receiver to sender)
ends a transfer; PROBE / PROBE_ACK test a path. Decoding never trusts a field it has not
checked: :func:`validate` checks every field against the session (and transfer) the packet
claims before a byte is written anywhere.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass, field, replace
from enum import IntEnum, IntFlag
from typing import NamedTuple

import numpy as np
from gradlane.transport.errors import ProtocolError
from gradlane.transport.wire.tag import PAYLOAD_OFFSET, TAG_OFFSET, TagKey, packet_tag

__all__ = [
    "BITMAP_KINDS",
    "HEADER_DTYPE",
    "HEADER_SIZE",
    "ITEMSIZE",
    "LOSSY",
    "MAGIC",
    "MAX_SCALE_BITS",
    "MAX_UDP_PAYLOAD",
    "SHARD_DTYPES",
    "VERSION",
    "DType",
    "Flags",
    "Header",
    "HeaderFields",
    "Kind",
    "Phase",
    "Reason",
    "SessionSpec",
    "TransferSpec",
    "chunk_counts",
    "decode_bitmap",
    "decode_header",
    "encode",
    "encode_bitmap",
    "encode_values",
    "header_view",
    "payload_elems_for",
    "scale_ok",
    "validate",
    "wire_format_ok",
]

MAGIC = 0x474C
VERSION = 1
HEADER_SIZE = PAYLOAD_OFFSET
#: Largest UDP payload over IPv4.
MAX_UDP_PAYLOAD = 65507


class Kind(IntEnum):
    """What a packet is; the receive path dispatches on it with a table."""

    DATA = 1
    ACK = 2
    NACK = 3
    STOP = 4
    PROBE = 5
    PROBE_ACK = 6
    HELLO = 7
    MANIFEST = 8
    FIN = 9


class Flags(IntFlag):
    """Per-packet flags.

    ``PASS_END`` marks the chunk a sender sends last in its first pass (its send order: class,
    then index). Once it has come, a gap the receiver still has is loss, not data on its way:
    the receiver settles or NACKs that sender after the reorder window instead of waiting for
    the sender's FIN or the soft deadline.

    ``HELD`` (on an ACK, with no bitmap): the receiver holds the sender's data for a transfer it
    has not started yet. Its ACKs come once it starts; until then the sender's retransmission
    timeout is off for that transfer, instead of resending whole shards to a peer that is
    merely late to the collective.
    """

    NONE = 0
    RETRANSMIT = 1
    PROTECTED = 2
    LAST = 4
    ROTATED = 8
    DROPPABLE = 16
    PASS_END = 32
    HELD = 64


class Phase(IntEnum):
    """Which step of a collective a packet belongs to."""

    REDUCE = 0
    GATHER = 1
    PUSH = 2
    PULL = 3


class DType(IntEnum):
    """Payload element types. f16 and bf16 travel as raw 16-bit words.

    ``E4M3`` is the 8-bit float OCP FP8 E4M3FN (no infinities; max 448), each element
    multiplied by the packet's scale (its ``aux``, float32 bits); it exists only as a lossy
    wire format of a float32 transfer, as bf16 can be too (:data:`LOSSY`).
    """

    F32 = 0
    F16 = 1
    BF16 = 2
    E4M3 = 3


#: Bytes per element of each :class:`DType`, indexable by the enum value.
ITEMSIZE = (4, 2, 2, 1)

#: The dtypes a bucket (a transfer) may have; E4M3 is only a lossy format of chunks.
SHARD_DTYPES = (DType.F32, DType.F16, DType.BF16)
#: The formats a float32 transfer's chunks may travel in instead of float32 (lossy, each
#: chunk's choice; the receiver converts to float32 as it reduces or places).
LOSSY = frozenset((DType.BF16, DType.E4M3))
#: Bits of the largest positive finite float32: an E4M3 scale's bits are in (0, this].
MAX_SCALE_BITS = 0x7F7FFFFF


def wire_format_ok(dtype: int, transfer_dtype: int) -> bool:
    """Whether a DATA packet in ``dtype`` may belong to a transfer of ``transfer_dtype``: the
    same type, or a :data:`LOSSY` format of a float32 transfer."""
    return dtype == transfer_dtype or (transfer_dtype == DType.F32 and dtype in LOSSY)


def scale_ok(dtype: int, aux: int) -> bool:
    """Whether a DATA packet's ``aux`` suits its ``dtype``: an E4M3 packet's scale (float32
    bits) must be positive and finite; other types do not read it."""
    return dtype != DType.E4M3 or 0 < aux <= MAX_SCALE_BITS


class Reason(IntEnum):
    """Why a datagram was rejected; each has its own counter. ``OK`` means accepted.

    ``UNEXPECTED_KIND``: a well-formed kind the receiving endpoint does not take (HELLO on the
    data plane). ``BITMAP_RANGE``: a bitmap (ACK/NACK/MANIFEST/FIN) covering chunks its transfer
    does not have; it is rejected before a bit of it is unpacked, so the work a packet causes is
    bounded by what the transfer tracks, not by the count it claims.
    """

    OK = 0
    TRUNCATED = 1
    OVERSIZED = 2
    BAD_MAGIC = 3
    BAD_VERSION = 4
    BAD_KIND = 5
    FOREIGN_JOB = 6
    BAD_TAG = 7
    STALE_STEP = 8
    BAD_BUCKET = 9
    BAD_PHASE = 10
    BAD_RANK = 11
    BAD_SHARD = 12
    CHUNK_RANGE = 13
    COUNT_MISMATCH = 14
    BAD_DTYPE = 15
    DUPLICATE = 16
    UNKNOWN_TRANSFER = 17
    UNEXPECTED_KIND = 18
    BITMAP_RANGE = 19


N_REASONS = len(Reason)

HEADER_DTYPE = np.dtype(
    {
        "names": [
            "magic", "version", "kind", "flags", "prio", "dtype", "phase", "job", "step",
            "bucket", "shard", "src", "dst", "chunk", "count", "norm", "aux", "tag",
        ],
        "formats": [
            "<u2", "u1", "u1", "u1", "u1", "u1", "u1", "<u4", "<u4",
            "<u2", "<u2", "<u2", "<u2", "<u4", "<u4", "<f4", "<u4", "<u8",
        ],
        "offsets": [0, 2, 3, 4, 5, 6, 7, 8, 12, 16, 18, 20, 22, 24, 28, 32, 36, 40],
        "itemsize": HEADER_SIZE,
    }
)  # fmt: skip
assert HEADER_DTYPE.fields is not None and HEADER_DTYPE.fields["tag"][1] == TAG_OFFSET


class HeaderFields(NamedTuple):
    """A header's fields as plain Python numbers (:data:`HEADER_DTYPE`'s order), made in one
    conversion (``HeaderFields._make(record.item())``): checking and dispatching a control
    packet reads a dozen fields, and Python ints are far cheaper to use than NumPy scalars."""

    magic: int
    version: int
    kind: int
    flags: int
    prio: int
    dtype: int
    phase: int
    job: int
    step: int
    bucket: int
    shard: int
    src: int
    dst: int
    chunk: int
    count: int  # type: ignore[assignment]  # shadows tuple.count: the wire name wins
    norm: float
    aux: int
    tag: int


assert HeaderFields._fields == HEADER_DTYPE.names


def header_fields(buf: np.ndarray) -> HeaderFields:
    """The header fields of a packet (uint8, at least :data:`HEADER_SIZE` bytes)."""
    return HeaderFields._make(buf[:HEADER_SIZE].view(HEADER_DTYPE)[0].item())


@dataclass(frozen=True)
class Header:
    """One decoded header. Used for control packets and tests; the data path uses arrays."""

    kind: int = Kind.DATA
    job: int = 0
    step: int = 0
    bucket: int = 0
    shard: int = 0
    src: int = 0
    dst: int = 0
    chunk: int = 0
    count: int = 0
    flags: int = 0
    prio: int = 0
    dtype: int = DType.F32
    phase: int = Phase.REDUCE
    norm: float = 0.0
    aux: int = 0
    tag: int = 0
    magic: int = MAGIC
    version: int = VERSION

    def with_(self, **changes: int | float) -> Header:
        """A copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]


_FIELDS = HEADER_DTYPE.names or ()
#: HEADER_DTYPE as a ``struct`` layout (contiguous, little-endian; checked below): encoding a
#: control packet is then one ``pack_into`` rather than a NumPy assignment per field.
_HEADER_STRUCT = struct.Struct(
    "<"
    + "".join(
        {"u1": "B", "u2": "H", "u4": "I", "u8": "Q", "f4": "f"}[f"{dt.kind}{dt.itemsize}"]
        for dt in (HEADER_DTYPE[n] for n in _FIELDS)
    )
)
assert _HEADER_STRUCT.size == HEADER_SIZE and _FIELDS[-1] == "tag"
_header_values = operator.attrgetter(*_FIELDS[:-1])


def encode(header: Header, payload: bytes | np.ndarray = b"", key: TagKey | None = None) -> bytes:
    """Serialise ``header`` and ``payload``; the tag is computed here (``header.tag`` ignored)."""
    return encode_values(_header_values(header), payload, key)


def encode_values(
    values: tuple[int | float, ...], payload: bytes | np.ndarray = b"", key: TagKey | None = None
) -> bytes:
    """:func:`encode` from the header's values in :data:`HEADER_DTYPE` order, ``tag`` left out
    (magic and version included): what a core sending control packets on the hot path uses,
    skipping a :class:`Header` per packet."""
    body = payload.tobytes() if isinstance(payload, np.ndarray) else bytes(payload)
    buf = bytearray(HEADER_SIZE + len(body))
    try:
        _HEADER_STRUCT.pack_into(buf, 0, *values, 0)
    except struct.error as e:  # a field out of its range: as NumPy's assignment would say
        raise OverflowError(f"header field out of range: {e}") from e
    buf[HEADER_SIZE:] = body
    tag = packet_tag(buf, key or TagKey())
    buf[TAG_OFFSET:HEADER_SIZE] = tag.to_bytes(8, "little")
    return bytes(buf)


def decode_header(data: bytes | bytearray | memoryview | np.ndarray) -> Header:
    """Parse a header, checking only its framing (length, magic, version, kind).

    Raises :class:`ProtocolError`; session fields are checked by :func:`validate`.
    """
    buf = _as_u8(data)
    if buf.shape[0] < HEADER_SIZE:
        raise ProtocolError(Reason.TRUNCATED, f"{buf.shape[0]} bytes < header {HEADER_SIZE}")
    h = header_fields(buf)
    if h.magic != MAGIC:
        raise ProtocolError(Reason.BAD_MAGIC, hex(h.magic))
    if h.version != VERSION:
        raise ProtocolError(Reason.BAD_VERSION, str(h.version))
    if h.kind not in _KINDS:
        raise ProtocolError(Reason.BAD_KIND, str(h.kind))
    return Header(**h._asdict())


def header_view(arena: np.ndarray) -> np.ndarray:
    """Zero-copy structured view of the headers of a 2-D uint8 arena (one packet per row)."""
    if arena.dtype != np.uint8 or arena.ndim != 2 or arena.shape[1] < HEADER_SIZE:
        raise ValueError("arena must be a 2-D uint8 array with rows of at least 48 bytes")
    if not arena.flags["C_CONTIGUOUS"]:
        arena = np.ascontiguousarray(arena)
    return np.ndarray(
        shape=(arena.shape[0],), dtype=HEADER_DTYPE, buffer=arena, strides=(arena.strides[0],)
    )


_KINDS = frozenset(int(k) for k in Kind)


@dataclass(frozen=True)
class SessionSpec:
    """What every packet of a job must satisfy at one receiving rank.

    ``step_lo``..``step_hi`` is the window of steps the receiver accepts (inclusive); packets of
    older steps are stale, of far-future steps suspicious.
    """

    job: int
    me: int
    world: int
    key: TagKey = field(default_factory=TagKey)
    step_lo: int = 0
    step_hi: int = 0xFFFFFFFF
    n_buckets: int = 0x10000
    max_datagram: int = MAX_UDP_PAYLOAD


@dataclass(frozen=True)
class TransferSpec:
    """The shard a DATA packet claims to belong to: which step/bucket/shard/phase and its shape.

    ``src_lo``..``src_hi`` (exclusive) are the ranks allowed to send to it.
    """

    step: int
    bucket: int
    shard: int
    phase: int
    dtype: int
    n_elems: int
    chunk_elems: int
    src_lo: int = 0
    src_hi: int = 0x10000

    @property
    def n_chunks(self) -> int:
        """Chunks in the shard (the last one may be short; an empty shard has none)."""
        return -(-self.n_elems // self.chunk_elems)


def payload_elems_for(n_elems: int, chunk_elems: int, chunk: int) -> int:
    """Elements chunk ``chunk`` of an ``n_elems`` shard carries (0 when out of range)."""
    start = chunk * chunk_elems
    return max(0, min(chunk_elems, n_elems - start))


def chunk_counts(n_elems: int, chunk_elems: int) -> np.ndarray:
    """Elements per chunk of an ``n_elems`` shard, as an int64 array."""
    n_chunks = -(-n_elems // chunk_elems)
    counts = np.full(n_chunks, chunk_elems, dtype=np.int64)
    if n_chunks:
        counts[-1] = n_elems - (n_chunks - 1) * chunk_elems
    return counts


def validate(
    data: bytes | bytearray | memoryview | np.ndarray,
    session: SessionSpec,
    transfer: TransferSpec | None = None,
    *,
    tag: bool = True,
    header: HeaderFields | None = None,
) -> Reason:
    """Check every header field of one packet against ``session`` (and ``transfer``).

    Returns the first failing :class:`Reason`, or ``Reason.OK``. Cheap framing checks run before
    the tag, so junk costs little; the tag runs before any field is believed. ``tag=False``
    skips the tag, for a caller that checks it later before using the packet (the receive
    kernels do, when held early data is replayed). ``header``: the packet's
    :func:`header_fields`, when the caller has them already.
    """
    buf = _as_u8(data)
    n = buf.shape[0]
    if n < HEADER_SIZE:
        return Reason.TRUNCATED
    if n > session.max_datagram:
        return Reason.OVERSIZED
    h = header_fields(buf) if header is None else header
    if h.magic != MAGIC:
        return Reason.BAD_MAGIC
    if h.version != VERSION:
        return Reason.BAD_VERSION
    kind = h.kind
    if kind not in _KINDS:
        return Reason.BAD_KIND
    if h.job != session.job:
        return Reason.FOREIGN_JOB
    if tag and packet_tag(buf, session.key) != h.tag:
        return Reason.BAD_TAG
    if not session.step_lo <= h.step <= session.step_hi:
        return Reason.STALE_STEP
    if h.bucket >= session.n_buckets:
        return Reason.BAD_BUCKET
    if h.phase > Phase.PULL:
        return Reason.BAD_PHASE
    if h.src >= session.world or h.dst != session.me:
        return Reason.BAD_RANK
    if h.shard >= max(session.world, 1) and kind == Kind.DATA:
        return Reason.BAD_SHARD
    payload = n - HEADER_SIZE
    if kind == Kind.DATA:
        dt = h.dtype
        if dt > DType.E4M3 or not scale_ok(dt, h.aux):
            return Reason.BAD_DTYPE
        if h.count * ITEMSIZE[dt] != payload:
            return Reason.COUNT_MISMATCH
    elif kind in BITMAP_KINDS and payload != -(-h.count // 8):
        return Reason.COUNT_MISMATCH
    if transfer is None:
        return Reason.OK
    if (
        h.step != transfer.step
        or h.bucket != transfer.bucket
        or h.shard != transfer.shard
        or h.phase != transfer.phase
    ):
        return Reason.UNKNOWN_TRANSFER
    if not transfer.src_lo <= h.src < transfer.src_hi:
        return Reason.BAD_RANK
    if kind == Kind.DATA:
        if not wire_format_ok(h.dtype, transfer.dtype):
            return Reason.BAD_DTYPE
        chunk = h.chunk
        if chunk >= transfer.n_chunks:
            return Reason.CHUNK_RANGE
        if h.count != payload_elems_for(transfer.n_elems, transfer.chunk_elems, chunk):
            return Reason.COUNT_MISMATCH
    return Reason.OK


def validate_data_rows(hv: np.ndarray, lengths: np.ndarray, session: SessionSpec) -> np.ndarray:
    """:func:`validate`'s session-level checks (those after the tag) for DATA packets, over a
    batch: ``hv`` their header records (:func:`header_view` rows), ``lengths`` their lengths.

    Returns each packet's first failing reason as an int64 array (``Reason.OK``: none). For
    rows the framing checks (length, magic, version, kind, job) already passed; the tag is the
    caller's (the receive kernels check it before a packet is used).
    """
    reason = np.zeros(hv.shape[0], dtype=np.int64)
    step, dt = hv["step"], hv["dtype"].astype(np.int64)
    itemsize = np.asarray(ITEMSIZE, dtype=np.int64)[np.minimum(dt, len(ITEMSIZE) - 1)]
    checks = (
        ((step < session.step_lo) | (step > session.step_hi), Reason.STALE_STEP),
        (hv["bucket"] >= session.n_buckets, Reason.BAD_BUCKET),
        (hv["phase"] > Phase.PULL, Reason.BAD_PHASE),
        ((hv["src"] >= session.world) | (hv["dst"] != session.me), Reason.BAD_RANK),
        (hv["shard"] >= max(session.world, 1), Reason.BAD_SHARD),
        (
            (dt > DType.E4M3)
            | ((dt == DType.E4M3) & ((hv["aux"] == 0) | (hv["aux"] > MAX_SCALE_BITS))),
            Reason.BAD_DTYPE,
        ),
        (hv["count"].astype(np.int64) * itemsize != lengths - HEADER_SIZE, Reason.COUNT_MISMATCH),
    )
    for bad, why in reversed(checks):  # the first failure wins, as in validate()
        reason[bad] = int(why)
    return reason


#: Kinds whose payload is a bitmap of ``count`` bits (the kernels derive their check from it).
BITMAP_KINDS = frozenset((Kind.ACK, Kind.NACK, Kind.MANIFEST, Kind.FIN))


def encode_bitmap(bits: np.ndarray) -> bytes:
    """Pack a bool array into the little-endian bitmap carried by ACK/NACK/MANIFEST."""
    return np.packbits(np.asarray(bits, dtype=bool), bitorder="little").tobytes()


def decode_bitmap(payload: bytes | memoryview | np.ndarray, nbits: int) -> np.ndarray:
    """Unpack ``nbits`` bits of a bitmap payload into a bool array (checks its length)."""
    raw = _as_u8(payload)
    if raw.shape[0] != -(-nbits // 8):
        raise ProtocolError(Reason.COUNT_MISMATCH, f"bitmap of {raw.shape[0]} B for {nbits} bits")
    return np.unpackbits(raw, count=nbits, bitorder="little").astype(bool)


def _as_u8(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8) if data.dtype != np.uint8 else data.reshape(-1)
    return np.frombuffer(data, dtype=np.uint8)
