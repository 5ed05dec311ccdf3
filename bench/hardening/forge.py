"""The datagrams the spray sends: real packets recorded offline, and what an attacker makes of
them or from nothing.

Theory of operation
-------------------
*Real packets* come from :func:`record_packets`: two sans-I/O cores with the engines' exact
configuration (job, key, chunk size) all-reduce the engines' own seeded inputs for steps the
live engines have already finished, in memory, and every datagram they exchange is kept — the
bytes a capture of the wire would have shown. :class:`PacketFactory` then makes one datagram
of a *category* at a time (seeded, so a run is reproducible):

================  ===========================================================================
category          what it is (and where the engine counts it)
================  ===========================================================================
random            random bytes, 0 to 65507 long (``truncated``, ``bad_magic``, ``oversized``)
random_header     a valid frame (magic, version, kind, job) with random fields and a random
                  tag (``bad_tag``; ``bad_kind`` for a kind byte out of range)
mutation          a real packet with one header field set to a random value, or one byte of
                  it flipped (a framing reason, else ``bad_tag``)
truncation        a real packet cut short (``truncated`` or ``bad_tag``)
replay            a real packet of a finished collective, verbatim (``late`` DATA answered
                  with STOP, ``stale_step``, acknowledgements of transfers that are gone)
forged_tag        a real packet with a random tag (``bad_tag``)
foreign_job       a real packet of another job (``foreign_job``)
oversized         a real header with a payload past the engine's largest datagram
early_data        a full-size DATA datagram for a bucket that runs in a few steps, with a
                  forged tag: keyed engines reject it before holding anything (``bad_tag``);
                  an unkeyed engine holds it as early data (its tag is checked when replayed),
                  up to ``early_buffer_bytes``, until it expires (``early_expired``)
huge_count        signed ACK/NACK about the running transfer whose bitmap claims 480,000
                  chunks (``bitmap_range``, never unpacked), and signed DATA claiming 2^32-1
                  elements (``count_mismatch``)
control_kinds     every kind, signed, about a bucket that never runs (held early and expired,
                  HELLO as ``unexpected_kind``, PROBE answered)
signed_random     a signed header with random fields and a small payload, about a bucket that
                  never runs: what a key holder could send (``stale_step``, ``bad_rank``, ...)
================  ===========================================================================

Signed packets use the job's key (the campaign holds it, as a peer does) and never name a
running (step, bucket) except to claim an out-of-range bitmap: a key holder can of course
all-reduce garbage into a collective, which no transport can tell from a peer's data.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import numpy as np
from gradlane.bench.hardening.common import INPUT_SETS, input_sets
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import AllReduceComplete, AllReduceFailed, flat
from gradlane.transport.wire.header import (
    BITMAP_KINDS,
    HEADER_DTYPE,
    HEADER_SIZE,
    MAGIC,
    MAX_UDP_PAYLOAD,
    VERSION,
    Header,
    Kind,
    Phase,
    encode,
    encode_values,
)

__all__ = ["CATEGORIES", "DEFAULT_MIX", "PacketFactory", "record_packets"]

#: Every category, in the order of the module's table.
CATEGORIES = (
    "random",
    "random_header",
    "mutation",
    "truncation",
    "replay",
    "forged_tag",
    "foreign_job",
    "oversized",
    "early_data",
    "huge_count",
    "control_kinds",
    "signed_random",
)
#: The spray's default share of each category.
DEFAULT_MIX = {
    "random": 0.19,
    "random_header": 0.18,
    "mutation": 0.14,
    "truncation": 0.1,
    "replay": 0.1,
    "forged_tag": 0.08,
    "foreign_job": 0.04,
    "oversized": 0.02,
    "early_data": 0.03,
    "huge_count": 0.03,
    "control_kinds": 0.05,
    "signed_random": 0.04,
}
#: The share of recorded DATA packets (up to 64 KB) among the real packets picked.
DATA_SHARE = 0.2
#: Buckets the signed forgeries name: never the bucket a collective runs.
IDLE_BUCKETS = (4000, 4064)
#: Bits claimed by a huge bitmap (one 60,000-byte payload).
HUGE_BITS = 8 * 60_000
_NAMES: tuple[str, ...] = HEADER_DTYPE.names or ()
_INDEX = {name: i for i, name in enumerate(_NAMES)}
_FIELDS = [(name, HEADER_DTYPE.fields[name][:2]) for name in _NAMES]  # type: ignore[index]
_MUTABLE = [(n, dt, off) for n, (dt, off) in _FIELDS if n != "tag"]
#: A header as one ``struct`` layout (HEADER_DTYPE is packed little-endian, checked below).
_CODES = {"u1": "B", "u2": "H", "u4": "I", "u8": "Q", "f4": "f"}
_HEADER = struct.Struct("<" + "".join(_CODES[f"{dt.kind}{dt.itemsize}"] for _, (dt, _) in _FIELDS))
assert _HEADER.size == HEADER_SIZE


def record_packets(
    config: TransportConfig, world: int, steps: Sequence[int], n: int, seed: int, bucket: int = 0
) -> list[bytes]:
    """Every datagram two in-memory cores with ``config`` exchange while all-reducing the ranks'
    seeded inputs (:func:`~gradlane.bench.hardening.common.input_sets`) at ``steps``: the
    engines' real packets for those collectives, DATA, ACK and STOP alike."""
    inputs, _ = input_sets(seed, world, n)
    eps = [TransposeAllReduce(r, world, config) for r in range(world)]
    out: list[bytes] = []
    now = 0.0
    for step in steps:
        for r, ep in enumerate(eps):
            ep.start(step, bucket, inputs[step % INPUT_SETS][r], layer_position=0.5, now=now)
        finished: set[int] = set()
        idle_rounds = 0
        for _ in range(1_000_000):
            moved = False
            for r, ep in enumerate(eps):
                for dg in flat(ep.datagrams_to_send(now)):
                    data = dg.wire()
                    out.append(data)
                    eps[dg.peer].receive_datagram(data, dg.path, now)
                    moved = True
                while (ev := ep.next_event()) is not None:
                    if isinstance(ev, AllReduceComplete | AllReduceFailed):
                        finished.add(r)
            if len(finished) == world:
                idle_rounds += not moved
                if idle_rounds > 2:  # the last ACKs and STOPs are out too
                    break
            if not moved:
                due = [t for ep in eps if (t := ep.get_timer()) is not None]
                now = max(now, min(due)) if due else now + 1e-3
                for ep in eps:
                    t = ep.get_timer()
                    if t is not None and t <= now:
                        ep.handle_timer(now)
        now += 1.0  # the next collective starts well after this one's timers
    return out


