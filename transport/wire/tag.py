"""Integrity tags of gradlane packets (ARCHITECTURE §3, last row).

Theory of operation
-------------------
Every packet ends its 48-byte header with a 64-bit ``tag``. The tag covers the *message*
``packet[0:40] ‖ packet[48:length]``: the header without the tag field itself, then the payload.

* **Fast tag** (a job without a secret): a position-weighted checksum in the spirit of
  Fletcher. The message, zero-padded to a multiple of 4 bytes, is read as little-endian u32 words
  ``w_0 … w_{n-1}``; ``A = Σ w_i`` and ``B = Σ (i+1)·w_i`` (both mod 2^64), and
  ``tag = fmix64(A ^ rotl64(B, 32) ^ length·φ)`` with MurmurHash3's finaliser and φ the 64-bit
  golden ratio. It catches every single-word error and every swap of two different words, costs
  one multiply-add per word, and vectorises, so the packing kernel computes it in its copy loop.
  It is a checksum, not a defence: anyone can recompute it.
* **Keyed tag** (a job with a secret): a Carter–Wegman MAC in UMAC's style (Black, Halevi,
  Krawczyk, Krovetz & Rogaway, 1999), hash then PRF. The message is read as little-endian u64
  words ``m_i`` at their packet position ``i`` (zero-padded to whole words; word 5, the tag
  field, left out). Each word is one NH pair, its low and high u32 halves:
  ``NH(m, k) = ((m_lo + k_lo) mod 2^32) · ((m_hi + k_hi) mod 2^32)``, and
  ``h1 = Σ NH(m_i, K_i)``, ``h2 = Σ NH(m_i, K_{i+2})`` (mod 2^64) under a key stream ``K`` as
  long as the longest datagram (the Toeplitz shift of UMAC-64 gives two hashes, each
  2^-32-almost-universal over messages of one length, together 2^-64). The tag is
  ``SipHash-2-4_{k0,k1}(h1 ‖ h2 ‖ length)``: the PRF hides the hash and binds the length. Keys
  come from the secret (BLAKE2b for ``k0``/``k1``, SHAKE-256 of those for ``K``), the same on
  every rank. NH is one 32×32→64 multiply per 4 bytes and vectorises, so the kernels fuse it
  into their copy and reduce loops at close to the fast tag's cost; forged packets and those of
  another job are rejected unless the sender knows the secret.

The functions here are the definition: the numba kernels fuse the same arithmetic into their
loops and the tests hold them to these functions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from numba import njit

__all__ = ["NH_KEY_WORDS", "TAG_FAST", "TAG_KEYED", "TagKey", "packet_tag"]

#: ``TagKey.mode`` values.
TAG_FAST = 0
TAG_KEYED = 1

_U64 = np.uint64
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S0 = np.uint64(0x736F6D6570736575)
_S1 = np.uint64(0x646F72616E646F6D)
_S2 = np.uint64(0x6C7967656E657261)
_S3 = np.uint64(0x7465646279746573)
_LO32 = np.uint64(0xFFFFFFFF)

#: Bytes of the header the tag covers (everything before the tag field).
TAGGED_HEADER_BYTES = 40
#: Offset of the tag field and of the payload.
TAG_OFFSET = 40
PAYLOAD_OFFSET = 48
#: Longest message the keyed tag covers (a 64 KiB row), and the NH key stream's length in u64
#: words: one per message word, plus the Toeplitz shift of 2.
MAX_TAGGED_BYTES = 65536
NH_SHIFT = 2
NH_KEY_WORDS = MAX_TAGGED_BYTES // 8 + NH_SHIFT


@dataclass(frozen=True)
class TagKey:
    """How packets of one job are tagged: ``mode`` (TAG_FAST or TAG_KEYED) and key ``k0``/``k1``.

    Build it with :meth:`from_secret`; the same secret on every rank gives the same key. The NH
    key stream (:attr:`words`) is derived from ``k0``/``k1``, so those two are the whole key.
    """

    mode: int = TAG_FAST
    # Not in repr: the two words are the whole key (anyone who knows them forges packets).
    k0: int = field(default=0, repr=False)
    k1: int = field(default=0, repr=False)

    @classmethod
    def from_secret(cls, secret: bytes | str | None) -> TagKey:
        """A fast-tag key for ``None``/empty, else a keyed-MAC key derived from the secret."""
        if not secret:
            return cls()
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        digest = hashlib.blake2b(raw, digest_size=16, person=b"gradlane-tag-v2").digest()
        return cls(
            TAG_KEYED,
            int.from_bytes(digest[:8], "little"),
            int.from_bytes(digest[8:], "little"),
        )

    @property
    def keyed(self) -> bool:
        """True when the tag authenticates (a secret was given)."""
        return self.mode == TAG_KEYED

    @cached_property
    def words(self) -> np.ndarray:
        """The key as the kernels read it (read-only uint64): ``[k0, k1, K_0 … K_{n-1}]``.

        ``K`` is the NH key stream, :data:`NH_KEY_WORDS` words of SHAKE-256 over ``k0 ‖ k1``;
        a fast-tag key is just ``[0, 0]``.
        """
        k01 = np.array([self.k0, self.k1], dtype=np.uint64)
        if not self.keyed:
            out = k01
        else:
            seed = b"gradlane-nh-v1" + k01.tobytes()
            stream = hashlib.shake_256(seed).digest(8 * NH_KEY_WORDS)
            out = np.concatenate([k01, np.frombuffer(stream, dtype="<u8").astype(np.uint64)])
        out.flags.writeable = False
        return out


@njit(cache=True, inline="always")
def fmix64(x: np.uint64) -> np.uint64:
    """MurmurHash3's 64-bit finaliser: spreads every input bit over the output."""
    x ^= x >> _U64(33)
    x *= _M1
    x ^= x >> _U64(33)
    x *= _M2
    x ^= x >> _U64(33)
    return x


