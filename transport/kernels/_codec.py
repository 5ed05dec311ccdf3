"""The lossy wire formats' element conversions: float32 to bfloat16 and to E4M3, and back
(private; the send side is :mod:`._encode`, the receive side :mod:`._receive`).

Theory of operation
-------------------
**bfloat16** keeps float32's sign and exponent and the top 7 of its 23 mantissa bits, rounded
to nearest, ties to even (an IEEE conversion): the relative error of a normal value is at most
2⁻⁸. NaN stays NaN (quietened, sign kept), ±inf stays ±inf, and a value that rounds past the
largest bfloat16 becomes inf, as IEEE rounding does.

**E4M3** is OCP FP8 E4M3FN: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
NaN = ``0x7F``/``0xFF``, largest finite 448, smallest normal 2⁻⁶, subnormals ``m/8 · 2⁻⁶``. A
chunk travels with a float32 *scale* (:func:`e4m3_scale`: its largest finite magnitude over
448), and each element as ``e4m3(x · (1/scale))``, rounded to nearest even; a magnitude beyond
448 after rounding (or an infinity) saturates to ±448, never NaN; NaN stays NaN (``0x7F``, or
``0xFF`` when negative). Decoding multiplies the code's value by the scale.

The chunk kernels return the rounding error's energy (the squared residuals' sum, in float64)
and can keep each residual (``value - decoded``, float32: exact, since a rounding to nearest
lands within a factor of two of the value). A non-finite input's residual is 0: it is sent as
it is (bfloat16) or marked NaN/saturated (E4M3); the precision policies send such chunks in
float32 anyway.
"""

from __future__ import annotations

import numpy as np
from gradlane.transport.kernels._common import EXACT, REDUCTION, bf16_to_f32
from numba import njit

_U32 = np.uint32
_F32 = np.float32


