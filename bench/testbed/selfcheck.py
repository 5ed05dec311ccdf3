"""Measure what the testbed delivers: generator rates, shaping, drops, priority, impairment, CPU.

``python -m gradlane.bench.testbed.selfcheck --json bench/results/testbed_check.json``
builds a 4-host, 2-spine, 1 Gbit/s testbed and runs, each for
``--seconds``:

- ``udp700``: a 700 Mbit/s UDP flow host0 -> host1 over spine 0 (the 70 % cross traffic the
  testbed demo and replay run): the rate the sender, the bottleneck port and the sink each saw,
  tc drops, and the CPU the sender and sink processes used;
- ``udp1300``: the same flow at 130 % of the link: the sink gets the link rate, tc counts drops;
- ``tcp_bulk``: one unpaced TCP flow (what the shaper gives TCP);
- ``onoff``: 700 Mbit/s in on/off bursts (mean 20 ms each): the long-run rate halves;
- ``impair``: 5 % loss on spine 1 under a 900 Mbit/s flow: the fraction the forwarder dropped,
  its packet rate and CPU;
- ``priority``: on a testbed with ``priority``, 600 Mbit/s of DSCP 46 against 600 Mbit/s of
  DSCP 8 on one port: what each class delivered and dropped;
- ``full_load``: on a testbed at ``--full-load-mbit`` (default 200, the demo's and the replay's
  rate), every link of both spines at 98 % (a ring of flows over each spine, host h to h+1:
  each host sends and receives a link's worth on each path, the bytes of a clean all-reduce):
  what was delivered, the least-loaded switch port, and the whole machine's CPU split (user,
  system, softirq) and idle cores. It is the floor a transport's own CPU adds to: what the
  machine spends forwarding and generating the same bytes.

It prints one JSON object (and writes it with ``--json``) whose ``summary`` holds the headline
ratios. Numbers are wall-clock measurements on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from gradlane.bench.host import HostWatch, cpu_times
from gradlane.bench.testbed.netns import Testbed, TestbedSpec

__all__ = ["add_arguments", "check", "main", "run"]

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _port_delta(before: dict[str, Any], after: dict[str, Any], port: str, wall: float) -> dict:
    a, b = after[port], before[port]
    return {
        "port": port,
        "link": a["link"],
        "mbit": (a["sent_bytes"] - b["sent_bytes"]) * 8 / 1e6 / wall,
        "packets": a["sent_packets"] - b["sent_packets"],
        "drops": a["drops"] - b["drops"],
    }


def _flow(bed: Testbed, seconds: float, ports: list[str], **kw: Any) -> dict[str, Any]:
    """Run one cross-traffic flow for ``seconds``; its counters, port deltas and CPU use."""
    before = bed.link_stats()
    flow = bed.cross_traffic(**kw)
    t0 = time.monotonic()
    cpu0 = [_cpu_s(p) for p in flow.pids]
    time.sleep(seconds)  # a measurement window, not synchronisation
    cpu = [_cpu_s(p) - c for p, c in zip(flow.pids, cpu0, strict=True)]
    wall = time.monotonic() - t0
    after = bed.link_stats()
    stats = flow.stop()
    return {
        "flow": {k: v for k, v in kw.items() if k != "spine"} | {"spine": kw["spine"]},
        "sender_mbit": stats["sender"]["mbit"],
        "sink_mbit": stats["sink"]["mbit"],
        "delivered": stats["sink"]["bytes"] / max(stats["sender"]["bytes"], 1),
        "send_errors": stats["sender"]["send_errors"],
        "cpu_fraction": {"sink": cpu[0] / wall, "sender": cpu[1] / wall},
        "ports": [_port_delta(before, after, p, wall) for p in ports],
    }


#: Share of each link the full-load check offers (on the wire): below 1 so no queue grows.
FULL_LOAD_SHARE = 0.98


def full_load(seconds: float, prefix: str, link_mbit: float, hosts: int = 4) -> dict[str, Any]:
    """Every link of both spines of a ``hosts``-host testbed at :data:`FULL_LOAD_SHARE` of
    ``link_mbit`` for ``seconds``: delivered fraction, the least-loaded spine port's rate as a
    fraction of the link, and the whole machine's cores by kind (see the module docstring)."""
    spec = TestbedSpec(hosts=hosts, spines=2, link_mbit=link_mbit, prefix=prefix)
    with Testbed(spec) as bed:
        flows = []
        try:
            for spine in range(spec.spines):
                flows += bed.load_spine(spine, FULL_LOAD_SHARE * link_mbit)
            before, t0, cpu0 = bed.link_stats(), time.monotonic(), cpu_times()
            time.sleep(seconds)  # a measurement window, not synchronisation
            cpu1, wall, after = cpu_times(), time.monotonic() - t0, bed.link_stats()
        finally:
            stats = [flow.stop() for flow in flows]
    spine_ports = [p for p in after if p.startswith(f"{prefix}-s")]
    rates = [_port_delta(before, after, p, wall)["mbit"] / link_mbit for p in spine_ports]
    ticks = {k: cpu1[k] - cpu0[k] for k in cpu1}
    per_tick = (os.cpu_count() or 1) / max(sum(ticks.values()), 1)
    machine = {k: t * per_tick for k, t in ticks.items()}
    sent = sum(s["sender"]["bytes"] for s in stats)
    return {
        "link_mbit": link_mbit,
        "hosts": hosts,
        "flows": len(stats),
        "offered_share": FULL_LOAD_SHARE,
        "delivered": sum(s["sink"]["bytes"] for s in stats) / max(sent, 1),
        "spine_port_share_min": min(rates, default=0.0),
        "spine_port_share_mean": sum(rates) / max(len(rates), 1),
        "machine_cores": machine,
        "busy_cores": sum(v for k, v in machine.items() if k not in ("idle", "iowait")),
    }