@njit(cache=True, inline="always")
def fast_finish(a: np.uint64, b: np.uint64, length: int) -> np.uint64:
    """Final step of the fast tag from the two sums and the packet length in bytes."""
    rot = (b << _U64(32)) | (b >> _U64(32))
    return fmix64(a ^ rot ^ (_U64(length) * _GOLDEN))


@njit(cache=True, inline="always")
def _load_u32(buf: np.ndarray, pos: int, end: int) -> np.uint64:
    """Little-endian u32 at ``pos``, zero-padded past ``end``, as u64."""
    w = _U64(0)
    for k in range(4):
        if pos + k < end:
            w |= _U64(buf[pos + k]) << _U64(8 * k)
    return w


@njit(cache=True)
def fast_tag(pkt: np.ndarray, length: int) -> np.uint64:
    """Fast (unkeyed) tag of the packet in ``pkt[:length]`` (a uint8 array)."""
    a = _U64(0)
    b = _U64(0)
    idx = _U64(1)
    for pos in range(0, TAGGED_HEADER_BYTES, 4):
        w = _load_u32(pkt, pos, TAGGED_HEADER_BYTES)
        a += w
        b += idx * w
        idx += _U64(1)
    for pos in range(PAYLOAD_OFFSET, length, 4):
        w = _load_u32(pkt, pos, length)
        a += w
        b += idx * w
        idx += _U64(1)
    return fast_finish(a, b, length)


@njit(cache=True, inline="always")
def _rotl(x: np.uint64, b: int) -> np.uint64:
    return (x << _U64(b)) | (x >> _U64(64 - b))


