"""Trace replay: record DDP bucket traces (:mod:`.record`), synthesise them (:mod:`.synth`) and
replay them over gloo and gradlane (:mod:`.run`, :mod:`.rank`, :mod:`.report`).

:data:`COMMAND` is ``gradlane bench`` (the ``gradlane.commands`` entry-point group): it imports
:mod:`.run`, which imports torch and numba, only when that subcommand is chosen.
"""

from __future__ import annotations

from gradlane.integrations.cli.command import Command, CommandModule


def _run() -> CommandModule:
    from gradlane.bench.replay import run

    return run


#: ``gradlane bench``
COMMAND = Command.lazy(
    "benchmarks: `bench replay TRACE` replays a trace over gloo and gradlane", _run
)
