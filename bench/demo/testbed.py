"""``gradlane demo --network testbed``: the demo's DDP training across a congested testbed.

:func:`run_testbed_demo` brings up a leaf-spine testbed (:mod:`gradlane.bench.testbed.netns`; root,
or unprivileged user namespaces), starts UDP cross traffic through spine 0, and runs one rank per
host *inside the host's namespace* (``python -m gradlane.bench.demo.testbed``, talking to the parent
through :mod:`gradlane.bench.replay.rank_pipes`). Every rank trains the demo's model from the
same initialisation on the same batches (:func:`gradlane.bench.demo.training._train`), three
times (:data:`TESTBED_RUNS`): with DDP's default hook over gloo on the hosts' ECMP addresses
(``gloo``: each TCP connection hashed onto a spine, as on a real fabric), again with gloo on the
path-0 addresses (``gloo_path0``: every connection through the congested spine, like a job pinned
to one rail), and with the gradlane hook over both paths (the replay's testbed transport config,
``gradlane.bench.replay.run.TESTBED_TRANSPORT``: fixed pacing at a share of the link,
priorities, the loss bound). No loss is injected: what is lost, the network lost. The comparison
is the loopback demo's (:func:`gradlane.bench.demo.training._compare`, ``gloo`` the baseline);
the testbed is torn down whatever happens.

ECMP hashes each of gloo's TCP connections onto one spine, so a run may find gloo's ring all on
the free spine (a lucky hash) or partly on the congested one (the common case). The parent reads
the switch ports' counters at gloo's first and last progress report: the bytes spine 1 (no cross
traffic) carried in between, over the bytes gloo's ring had to move in those steps, is
``gloo_free_spine_share`` in the summary (:func:`free_spine_share`; 0.5 is an even split, near 1
a hash that kept gloo off the congestion), so a reader knows which case a comparison is.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

from gradlane.bench.demo.training import DemoOptions, _compare, _train
from gradlane.bench.replay.rank import NetParams, ReplayConfig, ifname_of, transport_config
from gradlane.bench.replay.rank_pipes import RankPipes, say
from gradlane.bench.testbed.netns import ECMP_IFNAME

__all__ = [
    "TESTBED_RUNS",
    "TestbedDemo",
    "free_spine_share",
    "main",
    "run_testbed_demo",
    "spine_bytes",
]

#: The testbed demo's runs, in order: gloo over ECMP (the baseline), gloo on path 0, gradlane.
TESTBED_RUNS = ("gloo", "gloo_path0", "gradlane")

#: Seconds without a word from any rank before the demo gives up.
SILENCE_S = 180.0
MASTER_PORT = 29410


#: IPv4 and TCP (with timestamps) headers inside the MTU, and the Ethernet header htb counts.
_TCP_IP_HEADERS, _ETHERNET_HEADER = 52, 14


def spine_bytes(link_stats: dict[str, dict[str, Any]]) -> dict[int, int]:
    """Bytes each spine has sent (its ports toward the leaves), from ``Testbed.link_stats()``."""
    out: dict[int, int] = {}
    for port in link_stats.values():
        link = str(port.get("link", ""))
        if link.startswith("spine"):
            spine = int(link[len("spine") : link.index("-")])
            out[spine] = out.get(spine, 0) + int(port.get("sent_bytes", 0))
    return out


def free_spine_share(
    free_bytes: int, steps: int, world: int, grad_bytes: int, mtu: int = 9000
) -> float | None:
    """The share of gloo's ring traffic over ``steps`` steps that crossed the spine without
    cross traffic, given the bytes that spine sent meanwhile: a ring all-reduce moves
    ``2 (world - 1) × grad_bytes`` per step over all ranks, as TCP segments of the MTU (their
    headers and the Ethernet header on the wire, as htb counts). None when nothing was moved."""
    payload = mtu - _TCP_IP_HEADERS
    wire = steps * 2 * (world - 1) * grad_bytes * (payload + _TCP_IP_HEADERS + _ETHERNET_HEADER)
    if wire <= 0:
        return None
    return min(1.0, max(0.0, free_bytes * payload / wire))


class TestbedDemo:
    """What the testbed looks like for the demo."""

    __test__ = False

    def __init__(
        self, hosts: int = 4, link_mbit: float = 200.0, cross: float = 0.7, queue: int = 1000
    ) -> None:
        self.hosts, self.link_mbit, self.cross, self.queue = hosts, link_mbit, cross, queue


def run_testbed_demo(
    opts: DemoOptions,
    tb: TestbedDemo,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Train three times (:data:`TESTBED_RUNS`) on a congested testbed, one rank per host;
    returns the comparison."""
    from gradlane.bench.replay.run import TESTBED_TRANSPORT, TestbedNetwork
    from gradlane.bench.testbed.netns import Testbed, TestbedSpec, privilege

    if opts.transport != "udp":
        raise ValueError("the testbed demo runs gradlane over UDP (its multipath data plane)")
    if opts.steps <= opts.warmup_steps:
        raise ValueError(f"--steps must be more than the {opts.warmup_steps} warm-up steps")
    privilege()  # TestbedUnavailable names what is missing (root)
    opts = replace(opts, ranks=tb.hosts, inject_loss=0.0)
    spec = TestbedSpec(
        hosts=tb.hosts,
        spines=2,
        link_mbit=tb.link_mbit,
        queue_packets=tb.queue,
        prefix=f"dm{os.getpid() % 1_000_000}",
    )
    results: dict[str, dict[int, dict[str, Any]]] = {run: {} for run in TESTBED_RUNS}
    t0 = time.perf_counter()
    with Testbed(spec) as bed:
        net = TestbedNetwork(bed, master_port=MASTER_PORT, **TESTBED_TRANSPORT)
        if tb.cross > 0:
            bed.cross_traffic(0, tb.cross * tb.link_mbit)
        master = list(net.master())
        jobs = [
            {
                "rank": r,
                "world": tb.hosts,
                "master": master,
                "addrs": net.addrs(r),
                "net": asdict(replace(net.params, hard_deadline_s=opts.hard_deadline_s)),
                "opts": asdict(opts),
            }
            for r in range(tb.hosts)
        ]
        # (step, spine 1's bytes) at gloo's first and last progress report (see the docstring)
        marks: list[tuple[int, int]] = []
        with RankPipes() as ranks:
            ranks.start([partial(net.popen, r) for r in range(tb.hosts)], __name__, jobs)
            for rank, msg in ranks.messages(opts.timeout_s, SILENCE_S):
                if msg["type"] == "progress":
                    if msg["run"] == "gloo" and (not marks or msg["step"] == opts.steps):
                        marks.append((int(msg["step"]), spine_bytes(bed.link_stats()).get(1, 0)))
                    if on_progress is not None:
                        on_progress(msg["run"], msg["step"], opts.steps)
                elif msg["type"] == "result":
                    results[msg["run"]][rank] = msg["out"]
        description = net.description
    out = _compare(opts, results, TESTBED_RUNS)
    share = None
    if len(marks) >= 2:
        (s0, b0), (s1, b1) = marks[0], marks[-1]
        grad = int(results["gloo"][0].get("grad_bytes", 0))
        share = free_spine_share(b1 - b0, s1 - s0, tb.hosts, grad, spec.mtu)
    out["summary"]["gloo_free_spine_share"] = share
    out["wall_s"] = time.perf_counter() - t0
    out["link_mbit"] = tb.link_mbit
    description = description.replace(
        "gloo over path 0 (spine 0)", "gloo over the ECMP addresses, then over path 0 (spine 0)"
    )
    out["network"] = f"{description}; UDP cross traffic at {tb.cross:.0%} of a link through spine 0"
    return out


