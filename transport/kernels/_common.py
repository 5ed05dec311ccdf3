"""Shared pieces of the numba kernels: the one kernel config, header words, tags, conversions.

Private to :mod:`gradlane.transport.kernels`; the public, checked API lives there.

Theory of operation
-------------------
The kernels look at an arena row (one datagram slot, a multiple of 8 bytes wide) through
uint32/uint64 views, never byte by byte on the hot path. The 48-byte header is six little-endian
u64 words; the fast tag is additive over u32 words (``A = Σ w``, ``B = Σ idx·w``), so a packer sums
the payload words while it copies them and adds the header's share afterwards, once the norm is
known, from a per-call template (:func:`header_template`) plus the few per-packet fields.
Every uint64 expression here stays pure uint64: numba promotes ``uint64 ∘ int64`` to float64,
silently.

numba caches each kernel keyed by its own source file only: after editing a helper here, clear
the ``*.nbi``/``*.nbc`` files in the ``__pycache__`` beside the kernel modules as imported (under
the editable install, ``build/__editable__*/gradlane/transport/kernels/``), or touch the kernel
modules, so kernels that inline it recompile.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gradlane.transport.errors import ConfigError
from gradlane.transport.wire.header import MAGIC, VERSION
from gradlane.transport.wire.tag import (
    NH_SHIFT,
    TAG_KEYED,
    fast_finish,
    keyed_finish,
    nh,
)
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError(
        "gradlane's kernels view packets as native words and need a little-endian host"
    )

_U64 = np.uint64
_U32 = np.uint32
_LO32 = np.uint64(0xFFFFFFFF)

#: Header word 0 (magic | version << 16); the kind goes into bits 24..31.
MAGIC_VERSION_WORD = MAGIC | (VERSION << 16)
#: Header u32 words before the tag; the payload's first word has fast-tag index 11.
HEADER_WORDS = 10
PAYLOAD_WORD = 12
PAYLOAD_HALF = 24
#: 0x7FFFFFFF / 0x7FFF: the magnitude bits of an IEEE float; for non-NaN values their unsigned
#: order is the order of ``abs(x)``, so max-abs is an integer max that vectorises and keeps NaN.
ABS32 = _U32(0x7FFFFFFF)
ABS16 = _U32(0x7FFF)

_ENV_FASTMATH = "GRADLANE_FASTMATH"
_FALSE = frozenset(("0", "false", "off", "no"))
_TRUE = frozenset(("1", "true", "on", "yes"))


@dataclass(frozen=True)
class KernelConfig:
    """Compilation flags of every gradlane kernel, read once from the environment at import.

    ``fastmath`` (env ``GRADLANE_FASTMATH``, default on) lets LLVM reassociate and contract the
    floating-point *reductions* (the per-chunk sum of squares behind ``norm``), which is what lets
    them vectorise; it never applies to the data path itself (accumulate, place, Hadamard), whose
    results stay exactly IEEE. Turn it off to get a norm that does not depend on the vector width.
    """

    fastmath: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelConfig:
        """The config the environment asks for (``GRADLANE_FASTMATH=0|1``)."""
        env = os.environ if environ is None else environ
        raw = env.get(_ENV_FASTMATH, "").strip().lower()
        if raw in _FALSE:
            return cls(fastmath=False)
        if raw in _TRUE or not raw:
            return cls(fastmath=True)
        raise ConfigError(f"{_ENV_FASTMATH}={raw!r}: use 1/true/on or 0/false/off")

    def reduction_jit(self) -> dict[str, Any]:
        """``njit`` options of the kernels that reduce floats (pack, chunk norms).

        numba's cache index does not record fastmath, so only the default flags are cached; a
        process that asks for other flags compiles its own and never reads or pollutes the cache.
        """
        fast = {"reassoc", "contract"} if self.fastmath else False
        return {
            "cache": self == KernelConfig(),
            "nogil": True,
            "fastmath": fast,
            "error_model": "numpy",
        }

    @staticmethod
    def exact_jit() -> dict[str, Any]:
        """``njit`` options of the kernels whose floating-point results must be exact IEEE."""
        return {"cache": True, "nogil": True, "fastmath": False, "error_model": "numpy"}


#: The config every kernel module compiles with (read once).
CONFIG = KernelConfig.from_env()
EXACT = KernelConfig.exact_jit()
REDUCTION = CONFIG.reduction_jit()


@njit(**EXACT)
def max_abs_bits(words: np.ndarray, mask: np.uint32) -> np.uint32:
    """Largest ``w & mask`` over u32 (mask 0x7FFFFFFF) or u16 (0x7FFF) float bit patterns."""
    mx = _U32(0)
    for j in range(words.shape[0]):
        mx = max(mx, _U32(words[j] & mask))
    return mx


@njit(**EXACT)
def bf16_to_f32(h: np.uint16) -> np.float32:
    """float32 value of a bfloat16 bit pattern (its high half)."""
    return _U32(_U32(h) << _U32(16)).view(np.float32)


_TWO_POW_112 = np.float32(2.0**112)


@njit(**EXACT)
def f16_to_f32(h: np.uint16) -> np.float32:
    """float32 value of an IEEE binary16 bit pattern, exactly as NumPy converts it.

    Exponent and mantissa shifted into float32 position read as a float32 are the value scaled by
    2**-112 (subnormals included: they land on float32 subnormals), so one exact multiply by 2**112
    finishes it; inf and NaN (all-ones exponent) keep their payload. Arithmetic rather than a
    65,536-entry table: no gather, so the loops that call it vectorise, which a lookup prevents.
    """
    x = _U32(h)
    sign = _U32((x & _U32(0x8000)) << _U32(16))
    em = _U32(x & _U32(0x7FFF))
    if em >= _U32(0x7C00):
        return _U32(sign | _U32(0x7F800000) | _U32((em & _U32(0x3FF)) << _U32(13))).view(np.float32)
    return _U32(sign | _U32(em << _U32(13))).view(np.float32) * _TWO_POW_112


@njit(inline="always", **EXACT)
def fast_word(
    a: np.uint64, a_hi: np.uint64, b: np.uint64, k: int, v: np.uint64
) -> tuple[np.uint64, np.uint64, np.uint64]:
    """:func:`fast_sums64`'s running sums ``(Σ (lo + hi), Σ hi, Σ k·(lo + hi))`` with u64 word
    ``k`` (``v``) added."""
    lo = v & _LO32
    hi = v >> _U64(32)
    s = lo + hi
    return a + s, a_hi + hi, b + _U64(k) * s


@njit(inline="always", **EXACT)
def fast_sums64(words64: np.ndarray, n_bytes: int) -> tuple[np.uint64, np.uint64]:
    """Fast-tag sums ``(Σ w, Σ j·w)`` (j from 0) of ``n_bytes`` message bytes read as u64 words.

    The message is zero-padded to whole u32 words by definition, whatever the buffer holds past
    ``n_bytes``; the buffer must extend to the next multiple of 8 (arena rows do). Word pair
    ``k`` holds u32 words ``2k`` (low half) and ``2k+1`` (high half), so
    ``Σ j·w = 2·Σ k·(lo + hi) + Σ hi``: one 64-bit multiply per pair instead of a widening and a
    multiply per word. The last, partial pair is masked to the message.
    """
    a = _U64(0)
    a_hi = _U64(0)
    b = _U64(0)
    n_full = n_bytes >> 3
    for k in range(n_full):
        a, a_hi, b = fast_word(a, a_hi, b, k, words64[k])
    rem = n_bytes & 7
    if rem:
        v = words64[n_full] & ((_U64(1) << _U64(8 * rem)) - _U64(1))
        a, a_hi, b = fast_word(a, a_hi, b, n_full, v)
    return a, _U64(2) * b + a_hi


@njit(inline="always", **EXACT)
def header_sums(row64: np.ndarray) -> tuple[np.uint64, np.uint64]:
    """Fast-tag sums of header u32 words 0..9 (indices 1..10), read as five u64 words.

    Pair ``k`` holds words ``2k`` and ``2k+1`` with indices ``2k+1`` and ``2k+2``:
    ``B = Σ (2k+1)·(lo + hi) + Σ hi``.
    """
    a = _U64(0)
    a_hi = _U64(0)
    b = _U64(0)
    for k in range(HEADER_WORDS // 2):
        v = row64[k]
        hi = v >> _U64(32)
        s = (v & _LO32) + hi
        a += s
        a_hi += hi
        b += _U64(2 * k + 1) * s
    return a, b + a_hi


@njit(inline="always", **EXACT)
def fast_row_finish(row64: np.ndarray, length: int, pa: np.uint64, pb: np.uint64) -> np.uint64:
    """Fast tag of an arena row from its payload's sums ``(Σ w, Σ j·w)`` (:func:`fast_sums64`)."""
    ha, hb = header_sums(row64)
    # Payload word j has index 11 + j: B = Σ (11 + j)·w = 11·A + Σ j·w.
    return fast_finish(ha + pa, hb + pb + _U64(11) * pa, length)


