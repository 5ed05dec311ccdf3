"""The wire-precision codec (transport/kernels/_codec.py) against its NumPy specification
(tests/support/codec_ref.py), against torch's bfloat16 and float8_e4m3fn where their
semantics agree, and against the formats' definitions: rounding at every tie, error bounds,
the residual identity and the edge cases.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from gradlane.transport.kernels import _codec as codec
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.support import codec_ref as ref
from tests.support.kernel_inputs import SETTINGS

F32 = np.float32
EMPTY = np.empty(0, np.float32)
LENGTHS = st.integers(0, 300)
#: Values a chunk is seeded with: zeros of both signs, the E4M3 range's ends and ties, float32's
#: smallest subnormal, largest finite and bfloat16's overflow threshold, infinities, NaNs.
SPECIALS = np.array(
    [0.0, -0.0, 448.0, -448.0, 464.0, 480.0, 2.0**-6, 2.0**-9, 2.0**-10, 1e-45, 3.4028235e38,
     -3.4028235e38, 3.3895314e38, np.inf, -np.inf, np.nan, -np.nan],
    dtype=np.float32,
)  # fmt: skip


@st.composite
def gradient_like(draw: st.DrawFn) -> np.ndarray:
    """Values spread over many binades around a drawn magnitude, a few specials mixed in."""
    n = draw(LENGTHS)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.floats(0.0, 40.0))
    mag = draw(st.floats(-130.0, 125.0))
    with np.errstate(over="ignore"):
        x = rng.standard_normal(n) * np.exp2(mag + rng.uniform(-spread, spread, n))
    x = np.clip(x, -3.4e38, 3.4e38).astype(np.float32)
    k = draw(st.integers(0, min(n, 4)))
    if k:
        x[rng.integers(0, n, k)] = rng.choice(SPECIALS, k)
    return x


#: Float32 chunks: element-wise floats (subnormals, zeros, NaN, inf), raw bit patterns (every
#: NaN payload), and gradient-like values.
CHUNKS = st.one_of(
    hnp.arrays(np.float32, LENGTHS, elements=st.floats(width=32)),
    hnp.arrays(np.uint32, LENGTHS, elements=st.integers(0, 2**32 - 1)).map(
        lambda b: b.view(np.float32)
    ),
    gradient_like(),
)
#: Scales a caller may pass: positive normal float32 across e4m3_scale's whole range.
SCALES = st.floats(2.0**-110, 2.0**119, width=32).map(F32)


def bits(a: np.ndarray) -> np.ndarray:
    """The uint32 bit patterns of float32 ``a`` (compares NaN payloads and zero signs)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def encode(x: np.ndarray, fmt: str, scale: np.float32, keep: bool = True) -> tuple:
    """(codes, residual, energy) of the compiled encoder (residual empty unless ``keep``)."""
    res = np.empty_like(x) if keep else EMPTY.copy()
    if fmt == "bf16":
        codes = np.empty(x.shape, np.uint16)
        energy = codec.encode_bf16(x, codes, res)
    else:
        codes = np.empty(x.shape, np.uint8)
        energy = codec.encode_e4m3(x, codes, F32(scale), res)
    return codes, res, energy


def encode_ref(x: np.ndarray, fmt: str, scale: np.float32) -> tuple:
    """(codes, residual, energy) of the reference encoder."""
    res = np.empty_like(x)
    if fmt == "bf16":
        codes = np.empty(x.shape, np.uint16)
        energy = ref.encode_bf16_ref(x, codes, res)
    else:
        codes = np.empty(x.shape, np.uint8)
        energy = ref.encode_e4m3_ref(x, codes, scale, res)
    return codes, res, energy


def decode(codes: np.ndarray, scale: np.float32) -> np.ndarray:
    """The compiled decoder's float32 values of bf16 (uint16) or E4M3 (uint8) codes."""
    out = np.empty(codes.shape, np.float32)
    if codes.dtype == np.uint16:
        codec.decode_bf16(out, codes)
    else:
        codec.decode_e4m3(out, codes, F32(scale))
    return out


def same_energy(got: float, want: float, n: int) -> bool:
    """Energies equal up to float64 summation order (the kernel's reduction is reassociated)."""
    if math.isinf(want):
        return got == want
    return abs(got - want) <= 2 * n * 2.0**-53 * want


