"""Send order at the sender core: what goes first, and how long a paced send waits.

* ``flat`` (priority off) serves transfers in the order they started; the default policy
  puts a front-layer bucket first (its ``send_position`` is its layer position).
* Class 0 never waits in the sender for a whole pacing quantum: it waits for one datagram's
  tokens, so the switches' priority queues, not the sender, hold it.
* Bulk sends wait for a quantum at the paths' pacers as at the NIC's (fewer passes, same rate),
  a transfer's short tail for its own size, and no wait ever fires without sending.
* A collective's reduce data to a peer goes before its gather data to that peer, whatever the
  chunks' classes; under a NIC cap, its reduce data to any peer goes before its gather data.
* An older step's data goes before a newer step's, whatever the classes: nothing of the newer
  step takes tokens while the older step's data to that peer waits for them.
* Under a NIC cap a step's reduce data goes before its gather data across buckets (class 0
  excepted), so the gathers of complete buckets are left to fill the links at the end.
* One bucket's shards to their owners go out at one pace (the least advanced first), not the
  lowest-numbered owner's whole shard first.
* With a quantum that follows loss, a loss halves the next bursts, and they grow back.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.pacing import PacingConfig
from gradlane.scheduling.priority import PriorityConfig, make_priority_policy
from gradlane.transport.core.events import DatagramRun
from gradlane.transport.core.outgoing import OutKey
from gradlane.transport.wire.header import HEADER_SIZE, DType, Phase

from tests.support.cores import make

#: Byte of the header that holds the bucket (see test_core's use of the same offset).
_BUCKET_BYTE = 16


def _bucket_order(ep, now: float = 0.0) -> list[int]:
    """Buckets of the DATA runs one sending pass hands out, in order, repeats collapsed."""
    order: list[int] = []
    for item in ep.datagrams_to_send(now):
        if isinstance(item, DatagramRun):
            hdr = np.frombuffer(item.hdr, np.uint8).reshape(-1, HEADER_SIZE)[item.chunks]
            for b in hdr[:, _BUCKET_BYTE].tolist():
                if not order or order[-1] != b:
                    order.append(b)
    return order


@pytest.mark.parametrize(("policy", "first"), [("flat", 0), ("layer+magnitude", 1)])
def test_flat_serves_in_start_order_and_the_default_front_layers_first(policy, first):
    eps = make(2, chunk_bytes=256, priority=PriorityConfig(policy=policy))
    rng = np.random.default_rng(3)
    for bucket, pos in ((0, 0.9), (1, 0.1)):  # a back layer's bucket starts first
        eps[0].start(1, bucket, rng.standard_normal(4000).astype(np.float32), pos, now=0.0)
    order = _bucket_order(eps[0])
    assert order[0] == first, order
    if policy == "flat":  # FIFO throughout: the whole first bucket, then the second
        assert order == [0, 1], order


def test_send_position_is_the_layer_position_except_for_flat():
    default = make_priority_policy(PriorityConfig())
    flat = make_priority_policy(PriorityConfig(policy="flat"))
    assert [default.send_position(p) for p in (0.0, 0.25, 1.0)] == [0.0, 0.25, 1.0]
    assert [flat.send_position(p) for p in (0.0, 0.25, 1.0)] == [0.0, 0.0, 0.0]


def _paced(**cfg):
    """Two cores whose rank 0 sends through a slow NIC pacer (a burst of some 26 datagrams) in
    quanta of 16 datagrams; ticks far apart, so the sender's timer is its pacing release."""
    return make(
        2,
        chunk_bytes=256,
        pacing=PacingConfig(burst_bytes=8192),
        nic_rate_Bps=2_000_000.0,
        tx_quantum_packets=16,
        tick_s=0.5,
        priority=PriorityConfig(policy="layer"),
        **cfg,
    )


