"""Pure scheduling policy for gradlane: priority classes, loss budget and deadlines, path choice,
pacing and congestion control.

Nothing here does I/O, reads a clock or uses global randomness: ``now`` is a parameter (seconds)
and randomness comes from a ``numpy.random.Generator`` passed in, so the same policies run in the
real engine, in the network simulator and in deterministic tests. The package imports nothing
from ``transport``, ``integrations`` or ``bench``.
"""

from gradlane.scheduling.errors import ConfigError, GradlaneError
from gradlane.scheduling.loss import Decision, LossConfig, LossPolicy, Verdict
from gradlane.scheduling.pacing import (
    CongestionController,
    FixedRate,
    LossTolerant,
    Pacer,
    PacingConfig,
    controller_names,
    make_controller,
    register_controller,
)
from gradlane.scheduling.paths import PathConfig, PathSet, PathState
from gradlane.scheduling.priority import (
    Classes,
    PriorityConfig,
    PriorityPolicy,
    make_priority_policy,
    priority_policy_names,
    register_priority_policy,
    send_order_key,
)

__all__ = [
    "Classes",
    "ConfigError",
    "CongestionController",
    "Decision",
    "FixedRate",
    "GradlaneError",
    "LossConfig",
    "LossPolicy",
    "LossTolerant",
    "Pacer",
    "PacingConfig",
    "PathConfig",
    "PathSet",
    "PathState",
    "PriorityConfig",
    "PriorityPolicy",
    "Verdict",
    "controller_names",
    "make_controller",
    "make_priority_policy",
    "priority_policy_names",
    "register_controller",
    "register_priority_policy",
    "send_order_key",
]
