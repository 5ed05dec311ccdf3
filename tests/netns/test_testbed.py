"""The emulated testbed (netns tier: root, or unprivileged user namespaces; skipped elsewhere).

Every test gets a prefix of its own (pid + counter) and a fixture that sweeps the prefix with
``down_all`` afterwards, so a failing test leaves nothing behind either. Waits poll a condition
(tc counters, a process's output) under a deadline; nothing sleeps to synchronise and nothing
asserts on timing except the lower bound an added delay must respect.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from gradlane.bench.testbed import netns as testbed
from gradlane.bench.testbed.netns import Testbed, TestbedSpec, down_all

pytestmark = pytest.mark.timeout(120)
_counter = itertools.count()
DEADLINE_S = 30.0

ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(2048)
    s.sendto(data, peer)
"""

FLOWS = """
import socket, sys
ok = 0
for i in range(int(sys.argv[4])):  # one socket per flow: a new source port, a new ECMP hash
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((sys.argv[1], 0))
        s.settimeout(2.0)
        s.sendto(b"flow", (sys.argv[2], int(sys.argv[3])))
        try:
            ok += s.recv(16) == b"flow"
        except TimeoutError:
            pass
print(ok)
"""

PROBE = """
import json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
s.settimeout(2.0)
rtts = []
for i in range(int(sys.argv[4])):
    t = time.monotonic()
    s.sendto(b"probe%d" % i, (sys.argv[2], int(sys.argv[3])))
    try:
        data, peer = s.recvfrom(2048)
    except TimeoutError:
        continue
    if data == b"probe%d" % i and peer[0] == sys.argv[2]:
        rtts.append(time.monotonic() - t)
print(json.dumps(rtts))
"""


def _available() -> str:
    try:
        return testbed.privilege()
    except testbed.TestbedUnavailable as exc:
        pytest.skip(f"netns tier: {exc}")


@pytest.fixture
def prefix() -> Iterator[str]:
    """A prefix no other run uses; everything under it is swept after the test, pass or fail."""
    _available()
    name = f"t{os.getpid() % 10000:04d}{next(_counter) % 100:02d}"  # 7 of the 8 characters
    yield name
    down_all(name)
    assert not _names(name), "a test left namespaces behind"