def _bulk_sent(seed: int):
    """``_paced`` cores whose rank 0 has started a back-layer bucket and sent the NIC's burst
    of it; with rank 0's sender, the datagram slot and the NIC rate."""
    eps = _paced()
    rng = np.random.default_rng(seed)
    eps[0].start(1, 0, rng.standard_normal(20_000).astype(np.float32), 0.9, now=0.0)
    assert _bucket_order(eps[0], 0.0) == [0]  # the NIC's burst went; its tokens are spent
    return eps, eps[0].endpoint.sender, eps[0].config.slot_bytes, eps[0].config.nic_rate_Bps


def test_class_0_waits_for_one_datagram_of_tokens_not_a_quantum():
    eps, sender, slot, rate = _bulk_sent(4)
    rng = np.random.default_rng(4)
    bulk_wait = sender.get_timer()
    assert bulk_wait is not None and bulk_wait >= 15 * slot / rate  # a whole quantum
    # A pinned (class 0) bucket arrives: the next send waits for one datagram's tokens only.
    eps[0].start(1, 1, rng.standard_normal(2_000).astype(np.float32), 0.0, now=0.0, pinned=True)
    assert _bucket_order(eps[0], 0.0) == []  # still no tokens at all
    urgent_wait = sender.get_timer()
    assert urgent_wait is not None and urgent_wait <= 2 * slot / rate < bulk_wait
    # Once that datagram's tokens are in, class 0 goes, ahead of the bulk bucket.
    order = _bucket_order(eps[0], urgent_wait)
    assert order and order[0] == 1, order


def test_without_class_0_the_quantum_still_batches_sends():
    """The bulk path keeps its batching: tokens for less than a quantum send nothing."""
    eps, sender, slot, rate = _bulk_sent(5)
    assert _bucket_order(eps[0], 2 * slot / rate) == []  # two datagrams' tokens: wait on
    wake = sender.get_timer()
    assert wake is not None and wake >= 15 * slot / rate


def test_urgency_orders_waiting_requests_pinned_then_front_layers_then_arrival():
    """The start order both planes use for requests that wait together (a stable sort)."""
    from gradlane.transport.drivers.futures import CollectiveRequest, urgency

    x = np.zeros(4, np.float32)
    asks = [(0, 0.9, False), (1, 0.2, False), (2, 0.9, True), (3, 0.2, False), (4, 0.5, True)]
    reqs = [CollectiveRequest(1, b, x, layer_position=pos, pinned=p) for b, pos, p in asks]
    default = make_priority_policy(PriorityConfig())
    flat = make_priority_policy(PriorityConfig(policy="flat"))
    assert [r.bucket for r in sorted(reqs, key=lambda r: urgency(r, default))] == [4, 2, 1, 3, 0]
    assert [r.bucket for r in sorted(reqs, key=lambda r: urgency(r, flat))] == [2, 4, 0, 1, 3]


def _path_paced(burst_packets: int, **cfg):
    """Two cores whose rank 0 is paced by its per-path pacers only (no NIC cap), in quanta of
    8 datagrams, with buckets of ``burst_packets`` datagrams' worth of tokens."""
    slot = 256 + HEADER_SIZE
    return make(
        2,
        chunk_bytes=256,
        pacing=PacingConfig(
            controller="fixed", initial_rate_Bps=1_000_000.0, burst_bytes=burst_packets * slot
        ),
        tx_quantum_packets=8,
        tick_s=0.5,
        priority=PriorityConfig(policy="layer"),
        **cfg,
    )


def _sent(ep, now: float) -> int:
    """Datagrams of DATA one sending pass hands out."""
    return sum(len(x) for x in ep.datagrams_to_send(now) if isinstance(x, DatagramRun))


def test_path_pacers_batch_sends_as_the_nic_does():
    """Without a NIC cap, a wake-up with tokens for less than a quantum (an ACK, a read) sends
    nothing; the timer waits for the quantum, and then a whole quantum goes."""
    eps = _path_paced(32)
    sender, slot = eps[0].endpoint.sender, eps[0].config.slot_bytes
    rng = np.random.default_rng(6)
    eps[0].start(1, 0, rng.standard_normal(20_000).astype(np.float32), 0.9, now=0.0)
    assert _sent(eps[0], 0.0) == 32  # the full bucket
    rate = 1_000_000.0
    assert _sent(eps[0], 3 * slot / rate) == 0  # three datagrams' tokens: wait on
    wake = sender.get_timer()
    assert wake is not None and 7 * slot / rate <= wake <= 9 * slot / rate
    assert 8 <= _sent(eps[0], wake) <= 9