def _e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 E4M3FN codes (quiet NaN for ``0x7F``/``0xFF``)."""
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    vals = (sign * mag).astype(np.float32)
    bits = vals.view(np.uint32)
    bits[0x7F], bits[0xFF] = 0x7FC00000, 0xFFC00000  # quiet NaNs, with the code's sign
    return vals


#: The float32 value of every E4M3 code.
E4M3_TABLE = _e4m3_values()
E4M3_TABLE.flags.writeable = False
#: The largest finite E4M3 magnitude.
E4M3_MAX = 448.0
_INV_MAX = _F32(1.0 / E4M3_MAX)
#: Below this largest magnitude a chunk's scale would underflow: it is sent with scale 1 (its
#: values round to zero, and error feedback keeps them).
_TINY = _F32(2.0**-100)


@njit(inline="always", **EXACT)
def f32_to_bf16(x: np.float32) -> np.uint16:
    """bfloat16 bits of ``x``, rounded to nearest even (NaN quietened, inf kept)."""
    b = _U32(_F32(x).view(np.uint32))
    nan = (b & _U32(0x7FFFFFFF)) > _U32(0x7F800000)
    rounded = (b + _U32(0x7FFF) + ((b >> _U32(16)) & _U32(1))) >> _U32(16)
    # Selects, not branches: the loops that call this vectorise.
    return np.uint16(((b >> _U32(16)) | _U32(0x40)) if nan else rounded)


#: 2^14: a float32 whose last mantissa bit weighs 2^-9, E4M3's subnormal step; adding it to a
#: magnitude below 2^-6 rounds that magnitude to the step (nearest even) in hardware.
_SUB_MAGIC = _F32(2.0**14)
_SUB_MAGIC_BITS = _U32(0x46800000)
assert np.float32(2.0**14).view(np.uint32) == 0x46800000


@njit(inline="always", **EXACT)
def f32_to_e4m3(y: np.float32) -> np.uint8:
    """E4M3 code of ``y`` (already divided by its scale): nearest even, saturating at ±448;
    NaN → ``0x7F`` (``0xFF`` when its sign bit is set)."""
    b = _U32(_F32(y).view(np.uint32))
    sign = (b >> _U32(24)) & _U32(0x80)
    mag = b & _U32(0x7FFFFFFF)
    # Normal codes (|y| >= 2^-6): the mantissa rounded to 3 bits, ties to even, in the integer
    # bits; past 448 (0x43E00000) it saturates, an infinity too.
    r = (mag + _U32(0x7FFFF) + ((mag >> _U32(20)) & _U32(1))) & _U32(0xFFF00000)
    normal = ((r >> _U32(20)) - _U32(120 << 3)) & _U32(0x7F)
    normal = _U32(0x7E) if r > _U32(0x43E00000) else normal
    # Subnormal codes: k · 2^-9, k in 0..8 (8 is 2^-6, the first normal code).
    k = _U32(_F32(_U32(mag).view(np.float32) + _SUB_MAGIC).view(np.uint32) - _SUB_MAGIC_BITS)
    code = k if mag < _U32(0x3C800000) else normal
    code = _U32(0x7F) if mag > _U32(0x7F800000) else code
    return np.uint8(code | sign)


#: 2^-9: the E4M3 subnormal step.
_TWO_POW_M9 = _F32(2.0**-9)


@njit(inline="always", **EXACT)
def e4m3_to_f32(c: np.uint8) -> np.float32:
    """The float32 value of E4M3 code ``c`` (a quiet NaN, with the code's sign, for
    ``0x7F``/``0xFF``): arithmetic, no table, so the loops that call it vectorise, and no
    float32 subnormal on the way (an operation on one costs a microcode assist, ~100 cycles)."""
    cu = _U32(c) & _U32(0x7F)
    sign = _U32((_U32(c) & _U32(0x80)) << _U32(24))
    # Normal codes: exponent and mantissa shifted into float32 place, the bias moved 7 → 127.
    normal = _U32((cu << _U32(20)) + _U32(120 << 23))
    sub = _F32(_F32(cu) * _TWO_POW_M9).view(np.uint32)  # codes 0..7: m · 2^-9
    bits = sub if cu < _U32(8) else normal
    bits = _U32(0x7FC00000) if cu == _U32(0x7F) else bits
    return _U32(bits | sign).view(np.float32)


@njit(**EXACT)
def e4m3_scale(src: np.ndarray) -> np.float32:
    """A chunk's E4M3 scale: its largest finite magnitude times float32(1/448) (1 when that
    magnitude is 0 or too small to scale)."""
    amax = _U32(0)
    for j in range(src.shape[0]):
        # Magnitude bits of the finite values (a non-finite one counts as 0): the largest
        # magnitude is the largest such integer, a vectorised max.
        m = _U32(_F32(src[j]).view(np.uint32) & _U32(0x7FFFFFFF))
        amax = max(amax, m if m < _U32(0x7F800000) else _U32(0))
    a = _U32(amax).view(np.float32)
    if a < _TINY:
        return _F32(1.0)
    return _F32(a * _INV_MAX)


@njit(**EXACT)
def encode_bf16(src: np.ndarray, dst: np.ndarray, residual: np.ndarray) -> np.float64:
    """``dst`` = bfloat16 bits of ``src``; ``residual`` (empty: not kept) = what rounding
    removed; returns the squared residuals' sum."""
    n = src.shape[0]
    res = residual if residual.shape[0] > 0 else np.empty(n, dtype=np.float32)
    # The finite case, without the selects NaN and infinity need (twice as fast); the largest
    # exponent seen says whether the chunk had one, and then it is done again, carefully.
    top = _U32(0)
    for j in range(n):
        x = src[j]
        b = _U32(_F32(x).view(np.uint32))
        h = np.uint16((b + _U32(0x7FFF) + ((b >> _U32(16)) & _U32(1))) >> _U32(16))
        dst[j] = h
        res[j] = x - bf16_to_f32(h)
        top = max(top, _U32(b & _U32(0x7F800000)))
    if top == _U32(0x7F800000):
        for j in range(n):
            x = src[j]
            h = f32_to_bf16(x)
            dst[j] = h
            r = x - bf16_to_f32(h)
            finite = (_F32(x).view(np.uint32) & _U32(0x7F800000)) != _U32(0x7F800000)
            res[j] = r if finite else _F32(0.0)
    return sumsq(res)