def _names(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [ln.split()[0] for ln in out.stdout.splitlines() if ln.startswith(prefix + "-")]


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False)
    return {ln.split(":")[1].strip().split("@")[0] for ln in out.stdout.splitlines()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes only once reaped; /proc says which it is.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond: Callable[[], Any], what: str) -> Any:
    """Poll ``cond`` until it returns something truthy, or fail after the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _sent(bed: Testbed, port: str) -> int:
    return int(bed.link_stats()[port]["sent_packets"])


def _echo(bed: Testbed, host: int, port: int) -> subprocess.Popen[str]:
    proc = bed.hosts[host].popen(
        [sys.executable, "-c", ECHO, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    testbed.read_ready(proc, DEADLINE_S, "echo server")
    return proc


def _probe(bed: Testbed, src: int, dst: int, path: int, port: int, count: int) -> list[float]:
    here, there = bed.hosts[src].addrs[path], bed.hosts[dst].addrs[path]
    out = bed.hosts[src].run(
        [sys.executable, "-c", PROBE, here, there, str(port), str(count)],
        timeout=DEADLINE_S + 2.0 * count,
        capture_output=True,
        text=True,
        check=True,
    )
    return list(json.loads(out.stdout))


# -- lifecycle ----------------------------------------------------------------------------


def test_up_down_leaves_no_namespace_link_or_process(prefix):
    links_before = _root_links()
    spec = TestbedSpec(hosts=3, spines=2, prefix=prefix)
    with Testbed(spec) as bed:
        if bed.runner.holder_pid is None:  # as root the namespaces are visible by name
            assert sorted(_names(prefix)) == sorted(spec.namespaces())
        assert [h.addrs for h in bed.hosts] == [
            [f"10.200.{p}.{h + 1}" for p in range(2)] for h in range(3)
        ]
        sleeper = bed.hosts[1].popen(["sleep", "600"])
        flow = bed.cross_traffic(1, 50, src=2, dst=0)
        flow_pids = flow.pids
        holder = bed.runner.holder_pid
    assert not _names(prefix)
    assert not _alive(sleeper.pid)
    assert not any(_alive(p) for p in flow_pids)
    assert holder is None or not _alive(holder)
    ours = {f"{kind}{i}" for kind in "ehsl" for i in range(3)} | {"imA", "imB"}
    assert not (_root_links() - links_before) & ours  # no testbed link in the root namespace


def test_down_kills_what_ignores_sigterm_and_what_it_forked(prefix):
    with Testbed(TestbedSpec(hosts=2, spines=1, prefix=prefix)) as bed:
        # The shell ignores SIGTERM and so does its child (ignored signals survive exec).
        stubborn = bed.hosts[0].popen(
            ["sh", "-c", "trap '' TERM; sleep 600 & echo $!; wait"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert stubborn.stdout is not None
        child = int(stubborn.stdout.readline())
    stubborn.stdout.close()
    assert stubborn.returncode is not None  # reaped
    assert not _alive(child)  # swept from the namespace although nobody tracked it
    assert not _names(prefix)


def test_teardown_runs_when_the_body_raises(prefix):
    with pytest.raises(RuntimeError, match="boom"), Testbed(TestbedSpec(prefix=prefix)) as bed:
        sleeper = bed.hosts[0].popen(["sleep", "600"])
        imp = bed.impair(0, loss=0.5)
        raise RuntimeError("boom")
    assert not _names(prefix)
    assert not _alive(sleeper.pid)
    assert imp.stats is not None  # the impairment was stopped by the teardown
    assert not bed.is_up


def test_down_all_sweeps_leftovers_of_its_prefix_only(prefix):
    if testbed.privilege() != "root":
        pytest.skip("leftovers outlive their process only as root (a user namespace dies with it)")
    longer = f"{prefix}x"  # another testbed whose prefix starts with this one
    crashed = Testbed(TestbedSpec(hosts=2, spines=1, prefix=prefix), keep=True).up()
    orphan = crashed.hosts[0].popen(["sleep", "600"])
    bystander = Testbed(TestbedSpec(hosts=2, spines=1, prefix=longer)).up()
    try:
        removed = down_all(prefix)  # as if `crashed` belonged to a process that died
        assert set(TestbedSpec(hosts=2, spines=1, prefix=prefix).namespaces()) <= set(removed)
        assert not _names(prefix)
        assert _names(longer), "down_all removed another prefix's namespaces"
        orphan.wait(DEADLINE_S)  # killed by the sweep
        assert down_all(prefix) == []
    finally:
        bystander.down()
    assert not _names(longer)


# -- paths ---------------------------------------------------------------------------------


def test_every_path_reaches_the_other_host_through_its_own_spine(prefix):
    with Testbed(TestbedSpec(hosts=2, spines=2, prefix=prefix)) as bed:
        _echo(bed, 1, 7000)
        for path in range(2):
            before = {p: _sent(bed, f"{prefix}-s{p}/l1") for p in range(2)}
            rtts = _probe(bed, 0, 1, path, 7000, count=5)
            assert len(rtts) == 5, f"path {path}: {len(rtts)} of 5 echoes came back"
            after = {p: _sent(bed, f"{prefix}-s{p}/l1") for p in range(2)}
            assert after[path] - before[path] >= 5  # the probes crossed spine `path`
            assert after[1 - path] == before[1 - path]  # and not the other one


def test_ecmp_address_spreads_flows_over_the_spines(prefix):
    with Testbed(TestbedSpec(hosts=2, spines=2, prefix=prefix)) as bed:
        h0, h1 = bed.hosts
        assert (h0.ecmp_addr, h1.ecmp_addr) == ("10.200.100.1", "10.200.100.2")
        _echo(bed, 1, 7004)
        before = [_sent(bed, f"{prefix}-s{p}/l1") for p in range(2)]
        out = h0.run(
            [sys.executable, "-c", FLOWS, h0.ecmp_addr, h1.ecmp_addr, "7004", "32"],
            timeout=DEADLINE_S + 64,
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == "32"  # every flow got its echo back
        after = [_sent(bed, f"{prefix}-s{p}/l1") for p in range(2)]
        # 32 flows hashed over 2 spines: both carry some (all on one: probability 2**-31).
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


# -- cross traffic ---------------------------------------------------------------------------


def test_cross_traffic_congests_the_bottleneck_and_tc_counts_the_drops(prefix):
    spec = TestbedSpec(hosts=2, spines=2, link_mbit=100.0, queue_packets=32, prefix=prefix)
    with Testbed(spec) as bed:
        port = f"{prefix}-l0/s0"
        flow = bed.cross_traffic(0, 400.0, proto="udp", src=0, dst=1)
        _wait(lambda: bed.link_stats()[port]["drops"] >= 100, "drops at the bottleneck")
        stats = flow.stop()
        ports = bed.link_stats()
        assert stats["sender"]["bytes"] > stats["sink"]["bytes"] > 0
        # The spine's downlink runs at the same rate, so the first shaped hop takes the drops.
        assert ports[port]["drops"] >= 100
        assert ports[f"{prefix}-s0/l1"]["drops"] == 0
        assert ports[f"{prefix}-l0/s1"]["sent_packets"] == 0  # the other path stayed idle


def test_tcp_cross_traffic_on_off_crosses_its_spine(prefix):
    spec = TestbedSpec(hosts=2, spines=2, link_mbit=200.0, prefix=prefix)
    with Testbed(spec) as bed:
        flow = bed.cross_traffic(1, 100.0, proto="tcp", pattern="onoff", on_s=0.02, off_s=0.02)
        _wait(lambda: _sent(bed, f"{prefix}-s1/l1") >= 500, "TCP segments over spine 1")
        stats = flow.stop()
        assert stats["sink"]["bytes"] > 0
        assert stats["sender"]["bytes"] >= stats["sink"]["bytes"]
        assert _sent(bed, f"{prefix}-s0/l1") < 50  # ARP and nothing else on the other spine


def test_a_congested_spine_carries_cross_traffic_on_every_one_of_its_links(prefix):
    spec = TestbedSpec(hosts=3, spines=2, link_mbit=200.0, prefix=prefix)
    with Testbed(spec) as bed:
        flows = bed.load_spine(0, 50.0)
        assert [(f.spec.src, f.spec.dst) for f in flows] == [(0, 1), (1, 2), (2, 0)]
        ups, downs = (
            [f"{prefix}-l{h}/s0" for h in range(3)],
            [f"{prefix}-s0/l{h}" for h in range(3)],
        )
        _wait(
            lambda: all(_sent(bed, port) >= 300 for port in ups + downs),
            "300 packets on every link of spine 0",
        )
        stats = [f.stop() for f in flows]
        assert all(s["sink"]["bytes"] > 0 for s in stats)
        assert all(_sent(bed, f"{prefix}-s1/l{h}") < 50 for h in range(3))  # spine 1 stayed idle


def test_the_full_load_check_fills_every_spine_link_and_accounts_the_machine(prefix):
    """The self-check's floor: both spines' rings at 98% of a 100 Mbit/s link for a second;
    every byte arrives, every spine port carries most of its link, the CPU split adds up to
    the machine's cores, and nothing is left behind."""
    from gradlane.bench.testbed.selfcheck import full_load

    out = full_load(1.0, prefix, 100.0, hosts=2)
    assert out["flows"] == 4  # a flow each way between the two hosts, on each spine
    assert out["delivered"] >= 0.99, out
    assert out["spine_port_share_min"] >= 0.8, out  # a 1 s window on a shared machine
    assert sum(out["machine_cores"].values()) == pytest.approx(os.cpu_count() or 1, rel=0.01)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    assert prefix not in names.stdout


