"""A deterministic discrete-event network simulator that drives the real sans-I/O cores.

:data:`COMMAND` is ``gradlane netsim`` (the ``gradlane.commands`` entry-point group): it imports
:mod:`.scenarios`, which imports numba, only when that subcommand is chosen.
"""

from __future__ import annotations

from gradlane.integrations.cli.command import Command, CommandModule


def _scenarios() -> CommandModule:
    from gradlane.bench.sim import scenarios

    return scenarios


#: ``gradlane netsim``
COMMAND = Command.lazy("all-reduce scenarios on the simulated network", _scenarios)