def torch_bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def torch_e4m3(y: np.ndarray) -> np.ndarray:
    return torch.from_numpy(y.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


# -- the compiled kernels equal the reference, bit for bit ---------------------------------------


def test_the_table_is_the_format():
    t = codec.E4M3_TABLE
    assert np.array_equal(bits(t), bits(ref.E4M3_TABLE_REF))
    assert t[0x7E] == 448 and t[0xFE] == -448 and t[0x08] == 2.0**-6 and t[0x01] == 2.0**-9
    assert t[0x38] == 1.0 and t[0x3F] == 1.875 and t[0x00] == 0 and np.signbit(t[0x80])
    assert bits(t)[0x7F] == 0x7FC00000 and bits(t)[0xFF] == 0xFFC00000
    assert np.count_nonzero(np.isnan(t)) == 2
    codes = np.arange(256, dtype=np.uint8)
    theirs = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()
    finite = ~np.isnan(t)
    assert np.array_equal(bits(t[finite]), bits(theirs[finite]))
    assert np.isnan(theirs[~finite]).all()
    # The arithmetic decoder gives the table's bits for every code, scaled or not.
    assert np.array_equal(bits(decode(codes, F32(1.0))), bits(t))
    s = F32(3.0e-7)
    assert np.array_equal(bits(decode(codes, s)), bits(t * s))


@given(x=CHUNKS)
@SETTINGS
def test_the_conversions_equal_the_reference(x):
    bf = np.array([codec.f32_to_bf16(v) for v in x], dtype=np.uint16)
    e4 = np.array([codec.f32_to_e4m3(v) for v in x], dtype=np.uint8)
    assert np.array_equal(bf, ref.f32_to_bf16_ref(x))
    assert np.array_equal(e4, ref.f32_to_e4m3_ref(x))


@given(x=CHUNKS, fmt=st.sampled_from(["bf16", "e4m3"]), drawn=SCALES, own=st.booleans())
@SETTINGS
def test_the_chunk_kernels_equal_the_reference(x, fmt, drawn, own):
    scale = F32(codec.e4m3_scale(x))
    assert bits(np.array([scale])) == bits(np.array([ref.e4m3_scale_ref(x)]))
    if not own:
        scale = drawn
    codes, res, energy = encode(x, fmt, scale)
    want_codes, want_res, want_energy = encode_ref(x, fmt, scale)
    assert np.array_equal(codes, want_codes)
    assert np.array_equal(bits(res), bits(want_res))
    assert same_energy(energy, want_energy, x.size)
    # Without a residual to keep, the codes and the energy are the same.
    codes2, _, energy2 = encode(x, fmt, scale, keep=False)
    assert np.array_equal(codes2, codes)
    assert same_energy(energy2, want_energy, x.size)

    want_dec = np.empty_like(x)
    acc = np.random.default_rng(x.size).standard_normal(x.size).astype(np.float32)
    want_acc = acc.copy()
    if fmt == "bf16":
        ref.decode_bf16_ref(want_dec, codes)
        codec.add_bf16(acc, codes)
        ref.add_bf16_ref(want_acc, codes)
    else:
        ref.decode_e4m3_ref(want_dec, codes, scale)
        codec.add_e4m3(acc, codes, scale)
        ref.add_e4m3_ref(want_acc, codes, scale)
    assert np.array_equal(bits(decode(codes, scale)), bits(want_dec))
    assert np.array_equal(bits(acc), bits(want_acc))


@given(x=CHUNKS, scale=SCALES)
@SETTINGS
def test_an_element_is_coded_whatever_its_neighbours(x, scale):
    """A chunk that holds a non-finite value codes its other elements as one that does not."""
    finite = x[np.isfinite(x)]
    for fmt in ("bf16", "e4m3"):
        codes, res, _ = encode(finite, fmt, scale)
        for special in (np.inf, -np.inf, np.nan):
            more = np.append(finite, F32(special))
            codes2, res2, _ = encode(more, fmt, scale)
            assert np.array_equal(codes2[:-1], codes)
            assert np.array_equal(bits(res2[:-1]), bits(res))


# -- rounding at every tie, against the definitions and torch ------------------------------------


def test_bf16_rounds_to_nearest_even_at_every_tie():
    h = np.arange(0x10000, dtype=np.uint32)
    h = h[(h & 0x7FFF) < 0x7F80]  # the finite bfloat16 values, both signs
    base = h << 16
    mid = base | 0x8000  # halfway to the next bfloat16 away from zero
    x = np.concatenate([base, mid - 1, mid, mid + 1]).view(np.float32)
    away = h + 1  # the next bfloat16 away from zero (0x7F80: inf)
    want = np.concatenate([h, h, np.where(h & 1, away, h), away]).astype(np.uint16)
    assert np.array_equal(ref.f32_to_bf16_ref(x), want)
    codes, _, _ = encode(x, "bf16", F32(1.0))
    assert np.array_equal(codes, want)
    codes, _, _ = encode(np.append(x, F32(np.nan)), "bf16", F32(1.0))
    assert np.array_equal(codes[:-1], want)
    assert np.array_equal(torch_bf16(x), want)


def test_e4m3_rounds_to_nearest_even_at_every_tie():
    lo = np.arange(0x7E, dtype=np.int64)  # each finite magnitude but the largest, and its next
    v = ref.E4M3_TABLE_REF
    mid = ((v[lo].astype(np.float64) + v[lo + 1]) / 2).astype(np.float32)  # exact in float32
    below = np.nextafter(mid, F32(0.0))
    above = np.nextafter(mid, F32(np.inf))
    y = np.concatenate([v[lo], below, mid, above])
    want = np.concatenate([lo, lo, np.where(lo & 1, lo + 1, lo), lo + 1])
    y = np.concatenate([y, -y])
    want = np.concatenate([want, want | 0x80]).astype(np.uint8)
    assert np.array_equal(ref.f32_to_e4m3_ref(y), want)
    assert np.array_equal(np.array([codec.f32_to_e4m3(e) for e in y], np.uint8), want)
    codes, _, _ = encode(y, "e4m3", F32(1.0))
    assert np.array_equal(codes, want)
    codes, _, _ = encode(np.append(y, F32(np.inf)), "e4m3", F32(1.0))
    assert np.array_equal(codes[:-1], want)
    assert np.array_equal(torch_e4m3(y), want)


@given(x=CHUNKS)
@SETTINGS
def test_against_torch_where_its_semantics_agree(x):
    finite = np.isfinite(x)
    codes, _, _ = encode(x, "bf16", F32(1.0))
    assert np.array_equal(codes[finite], torch_bf16(x)[finite])
    # torch's float8_e4m3fn turns magnitudes from 480 up into NaN where E4M3 saturates: compare
    # inside ±448 only, the values as scaled by the chunk's own scale and unscaled.
    scale = F32(codec.e4m3_scale(x))
    for s in (scale, F32(1.0)):
        with np.errstate(over="ignore", invalid="ignore"):
            y = x * (F32(1.0) / s)
        inside = np.isfinite(y) & (np.abs(y) <= 448)
        codes, _, _ = encode(x, "e4m3", s)
        assert np.array_equal(codes[inside], torch_e4m3(y)[inside])


# -- error bounds and the residual ---------------------------------------------------------------


def half_ulp_bf16(x: np.ndarray) -> np.ndarray:
    """Half a bfloat16 unit in the last place at float32 ``x`` (finite): 2^(e-8), e = ⌊log2|x|⌋,
    and 2^-134 over the subnormals (step 2^-133)."""
    e = np.frexp(np.abs(x).astype(np.float64))[1] - 1
    return np.ldexp(1.0, np.maximum(e, -126) - 8)


def half_ulp_e4m3(y: np.ndarray) -> np.ndarray:
    """Half an E4M3 unit in the last place at ``|y| <= 448``: 2^(e-4), and 2^-10 over the
    subnormals (``|y| < 2^-6``, step 2^-9)."""
    e = np.frexp(np.abs(y).astype(np.float64))[1] - 1
    return np.ldexp(1.0, np.maximum(e, -6) - 4)


@given(x=CHUNKS)
@SETTINGS
def test_bf16_round_trip_error(x):
    codes, _, _ = encode(x, "bf16", F32(1.0))
    dec = decode(codes, F32(1.0))
    ok = np.isfinite(x) & np.isfinite(dec)  # not the values that round past the largest bf16
    err = np.abs(x[ok].astype(np.float64) - dec[ok])
    assert np.all(err <= half_ulp_bf16(x[ok]))
    normal = np.abs(x[ok]) >= 2.0**-126
    assert np.all(err[normal] <= 2.0**-8 * np.abs(x[ok][normal]))


@given(x=CHUNKS, drawn=SCALES, own=st.booleans())
@SETTINGS
def test_e4m3_round_trip_error(x, drawn, own):
    scale = F32(codec.e4m3_scale(x)) if own else drawn
    codes, _, _ = encode(x, "e4m3", scale)
    finite = np.isfinite(x)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (x * (F32(1.0) / scale))[finite]
    q = codec.E4M3_TABLE[codes[finite]].astype(np.float64)
    # Exact in the scaled domain: within half a unit, or saturated past 448, never NaN.
    inside = np.abs(y) <= 448
    assert np.all(np.abs(y[inside] - q[inside]) <= half_ulp_e4m3(y[inside]))
    assert np.all(q[~inside] == np.sign(y[~inside]) * 448)
    # Unscaled, up to the float32 roundings of the scaling and the decode.
    dec = decode(codes, scale)[finite].astype(np.float64)
    xs = x[finite].astype(np.float64)
    ok = inside & np.isfinite(dec)
    err = np.abs(xs - dec)[ok]
    slack = 1 + 2.0**-16
    normal = np.abs(y[ok]) >= 2.0**-6
    assert np.all(err[normal] <= 2.0**-4 * np.abs(xs[ok][normal]) * slack)
    assert np.all(err[~normal] <= 2.0**-10 * float(scale) * slack)


def exact_residual(x: np.ndarray, dec: np.ndarray, res: np.ndarray) -> np.ndarray:
    """Per element, whether ``dec + res == x`` in exact arithmetic (fsum rounds once)."""
    triples = zip(x.tolist(), dec.tolist(), res.tolist(), strict=True)
    return np.array([math.fsum((d, r, -v)) == 0 for v, d, r in triples], dtype=bool)


def within_one_rounding(x: np.ndarray, dec: np.ndarray, res: np.ndarray) -> bool:
    """Whether each ``res`` is within half a float32 unit (of ``res``) of the exact
    ``x - dec``."""
    for v, d, r in zip(x, dec, res, strict=True):
        exact = Fraction(float(v)) - Fraction(float(d))
        e = math.frexp(float(r))[1] - 1
        half_ulp = Fraction(2) ** (max(e, -126) - 24)
        if abs(Fraction(float(r)) - exact) > half_ulp:
            return False
    return True


@given(x=CHUNKS, fmt=st.sampled_from(["bf16", "e4m3"]), drawn=SCALES)
@SETTINGS
def test_the_residual_is_what_rounding_removed(x, fmt, drawn):
    """``residual = x - decoded`` is exact for bf16 short of overflow and for E4M3 under the
    chunk's own scale; under any scale it is the float32 difference, one rounding from exact.
    Non-finite inputs have residual 0; the energy is the residuals' sum of squares."""
    own = F32(codec.e4m3_scale(x))
    for scale in (own, drawn):
        codes, res, energy = encode(x, fmt, scale)
        dec = decode(codes, scale)
        finite = np.isfinite(x)
        assert np.all(bits(res[~finite]) == 0)
        ok = finite & np.isfinite(dec)
        if fmt == "bf16" or scale == own:
            assert exact_residual(x[ok], dec[ok], res[ok]).all()
            assert np.array_equal((dec[ok] + res[ok]).astype(np.float32), x[ok])
        assert within_one_rounding(x[ok], dec[ok], res[ok])
        wide = res.astype(np.float64)
        assert same_energy(energy, float(np.sum(wide * wide)), x.size)


# -- edge cases -----------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [0.0, -0.0])
@pytest.mark.parametrize("n", [0, 1, 17])
def test_a_chunk_of_zeros(zero, n):
    x = np.full(n, zero, np.float32)
    scale = codec.e4m3_scale(x)
    assert scale == 1.0
    sign = 0x80 if np.signbit(zero) else 0
    for fmt, code in (("bf16", sign << 8), ("e4m3", sign)):
        codes, res, energy = encode(x, fmt, scale)
        assert np.all(codes == code) and energy == 0.0 and not res.any()
        assert np.array_equal(bits(decode(codes, scale)), bits(x))


def test_scale_ignores_non_finite_values_and_negligible_chunks():
    assert codec.e4m3_scale(np.array([np.nan, np.inf, -np.inf], np.float32)) == 1.0
    assert codec.e4m3_scale(np.array([np.inf, -2.0, np.nan], np.float32)) == F32(2.0) * F32(
        1.0 / 448
    )
    tiny = np.array([2.0**-101, -(2.0**-120), 1e-45], np.float32)
    assert codec.e4m3_scale(tiny) == 1.0
    codes, res, _ = encode(tiny, "e4m3", F32(1.0))
    assert list(codes) == [0x00, 0x80, 0x00] and np.array_equal(bits(res), bits(tiny))


@given(v=st.floats(2.0**-100, float(np.finfo(np.float32).max), width=32), negative=st.booleans())
@SETTINGS
def test_a_chunk_of_one_value_is_448_times_its_scale(v, negative):
    x = np.array([-v if negative else v], np.float32)
    scale = F32(codec.e4m3_scale(x))
    codes, _, _ = encode(x, "e4m3", scale)
    assert codes[0] == (0xFE if negative else 0x7E)
    dec = decode(codes, scale)
    assert abs(float(dec[0]) - float(x[0])) <= 2.0**-21 * abs(float(x[0]))


def test_the_largest_magnitudes_get_the_largest_codes():
    x = np.array([1.0, -7.5, 0.25, 7.5, 3.4028235e38, -3.4028235e38], np.float32)
    codes, res, _ = encode(x[:4], "e4m3", F32(codec.e4m3_scale(x[:4])))
    assert codes[1] == 0xFE and codes[3] == 0x7E
    assert np.all((codes[[0, 2]] & 0x7F) < 0x7E)
    scale = F32(codec.e4m3_scale(x))
    codes, res, energy = encode(x, "e4m3", scale)
    assert codes[4] == 0x7E and codes[5] == 0xFE
    assert np.isfinite(decode(codes, scale)).all() and np.isfinite(res).all()
    assert np.isfinite(energy)


@given(x=CHUNKS, scale=SCALES)
@SETTINGS
def test_saturation_never_makes_nan_from_a_finite_value(x, scale):
    codes, _, _ = encode(x, "e4m3", scale)
    finite = np.isfinite(x)
    assert np.all((codes[finite] & 0x7F) != 0x7F)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x * (F32(1.0) / scale)
    assert np.all((codes[np.abs(y) > 464] & 0x7F) == 0x7E)


def test_non_finite_values():
    x = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7F800000, 0xFF800000],
                 np.uint32).view(np.float32)  # fmt: skip
    codes, res, energy = encode(x, "e4m3", F32(2.0))
    assert list(codes) == [0x7F, 0xFF, 0x7F, 0xFF, 0x7E, 0xFE]
    assert not res.any() and energy == 0.0
    assert [codec.f32_to_e4m3(v) for v in x] == list(codes)
    dec = decode(codes, F32(2.0))
    assert np.isnan(dec[:4]).all() and list(np.signbit(dec[:4])) == [False, True, False, True]
    assert list(dec[4:]) == [896.0, -896.0]
    codes, res, energy = encode(x, "bf16", F32(1.0))
    assert list(codes) == [0x7FC0, 0xFFC0, 0x7FC0, 0xFFC1, 0x7F80, 0xFF80]
    assert not res.any() and energy == 0.0
    assert [codec.f32_to_bf16(v) for v in x] == list(codes)


def test_bf16_overflows_to_inf_as_ieee_does():
    x = np.array([0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000], np.uint32).view(np.float32)
    codes, res, energy = encode(x, "bf16", F32(1.0))
    assert list(codes) == [0x7F7F, 0x7F80, 0x7F80, 0xFF80]
    # A finite value sent as inf: its residual is -inf, and the energy inf.
    assert res[0] == x[0] - F32(3.3895314e38) and res[1] == -np.inf and res[3] == np.inf
    assert energy == np.inf


def test_negative_zero():
    x = np.array([-0.0], np.float32)
    assert codec.f32_to_e4m3(x[0]) == 0x80 and codec.f32_to_bf16(x[0]) == 0x8000
    for fmt in ("bf16", "e4m3"):
        codes, res, _ = encode(x, fmt, F32(1.0))
        assert np.signbit(decode(codes, F32(1.0))[0]) and bits(res)[0] == 0
