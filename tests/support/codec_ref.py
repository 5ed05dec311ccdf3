"""The wire-precision codec in plain NumPy: the specification :mod:`._codec`'s compiled kernels
are held to (``tests/unit/test_codec.py``).

Theory of operation
-------------------
Every chunk kernel of :mod:`._codec` has a reference here of the same name with ``_ref``
appended, taking the same arguments and writing the same outputs; the tests run both on the
same inputs and compare codes, decoded values and residuals bit for bit, the error energy up to
the order of its float64 sum (the kernels' reduction is reassociated). The reference is written
for clarity, as whole-array NumPy expressions, and derives its roundings independently of the
kernels: a value is rounded by comparing its distances to the two nearest representable values
(ties to the even one), where the kernels add carries and magic constants to bit patterns.
Distances are taken in float64, which holds every difference of two float32 values near each
other exactly, so a tie is seen as a tie.

**bfloat16** keeps float32's sign, exponent and top 7 mantissa bits: a float32 value rounds to
the nearer of the two bfloat16 values around it, ties to the one whose last mantissa bit is 0.
Past the largest bfloat16 (``(2 - 2⁻⁷) · 2¹²⁷``) the next value up counts as ``2¹²⁸``, so a
value that rounds up there becomes inf, as IEEE rounding does. ±inf stays ±inf; NaN stays NaN,
quiet (the top mantissa bit set), with its sign and the top of its payload.

**E4M3** is OCP FP8 E4M3FN: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
infinities; NaN is ``0x7F`` and ``0xFF``; the largest finite magnitude is 448 (``0x7E``), the
smallest normal 2⁻⁶, subnormals ``m/8 · 2⁻⁶`` (steps of 2⁻⁹). A magnitude rounds to the nearest
of the 127 finite magnitudes, ties to the even code (the code's last bit is the mantissa's), and
*saturates*: anything past 448, infinities included, becomes ±448, never NaN. NaN becomes
``0x7F``, or ``0xFF`` when its sign bit is set. The sign is kept everywhere, so -0.0 is ``0x80``.
Code ``c`` decodes to :data:`E4M3_TABLE_REF` ``[c]``, NaN codes to a quiet NaN with the code's
sign (bits ``0x7FC00000`` / ``0xFFC00000``).

**Scale.** An E4M3 chunk travels with a float32 scale, :func:`e4m3_scale_ref`: its largest
finite magnitude times ``float32(1/448)``, or 1 when that magnitude is below 2⁻¹⁰⁰ (the scale
would approach float32's underflow, where its reciprocal overflows; such values are negligible
in a gradient: they round to 0 and the residual keeps them). Each element is encoded as
``e4m3(x · float32(1/scale))``: a multiply by the reciprocal, rounded once in float32, which is
what the kernels compute per element; it can put the largest element a rounding past 448, which
the saturation absorbs. An element decodes to ``E4M3_TABLE_REF[c] · scale`` (one float32
multiply).

**Residual and energy.** An encoder can keep each element's residual ``x - decoded(x)``, one
IEEE float32 subtraction, and returns the sum of the squared residuals (the rounding error's
energy) in float64, whether or not it keeps them. A non-finite input's residual is 0: it is
sent as it is (bfloat16) or marked NaN / saturated (E4M3), and error feedback must not carry an
infinity into the next step. A finite value that rounds to a bfloat16 inf has residual ∓inf.
The subtraction is exact (the residual is exactly what rounding removed) whenever the decoded
value is finite and within a factor of two of ``x``, or zero: always for bfloat16 short of
overflow, and (the tests check it) for E4M3 when the chunk is encoded with its own scale.
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32

#: The largest finite E4M3 magnitude.
E4M3_MAX = 448.0
#: Below this largest finite magnitude a chunk's scale is 1.
E4M3_TINY = 2.0**-100
#: float32 bits of the quiet NaN an E4M3 NaN code decodes to (the code's sign added).
E4M3_NAN_BITS = 0x7FC00000


def _e4m3_table() -> np.ndarray:
    """The float32 values of the 256 E4M3 codes, from the format's definition."""
    codes = np.arange(256, dtype=np.int64)
    exp = (codes >> 3) & 0xF
    man = codes & 7
    # Normal: (1 + m/8) · 2^(e-7) = (8 + m) · 2^(e-10); subnormal (e = 0): m · 2^-9.
    mag = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(man + 8, exp - 10))
    bits = np.abs(mag).astype(np.float32).view(np.uint32)
    bits = np.where((codes & 0x7F) == 0x7F, E4M3_NAN_BITS, bits)
    bits = bits | ((codes >> 7) << 31)
    return bits.astype(np.uint32).view(np.float32)


#: The float32 value of every E4M3 code, indexed by the code.
E4M3_TABLE_REF = _e4m3_table()
E4M3_TABLE_REF.flags.writeable = False
#: The 127 non-negative finite magnitudes, ascending (codes 0..0x7E), in float64.
_E4M3_MAGS = E4M3_TABLE_REF[:0x7F].astype(np.float64)


def _nearest_even(a: np.ndarray, lo: np.ndarray, hi: np.ndarray, lo_odd: np.ndarray) -> np.ndarray:
    """Whether ``a`` rounds up to ``hi`` rather than down to ``lo`` (``lo <= a <= hi``, float64)
    under round to nearest, ties to the even of the two (``lo_odd``: the lower one is odd)."""
    d_lo = a - lo
    d_hi = hi - a
    return (d_hi < d_lo) | ((d_hi == d_lo) & lo_odd)