def test_a_transfer_tail_shorter_than_a_quantum_waits_for_its_own_size_only():
    eps = _path_paced(32)
    sender, slot = eps[0].endpoint.sender, eps[0].config.slot_bytes
    rng = np.random.default_rng(7)
    # The peer's shard is half the bucket: 35 datagrams of 64 floats.
    eps[0].start(1, 0, rng.standard_normal(2 * 64 * 35).astype(np.float32), 0.9, now=0.0)
    assert _sent(eps[0], 0.0) == 32  # 35 datagrams: 3 left, fewer than a quantum
    wake = sender.get_timer()
    assert wake is not None and wake <= 2 * slot / 1_000_000.0
    assert _sent(eps[0], wake) >= 1


def _sends_without_spinning(eps, seed: int) -> None:
    """Rank 0 starts a back-layer bucket; over 20 wake-ups every wait moves the clock on (a
    wait that never came true would fire again at once) and data goes out."""
    sender = eps[0].endpoint.sender
    rng = np.random.default_rng(seed)
    eps[0].start(1, 0, rng.standard_normal(20_000).astype(np.float32), 0.9, now=0.0)
    now, sent = 0.0, 0
    for _ in range(20):
        sent += _sent(eps[0], now)
        wake = sender.get_timer()
        assert wake is not None and wake > now
        now = wake
    assert sent >= 20


def test_a_bucket_shallower_than_a_quantum_never_spins():
    """Tokens can never reach a quantum when the bucket holds less: the wait is for the full
    bucket, and then it sends (a wait that never came true would fire again at once)."""
    eps = _path_paced(3)
    _sends_without_spinning(eps, seed=8)


def test_a_nic_bucket_shallower_than_a_quantum_never_spins():
    """The same under a NIC cap whose bucket holds less than a quantum (4 datagrams here, 16
    per quantum): the pass waits for the NIC's full bucket, and then it sends."""
    slot = 256 + HEADER_SIZE
    eps = make(
        2,
        chunk_bytes=256,
        pacing=PacingConfig(burst_bytes=3 * slot),
        nic_rate_Bps=1_000_000.0,
        tx_quantum_packets=16,
        tick_s=0.5,
        priority=PriorityConfig(policy="layer"),
    )
    _sends_without_spinning(eps, seed=9)


#: Bytes of the header that hold the phase and the step's low byte (HEADER_DTYPE's offsets).
_PHASE_BYTE = 7
_STEP_BYTE = 12
_DST_BYTE = 22


def _header_runs(ep, now: float, byte: int) -> list[int]:
    """Header byte ``byte`` of each DATA datagram one sending pass hands out, in order."""
    values: list[int] = []
    for item in ep.datagrams_to_send(now):
        if isinstance(item, DatagramRun):
            hdr = np.frombuffer(item.hdr, np.uint8).reshape(-1, HEADER_SIZE)[item.chunks]
            values += hdr[:, byte].tolist()
    return values


def _sent_until(ep, n: int, byte: int = _PHASE_BYTE) -> list[int]:
    """Header byte ``byte`` (default: the phase) of the first ``n`` DATA datagrams ``ep`` sends, its
    sender's timer driving the clock (it must get there: every wait ends in a send)."""
    sender, now, values = ep.endpoint.sender, 0.0, []
    for _ in range(10 * n):
        values += _header_runs(ep, now, byte)
        wake = sender.get_timer()
        if wake is None or len(values) >= n:
            break
        now = max(wake, now)
    assert len(values) == n, values
    return values