@njit(inline="always", **EXACT)
def _e4m3_round(y: np.float32) -> np.float32:
    """|y| (finite) rounded to E4M3's nearest even magnitude, saturated at 448, in float
    arithmetic: adding ``m``, a power of two whose last mantissa bit weighs what E4M3's does at
    |y|'s exponent (2^-9 below 2^-6), rounds in hardware; subtracting it is exact."""
    a = min(abs(y), _F32(E4M3_MAX))
    e = _F32(a).view(np.int32) & np.int32(0x7F800000)
    m = max(np.int32(e + np.int32(20 << 23)).view(np.float32), _SUB_MAGIC)
    return min((a + m) - m, _F32(E4M3_MAX))


@njit(inline="always", **EXACT)
def _e4m3_code(q: np.float32) -> np.int32:
    """The code of a magnitude :func:`_e4m3_round` returned (no sign)."""
    normal = (_F32(q).view(np.int32) >> np.int32(20)) - np.int32(120 << 3)
    return normal if q >= _F32(2.0**-6) else np.int32(q * _F32(512.0))


@njit(**EXACT)
def encode_e4m3(
    src: np.ndarray, dst: np.ndarray, scale: np.float32, residual: np.ndarray
) -> np.float64:
    """``dst`` = E4M3 codes of ``src · (1/scale)`` (a multiply by the reciprocal);
    ``residual`` and the return value as :func:`encode_bf16`'s, the decoded value being the
    code's value times ``scale``."""
    n = src.shape[0]
    res = residual if residual.shape[0] > 0 else np.empty(n, dtype=np.float32)
    inv = _F32(1.0) / scale
    top = _U32(0)  # the finite case first, as in encode_bf16
    for j in range(n):
        x = src[j]
        q = _e4m3_round(x * inv)
        neg = _F32(x).view(np.int32) < np.int32(0)  # the sign bit (-0.0 too)
        dst[j] = np.uint8(_e4m3_code(q) | (np.int32(0x80) if neg else np.int32(0)))
        res[j] = x - (-q if neg else q) * scale
        top = max(top, _U32(_F32(x).view(np.uint32) & _U32(0x7F800000)))
    if top == _U32(0x7F800000):
        for j in range(n):
            x = src[j]
            cc = f32_to_e4m3(x * inv)
            dst[j] = cc
            r = x - e4m3_to_f32(cc) * scale
            finite = (_F32(x).view(np.uint32) & _U32(0x7F800000)) != _U32(0x7F800000)
            res[j] = r if finite else _F32(0.0)
    return sumsq(res)


@njit(**REDUCTION)
def sumsq(a: np.ndarray) -> np.float64:
    """Sum of squares of float32 ``a`` in float64 lanes (reassociated under the reduction
    flags; float64 so that no finite chunk's energy overflows): the rounding error's energy."""
    acc = np.float64(0.0)
    for j in range(a.shape[0]):
        v = np.float64(a[j])
        acc += v * v
    return acc


@njit(**EXACT)
def add_bf16(acc: np.ndarray, src: np.ndarray) -> None:
    """``acc += `` the float32 values of bfloat16 bits ``src``."""
    for j in range(src.shape[0]):
        acc[j] += bf16_to_f32(src[j])


@njit(**EXACT)
def add_e4m3(acc: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """``acc += `` the values of E4M3 codes ``src`` times ``scale``."""
    for j in range(src.shape[0]):
        acc[j] += e4m3_to_f32(src[j]) * scale


@njit(**EXACT)
def decode_bf16(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` = the float32 values of bfloat16 bits ``src``."""
    for j in range(src.shape[0]):
        dst[j] = bf16_to_f32(src[j])


@njit(**EXACT)
def decode_e4m3(dst: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """``dst`` = the values of E4M3 codes ``src`` times ``scale``."""
    for j in range(src.shape[0]):
        dst[j] = e4m3_to_f32(src[j]) * scale
