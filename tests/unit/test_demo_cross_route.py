"""The testbed demo's measure of whether ECMP put gloo's ring on the cross traffic's links:
pure arithmetic on switch port counters."""

from __future__ import annotations

import pytest
from gradlane.bench.demo.testbed import route_busy
from gradlane.bench.testbed.crosstraffic import ROUTES, route_flows, route_links
from gradlane.transport.errors import ConfigError


def _stats(sent: dict[str, int]) -> dict[str, dict]:
    return {f"ns/{i}": {"link": link, "sent_bytes": n} for i, (link, n) in enumerate(sent.items())}


def cross_route(src: int, dst: int, spine: int) -> tuple[str, ...]:
    return route_links(route_flows(4, "pair", src, dst), spine)


def test_the_cross_route_names_the_links_link_stats_reports():
    assert cross_route(0, 1, 0) == ("leaf0->spine0", "spine0->leaf1", "leaf1->host1.p0")


def test_a_congested_spine_is_a_ring_that_loads_every_link_of_the_spine_once():
    assert route_flows(4, "spine") == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert route_flows(2, "spine") == [(0, 1), (1, 0)]
    links = route_links(route_flows(4, "spine"), 1)
    assert len(links) == len(set(links)) == 12
    for h in range(4):  # up from each leaf, down to each leaf, and on to each host's rail 1
        assert {f"leaf{h}->spine1", f"spine1->leaf{h}", f"leaf{h}->host{h}.p1"} <= set(links)
    # Only its own links for one pair; and a clear error for what cannot be.
    assert route_flows(3, "pair", 2, 0) == [(2, 0)]
    with pytest.raises(ConfigError, match="route"):
        route_flows(4, "ring")
    with pytest.raises(ConfigError, match="2 hosts"):
        route_flows(1, "spine")


def test_the_demo_offers_exactly_the_routes_the_testbed_knows():
    """The demo's CLI names the routes itself (importing the testbed would slow every command's
    start-up): it must stay in step with the testbed's list."""
    import argparse

    from gradlane.bench.demo.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    action = next(a for a in p._actions if a.dest == "cross_route")
    assert set(action.choices) == set(ROUTES) and action.default in ROUTES


def test_route_busy_is_the_busiest_route_link_over_the_link_rate():
    route = cross_route(0, 1, 0)
    before = _stats(dict.fromkeys([*route, "spine1->leaf2"], 1000))
    mbit, seconds = 200.0, 2.0
    full = int(mbit * 1e6 / 8 * seconds)  # bytes a link sends in that time at its rate
    after = _stats(
        {
            "leaf0->spine0": 1000 + int(0.7 * full),  # the cross traffic alone
            "spine0->leaf1": 1000 + full,  # gloo shared this one
            "leaf1->host1.p0": 1000 + int(0.7 * full),
            "spine1->leaf2": 1000 + full,  # off the route: not counted
        }
    )
    assert route_busy(before, after, route, seconds, mbit) == pytest.approx(1.0, abs=1e-6)
    after["ns/1"]["sent_bytes"] = 1000 + int(0.7 * full)
    assert route_busy(before, after, route, seconds, mbit) == pytest.approx(0.7, abs=1e-6)
    assert route_busy(before, after, route, 0.0, mbit) is None
    assert route_busy(before, after, ("leaf9->spine0",), seconds, mbit) is None
