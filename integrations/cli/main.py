"""The ``gradlane`` command line: the subcommands registered in the ``gradlane.commands`` group.

Every distribution may add subcommands through the entry-point group ``gradlane.commands``
(see :mod:`gradlane.integrations.cli.command`); gradlane's own are declared in its
``pyproject.toml``, each by the package that owns it, so this module imports none of them.
Listing them loads each entry point's light :class:`~gradlane.integrations.cli.command.Command`;
a command's options and code are loaded only when it is chosen, so ``gradlane --help`` stays
fast and imports neither torch nor numba. A command that fails to load is skipped with a line
on stderr: a broken plugin does not break the others.

All user-facing output of the package goes through :func:`emit` (STYLE rule 10).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from gradlane.integrations.cli.command import Command, emit
from gradlane.transport import __version__

__all__ = ["GROUP", "commands", "emit", "main"]

#: The entry-point group that registers subcommands.
GROUP = "gradlane.commands"


def commands() -> dict[str, Command]:
    """The registered subcommands by name, in the order of their distributions' metadata.

    An entry point that fails to load, or loads something that is not a command (no ``help``,
    ``add_arguments`` and ``run``), is skipped with a line on stderr; of two with one name, the
    first found is kept.
    """
    found: dict[str, Command] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in found:
            continue
        try:
            command = ep.load()
        except Exception as e:  # a plugin may fail in any way; it must not take the CLI down
            emit(f"gradlane: skipping command {ep.name!r} ({ep.value}): {type(e).__name__}: {e}",
                 err=True)  # fmt: skip
            continue
        if not all(hasattr(command, a) for a in ("help", "add_arguments", "run")):
            emit(f"gradlane: skipping command {ep.name!r} ({ep.value}): not a Command", err=True)
            continue
        found[ep.name] = command
    return found


def _parser(argv: Sequence[str], registered: dict[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradlane",
        description="gradlane: a network transport for data-parallel gradient traffic "
        "(priorities, bounded loss with deadlines, multipath).",
    )
    parser.add_argument("--version", action="version", version=f"gradlane {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in registered.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        p.set_defaults(_run=command.run)
        # Only the chosen command declares its options: declaring them may import its code.
        if argv and argv[0] == name:
            command.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradlane`` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(argv, commands())
    args = parser.parse_args(argv)
    args.argv = argv  # the command line as given (results files record it)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 0
    return int(run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
