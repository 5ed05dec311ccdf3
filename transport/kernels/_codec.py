"""The lossy wire formats' element conversions: float32 to bfloat16 and to E4M3, and back
(private; the send side is :mod:`._encode`, the receive side :mod:`._receive`).

Theory of operation
-------------------
**bfloat16** keeps float32's sign and exponent and the top 7 of its 23 mantissa bits, rounded
to nearest, ties to even (an IEEE conversion): the relative error of a normal value is at most
2⁻⁹. NaN stays NaN (quietened, sign kept), ±inf stays ±inf, and a value that rounds past the
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
from gradlane.transport.kernels._common import EXACT, bf16_to_f32
from numba import njit

_U32 = np.uint32
_F32 = np.float32


def _e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 E4M3FN codes (NaN for ``0x7F``/``0xFF``)."""
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    vals = (sign * mag).astype(np.float32)
    vals[(codes & 0x7F) == 0x7F] = np.nan
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
    if (b & _U32(0x7FFFFFFF)) > _U32(0x7F800000):
        return np.uint16((b >> _U32(16)) | _U32(0x40))
    return np.uint16((b + _U32(0x7FFF) + ((b >> _U32(16)) & _U32(1))) >> _U32(16))


@njit(inline="always", **EXACT)
def f32_to_e4m3(y: np.float32) -> np.uint8:
    """E4M3 code of ``y`` (already divided by its scale): nearest even, saturating at ±448;
    NaN → ``0x7F`` (``0xFF`` when its sign bit is set)."""
    b = _U32(_F32(y).view(np.uint32))
    sign = np.uint8((b >> _U32(24)) & _U32(0x80))
    mag = b & _U32(0x7FFFFFFF)
    if mag > _U32(0x7F800000):
        return np.uint8(sign | np.uint8(0x7F))
    if mag >= _U32(0x3C800000):  # >= 2^-6: a normal code, or saturated
        # Round the mantissa to 3 bits, ties to even, in the integer bits.
        r = (mag + _U32(0x7FFFF) + ((mag >> _U32(20)) & _U32(1))) & _U32(0xFFF00000)
        e = np.int64(r >> _U32(23)) - 127
        m = np.int64((r >> _U32(20)) & _U32(7))
        if e > 8 or (e == 8 and m == 7):
            return np.uint8(sign | np.uint8(0x7E))
        return np.uint8(sign | np.uint8(((e + 7) << 3) | m))
    # A subnormal code: k · 2^-9, k = round-half-even(|y| · 2^9) in 0..8 (8 is 2^-6, code 8).
    t = _U32(mag).view(np.float32) * _F32(512.0)  # exact: a power of two
    k = np.int64(t)
    f = t - _F32(k)
    if f > _F32(0.5) or (f == _F32(0.5) and k & 1):
        k += 1
    return np.uint8(sign | np.uint8(k))


@njit(**EXACT)
def e4m3_scale(src: np.ndarray) -> np.float32:
    """A chunk's E4M3 scale: its largest finite magnitude over 448 (1 when that is 0 or too
    small to scale)."""
    amax = _F32(0.0)
    for j in range(src.shape[0]):
        a = abs(src[j])
        if a > amax and a <= _F32(3.4028235e38):  # finite (NaN fails both)
            amax = a
    if amax < _TINY:
        return _F32(1.0)
    return _F32(amax * _INV_MAX)


@njit(**EXACT)
def encode_bf16(src: np.ndarray, dst: np.ndarray, residual: np.ndarray) -> np.float64:
    """``dst`` = bfloat16 bits of ``src``; ``residual`` (empty: not kept) = what rounding
    removed; returns the squared residuals' sum."""
    keep = residual.shape[0] > 0
    e = np.float64(0.0)
    for j in range(src.shape[0]):
        x = src[j]
        h = f32_to_bf16(x)
        dst[j] = h
        r = x - bf16_to_f32(h)
        if not np.isfinite(r):
            r = _F32(0.0)
        if keep:
            residual[j] = r
        e += np.float64(r) * np.float64(r)
    return e


@njit(**EXACT)
def encode_e4m3(
    src: np.ndarray, dst: np.ndarray, scale: np.float32, residual: np.ndarray
) -> np.float64:
    """``dst`` = E4M3 codes of ``src · (1/scale)`` (a multiply by the reciprocal: one rounding
    less than no exact division would save); ``residual`` and the return value as
    :func:`encode_bf16`'s, the decoded value being ``E4M3_TABLE[code] · scale``."""
    keep = residual.shape[0] > 0
    inv = _F32(1.0) / scale
    table = E4M3_TABLE
    e = np.float64(0.0)
    for j in range(src.shape[0]):
        x = src[j]
        c = f32_to_e4m3(x * inv)
        dst[j] = c
        r = x - table[c] * scale
        if not np.isfinite(r):
            r = _F32(0.0)
        if keep:
            residual[j] = r
        e += np.float64(r) * np.float64(r)
    return e


@njit(**EXACT)
def add_bf16(acc: np.ndarray, src: np.ndarray) -> None:
    """``acc += `` the float32 values of bfloat16 bits ``src``."""
    for j in range(src.shape[0]):
        acc[j] += bf16_to_f32(src[j])


@njit(**EXACT)
def add_e4m3(acc: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """``acc += `` the values of E4M3 codes ``src`` times ``scale``."""
    table = E4M3_TABLE
    for j in range(src.shape[0]):
        acc[j] += table[src[j]] * scale


@njit(**EXACT)
def decode_bf16(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` = the float32 values of bfloat16 bits ``src``."""
    for j in range(src.shape[0]):
        dst[j] = bf16_to_f32(src[j])


@njit(**EXACT)
def decode_e4m3(dst: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """``dst`` = the values of E4M3 codes ``src`` times ``scale``."""
    table = E4M3_TABLE
    for j in range(src.shape[0]):
        dst[j] = table[src[j]] * scale
