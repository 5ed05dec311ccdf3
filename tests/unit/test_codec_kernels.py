"""The wire formats' conversions (transport/kernels/_codec.py) against their NumPy reference
(tests/support/naive.py: E4M3 by search over the 256 codes' values, not by bits) and torch's
float8_e4m3fn and bfloat16 as an independent oracle where their semantics agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gradlane.transport.kernels import _codec as codec
from gradlane.transport.wire.header import DType
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.support import naive
from tests.support.kernel_inputs import SETTINGS

FLOATS = hnp.arrays(
    np.float32,
    st.integers(0, 300),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
)


def _encode(x: np.ndarray, fmt: int, scale: np.float32) -> tuple:
    res = np.empty_like(x)
    if fmt == DType.BF16:
        codes = np.empty(x.shape, np.uint16)
        err2 = codec.encode_bf16(x, codes, res)
        dec = np.empty_like(x)
        codec.decode_bf16(dec, codes)
    else:
        codes = np.empty(x.shape, np.uint8)
        err2 = codec.encode_e4m3(x, codes, scale, res)
        dec = np.empty_like(x)
        codec.decode_e4m3(dec, codes, scale)
    return codes, dec, res, err2


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@given(x=FLOATS, fmt=st.sampled_from([DType.BF16, DType.E4M3]))
@SETTINGS
def test_the_kernels_equal_the_reference(x, fmt):
    scale = np.float32(codec.e4m3_scale(x))
    assert scale == naive.e4m3_scale(x)
    codes, dec, res, err2 = _encode(x, fmt, scale)
    ref_codes, ref_dec, ref_res, ref_err2 = naive.encode_ref(x, fmt, scale)
    assert np.array_equal(codes, ref_codes)
    assert _same_bits(dec, ref_dec)
    assert _same_bits(res, ref_res)
    assert err2 == pytest.approx(ref_err2, rel=1e-5, abs=1e-30)
    # Adding decodes exactly what decoding then adding gives.
    acc = np.full(x.shape, 0.5, np.float32)
    if fmt == DType.BF16:
        codec.add_bf16(acc, codes)
    else:
        codec.add_e4m3(acc, codes, scale)
    assert _same_bits(acc, (np.float32(0.5) + ref_dec).astype(np.float32))


@given(x=FLOATS)
@SETTINGS
def test_against_torch_where_it_agrees(x):
    fin = np.isfinite(x)
    got16 = np.empty(x.shape, np.uint16)
    codec.encode_bf16(x, got16, np.empty(0, np.float32))
    ref16 = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got16[fin], ref16[fin])
    got8 = np.empty(x.shape, np.uint8)
    codec.encode_e4m3(x, got8, np.float32(1.0), np.empty(0, np.float32))
    ref8 = torch.from_numpy(x.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    inside = fin & (np.abs(x) <= 448)  # torch gives NaN past 448; the codec saturates
    assert np.array_equal(got8[inside], ref8[inside])


def test_round_trip_error_bounds():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(100_000) * np.exp(rng.uniform(-8, 8, 100_000))).astype(np.float32)
    _, dec, res, _ = _encode(x, DType.BF16, np.float32(1.0))
    assert np.all(np.abs(res) <= np.abs(x) * 2.0**-8)  # half a unit of 8 significant bits
    assert _same_bits((dec + res).astype(np.float32), x)  # the residual is exact
    scale = np.float32(codec.e4m3_scale(x))
    _, dec, res, _ = _encode(x, DType.E4M3, scale)
    y = np.abs(x / scale)
    normal = y >= 2.0**-6
    assert np.all(np.abs(res[normal]) <= np.abs(x[normal]) * 2.0**-4 * 1.0001)
    assert np.all(np.abs(res[~normal]) <= 2.0**-10 * scale * 1.0001)
    assert _same_bits((dec + res).astype(np.float32), x)


def test_edge_cases():
    z = np.zeros(16, np.float32)
    assert codec.e4m3_scale(z) == 1.0
    codes, dec, res, err2 = _encode(z, DType.E4M3, np.float32(1.0))
    assert not codes.any() and not dec.any() and err2 == 0.0
    one = np.array([3.0], np.float32)
    scale = np.float32(codec.e4m3_scale(one))
    codes, dec, _, _ = _encode(one, DType.E4M3, scale)
    assert codes[0] == 0x7E and dec[0] == pytest.approx(3.0, rel=1e-6)
    edge = np.array([448, -448, 464, 1e30, -np.inf, np.inf, np.nan, -0.0], np.float32)
    codes, _, res, _ = _encode(edge, DType.E4M3, np.float32(1.0))
    assert list(codes) == [0x7E, 0xFE, 0x7E, 0x7E, 0xFE, 0x7E, 0x7F, 0x80]
    assert res[4] == 0 and res[5] == 0 and res[6] == 0
    _, dec, _, _ = _encode(np.array([np.inf, -np.inf, np.nan, 3.4e38], np.float32), DType.BF16, 1)
    assert dec[0] == np.inf and dec[1] == -np.inf and np.isnan(dec[2]) and dec[3] == np.inf
    # The decoder's values are the table's, for every code.
    all_codes = np.arange(256, dtype=np.uint8)
    out = np.empty(256, np.float32)
    codec.decode_e4m3(out, all_codes, np.float32(1.0))
    assert _same_bits(out, codec.E4M3_TABLE)