# -- rank process ----------------------------------------------------------------------------------
class _Up:
    """The ``up`` queue of :func:`gradlane.bench.demo.training._train`, as stdout lines."""

    def put(self, msg: tuple[Any, ...]) -> None:
        say(type=msg[0], run=msg[1], step=msg[2])


def _rank(job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from gradlane.bench.demo.models import load_digits

    rank, world, addrs = int(job["rank"]), int(job["world"]), list(job["addrs"])
    opts = DemoOptions(**job["opts"])
    master, port = job["master"]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master, str(port)
    torch.set_num_threads(1)
    td = datetime.timedelta(seconds=120)
    store = dist.TCPStore(master, int(port), world, rank == 0, timeout=td)
    # gloo reads GLOO_SOCKET_IFNAME as each group is built: the default group binds the host's
    # ECMP address (its connections hashed over the spines), the second one path 0's.
    os.environ["GLOO_SOCKET_IFNAME"] = ECMP_IFNAME
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=td)
    path0 = ifname_of(addrs[0])
    if not path0:
        raise RuntimeError(f"no interface holds path 0's address {addrs[0]}")
    os.environ["GLOO_SOCKET_IFNAME"] = path0
    groups = {"gloo": None, "gloo_path0": dist.new_group(backend="gloo", timeout=td)}
    try:
        net = NetParams(**job["net"])
        cfg = ReplayConfig("udp", opts.loss_bound)
        transport = transport_config(cfg, net, len(addrs), world, opts.seed * 1000 + rank)
        data = load_digits(opts.seed)
        for run in TESTBED_RUNS:
            group = groups.get(run)
            out = _train(run, rank, world, opts, data, _Up(), transport, tuple(addrs), group)
            say(type="result", run=run, out=out)
    finally:
        dist.destroy_process_group()


def main() -> int:
    """Rank entry point: the job on stdin, messages on stdout (see
    :mod:`gradlane.bench.replay.rank_pipes`)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("gradlane.transport.drivers.udp.sockets").setLevel(logging.ERROR)
    rank = None
    try:
        job = json.loads(sys.stdin.readline())
        rank = job.get("rank")
        _rank(job)
    except BaseException as e:  # reported to the parent, which stops every rank
        say(type="error", rank=rank, message=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
        return 1
    say(type="done", rank=rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
