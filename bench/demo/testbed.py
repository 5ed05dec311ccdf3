"""``gradlane demo --network testbed``: the demo's DDP training across a congested testbed.

:func:`run_testbed_demo` brings up a leaf-spine testbed (:mod:`gradlane.bench.testbed.netns`; root,
or unprivileged user namespaces), starts UDP cross traffic on spine 0, and runs one rank per
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

ECMP hashes each of gloo's TCP connections onto one spine, and the cross traffic loads only the
links of its own route by default (host 0 → spine 0 → host 1), so a run may find none of gloo's
ring on those links (a lucky hash: gloo runs as on a free network) or some of it there (gloo's
ring runs at that connection's pace). ``route="spine"`` loads every link of spine 0 instead
(:func:`gradlane.bench.testbed.crosstraffic.load_spine`: a ring of flows), so gloo runs free
only if the hash keeps all its connections on spine 1. The parent reads the switch ports'
counters at gloo's first and last progress report; how busy the cross traffic's busiest link
was in between, as a fraction of the link rate, is ``gloo_cross_route_busy`` in the summary
(:func:`route_busy`): about the cross traffic's own share when gloo kept off its links, near 1
when gloo shared one. A reader knows which case a comparison is.
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
from gradlane.bench.testbed.crosstraffic import cross_where, route_links
from gradlane.bench.testbed.netns import ECMP_IFNAME
from gradlane.scheduling.precision import PrecisionConfig

__all__ = [
    "TESTBED_RUNS",
    "TestbedDemo",
    "main",
    "route_busy",
    "run_testbed_demo",
    "testbed_runs",
]

#: The testbed demo's runs, in order: gloo over ECMP (the baseline), gloo on path 0, gradlane.
TESTBED_RUNS = ("gloo", "gloo_path0", "gradlane")


def testbed_runs(opts: DemoOptions) -> tuple[str, ...]:
    """:data:`TESTBED_RUNS`, then ``gradlane_<policy>`` with ``opts.precision`` if set."""
    return TESTBED_RUNS + ((f"gradlane_{opts.precision}",) if opts.precision else ())


#: Seconds without a word from any rank before the demo gives up.
SILENCE_S = 180.0
MASTER_PORT = 29410


def route_busy(
    before: dict[str, dict[str, Any]],
    after: dict[str, dict[str, Any]],
    links: tuple[str, ...],
    seconds: float,
    link_mbit: float,
) -> float | None:
    """How busy the busiest of ``links`` was between two ``Testbed.link_stats()`` readings
    ``seconds`` apart: bytes sent over what the link rate allows (None without a reading)."""
    if seconds <= 0:
        return None

    def sent(stats: dict[str, dict[str, Any]]) -> dict[str, int]:
        return {str(v.get("link")): int(v.get("sent_bytes", 0)) for v in stats.values()}

    b, a = sent(before), sent(after)
    busy = [(a[k] - b[k]) * 8 / (link_mbit * 1e6 * seconds) for k in links if k in a and k in b]
    return max(busy) if busy else None


class TestbedDemo:
    """What the testbed looks like for the demo."""

    __test__ = False

    def __init__(
        self,
        hosts: int = 4,
        link_mbit: float = 200.0,
        cross: float = 0.7,
        queue: int = 1000,
        route: str = "pair",
    ) -> None:
        self.hosts, self.link_mbit, self.cross, self.queue = hosts, link_mbit, cross, queue
        self.route = route  # see gradlane.bench.testbed.crosstraffic.ROUTES


def run_testbed_demo(
    opts: DemoOptions,
    tb: TestbedDemo,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Train three times (:data:`TESTBED_RUNS`) on a congested testbed, one rank per host;
    returns the comparison."""
    from gradlane.bench.replay.run import TESTBED_TRANSPORT, TestbedNetwork
    from gradlane.bench.testbed.netns import Testbed, TestbedSpec, privilege
    from gradlane.bench.testbed.orphans import owned_prefix, sweep_orphans

    if opts.transport != "udp":
        raise ValueError("the testbed demo runs gradlane over UDP (its multipath data plane)")
    if opts.steps <= opts.warmup_steps:
        raise ValueError(f"--steps must be more than the {opts.warmup_steps} warm-up steps")
    privilege()  # TestbedUnavailable names what is missing (root)
    opts = replace(opts, ranks=tb.hosts, inject_loss=0.0)
    sweep_orphans("dm")  # what killed runs left (nothing else removes it)
    spec = TestbedSpec(
        hosts=tb.hosts,
        spines=2,
        link_mbit=tb.link_mbit,
        queue_packets=tb.queue,
        prefix=owned_prefix("dm"),
    )
    runs = testbed_runs(opts)
    results: dict[str, dict[int, dict[str, Any]]] = {run: {} for run in runs}
    t0 = time.perf_counter()
    with Testbed(spec) as bed:
        net = TestbedNetwork(bed, master_port=MASTER_PORT, **TESTBED_TRANSPORT)
        route: tuple[str, ...] = ()
        if tb.cross > 0:
            flows = bed.load_spine(0, tb.cross * tb.link_mbit, tb.route)
            route = route_links([(f.spec.src, f.spec.dst) for f in flows], 0)
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
        # (time, switch counters) at gloo's first and last progress report (see the docstring)
        marks: list[tuple[float, dict[str, dict[str, Any]]]] = []
        with RankPipes() as ranks:
            ranks.start([partial(net.popen, r) for r in range(tb.hosts)], __name__, jobs)
            for rank, msg in ranks.messages(opts.timeout_s, SILENCE_S):
                if msg["type"] == "progress":
                    if msg["run"] == "gloo" and (not marks or msg["step"] == opts.steps):
                        marks.append((time.monotonic(), bed.link_stats()))
                    if on_progress is not None:
                        on_progress(msg["run"], msg["step"], opts.steps)
                elif msg["type"] == "result":
                    results[msg["run"]][rank] = msg["out"]
        description = net.description
    out = _compare(opts, results, runs)
    busy = None
    if len(marks) >= 2 and route:
        (t0_, before), (t1_, after) = marks[0], marks[-1]
        busy = route_busy(before, after, route, t1_ - t0_, tb.link_mbit)
    out["summary"]["gloo_cross_route_busy"] = busy
    out["summary"]["cross_share"] = tb.cross
    out["wall_s"] = time.perf_counter() - t0
    out["link_mbit"] = tb.link_mbit
    description = description.replace(
        "gloo over path 0 (spine 0)", "gloo over the ECMP addresses, then over path 0 (spine 0)"
    )
    out["network"] = (
        f"{description}; UDP cross traffic at {tb.cross:.0%} of a link {cross_where(tb.route)}"
    )
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
        for run in testbed_runs(opts):
            group = groups.get(run)
            cfg_run = transport
            if run.startswith("gradlane_"):  # the extra run: a lossy wire precision
                cfg_run = replace(
                    transport,
                    precision=PrecisionConfig(
                        policy=opts.precision, error_feedback=opts.error_feedback
                    ),
                )
            out = _train(run, rank, world, opts, data, _Up(), cfg_run, tuple(addrs), group)
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