# -- impairment ------------------------------------------------------------------------------


def test_impairment_drops_about_the_configured_fraction(prefix):
    with Testbed(TestbedSpec(hosts=2, spines=2, prefix=prefix)) as bed:
        into, out = f"{prefix}-l0/s0", f"{prefix}-s0/l1"  # the spine's way in and way out
        before = bed.link_stats()
        imp = bed.impair(0, loss=0.2, seed=7)
        flow = bed.cross_traffic(0, 100.0, proto="udp", src=0, dst=1)
        _wait(lambda: _sent(bed, out) >= 2000, "2000 packets through spine 0")
        flow.stop()
        counts = imp.stop()
        after = bed.link_stats()
        assert counts["received"] >= 2000 and counts["overrun"] == 0
        assert 0.16 <= counts["loss_observed"] <= 0.24, counts
        # The switches agree: what left the spine is what entered it less the drops.
        sent_in = after[into]["sent_packets"] - before[into]["sent_packets"]
        sent_out = after[out]["sent_packets"] - before[out]["sent_packets"]
        assert 0.72 <= sent_out / sent_in <= 0.86, (sent_in, sent_out, counts)
        # Stopped: the kernel forwards again, losslessly.
        _echo(bed, 1, 7001)
        assert len(_probe(bed, 0, 1, 0, 7001, count=20)) == 20


