"""Testbeds left by killed runs (netns tier, root only: ``sweep_orphans`` does nothing else).

Each test makes namespaces of its own kind (a prefix no run uses) and removes whatever is left of
them afterwards, also on failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from gradlane.bench.testbed import netns as testbed
from gradlane.bench.testbed.orphans import PID_MOD, owned_prefix, owner_alive, sweep_orphans

pytestmark = pytest.mark.timeout(60)


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line]


def _dead_number() -> int:
    """A prefix number no living process owns: a child's pid once it has exited."""
    for _ in range(20):
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait(timeout=30)
        n = child.pid % PID_MOD
        if not owner_alive(n):
            return n
    pytest.skip("no free pid number found (a busy machine reuses pids at once)")


@pytest.fixture
def kind() -> Iterator[str]:
    try:
        if testbed.privilege() != "root":
            pytest.skip("netns tier: the sweep is for root's named namespaces")
    except testbed.TestbedUnavailable as exc:
        pytest.skip(f"netns tier: {exc}")
    k = "zq"  # no run uses it; two letters leave room for the 6 digits of a pid number
    yield k
    for ns in _netns():
        if ns.startswith(k) and ns[len(k) : len(k) + 1].isdigit():
            subprocess.run(["ip", "netns", "del", ns], check=False)


def test_a_killed_runs_testbed_is_swept_and_a_living_ones_is_not(kind: str) -> None:
    dead, mine = f"{kind}{_dead_number()}", owned_prefix(kind)
    made = [f"{dead}-h0", f"{dead}-l0", f"{dead}-s0", f"{mine}-h0"]
    for ns in made:
        subprocess.run(["ip", "netns", "add", ns], check=True)
    assert set(sweep_orphans(kind)) == {f"{dead}-h0", f"{dead}-l0", f"{dead}-s0"}
    left = _netns()
    assert f"{mine}-h0" in left and not any(ns.startswith(f"{dead}-") for ns in left)


def test_a_namespace_with_a_process_inside_is_left_alone(kind: str) -> None:
    dead = f"{kind}{_dead_number()}"
    subprocess.run(["ip", "netns", "add", f"{dead}-h0"], check=True)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", f"{dead}-h0", sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
    )
    try:
        # The process is inside once `ip netns pids` lists it (polled under a deadline).
        deadline = time.monotonic() + 30.0
        while not subprocess.run(
            ["ip", "netns", "pids", f"{dead}-h0"], check=False, capture_output=True, text=True
        ).stdout.split():
            if time.monotonic() > deadline:
                pytest.fail("the process never showed inside the namespace")
        assert sweep_orphans(kind) == []
        assert f"{dead}-h0" in _netns()
    finally:
        proc.communicate(input=b"", timeout=30)


def test_a_prefix_number_is_alive_while_any_pid_could_own_it() -> None:
    assert owner_alive(os.getpid() % PID_MOD)
