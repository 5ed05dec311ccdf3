"""The ``gradlane`` command line: one table of subcommands, each imported only when used.

All user-facing output of the package goes through :func:`emit` (STYLE rule 10).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from gradlane.transport import __version__

__all__ = ["emit", "main", "progress"]

#: name -> (module, one-line help). Each module offers ``add_arguments(parser)`` and ``run(args)``;
#: imports are lazy so ``gradlane --help`` stays fast and never imports torch or numba.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "gradlane.bench.demo.cli",
        "the main job: DDP training on this machine, gloo's default hook vs gradlane's, "
        "side by side (--network sim: the simulated leaf-spine)",
    ),
    "netsim": ("gradlane.bench.sim.scenarios", "all-reduce scenarios on the simulated network"),
    "daemon": (
        "gradlane.integrations.cli.daemon",
        "run this host's transport daemon (trainers connect with GRADLANE_MODE=daemon)",
    ),
    "stats": ("gradlane.integrations.cli.stats", "print a gradlane daemon's metrics"),
    "bench": (
        "gradlane.bench.replay.run",
        "benchmarks: `bench replay TRACE` replays a trace over gloo and gradlane",
    ),
    "testbed": (
        "gradlane.bench.testbed.cli",
        "the emulated leaf-spine of network namespaces: testbed up|down|status",
    ),
}


def emit(text: str = "", *, err: bool = False) -> None:
    """Write one line of user-facing output (stdout, or stderr with ``err``)."""
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()


def progress(text: str, *, done: bool = False) -> None:
    """Redraw one status line on stderr (a progress bar); ``done`` ends it with a newline.

    Off a terminal (logs, CI) only the ``done`` lines are written.
    """
    if sys.stderr.isatty():
        sys.stderr.write("\r" + text + "\x1b[K" + ("\n" if done else ""))
    elif done:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradlane",
        description="gradlane: a network transport for data-parallel gradient traffic "
        "(priorities, bounded loss with deadlines, multipath).",
    )
    parser.add_argument("--version", action="version", version=f"gradlane {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Arguments are declared by the subcommand's module, loaded only for that subcommand.
        if argv and argv[0] == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradlane`` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(argv)
    args = parser.parse_args(argv)
    module = getattr(args, "_module", None)
    if module is None:
        parser.print_help()
        return 0
    run: Callable[[argparse.Namespace], int] = importlib.import_module(module).run
    return int(run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