@njit(inline="always", **EXACT)
def fast_tag_row(row64: np.ndarray, length: int) -> np.uint64:
    """Fast tag of the packet in an arena row (``tag.fast_tag``), read as u64 words."""
    pa, pb = fast_sums64(row64[PAYLOAD_WORD // 2 :], length - 48)
    return fast_row_finish(row64, length, pa, pb)


@njit(inline="always", **EXACT)
def nh_words(words64: np.ndarray, n_bytes: int, key: np.ndarray) -> tuple[np.uint64, np.uint64]:
    """The two NH sums (``tag.keyed_tag``) of ``n_bytes`` message bytes read as u64 words,
    word ``i`` under key words ``key[i]`` and ``key[i + 2]`` (``key`` starts at the first word's
    key). Zero-padded to a whole word by definition, whatever the buffer holds past ``n_bytes``;
    the buffer must extend to the next multiple of 8 (arena rows do)."""
    h1 = _U64(0)
    h2 = _U64(0)
    n_full = n_bytes >> 3
    for i in range(n_full):
        m = words64[i]
        h1 += nh(m, key[i])
        h2 += nh(m, key[i + NH_SHIFT])
    rem = n_bytes & 7
    if rem:
        m = words64[n_full] & ((_U64(1) << _U64(8 * rem)) - _U64(1))
        h1 += nh(m, key[n_full])
        h2 += nh(m, key[n_full + NH_SHIFT])
    return h1, h2


@njit(inline="always", **EXACT)
def nh_pairs32(w32: np.ndarray, key: np.ndarray) -> tuple[np.uint64, np.uint64]:
    """:func:`nh_words` of a message given as u32 words (a float32 chunk's bits, any 4-byte
    alignment): word pair ``j`` is ``w32[2j] | w32[2j+1] << 32``, the last one zero-padded."""
    h1 = _U64(0)
    h2 = _U64(0)
    n = w32.shape[0]
    for j in range(n >> 1):
        lo = _U64(w32[2 * j])
        hi = _U64(w32[2 * j + 1])
        k1 = key[j]
        k2 = key[j + NH_SHIFT]
        h1 += ((lo + k1) & _LO32) * ((hi + (k1 >> _U64(32))) & _LO32)
        h2 += ((lo + k2) & _LO32) * ((hi + (k2 >> _U64(32))) & _LO32)
    if n & 1:
        m = _U64(w32[n - 1])
        h1 += nh(m, key[n >> 1])
        h2 += nh(m, key[(n >> 1) + NH_SHIFT])
    return h1, h2


@njit(inline="always", **EXACT)
def nh_header(
    w0: np.uint64, w1: np.uint64, w2: np.uint64, w3: np.uint64, w4: np.uint64, key: np.ndarray
) -> tuple[np.uint64, np.uint64]:
    """The header's share of the NH sums: u64 words 0..4 under ``key[2 + i]`` (``key`` is
    :attr:`TagKey.words`), from registers."""
    h1 = nh(w0, key[2]) + nh(w1, key[3]) + nh(w2, key[4]) + nh(w3, key[5]) + nh(w4, key[6])
    s = 2 + NH_SHIFT
    h2 = nh(w0, key[s]) + nh(w1, key[s + 1]) + nh(w2, key[s + 2]) + nh(w3, key[s + 3])
    return h1, h2 + nh(w4, key[s + 4])


#: Where payload word 0 (row u64 word 6) finds its NH key in :attr:`TagKey.words`.
KEY_PAYLOAD = 2 + PAYLOAD_WORD // 2


@njit(inline="always", **EXACT)
def keyed_row_finish(
    row64: np.ndarray, length: int, key: np.ndarray, p1: np.uint64, p2: np.uint64
) -> np.uint64:
    """Keyed tag of an arena row from its payload's two NH sums (:func:`nh_words`)."""
    h1, h2 = nh_header(row64[0], row64[1], row64[2], row64[3], row64[4], key)
    return keyed_finish(key[0], key[1], h1 + p1, h2 + p2, length)


@njit(**EXACT)
def keyed_row(row64: np.ndarray, length: int, key: np.ndarray) -> np.uint64:
    """Keyed tag of the packet in an arena row (``tag.keyed_tag``), read as u64 words."""
    p1, p2 = nh_words(row64[PAYLOAD_WORD // 2 :], length - 48, key[KEY_PAYLOAD:])
    return keyed_row_finish(row64, length, key, p1, p2)


#: Layout of the header template :func:`finish_packet` takes (uint64[5]): header u64 words 0..2
#: with the per-packet fields (flags, prio) zero, then the fast-tag sums of those six u32 words.
TMPL_A = 3
TMPL_B = 4


def header_template(words: np.ndarray) -> np.ndarray:
    """The uint64[5] template of header u32 words 0..5 (``words``; flags and prio zero)."""
    return _template(np.ascontiguousarray(words[:6], dtype=np.uint32))


@njit(**EXACT)
def _template(w: np.ndarray) -> np.ndarray:
    # Compiled: a transfer's header differs in its step from every earlier one, so the template
    # is built once per transfer, on the send path, where Python integer sums would cost more
    # than the header pass itself. The sums of six u32 words (weights up to 6) stay far below
    # 2^64: the u64 arithmetic is exact.
    tmpl = np.zeros(5, dtype=np.uint64)
    a = _U64(0)
    b = _U64(0)
    for i in range(6):
        x = _U64(w[i])
        a += x
        b += _U64(i + 1) * x
    for k in range(3):
        tmpl[k] = _U64(w[2 * k]) | (_U64(w[2 * k + 1]) << _U64(32))
    tmpl[TMPL_A] = a
    tmpl[TMPL_B] = b
    return tmpl


@njit(inline="always", **EXACT)
def finish_packet(
    row64: np.ndarray,
    tmpl: np.ndarray,
    flags: int,
    prio: int,
    chunk: int,
    count: int,
    norm: np.float32,
    length: int,
    pay_a: np.uint64,
    pay_b: np.uint64,
    mode: int,
    key: np.ndarray,
) -> None:
    """Write the header (five u64 words) and the tag of one packet.

    ``tmpl`` is :func:`header_template`; flags, prio, chunk, count and norm are merged in here,
    aux is 0. ``pay_a``/``pay_b`` are the payload's fast-tag sums (indices from 0), or under a
    keyed ``mode`` its two NH sums (:func:`nh_words` from ``key[KEY_PAYLOAD:]``). The header's
    own sums come from registers, not from the row: reading u64 words back right after writing
    them in other widths defeats store forwarding, a stall on every packet.
    """
    finish_packet_as(
        row64, tmpl, flags, prio, 0, chunk, count, norm, 0, length, pay_a, pay_b, mode, key
    )


@njit(inline="always", **EXACT)
def finish_packet_as(
    row64: np.ndarray,
    tmpl: np.ndarray,
    flags: int,
    prio: int,
    dtype: int,
    chunk: int,
    count: int,
    norm: np.float32,
    aux: int,
    length: int,
    pay_a: np.uint64,
    pay_b: np.uint64,
    mode: int,
    key: np.ndarray,
) -> None:
    """:func:`finish_packet` of a chunk in its own wire ``dtype`` (added to the template's,
    which is then float32's 0) with ``aux`` (an E4M3 chunk's scale bits): a float32 transfer's
    lossy-format chunks."""
    # flags, prio and dtype: bits 0..23 of header u32 word 1 (bits 32..55 of u64 word 0).
    fp = _U64(flags & 0xFF) | (_U64(prio & 0xFF) << _U64(8)) | (_U64(dtype & 0xFF) << _U64(16))
    chunk_w = _U64(chunk) & _LO32
    count_w = _U64(count) & _LO32
    norm_w = _U64(np.float32(norm).view(np.uint32))
    aux_w = _U64(aux) & _LO32
    w0 = tmpl[0] | (fp << _U64(32))
    w3 = chunk_w | (count_w << _U64(32))
    w4 = norm_w | (aux_w << _U64(32))
    row64[0] = w0
    row64[1] = tmpl[1]
    row64[2] = tmpl[2]
    row64[3] = w3
    row64[4] = w4
    if mode == TAG_KEYED:
        h1, h2 = nh_header(w0, tmpl[1], tmpl[2], w3, w4, key)
        row64[5] = keyed_finish(key[0], key[1], h1 + pay_a, h2 + pay_b, length)
    else:
        # Header words 1, 6, 7, 8, 9 carry indices 2, 7, 8, 9, 10; payload word j has index
        # 11 + j.
        ha = tmpl[TMPL_A] + fp + chunk_w + count_w + norm_w + aux_w
        hb = tmpl[TMPL_B] + _U64(2) * fp + _U64(7) * chunk_w + _U64(8) * count_w
        hb += _U64(9) * norm_w + _U64(10) * aux_w
        row64[5] = fast_finish(ha + pay_a, hb + pay_b + _U64(11) * pay_a, length)


@njit(**EXACT)
def splitmix64(z: np.uint64) -> np.uint64:
    """SplitMix64's output function (Steele, Lea & Flood 2014) of one counter value."""
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _is_bytes(t: Any) -> bool:
    """Whether a numba type is a contiguous 1-D uint8 array (what the byte intrinsics take)."""
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.uint8 and t.layout == "C"


def _memcpy(typingctx: Any, dst: Any, d: Any, src: Any, s: Any, n: Any) -> Any:
    """``dst[d : d + n] = src[s : s + n]`` for 1-D uint8 arrays, as one ``llvm.memcpy`` (the
    library's vectorised copy: a compiled loop with run-time bounds copies at a fraction of
    its speed). Compiled code only; nothing is checked: the caller keeps both ranges inside
    their arrays and apart."""
    if not (_is_bytes(dst) and _is_bytes(src)):
        return None
    sig = types.void(dst, d, src, s, n)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        dst_v, d_v, src_v, s_v, n_v = args
        da = context.make_array(signature.args[0])(context, builder, dst_v)
        sa = context.make_array(signature.args[2])(context, builder, src_v)
        cgutils.raw_memcpy(
            builder, builder.gep(da.data, [d_v]), builder.gep(sa.data, [s_v]), n_v, 1
        )
        return context.get_dummy_value()

    return sig, codegen


def _memzero(typingctx: Any, dst: Any, d: Any, n: Any) -> Any:
    """``dst[d : d + n] = 0`` for a 1-D uint8 array, as one ``llvm.memset``. Compiled code
    only; the caller keeps the range inside the array."""
    if not _is_bytes(dst):
        return None
    sig = types.void(dst, d, n)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        dst_v, d_v, n_v = args
        da = context.make_array(signature.args[0])(context, builder, dst_v)
        cgutils.memset(builder, builder.gep(da.data, [d_v]), n_v, 0)
        return context.get_dummy_value()

    return sig, codegen


#: ``memcpy(dst, d, src, s, n)``: ``dst[d : d + n] = src[s : s + n]`` in compiled code (see
#: :func:`_memcpy`).
memcpy: Any = intrinsic(_memcpy)
#: ``memzero(dst, d, n)``: ``dst[d : d + n] = 0`` in compiled code (see :func:`_memzero`).
memzero: Any = intrinsic(_memzero)


@njit(nogil=True, cache=True)
def copy_bytes(dst: np.ndarray, src: np.ndarray, a: int, k: int) -> None:
    """``dst[:k] = src[a : a + k]`` (1-D uint8) in one :func:`memcpy`; the caller keeps both
    ranges inside their arrays."""
    memcpy(dst, 0, src, a, k)