def check(seconds: float, prefix: str, full_load_mbit: float = 200.0) -> dict[str, Any]:
    """Run every measurement; returns the result object (see the module docstring)."""
    spec = TestbedSpec(hosts=4, spines=2, link_mbit=1000.0, prefix=prefix)
    out: dict[str, Any] = {"spec": spec.__dict__, "seconds": seconds}
    path0 = [f"{prefix}-l0/s0", f"{prefix}-s0/l1", f"{prefix}-l1/h0"]
    with Testbed(spec) as bed:
        out["udp700"] = _flow(bed, seconds, path0, spine=0, rate_mbit=700.0)
        out["udp1300"] = _flow(bed, seconds, path0, spine=0, rate_mbit=1300.0)
        out["tcp_bulk"] = _flow(bed, seconds, path0, spine=0, rate_mbit=None, proto="tcp")
        out["onoff"] = _flow(
            bed, seconds, path0, spine=0, rate_mbit=700.0, pattern="onoff", on_s=0.02, off_s=0.02
        )
        imp = bed.impair(1, loss=0.05, seed=3)
        pid = imp.pid or 0
        cpu0, t0 = _cpu_s(pid), time.monotonic()
        ports1 = [f"{prefix}-l2/s1", f"{prefix}-s1/l3"]
        res = _flow(bed, seconds, ports1, spine=1, rate_mbit=900.0, src=2, dst=3)
        window = time.monotonic() - t0
        cpu = (_cpu_s(pid) - cpu0) / window
        counts = imp.stop()
        out["impair"] = res | {
            "configured_loss": 0.05,
            "forwarder": counts,
            "forwarder_pps": counts.get("received", 0) / window,
            "forwarder_cpu_fraction": cpu,
        }
    pspec = TestbedSpec(hosts=2, spines=1, link_mbit=1000.0, priority=True, prefix=prefix)
    with Testbed(pspec) as bed:
        port = f"{prefix}-l0/s0"
        before = bed.link_stats()[port]["classes"]
        high = bed.cross_traffic(0, 600.0, dscp=46, port=5301)
        low = bed.cross_traffic(0, 600.0, dscp=8, port=5302)
        time.sleep(seconds)
        hi, lo = high.stop(), low.stop()
        after = bed.link_stats()[port]["classes"]
        out["priority"] = {
            name: {
                "sender_mbit": s["sender"]["mbit"],
                "sink_mbit": s["sink"]["mbit"],
                "delivered": s["sink"]["bytes"] / max(s["sender"]["bytes"], 1),
                "tc_drops": after[cls]["drops"] - before[cls]["drops"],
            }
            for name, s, cls in (("dscp46", hi, "dscp46"), ("dscp8", lo, "dscp8"))
        }
    out["full_load"] = full_load(seconds, prefix, full_load_mbit)
    u7 = out["udp700"]
    out["summary"] = {
        "udp700_sink_mbit": u7["sink_mbit"],
        "udp700_bottleneck_mbit": u7["ports"][0]["mbit"],
        "udp700_sender_cpu": u7["cpu_fraction"]["sender"],
        "udp1300_sink_mbit": out["udp1300"]["sink_mbit"],
        "udp1300_tc_drops": out["udp1300"]["ports"][0]["drops"],
        "tcp_bulk_mbit": out["tcp_bulk"]["sink_mbit"],
        "onoff_mbit": out["onoff"]["sink_mbit"],
        "impair_loss_observed": out["impair"]["forwarder"].get("loss_observed"),
        "impair_forwarder_pps": out["impair"]["forwarder_pps"],
        "impair_forwarder_overrun": out["impair"]["forwarder"].get("overrun"),
        "priority_delivered_high": out["priority"]["dscp46"]["delivered"],
        "priority_delivered_low": out["priority"]["dscp8"]["delivered"],
        "full_load_delivered": out["full_load"]["delivered"],
        "full_load_spine_port_share_min": out["full_load"]["spine_port_share_min"],
        "full_load_busy_cores": out["full_load"]["busy_cores"],
    }
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the check."""
    p.add_argument("--seconds", type=float, default=3.0, help="length of each measurement")
    p.add_argument("--prefix", default=f"ck{os.getpid() % 100000}", help="namespace prefix")
    p.add_argument("--json", metavar="PATH", help="also write the result here")
    p.add_argument(
        "--full-load-mbit",
        type=float,
        default=200.0,
        help="link rate of the full-load check (default 200, the demo's)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the check, print the JSON, write it where ``--json`` says."""
    host = HostWatch()
    result = check(args.seconds, args.prefix, args.full_load_mbit)
    result["host"] = host.record()
    result["command"] = "python -m gradlane.bench.testbed.selfcheck " + " ".join(sys.argv[1:])
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gradlane.bench.testbed.selfcheck``."""
    p = argparse.ArgumentParser(
        prog="python -m gradlane.bench.testbed.selfcheck", description=__doc__
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
