"""``python -m gradlane.bench.hardening``: run the campaign's phases, print the table, write the
JSON (see docs/hardening.md).

Usage::

    python -m gradlane.bench.hardening --json bench/results/hardening.json   # the full campaign
    python -m gradlane.bench.hardening --quick --skip-keyed                  # about a minute
    python -m gradlane.bench.hardening --phases spray --datagrams 200000 --rates 50000

Phases, in order: ``spray`` (live collectives under a datagram flood), ``daemon`` (forged IPC
against a daemon), ``faults`` (kill -9 of a rank, a daemon, a trainer; a path going silent),
``soak`` (many steps, memory and descriptors), ``keyed`` (the keyed/unkeyed all-reduce ratio,
from ``gradlane.bench.perf.allreduce``). Each phase has its own time budget; a phase that fails
or overruns is reported in the JSON (``errors``) and the others still run. Everything runs on
loopback (127.0.0.0/8); every process and socket a phase starts is closed when it ends, also on
Ctrl-C. Exit code: 0 when every correctness key holds, 1 when one does not, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from gradlane.bench.hardening.common import SECRET, Budget, PhaseTimeout
from gradlane.bench.hardening.report import CORRECTNESS, check, print_table, targets, write_json
from gradlane.bench.host import HostWatch
from gradlane.integrations.cli.command import emit

__all__ = ["PHASES", "add_arguments", "main", "run"]

PHASES = ("spray", "daemon", "faults", "soak", "keyed")
#: Sizes of a ``--quick`` run: the same phases, small counts.
QUICK = {
    "datagrams": 20_000,
    "rates": "10000,30000",
    "min_collectives": 20,
    "quiet_collectives": 20,
    "spray_elems": 65_536,
    "spray_hard_deadline": 2.0,
    "daemon_messages": 5_000,
    "soak_steps": 500,
    "soak_hard_deadline": 1.0,
    "path_steps": 20,
    "hard_deadline": 1.0,
    "keyed_reps": 3,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The campaign's flags (``gradlane bench hardening`` takes the same)."""
    p.add_argument("--json", metavar="PATH", help="write the JSON report here")
    p.add_argument("--quick", action="store_true", help="the same phases with small counts")
    p.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated, of: {', '.join(PHASES)}"
    )
    p.add_argument("--skip-keyed", action="store_true", help="leave out the keyed phase")
    p.add_argument("--seed", type=int, default=0, help="seeds every generator (default 0)")
    g = p.add_argument_group("spray")
    g.add_argument("--datagrams", type=int, default=1_050_000, help="datagrams to spray")
    g.add_argument(
        "--rates",
        default="20000,50000,100000",
        help="flood levels in datagrams/s, comma-separated (0: unpaced, the most intense)",
    )
    g.add_argument("--min-collectives", type=int, default=200, help="collectives per level")
    g.add_argument("--quiet-collectives", type=int, default=100, help="of the quiet baseline")
    g.add_argument("--spray-elems", type=int, default=262_144, help="float32 per bucket")
    g.add_argument("--spray-hard-deadline", type=float, default=5.0, help="seconds")
    g.add_argument("--unkeyed", action="store_true", help="engines without a job secret")
    g = p.add_argument_group("daemon, faults, soak, keyed")
    g.add_argument("--daemon-messages", type=int, default=105_000, help="hostile IPC messages")
    g.add_argument("--hard-deadline", type=float, default=2.0, help="of the faults (seconds)")
    g.add_argument("--path-steps", type=int, default=40, help="steps of the path-death case")
    g.add_argument("--soak-steps", type=int, default=10_000, help="steps of the soak")
    g.add_argument(
        "--soak-hard-deadline",
        type=float,
        default=5.0,
        help="of the soak (seconds; its warm-up lasts longer than this)",
    )
    g.add_argument("--keyed-reps", type=int, default=9, help="repetitions of the keyed phase")
    g.add_argument("--phase-time", type=float, default=900.0, help="each phase's budget (s)")
    g.add_argument("--verbose", action="store_true", help="gradlane's own log lines too")