@njit(cache=True, inline="always")
def _sipround(
    v0: np.uint64, v1: np.uint64, v2: np.uint64, v3: np.uint64
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    v0 += v1
    v1 = _rotl(v1, 13)
    v1 ^= v0
    v0 = _rotl(v0, 32)
    v2 += v3
    v3 = _rotl(v3, 16)
    v3 ^= v2
    v0 += v3
    v3 = _rotl(v3, 21)
    v3 ^= v0
    v2 += v1
    v1 = _rotl(v1, 17)
    v1 ^= v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


@njit(cache=True, inline="always")
def sip_finish(
    v0: np.uint64, v1: np.uint64, v2: np.uint64, v3: np.uint64, last: np.uint64
) -> np.uint64:
    """SipHash-2-4's last block (``last`` holds the tail bytes and the length) and finalisation."""
    v3 ^= last
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0 ^= last
    v2 ^= _U64(0xFF)
    for _ in range(4):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


@njit(cache=True)
def siphash24_parts(
    k0: np.uint64, k1: np.uint64, buf: np.ndarray, s1: int, e1: int, s2: int, e2: int
) -> np.uint64:
    """SipHash-2-4 of ``buf[s1:e1] ‖ buf[s2:e2]`` (uint8 array) under key (k0, k1).

    Two spans so the packet's tag field can be skipped without copying.
    """
    v0 = k0 ^ _S0
    v1 = k1 ^ _S1
    v2 = k0 ^ _S2
    v3 = k1 ^ _S3
    total = (e1 - s1) + (e2 - s2)
    m = _U64(0)
    nb = 0  # bytes gathered into m
    for span in range(2):
        s = s1 if span == 0 else s2
        e = e1 if span == 0 else e2
        for pos in range(s, e):
            m |= _U64(buf[pos]) << _U64(8 * nb)
            nb += 1
            if nb == 8:
                v3 ^= m
                v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
                v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
                v0 ^= m
                m = _U64(0)
                nb = 0
    last = m | (_U64(total & 0xFF) << _U64(56))
    return sip_finish(v0, v1, v2, v3, last)


@njit(cache=True, inline="always")
def nh(m: np.uint64, k: np.uint64) -> np.uint64:
    """UMAC's NH of one u64 word as a pair of u32 halves under key word ``k``."""
    lo = (m + k) & _LO32
    hi = ((m >> _U64(32)) + (k >> _U64(32))) & _LO32
    return lo * hi


@njit(cache=True, inline="always")
def keyed_finish(
    k0: np.uint64, k1: np.uint64, h1: np.uint64, h2: np.uint64, length: int
) -> np.uint64:
    """The keyed tag from the two NH sums: SipHash-2-4 of ``h1 ‖ h2 ‖ length`` (24 bytes)."""
    v0 = k0 ^ _S0
    v1 = k1 ^ _S1
    v2 = k0 ^ _S2
    v3 = k1 ^ _S3
    for m in (h1, h2, _U64(length)):
        v3 ^= m
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0 ^= m
    return sip_finish(v0, v1, v2, v3, _U64(24) << _U64(56))


@njit(cache=True)
def keyed_tag(pkt: np.ndarray, length: int, key: np.ndarray) -> np.uint64:
    """Keyed tag of the packet in ``pkt[:length]`` (a uint8 array) under ``key``
    (:attr:`TagKey.words`), byte by byte: the definition the kernels are held to."""
    h1 = _U64(0)
    h2 = _U64(0)
    n_words = (length + 7) // 8
    for i in range(n_words):
        if i == TAG_OFFSET // 8:
            continue
        m = _U64(0)
        for b in range(8):
            if 8 * i + b < length:
                m |= _U64(pkt[8 * i + b]) << _U64(8 * b)
        h1 += nh(m, key[2 + i])
        h2 += nh(m, key[2 + i + NH_SHIFT])
    return keyed_finish(key[0], key[1], h1, h2, length)


@njit(cache=True)
def tag_of(pkt: np.ndarray, length: int, mode: int, key: np.ndarray) -> np.uint64:
    """Tag of ``pkt[:length]`` (header + payload, uint8) under ``key`` (:attr:`TagKey.words`)."""
    if mode == TAG_KEYED:
        return keyed_tag(pkt, length, key)
    return fast_tag(pkt, length)


def packet_tag(packet: bytes | bytearray | memoryview | np.ndarray, key: TagKey) -> int:
    """The tag a packet must carry under ``key`` (the tag field's own value is ignored)."""
    arr = np.frombuffer(packet, dtype=np.uint8) if not isinstance(packet, np.ndarray) else packet
    if arr.dtype != np.uint8 or arr.ndim != 1:
        arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if key.keyed and arr.shape[0] > MAX_TAGGED_BYTES:
        raise ValueError(f"a keyed tag covers at most {MAX_TAGGED_BYTES} bytes")
    return int(tag_of(arr, arr.shape[0], key.mode, key.words))


def siphash24(key16: bytes, message: bytes) -> int:
    """Plain SipHash-2-4 of ``message`` under a 16-byte key (for test vectors and tooling)."""
    if len(key16) != 16:
        raise ValueError("SipHash needs a 16-byte key")
    arr = np.frombuffer(bytes(message) or b"\0", dtype=np.uint8)
    k0 = int.from_bytes(key16[:8], "little")
    k1 = int.from_bytes(key16[8:], "little")
    n = len(message)
    return int(siphash24_parts(_U64(k0), _U64(k1), arr, 0, n, n, n))
