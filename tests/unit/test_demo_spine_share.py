"""The testbed demo's measure of where ECMP put gloo's ring: pure arithmetic on port counters."""

from __future__ import annotations

import pytest
from gradlane.bench.demo.testbed import free_spine_share, spine_bytes


def test_spine_bytes_sums_each_spines_ports_toward_the_leaves():
    stats = {
        "p-s0/l0": {"link": "spine0->leaf0", "sent_bytes": 100},
        "p-s0/l1": {"link": "spine0->leaf1", "sent_bytes": 50},
        "p-s1/l0": {"link": "spine1->leaf0", "sent_bytes": 7},
        "p-l0/s0": {"link": "leaf0->spine0", "sent_bytes": 1000},  # a leaf's uplink: not counted
        "p-l0/h0": {"link": "leaf0->host0.p0", "sent_bytes": 1000},
    }
    assert spine_bytes(stats) == {0: 150, 1: 7}


def test_free_spine_share_of_a_ring_all_reduce():
    world, grad, steps, mtu = 4, 4_500_000, 10, 9000
    ring = steps * 2 * (world - 1) * grad  # payload bytes gloo's ring moves
    on_wire = ring * (mtu + 14) / (mtu - 52)  # in MTU-sized TCP segments, as htb counts
    assert free_spine_share(round(on_wire), steps, world, grad, mtu) == pytest.approx(1.0)
    assert free_spine_share(round(on_wire / 2), steps, world, grad, mtu) == pytest.approx(0.5)
    assert free_spine_share(0, steps, world, grad, mtu) == 0.0
    assert free_spine_share(2 * round(on_wire), steps, world, grad, mtu) == 1.0  # clamped
    assert free_spine_share(10, 0, world, grad, mtu) is None