def f32_to_bf16_ref(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 ``x``: nearest, ties to even; NaN quietened
    (sign and the top of the payload kept), ±inf kept, overflow to ±inf."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)
    sign = (b >> 16) & 0x8000
    mag = b & 0x7FFFFFFF
    down = mag >> 16  # the bfloat16 at or below |x|
    finite = mag < 0x7F800000
    # Widening a signalling NaN raises "invalid"; the non-finite values are decided below.
    with np.errstate(invalid="ignore"):
        lo = (down << 16).astype(np.uint32).view(np.float32).astype(np.float64)
        # The bfloat16 above |x|; past the largest finite one, 2^128 stands for the inf it is.
        hi = ((down + 1) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
        hi = np.where(down + 1 == 0x7F80, 2.0**128, hi)
        a = mag.astype(np.uint32).view(np.float32).astype(np.float64)
        up = finite & _nearest_even(a, lo, hi, (down & 1) == 1)
    code = np.where(mag > 0x7F800000, (b >> 16) | 0x40, (down + up) | sign)
    return code.astype(np.uint16)


def bf16_to_f32_ref(h: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns ``h`` (exact: the high half of a float32)."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_e4m3_ref(y: np.ndarray) -> np.ndarray:
    """E4M3 codes (uint8) of float32 ``y`` (already divided by its scale): nearest, ties to the
    even code; saturating at ±448 (±inf too); NaN → ``0x7F``, ``0xFF`` when its sign bit is set;
    -0.0 → ``0x80``."""
    y = np.ascontiguousarray(y, dtype=np.float32)
    sign = np.signbit(y).astype(np.int64) << 7
    with np.errstate(invalid="ignore"):
        a = np.minimum(np.abs(y).astype(np.float64), E4M3_MAX)  # NaN stays NaN
        hi = np.clip(np.searchsorted(_E4M3_MAGS, a), 1, 0x7E)  # first magnitude >= a
        lo = hi - 1
        up = _nearest_even(a, _E4M3_MAGS[lo], _E4M3_MAGS[hi], (lo & 1) == 1)
    code = np.where(np.isnan(y), 0x7F, lo + up) | sign
    return code.astype(np.uint8)


def e4m3_to_f32_ref(c: np.ndarray) -> np.ndarray:
    """float32 values of E4M3 codes ``c`` (quiet NaN with the code's sign for NaN codes)."""
    return E4M3_TABLE_REF[np.asarray(c, dtype=np.uint8)]


def _residual(src: np.ndarray, dec: np.ndarray, residual: np.ndarray) -> np.float64:
    """Store ``src - dec`` (0 where ``src`` is not finite) into ``residual`` unless it is empty;
    return its sum of squares in float64."""
    with np.errstate(invalid="ignore", over="ignore"):
        res = np.where(np.isfinite(src), src - dec, _F32(0.0)).astype(np.float32)
    if residual.shape[0] > 0:
        residual[...] = res
    return np.float64(np.sum(np.square(res.astype(np.float64))))


def encode_bf16_ref(src: np.ndarray, dst: np.ndarray, residual: np.ndarray) -> np.float64:
    """``dst`` (uint16) = bfloat16 bits of ``src`` (float32); ``residual`` (float32, empty: not
    kept) = ``src - decoded``, 0 where ``src`` is not finite; returns the residuals' sum of
    squares (float64)."""
    codes = f32_to_bf16_ref(src)
    dst[...] = codes
    return _residual(src, bf16_to_f32_ref(codes), residual)


def e4m3_scale_ref(src: np.ndarray) -> np.float32:
    """E4M3 scale of a float32 chunk: its largest finite magnitude times ``float32(1/448)``;
    1 when that magnitude is below 2⁻¹⁰⁰, the chunk is empty or nothing in it is finite."""
    src = np.asarray(src, dtype=np.float32)
    finite = np.abs(src[np.isfinite(src)])
    amax = finite.max() if finite.size else _F32(0.0)
    if amax < E4M3_TINY:
        return _F32(1.0)
    return _F32(amax * _F32(1.0 / E4M3_MAX))


def encode_e4m3_ref(
    src: np.ndarray, dst: np.ndarray, scale: np.float32, residual: np.ndarray
) -> np.float64:
    """``dst`` (uint8) = E4M3 codes of ``src · float32(1/scale)`` (float32 products); residual
    and return value as :func:`encode_bf16_ref`'s, the decoded value being
    ``E4M3_TABLE_REF[code] · scale``. ``scale`` is positive, finite and normal."""
    scale = _F32(scale)
    # Past float32's range the product is inf, which saturates; NaN raises "invalid".
    with np.errstate(over="ignore", invalid="ignore"):
        codes = f32_to_e4m3_ref(src * (_F32(1.0) / scale))
        dec = e4m3_to_f32_ref(codes) * scale
    dst[...] = codes
    return _residual(src, dec, residual)


def decode_bf16_ref(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` (float32) = the values of bfloat16 bits ``src``."""
    dst[...] = bf16_to_f32_ref(src)


def decode_e4m3_ref(dst: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """``dst`` (float32) = the values of E4M3 codes ``src`` times ``scale`` (float32)."""
    with np.errstate(over="ignore", invalid="ignore"):
        dst[...] = e4m3_to_f32_ref(src) * _F32(scale)


def add_bf16_ref(acc: np.ndarray, src: np.ndarray) -> None:
    """``acc`` (float32) += the values of bfloat16 bits ``src``."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.add(acc, bf16_to_f32_ref(src), out=acc)


def add_e4m3_ref(acc: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """``acc`` (float32) += the values of E4M3 codes ``src`` times ``scale``: the product is
    rounded to float32 before the sum (no fused multiply-add)."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.add(acc, e4m3_to_f32_ref(src) * _F32(scale), out=acc)
