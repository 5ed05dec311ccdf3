"""The testbed's pure parts: spec validation, the tc lines it writes, parsing tc's counters."""

from __future__ import annotations

import json
import re

import pytest
from gradlane.bench.testbed.crosstraffic import FlowSpec
from gradlane.bench.testbed.impair import ImpairSpec
from gradlane.bench.testbed.netns import ECMP_IFNAME, TestbedSpec, ip_plan, path_addr
from gradlane.bench.testbed.tc import PortShape, class_table, parse_qdisc_stats, port_commands
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.errors import ConfigError


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"hosts": 1}, "hosts"),
        ({"spines": 0}, "spines"),
        ({"link_mbit": 0.5}, "link_mbit"),
        ({"queue_packets": 4}, "queue_packets"),
        ({"prefix": "Gl"}, "prefix"),
        ({"prefix": "gl-1"}, "prefix"),
        ({"prefix": "abcdefghi"}, "prefix"),
        ({"mtu": 4000}, "mtu"),
    ],
)
def test_spec_rejects_bad_values_with_the_field_name(kw, message):
    with pytest.raises(ConfigError, match=message):
        TestbedSpec(**kw)


def test_namespaces_and_addresses_follow_the_documented_plan():
    spec = TestbedSpec(hosts=3, spines=2, prefix="ab")
    hosts, leaves, spines = (
        ["ab-h0", "ab-h1", "ab-h2"],
        ["ab-l0", "ab-l1", "ab-l2"],
        ["ab-s0", "ab-s1"],
    )
    assert spec.namespaces() == [*hosts, *leaves, *spines]
    assert path_addr(1, 2) == "10.200.1.3"


def test_ip_plan_pins_each_path_to_its_spine_and_hashes_the_ecmp_address():
    spec = TestbedSpec(hosts=2, spines=3, prefix="ab")
    links, per_ns = ip_plan(spec)
    assert len(links) == 2 * 2 * 3  # host-leaf and leaf-spine per host and spine
    assert "route add 10.200.2.0/24 via 10.200.66.2 dev e2 src 10.200.2.2" in per_ns["ab-h1"]
    assert "route add 10.200.1.0/24 via 10.200.193.1 dev s1" in per_ns["ab-l0"]
    assert "route add 10.200.0.2/32 via 10.200.128.2 dev l1" in per_ns["ab-s0"]
    ecmp = [ln for ln in per_ns["ab-l0"] if ln.startswith("route add 10.200.100.0/24")]
    assert len(ecmp) == 1 and ecmp[0].count("nexthop") == 3
    every = [ln for lines in per_ns.values() for ln in lines] + links
    rails = [ln for ln in every if re.match(r"link set e\d ", ln)]
    assert len(rails) == 2 * 3 and all("mtu 9000 gso_max_segs 1" in ln for ln in rails)
    assert f"addr add 10.200.100.2/32 dev {ECMP_IFNAME}" in per_ns["ab-h1"]


def test_plain_port_is_one_shaped_class_with_a_packet_queue():
    lines = port_commands("l0", PortShape(1000.0, 500))
    assert lines[0] == "qdisc replace dev l0 root handle 1: htb default 10"
    assert any("classid 1:10 htb rate 1000mbit ceil 1000mbit" in ln for ln in lines)
    assert "qdisc add dev l0 parent 1:10 handle 10: pfifo limit 500" in lines
    assert not any(ln.startswith("filter") for ln in lines)


def test_priority_port_maps_gradlane_dscp_marks_to_classes_with_shrinking_queues():
    shape = PortShape(1000.0, 1000, priority=True)
    table = class_table(shape)
    assert [name for name, _, _ in table] == [
        "dscp46",
        "dscp34",
        "dscp26",
        "best-effort",
        "dscp8",
    ]
    assert [q for _, _, q in table] == [1000, 500, 250, 125, 62]
    lines = port_commands("s1", shape)
    assert lines[0].endswith("htb default 13")  # unmarked traffic: best effort
    tos = [PriorityConfig().tos(c) for c in range(4)]
    for cls, minor in zip(range(4), ("10", "11", "12", "14"), strict=True):
        expect = f"match ip tos {tos[cls]:#04x} 0xfc flowid 1:{minor}"
        assert any(expect in ln for ln in lines), expect
    prios = [ln.split(" prio ")[1] for ln in lines if "parent 1:1 " in ln]
    assert prios == ["0", "1", "2", "3", "4"]


def test_parse_qdisc_stats_reports_ports_and_classes():
    shape = PortShape(100.0, 64, priority=True)
    text = json.dumps(
        [
            {"kind": "htb", "handle": "1:", "dev": "s0", "root": True, "bytes": 900, "packets": 9}
            | {"drops": 3, "overlimits": 5, "backlog": 0, "qlen": 0},
            {"kind": "pfifo", "handle": "14:", "dev": "s0", "parent": "1:14", "bytes": 100}
            | {"packets": 1, "drops": 3, "overlimits": 0, "backlog": 0, "qlen": 0},
            {"kind": "noqueue", "handle": "0:", "dev": "lo", "root": True, "bytes": 0},
        ]
    )
    ports = parse_qdisc_stats(text, {"s0": shape})
    assert set(ports) == {"s0"}
    assert ports["s0"]["drops"] == 3 and ports["s0"]["sent_packets"] == 9
    assert ports["s0"]["classes"]["dscp8"]["drops"] == 3
    with pytest.raises(ValueError, match="JSON"):
        parse_qdisc_stats("qdisc htb 1: root", {"s0": shape})


@pytest.mark.parametrize(
    "kw",
    [
        {"proto": "sctp"},
        {"pattern": "bursty"},
        {"rate_mbit": None, "proto": "udp"},
        {"src": 1, "dst": 1},
        {"dscp": 64},
        {"on_s": 0.0},
    ],
)
def test_flow_spec_rejects_bad_values(kw):
    with pytest.raises(ConfigError):
        FlowSpec(**kw)


def test_impair_spec_needs_an_impairment_and_sane_values():
    with pytest.raises(ConfigError, match="needs loss"):
        ImpairSpec()
    with pytest.raises(ConfigError, match="loss"):
        ImpairSpec(loss=1.0)
    with pytest.raises(ConfigError, match="delay_ms"):
        ImpairSpec(delay_ms=-1.0)
    assert ImpairSpec(loss=0.01).loss == 0.01