@pytest.mark.parametrize(
    ("first", "second"), [(Phase.REDUCE, Phase.GATHER), (Phase.PUSH, Phase.PULL)]
)
def test_a_collective_s_reduce_data_to_a_peer_goes_before_its_gather_whatever_the_classes(
    first, second
):
    """The peer starts its gather only once every rank's reduce data has come: a rank's
    pinned (class 0) gather chunks wait behind its least important reduce chunks to that peer,
    and go as soon as those have all been sent (not acknowledged)."""
    eps = _path_paced(8)
    sender = eps[0].endpoint.sender
    rng = np.random.default_rng(9)
    shard = rng.standard_normal(64 * 20).astype(np.float32)
    sender.start(OutKey(1, 0, 1, first, 1), shard, DType.F32, 0.9, 0.0)
    sender.start(OutKey(1, 0, 0, second, 1), shard.copy(), DType.F32, 0.9, 0.0, pinned=True)
    phases = _sent_until(eps[0], 40)
    assert phases == [int(first)] * 20 + [int(second)] * 20, phases


def _three_ranks(nic: bool):
    """Three cores whose per-peer pacers start full (1 MB/s each), with or without a NIC cap at
    the same rate, sending one datagram per batch; ticks far apart."""
    cfg = {"nic_rate_Bps": 1_000_000.0} if nic else {}
    return make(
        3,
        chunk_bytes=256,
        pacing=PacingConfig(controller="fixed", initial_rate_Bps=1_000_000.0, burst_bytes=1 << 20),
        tx_quantum_packets=1,
        tick_s=0.5,
        priority=PriorityConfig(policy="layer"),
        **cfg,
    )


@pytest.mark.parametrize("nic", [True, False], ids=["nic-cap", "no-nic-cap"])
def test_under_a_nic_cap_the_reduce_data_to_any_peer_goes_before_the_gather(nic):
    """With one NIC rate for every peer, the gather to one peer would take that rate from the
    reduce data another peer waits on: it waits too. Without a NIC cap each peer has its own
    pacers, so the gather to another peer goes at once (its class 0 first)."""
    eps = _three_ranks(nic)
    sender = eps[0].endpoint.sender
    rng = np.random.default_rng(10)
    shard = rng.standard_normal(64 * 20).astype(np.float32)
    sender.start(OutKey(1, 0, 2, Phase.REDUCE, 2), shard, DType.F32, 0.9, 0.0)
    sender.start(OutKey(1, 0, 0, Phase.GATHER, 1), shard.copy(), DType.F32, 0.9, 0.0, pinned=True)
    phases = _sent_until(eps[0], 40)
    assert sorted(phases) == [0] * 20 + [1] * 20, phases
    if nic:
        assert phases == [0] * 20 + [1] * 20, phases
    else:
        assert phases[0] == int(Phase.GATHER), phases  # pinned, to its own peer's pacers


@pytest.mark.parametrize("nic", [True, False], ids=["nic-cap", "no-nic-cap"])
def test_an_older_step_s_data_goes_before_a_newer_step_s_whatever_the_classes(nic):
    """A rank that completed step 1 starts step 2 while its own gather of step 1 to a peer is
    still going out: the peer cannot use step 2's data before it has finished step 1, so the
    old tail goes first, even against the new step's pinned (class 0) chunks."""
    cfg = {"nic_rate_Bps": 1_000_000.0} if nic else {}
    eps = _path_paced(8, **cfg)
    sender = eps[0].endpoint.sender
    rng = np.random.default_rng(11)
    shard = rng.standard_normal(64 * 20).astype(np.float32)
    sender.start(OutKey(1, 0, 0, Phase.GATHER, 1), shard, DType.F32, 0.9, 0.0)
    sender.start(OutKey(2, 0, 1, Phase.REDUCE, 1), shard.copy(), DType.F32, 0.0, 0.0, pinned=True)
    steps = _sent_until(eps[0], 40, _STEP_BYTE)
    assert steps == [1] * 20 + [2] * 20, steps


