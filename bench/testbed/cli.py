"""``gradlane testbed up|down|status``: the emulated leaf-spine from the command line.

``up`` builds a testbed and leaves it running (a state file under ``/run/gradlane`` as root, the
temp directory otherwise, records it by prefix); ``down`` removes everything with the prefix,
also leftovers of crashed runs; ``status`` lists namespaces, path addresses and per-port queue
counters. Processes are started in a host with ``ip netns exec <prefix>-h<i> ...`` (as root).
"""

from __future__ import annotations

import argparse
import json

from gradlane.integrations.cli.command import Command, emit

__all__ = ["COMMAND", "add_arguments", "run"]

# The testbed's modules are imported inside the functions: ``gradlane`` loads COMMAND to list
# the subcommands, and they import numba (through gradlane.scheduling).


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``gradlane testbed``."""
    from gradlane.bench.testbed.netns import TestbedSpec

    p.add_argument("action", choices=["up", "down", "status"])
    defaults = TestbedSpec()
    p.add_argument("--hosts", type=int, default=defaults.hosts)
    p.add_argument("--spines", type=int, default=defaults.spines, help="= paths per host pair")
    p.add_argument("--link-mbit", type=float, default=defaults.link_mbit)
    p.add_argument(
        "--queue-packets",
        type=int,
        default=defaults.queue_packets,
        help="queue limit per switch port (of the top class with --priority)",
    )
    p.add_argument(
        "--priority", action="store_true", help="DSCP classes on every switch port (htb + u32)"
    )
    p.add_argument("--mtu", type=int, choices=[1500, 9000], default=defaults.mtu)
    p.add_argument("--prefix", default=defaults.prefix, help="namespace name prefix")
    p.add_argument("--json", action="store_true", help="status: one JSON object")


def _up(args: argparse.Namespace) -> int:
    from gradlane.bench.testbed.netns import Testbed, TestbedSpec, state_path

    spec = TestbedSpec(
        hosts=args.hosts,
        spines=args.spines,
        link_mbit=args.link_mbit,
        queue_packets=args.queue_packets,
        priority=args.priority,
        prefix=args.prefix,
        mtu=args.mtu,
    )
    bed = Testbed(spec, keep=True).up()
    emit(
        f"testbed {spec.prefix} up: {spec.hosts} hosts, {spec.spines} spines, "
        f"{spec.link_mbit:g} Mbit/s links, queue {spec.queue_packets} packets, "
        f"priority {'on' if spec.priority else 'off'}, MTU {spec.mtu}"
    )
    for host in bed.hosts:
        emit(f"  {host.netns}: " + "  ".join(f"path{p} {a}" for p, a in enumerate(host.addrs)))
    emit(f"state: {state_path(spec.prefix)}")
    emit(f"remove with `gradlane testbed down --prefix {spec.prefix}`")
    return 0


def _status(args: argparse.Namespace) -> int:
    from gradlane.bench.testbed.netns import attach, load_state, state_path

    state = load_state(args.prefix)
    if state is None:
        emit(f"no testbed {args.prefix!r} recorded at {state_path(args.prefix)}", err=True)
        return 1
    bed = attach(args.prefix)
    present = set(bed.runner.namespaces())
    missing = [n for n in state["namespaces"] if n not in present]
    stats = bed.link_stats() if not missing else {}
    if args.json:
        emit(json.dumps({"state": state, "missing": missing, "ports": stats}, indent=1))
        return 0 if not missing else 1
    spec = bed.spec
    emit(
        f"testbed {spec.prefix}: {spec.hosts} hosts, {spec.spines} spines, "
        f"{spec.link_mbit:g} Mbit/s, priority {'on' if spec.priority else 'off'}"
    )
    if missing:
        emit(
            f"  missing namespaces: {missing} (run `gradlane testbed down --prefix {spec.prefix}`)"
        )
        return 1
    for host in bed.hosts:
        emit(f"  {host.netns}: " + "  ".join(f"path{p} {a}" for p, a in enumerate(host.addrs)))
    emit(f"  {'port':<12} {'link':<18} {'sent MB':>9} {'packets':>9} {'drops':>7} {'backlog':>8}")
    for port, c in stats.items():
        emit(
            f"  {port:<12} {c['link']:<18} {c['sent_bytes'] / 1e6:>9.1f} "
            f"{c['sent_packets']:>9} {c['drops']:>7} {c['backlog_bytes']:>8}"
        )
        for name, k in c["classes"].items():
            if spec.priority and k["sent_packets"] + k["drops"]:
                mbytes = k["sent_bytes"] / 1e6
                emit(f"  {'':<14} {name:<16} {mbytes:>9.1f} {k['sent_packets']:>9} {k['drops']:>7}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``gradlane testbed ACTION``; returns the exit code."""
    from gradlane.bench.testbed.netns import TestbedError, down_all, privilege
    from gradlane.transport.errors import GradlaneError

    try:
        privilege()
        if args.action == "up":
            return _up(args)
        if args.action == "down":
            removed = down_all(args.prefix)
            emit(f"removed: {', '.join(removed)}" if removed else f"nothing named {args.prefix}-*")
            return 0
        return _status(args)
    except TestbedError as exc:
        emit(f"gradlane testbed {args.action}: {exc}", err=True)
        return 2
    except GradlaneError as exc:  # ConfigError: bad options
        emit(f"gradlane testbed {args.action}: {exc}", err=True)
        return 2


#: ``gradlane testbed``, registered in the ``gradlane.commands`` entry-point group.
COMMAND = Command(
    help="the emulated leaf-spine of network namespaces: testbed up|down|status",
    add_arguments=add_arguments,
    run=run,
)
