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
* **Keyed tag** (a job with a secret): SipHash-2-4 (Aumasson & Bernstein, 2012) of the same
  message under a 128-bit key derived from the secret with BLAKE2b. Packets of another job or
  forged ones are rejected unless the sender knows the secret. It costs more (two SipHash
  rounds per 8 bytes, which do not vectorise), which is the price of authentication.

The functions here are the definition: the numba kernels fuse the same arithmetic into their
loops and the tests hold them to these functions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = ["TAG_FAST", "TAG_SIPHASH", "TagKey", "packet_tag"]

#: ``TagKey.mode`` values.
TAG_FAST = 0
TAG_SIPHASH = 1

_U64 = np.uint64
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S0 = np.uint64(0x736F6D6570736575)
_S1 = np.uint64(0x646F72616E646F6D)
_S2 = np.uint64(0x6C7967656E657261)
_S3 = np.uint64(0x7465646279746573)

#: Bytes of the header the tag covers (everything before the tag field).
TAGGED_HEADER_BYTES = 40
#: Offset of the tag field and of the payload.
TAG_OFFSET = 40
PAYLOAD_OFFSET = 48


@dataclass(frozen=True)
class TagKey:
    """How packets of one job are tagged: ``mode`` (TAG_FAST or TAG_SIPHASH) and key ``k0``/``k1``.

    Build it with :meth:`from_secret`; the same secret on every rank gives the same key.
    """

    mode: int = TAG_FAST
    k0: int = 0
    k1: int = 0

    @classmethod
    def from_secret(cls, secret: bytes | str | None) -> TagKey:
        """A fast-tag key for ``None``/empty, else a SipHash key derived from the secret."""
        if not secret:
            return cls()
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        digest = hashlib.blake2b(raw, digest_size=16, person=b"gradlane-tag-v1").digest()
        return cls(
            TAG_SIPHASH,
            int.from_bytes(digest[:8], "little"),
            int.from_bytes(digest[8:], "little"),
        )

    @property
    def keyed(self) -> bool:
        """True when the tag authenticates (a secret was given)."""
        return self.mode == TAG_SIPHASH


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


@njit(cache=True)
def tag_of(pkt: np.ndarray, length: int, mode: int, k0: np.uint64, k1: np.uint64) -> np.uint64:
    """Tag of ``pkt[:length]`` (header + payload, uint8) for a key given as plain scalars."""
    if mode == TAG_SIPHASH:
        return siphash24_parts(k0, k1, pkt, 0, TAGGED_HEADER_BYTES, PAYLOAD_OFFSET, length)
    return fast_tag(pkt, length)


def packet_tag(packet: bytes | bytearray | memoryview | np.ndarray, key: TagKey) -> int:
    """The tag a packet must carry under ``key`` (the tag field's own value is ignored)."""
    arr = np.frombuffer(packet, dtype=np.uint8) if not isinstance(packet, np.ndarray) else packet
    if arr.dtype != np.uint8 or arr.ndim != 1:
        arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return int(tag_of(arr, arr.shape[0], key.mode, _U64(key.k0), _U64(key.k1)))


def siphash24(key16: bytes, message: bytes) -> int:
    """Plain SipHash-2-4 of ``message`` under a 16-byte key (for test vectors and tooling)."""
    if len(key16) != 16:
        raise ValueError("SipHash needs a 16-byte key")
    arr = np.frombuffer(bytes(message) or b"\0", dtype=np.uint8)
    k0 = int.from_bytes(key16[:8], "little")
    k1 = int.from_bytes(key16[8:], "little")
    n = len(message)
    return int(siphash24_parts(_U64(k0), _U64(k1), arr, 0, n, n, n))