def test_impairment_delay_is_added_on_each_crossing(prefix):
    with Testbed(TestbedSpec(hosts=2, spines=2, prefix=prefix)) as bed:
        _echo(bed, 1, 7002)
        bed.impair(1, delay_ms=15.0)
        slow = _probe(bed, 0, 1, 1, 7002, count=5)
        fast = _probe(bed, 0, 1, 0, 7002, count=5)
        assert len(slow) == 5 and len(fast) == 5
        assert min(slow) >= 0.030  # 15 ms each way through the impaired spine
        assert min(fast) < min(slow)


# -- priority ----------------------------------------------------------------------------------


def test_priority_bottleneck_high_class_loses_less_than_low_class(prefix):
    spec = TestbedSpec(
        hosts=2, spines=1, link_mbit=100.0, queue_packets=64, priority=True, prefix=prefix
    )
    with Testbed(spec) as bed:
        high = bed.cross_traffic(0, 80.0, dscp=46)  # gradlane class 0 (EF)
        low = bed.cross_traffic(0, 80.0, dscp=8)  # gradlane's droppable class (CS1)
        port = f"{prefix}-l0/s0"
        _wait(lambda: bed.link_stats()[port]["classes"]["dscp8"]["drops"] >= 200, "low drops")
        hi, lo = high.stop(), low.stop()
        classes = bed.link_stats()[port]["classes"]
        assert classes["dscp46"]["sent_packets"] > 0
        assert classes["dscp46"]["drops"] < classes["dscp8"]["drops"]
        hi_frac = hi["sink"]["bytes"] / hi["sender"]["bytes"]
        lo_frac = lo["sink"]["bytes"] / lo["sender"]["bytes"]
        assert hi_frac > lo_frac, (hi_frac, lo_frac)


# -- without root, and the CLI ---------------------------------------------------------------


def test_user_namespace_mode(prefix, monkeypatch):
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged user namespaces: {probe.stderr.decode().strip()}")
    monkeypatch.setenv(testbed.USERNS_ENV, "1")
    with Testbed(TestbedSpec(hosts=2, spines=2, prefix=prefix)) as bed:
        holder = bed.runner.holder_pid
        assert holder is not None
        assert not _names(prefix)  # private to the holder's mount namespace
        _echo(bed, 1, 7003)
        assert len(_probe(bed, 0, 1, 1, 7003, count=3)) == 3
    assert not _alive(holder)


def test_cli_up_status_down(prefix, capsys):
    from gradlane.integrations.cli.main import main

    argv = ["--prefix", prefix, "--hosts", "2", "--spines", "1"]
    assert main(["testbed", "up", *argv]) == 0
    assert f"{prefix}-h1: path0 10.200.0.2" in capsys.readouterr().out
    assert main(["testbed", "status", "--json", *argv]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["missing"] == [] and f"{prefix}-s0/l1" in status["ports"]
    assert main(["testbed", "up", *argv]) == 2  # already up: a clear error, not a second copy
    assert "already exist" in capsys.readouterr().err
    assert main(["testbed", "down", *argv]) == 0
    assert not _names(prefix)
    assert main(["testbed", "status", *argv]) == 1