def _options(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--quick``'s sizes where the user left the defaults."""
    if args.quick:
        defaults = argparse.ArgumentParser()
        add_arguments(defaults)
        base = defaults.parse_args([])
        for key, value in QUICK.items():
            if getattr(args, key) == getattr(base, key):
                setattr(args, key, value)
    return args


def run(args: argparse.Namespace) -> int:
    """Run the chosen phases; print the table; write the JSON; the exit code."""
    args = _options(args)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = sorted(set(phases) - set(PHASES))
    try:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        rates = ()
    if bad or not rates or any(r < 0 for r in rates):
        emit(f"hardening: unknown phase(s) {bad} or bad --rates {args.rates!r}", err=True)
        return 2
    if args.skip_keyed and "keyed" in phases:
        phases.remove("keyed")
    if not args.verbose:  # the faults make gradlane log the errors they cause: expected here
        logging.getLogger("gradlane").setLevel(logging.CRITICAL)
    host = HostWatch()
    doc: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if not callable(v)},
        "phases": {},
        "errors": {},
        "notes": [],
        "phase_seconds": {},
    }
    summary: dict[str, Any] = {}
    for name in phases:
        t0 = time.monotonic()
        budget = Budget(args.phase_time, name)
        try:
            section = _PHASES[name](args, budget)
        except (PhaseTimeout, TimeoutError, RuntimeError, OSError) as e:
            doc["errors"][name] = f"{type(e).__name__}: {e}"
            emit(f"hardening: phase {name} failed: {type(e).__name__}: {e}", err=True)
            section = {}
        doc["phase_seconds"][name] = time.monotonic() - t0
        doc["phases"][name] = section
        summary.update(section.get("summary", {}))
        if section.get("note"):
            doc["notes"].append(f"{name}: {section['note']}")
        emit(f"hardening: phase {name} done in {doc['phase_seconds'][name]:.1f}s", err=True)
    if "keyed" not in phases:
        doc["notes"].append("keyed: skipped (--skip-keyed or not in --phases)")
    goals = targets(args.hard_deadline)
    met = check(summary, goals)
    doc["summary"] = {
        **summary,
        "targets": {k: {"op": op, "value": v} for k, (op, v) in goals.items()},
        "targets_met": met,
    }
    doc["targets"] = doc["summary"]["targets"]
    doc["targets_met"] = met
    doc["host"] = host.record()
    print_table(doc)
    if args.json:
        write_json(args.json, {k: v for k, v in doc.items() if k not in ("targets", "targets_met")})
    broken = [k for k in CORRECTNESS if met.get(k) is False]
    if broken or doc["errors"]:
        emit(
            f"hardening: correctness keys missed: {broken}; phase errors: {doc['errors']}", err=True
        )
        return 1
    return 0


def _spray(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    from gradlane.bench.hardening.spray import SprayOptions, run_spray

    opts = SprayOptions(
        datagrams=args.datagrams,
        levels=tuple(float(r) for r in args.rates.split(",")),
        min_collectives=args.min_collectives,
        quiet_collectives=args.quiet_collectives,
        elems=args.spray_elems,
        secret=None if args.unkeyed else SECRET,
        hard_deadline_s=args.spray_hard_deadline,
        seed=args.seed,
    )
    return run_spray(opts, budget)


def _daemon(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    from gradlane.bench.hardening.daemon_ipc import run_daemon_ipc

    return run_daemon_ipc(args.daemon_messages, budget, seed=args.seed)


def _faults(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    from gradlane.bench.hardening.faults import run_faults

    return run_faults(budget, hard_deadline_s=args.hard_deadline, path_steps=args.path_steps)


def _soak(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    from gradlane.bench.hardening.soak import run_soak

    return run_soak(args.soak_steps, budget, hard_deadline_s=args.soak_hard_deadline)


def _keyed(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    from gradlane.bench.hardening.keyed import run_keyed

    return run_keyed(budget.left(), reps=args.keyed_reps)


_PHASES: dict[str, Callable[[argparse.Namespace, Budget], dict[str, Any]]] = {
    "spray": _spray,
    "daemon": _daemon,
    "faults": _faults,
    "soak": _soak,
    "keyed": _keyed,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m gradlane.bench.hardening``."""
    ap = argparse.ArgumentParser(
        prog="python -m gradlane.bench.hardening", description=__doc__.split("\n")[0]
    )
    add_arguments(ap)
    try:
        return run(ap.parse_args(argv))
    except KeyboardInterrupt:  # the phases' own clean-up ran on the way out
        emit("hardening: interrupted", err=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