def test_one_bucket_s_shards_reach_their_owners_at_one_pace():
    """Under a NIC cap, with every peer's pacers full (as after the idle time between steps),
    start order would give the first owner its whole shard before the last owner got a byte:
    that owner's reduce, then its gather, would end the step late. The least advanced
    transfer goes first instead: every owner is served from the first quanta on and the
    shares sent never differ by more than a quantum."""
    quantum = 4
    eps = make(
        4,
        chunk_bytes=256,
        nic_rate_Bps=1_000_000.0,
        pacing=PacingConfig(controller="fixed", initial_rate_Bps=1_000_000.0, burst_bytes=1 << 20),
        tx_quantum_packets=quantum,
        tick_s=0.5,
        priority=PriorityConfig(policy="flat"),
    )
    sender = eps[0].endpoint.sender
    rng = np.random.default_rng(12)
    for j in (1, 2, 3):
        shard = rng.standard_normal(64 * 20).astype(np.float32)
        sender.start(OutKey(1, 0, j, Phase.REDUCE, j), shard, DType.F32, 0.5, 0.0)
    dsts = _sent_until(eps[0], 60, _DST_BYTE)
    assert sorted(dsts) == [1] * 20 + [2] * 20 + [3] * 20
    assert 3 in dsts[: 3 * quantum], dsts
    for n in range(1, 61):
        counts = [dsts[:n].count(j) for j in (1, 2, 3)]
        assert max(counts) - min(counts) <= quantum, (n, dsts)


@pytest.mark.parametrize("nic", [True, False], ids=["nic-cap", "no-nic-cap"])
def test_under_a_nic_cap_a_step_s_reduce_data_goes_before_other_buckets_gathers(nic):
    """Bucket 0's gather (a middle layer, class 2) would go before bucket 1's reduce data (a
    back layer, class 3) by class; under a NIC cap it waits for it, while bucket 2's pinned
    gather (class 0) still goes first. Without a NIC cap classes decide alone."""
    eps = _three_ranks(nic)
    sender = eps[0].endpoint.sender
    rng = np.random.default_rng(13)
    shard = rng.standard_normal(64 * 10).astype(np.float32)
    sender.start(OutKey(1, 1, 2, Phase.REDUCE, 2), shard, DType.F32, 0.9, 0.0)
    sender.start(OutKey(1, 0, 0, Phase.GATHER, 1), shard.copy(), DType.F32, 0.5, 0.0)
    sender.start(OutKey(1, 2, 0, Phase.GATHER, 2), shard.copy(), DType.F32, 0.5, 0.0, pinned=True)
    buckets = _sent_until(eps[0], 30, _BUCKET_BYTE)
    if nic:
        assert buckets == [2] * 10 + [1] * 10 + [0] * 10, buckets
    else:
        assert buckets == [2] * 10 + [0] * 10 + [1] * 10, buckets


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_loss_halves_the_next_bursts_when_the_quantum_follows_loss(adaptive):
    """With ``tx_quantum_min_packets`` a detected loss halves the quantum (8 → 4 datagrams) and
    the pacers' depths with it (32 → 16): after an idle spell the next pass sends 16 datagrams
    back to back; with a fixed quantum the full 32."""
    extra = {"tx_quantum_min_packets": 2, "tx_quantum_grow_s": 10.0} if adaptive else {}
    eps = _path_paced(32, **extra)
    sender = eps[0].endpoint.sender
    rng = np.random.default_rng(9)
    eps[0].start(1, 0, rng.standard_normal(40_000).astype(np.float32), 0.9, now=0.0)
    assert _sent(eps[0], 0.0) == 32  # the full bucket: 32 datagrams back to back
    (key,) = sender.transfers
    bits = np.zeros(sender.n_chunks(key), dtype=bool)
    bits[0] = True  # the first chunk, overtaken by the 32nd: lost
    sender.on_nack(key, 0, bits, now=1.0, newest=31)
    # Long idle: the bucket is as full as its depth lets it be (the resend goes first).
    assert _sent(eps[0], 2.0) == (16 if adaptive else 32)
    assert eps[0].endpoint.stats()["burst_cuts"] == (1 if adaptive else 0)
    # Grown back (one datagram per 10 s here): the full bursts again.
    assert _sent(eps[0], 2.0 + 10.0 * 4) == 32
