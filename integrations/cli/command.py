"""What a ``gradlane`` subcommand is made of: :class:`Command`, :func:`emit`, :class:`RunProgress`.

A package registers a subcommand by naming a :class:`Command` in the ``gradlane.commands``
entry-point group of its distribution::

    [project.entry-points."gradlane.commands"]
    demo = "gradlane.bench.demo.cli:COMMAND"

``gradlane`` loads every registered command to list them, so the module that holds a
``Command`` must be light: it imports neither torch nor numba, and a command whose code does
builds itself with :meth:`Command.lazy`, which imports that code only when the command is
chosen. This module also holds the two commands of :mod:`gradlane.integrations.cli` itself,
``daemon`` and ``stats``.

All user-facing output of the package goes through :func:`emit` (STYLE rule 10); progress bars
are drawn by tqdm.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["DAEMON", "STATS", "Command", "CommandModule", "RunProgress", "emit"]


def emit(text: str = "", *, err: bool = False) -> None:
    """Write one line of user-facing output (stdout, or stderr with ``err``)."""
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()


class CommandModule(Protocol):
    """A module that implements a subcommand: its arguments and what it does."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare the subcommand's options on ``parser``."""

    def run(self, args: argparse.Namespace) -> int:
        """Run the subcommand; returns the process exit code."""


@dataclass(frozen=True)
class Command:
    """One subcommand of ``gradlane``.

    ``add_arguments(parser)`` is called only when the subcommand is chosen (``gradlane NAME
    ...``), then ``run(args)`` with the parsed options; it returns the exit code.
    """

    help: str
    """One line, shown by ``gradlane --help`` and as the subcommand's description."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    @classmethod
    def lazy(cls, help: str, load: Callable[[], CommandModule]) -> Command:
        """A command whose code ``load()`` imports (a function with an ``import`` statement
        inside), the first time the command's options or run are needed."""

        def add_arguments(parser: argparse.ArgumentParser) -> None:
            load().add_arguments(parser)

        def run(args: argparse.Namespace) -> int:
            return load().run(args)

        return cls(help=help, add_arguments=add_arguments, run=run)


class RunProgress:
    """Progress bars on stderr, one per named run, fed ``update(name, step, steps)``.

    On a terminal each run draws a live tqdm bar, left in place once the run is done; elsewhere
    (logs, CI, pytest) only a finished run's line is written, through :func:`emit`. Step 0
    announces a run that has not stepped yet (``note`` says what it is doing meanwhile). A
    run's clock starts at the first step it reports, so its rate counts the steps after that
    one and leaves out any warm-up. Runs may interleave. Use it as a context manager, so that
    an interrupted run's bar ends its line.
    """

    def __init__(self, label_width: int = 8, unit: str = "step") -> None:
        self._label_width = label_width
        self._unit = unit
        self._live = sys.stderr.isatty()
        self._bars: dict[str, Any] = {}  # name -> its tqdm bar (on a terminal)
        self._first: dict[str, tuple[float, int]] = {}  # name -> (monotonic time, step) of the
        # first step it reported

    def update(self, name: str, step: int, steps: int, note: str = "") -> None:
        """Run ``name`` is at ``step`` of ``steps``; ``note``: what it is doing, if not stepping."""
        label = f"  {name:<{self._label_width}}"
        first = step > 0 and name not in self._first
        if first:
            self._first[name] = (time.monotonic(), step)
        if self._live:
            self._draw(name, label, step, steps, note, first)
        if step >= steps:
            self._finish(name, label, steps)

    def _draw(self, name: str, label: str, step: int, steps: int, note: str, first: bool) -> None:
        from tqdm import tqdm  # noqa: PLC0415 (only a running command draws bars)

        bar = self._bars.get(name)
        if bar is not None and first:  # the announcement's bar gives its line to the run's
            bar.close()
            bar = None
        if bar is None:
            bar = tqdm(
                total=steps,
                initial=step,
                desc=label,
                unit=self._unit,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=step > 0,
            )
            self._bars[name] = bar
        bar.set_postfix_str(note, refresh=False)
        bar.n = step
        bar.refresh()

    def _finish(self, name: str, label: str, steps: int) -> None:
        from tqdm import tqdm  # noqa: PLC0415 (only a running command draws bars)

        bar = self._bars.pop(name, None)
        started, initial = self._first.pop(name, (time.monotonic(), steps))
        if bar is not None:
            bar.close()
            return
        line = tqdm.format_meter(
            steps,
            steps,
            time.monotonic() - started,
            prefix=label,
            ascii=True,
            unit=self._unit,
            initial=initial,
        )
        emit(line, err=True)

    def close(self) -> None:
        """End the bars of unfinished runs (their lines stay as they were)."""
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the commands of this package ------------------------------------------------------------------
def _daemon() -> CommandModule:
    from gradlane.integrations.cli import daemon  # noqa: PLC0415 (the command's code: torch)

    return daemon


def _stats() -> CommandModule:
    from gradlane.integrations.cli import stats  # noqa: PLC0415 (the command's code: numba)

    return stats


#: ``gradlane daemon``
DAEMON = Command.lazy(
    "run this host's transport daemon (trainers connect with GRADLANE_MODE=daemon)", _daemon
)
#: ``gradlane stats``
STATS = Command.lazy("print a gradlane daemon's metrics", _stats)
