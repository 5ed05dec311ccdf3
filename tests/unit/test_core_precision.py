"""Lossy wire formats through the sans-I/O cores wired in memory: every replica holds the same
result, close to the exact sum; protected chunks stay float32; error feedback makes up over
steps what the rounding removed; the reports count bytes per format and the error; the
adaptive level follows exposed communication and the error bound; hostile lossy packets are
counted drops.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.precision import PrecisionConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.collective import shard_bounds
from gradlane.transport.core.events import AllReduceComplete, SenderReport
from gradlane.transport.core.wire_precision import RESIDUAL_STEPS, WirePrecision
from gradlane.transport.wire.header import DType, Header, Kind, Phase, Reason, encode

from tests.support.cores import header_of, make, random_datas, run_allreduce
from tests.support.wire import Wire


def _lossy(world: int, policy: str, **precision: object) -> list:
    return make(world, precision=PrecisionConfig(policy=policy, **precision))


def _formats_seen(wire_log: list, phase: Phase) -> set[int]:
    return {int(h["dtype"]) for h in wire_log if int(h["phase"]) == phase}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(("policy", "rtol"), [("bf16", 2e-2), ("e4m3", 0.15)])
def test_every_replica_holds_the_same_result_close_to_the_sum(world, policy, rtol):
    n = 3000
    datas = random_datas(world, n, seed=world)
    eps = _lossy(world, policy)
    drop_rng = np.random.default_rng(5)
    seen: list = []

    def drop(src, dg, q):
        h = header_of(dg)
        if int(h["kind"]) == Kind.DATA:
            seen.append(h)
        return bool(drop_rng.random() < 0.1)

    wire = Wire(eps, jitter=100e-6, seed=world, drop=drop)
    out = run_allreduce(eps, datas, wire)
    exact = np.sum(datas, axis=0, dtype=np.float64)
    results = [out[r].result for r in range(world)]
    for r in range(world):
        assert isinstance(out[r], AllReduceComplete)
        assert out[r].report.delivered_fraction == 1.0
        # Bit for bit the same on every rank: owners keep what they gather to the others.
        assert np.array_equal(results[r].view(np.uint32), results[0].view(np.uint32))
    err = np.linalg.norm(results[0] - exact) / np.linalg.norm(exact)
    assert 0 < err < rtol
    want = DType.BF16 if policy == "bf16" else DType.E4M3
    for phase in (Phase.REDUCE, Phase.GATHER):
        assert want in _formats_seen(seen, phase)
    snd = out[0].report.sender
    assert snd.format_bytes[1 if policy == "bf16" else 2] > 0
    assert 0 < snd.compressed_share <= 1.0 and snd.rel_error > 0


def test_protected_chunks_travel_float32_and_the_rest_in_fewer_bits():
    world, n = 2, 4096
    datas = random_datas(world, n, seed=1)
    eps = _lossy(world, "e4m3")
    seen: list = []
    wire = Wire(eps, drop=lambda s, dg, q: bool(seen.append(header_of(dg))))
    out = run_allreduce(eps, datas, wire)
    data_rows = [h for h in seen if int(h["kind"]) == Kind.DATA]
    protected = [h for h in data_rows if int(h["flags"]) & 2]
    assert protected and all(int(h["dtype"]) == DType.F32 for h in protected)
    rest = [h for h in data_rows if not int(h["flags"]) & 2]
    assert rest and all(int(h["dtype"]) == DType.E4M3 for h in rest)
    # An E4M3 payload is a quarter of the float32 one: the bytes per format say so.
    fb = out[0].report.sender.format_bytes
    assert fb[2] > 0 and fb[0] > 0 and fb[1] == 0


def test_the_default_policy_sends_float32_and_every_rank_holds_the_same_sum():
    world, n = 3, 2000
    datas = random_datas(world, n, seed=2)
    eps = make(world)
    out = run_allreduce(eps, datas, Wire(eps))
    exact = (datas[0] + datas[1]) + datas[2]
    for r in range(world):
        rep = out[r].report.sender
        assert rep.format_bytes[1] == rep.format_bytes[2] == 0 and rep.compressed_share == 0.0
        # The two other shards to their owners, then this rank's own shard to both peers.
        b = shard_bounds(n, world)
        sizes = np.diff(b)
        sent = 4 * (int(sizes.sum()) - int(sizes[r]) + (world - 1) * int(sizes[r]))
        assert rep.format_bytes[0] == sent and rep.err2 == rep.norm2 == 0.0
        assert np.array_equal(out[r].result.view(np.uint32), out[0].result.view(np.uint32))
        np.testing.assert_allclose(out[r].result, exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_makes_up_over_steps_what_rounding_removed(feedback):
    """The same gradient every step: with feedback the mean result over the steps tends to
    the exact sum (the residual carries what each step's rounding removed); without it, every
    step rounds the same way and the mean keeps that error."""
    world, n, steps = 2, 1500, 24
    datas = random_datas(world, n, seed=3)
    eps = _lossy(world, "e4m3", error_feedback=feedback)
    wire = Wire(eps)
    exact = np.sum(datas, axis=0, dtype=np.float64)
    acc = np.zeros(n)
    for s in range(1, steps + 1):
        out = run_allreduce(eps, datas, wire, step=s)
        acc += out[0].result
    err_mean = np.linalg.norm(acc / steps - exact) / np.linalg.norm(exact)
    err_one = np.linalg.norm(out[0].result - exact) / np.linalg.norm(exact)
    if feedback:
        assert err_mean < 0.2 * err_one
    else:
        assert err_mean > 0.9 * err_one


def _report(err2: float, norm2: float) -> SenderReport:
    return SenderReport(err2=err2, norm2=norm2)


def test_the_adaptive_level_rises_while_communication_is_exposed_and_falls_on_error():
    wp = WirePrecision(TransportConfig(precision=PrecisionConfig(policy="adaptive")))
    assert wp.level == 0.0 and wp.policy.lossy
    t = 0.0
    # Each step: buckets start over 10 ms, the last ends 40 ms after the last start (exposed).
    for step in range(1, 6):
        for b in range(3):
            wp.on_start(step, t + b * 0.005)
        for _ in range(3):
            wp.on_end(step, t + 0.05, _report(1e-6, 1.0))
        t += 0.1
    levels_up = wp.level
    assert levels_up > 0.5
    # The error over the bound: the level comes down.
    for step in range(6, 9):
        wp.on_start(step, t)
        wp.on_end(step, t + 0.05, _report(0.25, 1.0))
        t += 0.1
    wp.on_start(9, t)
    assert wp.level < levels_up


def test_a_fixed_policy_has_no_controller_and_f32_no_feedback():
    fixed = WirePrecision(TransportConfig(precision=PrecisionConfig(policy="bf16")))
    assert fixed.controller is None and fixed.feedback and fixed.level == 0.0
    plain = WirePrecision(TransportConfig())
    assert not plain.policy.lossy and not plain.feedback
    assert not plain.applies(DType.F32, False, 2)
    assert fixed.applies(DType.F32, False, 2) and not fixed.applies(DType.BF16, False, 2)


def test_the_residual_resets_when_the_bucket_layout_changes_and_goes_when_unused():
    wp = WirePrecision(TransportConfig(precision=PrecisionConfig(policy="e4m3")))
    a = np.ones(10, dtype=np.float32)
    src, res = wp.contribution(1, 0, a)
    assert res is not None and np.array_equal(src, a)
    res[:] = 0.5
    src, res2 = wp.contribution(2, 0, a)
    assert res2 is res and np.array_equal(src, a + 0.5)
    src, res3 = wp.contribution(3, 0, np.ones(12, dtype=np.float32))
    assert res3 is not None and res3.shape == (12,) and not res3.any()
    # Bucket 1 contributes once; bucket 0 goes on: after RESIDUAL_STEPS more steps, bucket 1's
    # residual is gone (a fresh zero buffer if it comes back).
    _, r1 = wp.contribution(3, 1, a)
    assert r1 is not None
    r1[:] = 2.0
    for step in range(4, 4 + RESIDUAL_STEPS + 1):
        wp.contribution(step, 0, np.ones(12, dtype=np.float32))
    _, back = wp.contribution(4 + RESIDUAL_STEPS + 1, 1, a)
    assert back is not None and back is not r1 and not back.any()


@pytest.mark.parametrize("aux", [0, 0x7F800000, 0x7FC00000, 0x80000001])
def test_an_e4m3_packet_with_a_bad_scale_is_a_counted_drop(aux):
    world, n = 2, 256
    datas = random_datas(world, n, seed=4)
    eps = _lossy(world, "e4m3")
    for r, ep in enumerate(eps):
        ep.start(1, 0, datas[r], layer_position=0.5, now=0.0)
    h = Header(kind=Kind.DATA, dtype=DType.E4M3, job=eps[0].config.job, step=1, bucket=0,
               shard=0, src=1, dst=0, chunk=0, count=64, phase=Phase.REDUCE, aux=aux)  # fmt: skip
    counters = eps[0].endpoint.counters
    before = counters.copy()
    eps[0].receive_datagram(encode(h, np.zeros(64, dtype=np.uint8)), 0, 0.0)
    eps[0].datagrams_to_send(0.0)
    assert {Reason(i): int(v) for i, v in enumerate(counters - before) if v} == {
        Reason.BAD_DTYPE: 1
    }
    # The same chunk with a good scale is taken.
    good = encode(h.with_(aux=int(np.float32(0.5).view(np.uint32))), np.zeros(64, np.uint8))
    eps[0].receive_datagram(good, 0, 0.0)
    eps[0].datagrams_to_send(0.0)
    assert int(counters[Reason.OK]) == int(before[Reason.OK]) + 1


def test_an_e4m3_chunk_of_a_16bit_transfer_is_a_counted_drop():
    world, n = 2, 256
    words = [np.zeros(n, dtype=np.uint16) for _ in range(world)]
    eps = make(world)
    for r, ep in enumerate(eps):
        ep.start(1, 0, words[r], layer_position=0.5, now=0.0, dtype=DType.BF16)
    count = 128  # a 16-bit transfer's chunk of 256 bytes
    h = Header(kind=Kind.DATA, dtype=DType.E4M3, job=eps[0].config.job, step=1, bucket=0, shard=0,
               src=1, dst=0, chunk=0, count=count, phase=Phase.REDUCE,
               aux=int(np.float32(1.0).view(np.uint32)))  # fmt: skip
    counters = eps[0].endpoint.counters
    before = counters.copy()
    eps[0].receive_datagram(encode(h, np.zeros(count, dtype=np.uint8)), 0, 0.0)
    eps[0].datagrams_to_send(0.0)
    assert int(counters[Reason.BAD_DTYPE]) == int(before[Reason.BAD_DTYPE]) + 1