class PacketFactory:
    """Makes the spray's datagrams, one category at a time (see the module docstring).

    ``real``: recorded packets of finished collectives; ``live_step(rank)``: the step that rank
    runs now; ``live_bucket``: the bucket the collectives use. ``rng``: seeded.
    """

    def __init__(
        self,
        config: TransportConfig,
        world: int,
        real: Sequence[bytes],
        rng: np.random.Generator,
        live_step: Callable[[int], int],
        live_bucket: int = 0,
    ) -> None:
        if not real:
            raise ValueError("the spray needs recorded packets to replay and mutate")
        self.config = config
        self.key = config.tag_key
        self.world = world
        self.real = list(real)
        # Mostly the small control packets: a flood of 64 KB DATA is a bandwidth test of
        # loopback more than of the engine.
        self.real_data = [p for p in real if len(p) > 4096] or self.real
        self.real_small = [p for p in real if len(p) <= 4096] or self.real
        self.rng = rng
        self.live_step = live_step
        self.live_bucket = live_bucket
        self.max_row = config.slot_bytes
        self._signed: dict[tuple[int, int], list[bytes]] = {}
        self._huge: dict[tuple[int, int], list[bytes]] = {}
        self._zeros: bytes | None = None
        self._makers: dict[str, Callable[[int], bytes]] = {
            "random": self._random,
            "random_header": self._random_header,
            "mutation": self._mutation,
            "truncation": self._truncation,
            "replay": self._replay,
            "forged_tag": self._forged_tag,
            "foreign_job": self._foreign_job,
            "oversized": self._oversized,
            "early_data": self._early_data,
            "huge_count": self._huge_count,
            "control_kinds": self._control_kinds,
            "signed_random": self._signed_random,
        }
        assert set(self._makers) == set(CATEGORIES)

    def make(self, category: str, dst: int) -> bytes:
        """One datagram of ``category`` for rank ``dst``."""
        return self._makers[category](dst)

    # -- helpers -------------------------------------------------------------------------------
    def _pick(self) -> bytes:
        pool = self.real_data if self.rng.random() < DATA_SHARE else self.real_small
        return pool[int(self.rng.integers(len(pool)))]

    def _length(self) -> int:
        """Mostly small datagrams, some up to the largest UDP payload."""
        u = self.rng.random()
        if u < 0.25:
            return int(self.rng.integers(0, HEADER_SIZE))
        if u < 0.6:
            return int(self.rng.integers(HEADER_SIZE, 200))
        if u < 0.92:
            return int(self.rng.integers(200, 1500))
        return int(self.rng.integers(1500, MAX_UDP_PAYLOAD + 1))

    def _header(self, dst: int, **fixed: int | float) -> list[int | float]:
        """Header values (:data:`HEADER_DTYPE` order, the tag last) with a valid frame (magic,
        version, job) and random fields, then ``fixed`` (by field name)."""
        rng = self.rng
        r = rng.integers(0, 1 << 32, size=16, dtype=np.uint64).tolist()
        w = self.world + 1
        kind = 1 + r[0] % 9 if r[1] % 20 else r[0] % 256
        values: list[int | float] = [
            MAGIC, VERSION, kind, r[2] % 256, r[3] % 8, r[4] % 4, r[5] % 5, self.config.job,
            max(0, self.live_step(dst) + int(r[6] % 201) - 100), r[7] % (1 << 16), r[8] % w,
            r[9] % w, dst if r[10] % 10 else r[10] % w, r[11] % 64, r[12] % 64,
            float(rng.standard_normal()), r[13], r[14] << 31 | r[15],
        ]  # fmt: skip
        for name, value in fixed.items():
            values[_INDEX[name]] = value
        return values

    # -- categories ----------------------------------------------------------------------------
    def _random(self, dst: int) -> bytes:
        return self.rng.bytes(self._length())

    def _random_header(self, dst: int) -> bytes:
        h = self._header(dst)  # a random tag: nobody without the key can do better
        n = int(h[_INDEX["count"]]) * 4 if self.rng.random() < 0.5 else self._length() // 8
        return _HEADER.pack(*h) + self.rng.bytes(min(n, MAX_UDP_PAYLOAD - HEADER_SIZE))

    def _mutation(self, dst: int) -> bytes:
        p = bytearray(self._pick())
        rng = self.rng
        if rng.random() < 0.5 and len(p) >= HEADER_SIZE:
            _, dt, off = _MUTABLE[int(rng.integers(len(_MUTABLE)))]
            if dt.kind == "f":
                value = np.array(rng.standard_normal() * 1e6, dtype=dt)
            else:
                value = np.array(rng.integers(0, 1 << (8 * dt.itemsize), dtype=np.uint64), dt)
            p[off : off + dt.itemsize] = value.tobytes()
        else:
            i = int(rng.integers(len(p)))
            p[i] ^= int(rng.integers(1, 256))
        return bytes(p)

    def _truncation(self, dst: int) -> bytes:
        p = self._pick()
        return p[: int(self.rng.integers(0, len(p)))]

    def _replay(self, dst: int) -> bytes:
        return self._pick()

    def _forged_tag(self, dst: int) -> bytes:
        p = bytearray(self._pick())
        p[40:48] = self.rng.bytes(8)
        return bytes(p)

    def _foreign_job(self, dst: int) -> bytes:
        p = bytearray(self._pick())
        job = int(self.rng.integers(0, 1 << 32))
        if job == self.config.job:
            job ^= 1
        p[8:12] = job.to_bytes(4, "little")
        return bytes(p)

    def _oversized(self, dst: int) -> bytes:
        size = int(self.rng.integers(self.max_row + 1, MAX_UDP_PAYLOAD + 1))
        head = self._pick()[:HEADER_SIZE]
        return head + bytes(size - len(head))

    def _early_data(self, dst: int) -> bytes:
        rng = self.rng
        elems = self.config.chunk_bytes // 4
        values = [0] * len(_NAMES)
        fields = {"magic": MAGIC, "version": VERSION, "kind": Kind.DATA, "job": self.config.job,
                  "step": self.live_step(dst) + int(rng.integers(1, 33)),
                  "bucket": int(rng.integers(*IDLE_BUCKETS)), "shard": dst,
                  "src": (dst + 1) % self.world, "dst": dst, "count": elems,
                  "tag": int(rng.integers(0, 1 << 63))}  # fmt: skip
        for name, value in fields.items():
            values[_INDEX[name]] = value
        if self._zeros is None or len(self._zeros) != 4 * elems:
            self._zeros = bytes(4 * elems)
        return _HEADER.pack(*values) + self._zeros

    def _huge_count(self, dst: int) -> bytes:
        step = self.live_step(dst)
        key = (dst, step)
        cached = self._huge.get(key)
        if cached is None:
            if len(self._huge) > 64:
                self._huge.clear()
            cached = self._huge[key] = self._huge_packets(dst, step)
        return cached[int(self.rng.integers(len(cached)))]

    def _huge_packets(self, dst: int, step: int) -> list[bytes]:
        """About ``dst``'s outgoing transfers of the running collective: ACK/NACK from their
        receivers claiming far more chunks than they have, and DATA claiming 2^32-1 elements."""
        bitmap = b"\xff" * (HUGE_BITS // 8)
        out = []
        for peer in range(self.world):
            if peer == dst:
                continue
            # dst sends shard `peer` in the reduce phase and its own shard in the gather.
            for shard, phase in ((peer, Phase.REDUCE), (dst, Phase.GATHER)):
                for kind in (Kind.ACK, Kind.NACK):
                    for chunk in (0, 1, 1 << 31):
                        h = Header(
                            kind=kind,
                            job=self.config.job,
                            step=step,
                            bucket=self.live_bucket,
                            shard=shard,
                            phase=phase,
                            src=peer,
                            dst=dst,
                            chunk=chunk,
                            count=HUGE_BITS,
                        )
                        out.append(encode(h, bitmap, self.key))
            h = Header(
                kind=Kind.DATA,
                job=self.config.job,
                step=step,
                bucket=self.live_bucket,
                shard=dst,
                src=peer,
                dst=dst,
                count=0xFFFFFFFF,
            )
            out.append(encode(h, b"\0\0\0\0", self.key))
        return out

    def _control_kinds(self, dst: int) -> bytes:
        step = self.live_step(dst)
        key = (dst, step)
        cached = self._signed.get(key)
        if cached is None:
            if len(self._signed) > 64:
                self._signed.clear()
            cached = self._signed[key] = self._every_kind(dst, step)
        return cached[int(self.rng.integers(len(cached)))]

    def _every_kind(self, dst: int, step: int) -> list[bytes]:
        """One signed packet of every kind from a peer about an idle bucket at ``step``."""
        out = []
        src = (dst + 1) % self.world
        for i, kind in enumerate(Kind):
            count = 1 if kind == Kind.DATA or kind in BITMAP_KINDS else 0
            bucket = IDLE_BUCKETS[0] + (step + i) % (IDLE_BUCKETS[1] - IDLE_BUCKETS[0])
            h = Header(
                kind=kind,
                job=self.config.job,
                step=step,
                bucket=bucket,
                shard=dst,
                src=src,
                dst=dst,
                count=count,
            )
            payload = b"\xff" if kind in BITMAP_KINDS else bytes(4 * count)
            out.append(encode(h, payload, self.key))
        return out

    def _signed_random(self, dst: int) -> bytes:
        rng = self.rng
        bucket = int(rng.integers(IDLE_BUCKETS[0], 1 << 16))
        h = self._header(dst, bucket=bucket, count=int(rng.integers(0, 17)))
        kind, count = int(h[_INDEX["kind"]]), int(h[_INDEX["count"]])
        if kind in BITMAP_KINDS:
            n = -(-count // 8)
        elif kind == Kind.DATA:
            n = count * (4 if h[_INDEX["dtype"]] == 0 else 2)
        else:
            n = 0
        if rng.random() < 0.2:  # a payload that disagrees with the count
            n = int(rng.integers(0, 64))
        return encode_values(tuple(h[:-1]), rng.bytes(n), self.key)
