"""Testbeds whose owner died: the namespaces a killed run left behind.

A run removes its testbed whatever happens in Python (``with Testbed``), but not when its process
is killed (SIGKILL, the out-of-memory killer, a session that ends under it). The replay and the
demo name their testbeds after their process, ``{kind}{pid mod 10^6}`` (``rp…``, ``dm…``), so
before building one they remove the testbeds of their kind whose owner no longer exists
(:func:`sweep_orphans`). A namespace is left alone while any process could own it: every pid
``n + k·10^6`` up to ``pid_max`` is checked, and a namespace with a process inside is not an
orphan. Root only: an unprivileged testbed lives in a user namespace that dies with its holder.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

from gradlane.bench.testbed.netns import (
    TestbedError,
    TestbedUnavailable,
    down_all,
    privilege,
    root_namespaces,
)
from gradlane.transport.errors import ConfigError

__all__ = ["PID_MOD", "owned_prefix", "owner_alive", "sweep_orphans"]

log = logging.getLogger(__name__)

#: Testbed prefixes carry the owner's pid modulo this (a prefix is at most 8 characters).
PID_MOD = 1_000_000
_PID_MAX_DEFAULT = 1 << 22  # Linux's largest pid_max on 64-bit


def owned_prefix(kind: str) -> str:
    """The testbed prefix of this process for ``kind`` (a short lowercase word, e.g. ``"rp"``)."""
    return f"{kind}{os.getpid() % PID_MOD}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


def owner_alive(n: int) -> bool:
    """True while some process could own prefix number ``n`` (a pid ≡ ``n`` mod ``PID_MOD``)."""
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = _PID_MAX_DEFAULT
    return any(_alive(pid) for pid in range(n, pid_max + 1, PID_MOD) if pid > 0)


def sweep_orphans(kind: str) -> list[str]:
    """Remove the testbeds ``{kind}{n}-*`` whose owner is gone and that hold no process; returns
    the namespaces removed. Never raises for what it cannot do (no root, ``ip`` failing): the
    names are then left for ``gradlane testbed down --prefix …``."""
    try:
        if privilege() != "root":
            return []
        inside = root_namespaces()
    except (TestbedUnavailable, TestbedError, OSError, subprocess.SubprocessError):
        return []
    pattern = re.compile(rf"^{re.escape(kind)}(\d+)-[hls]\d+$")
    owners: dict[int, list[str]] = {}
    for ns in inside:
        m = pattern.match(ns)
        if m:
            owners.setdefault(int(m.group(1)), []).append(ns)
    removed: list[str] = []
    for n, spaces in sorted(owners.items()):
        if owner_alive(n) or any(inside[ns] for ns in spaces):
            continue  # a process could own it, or something still runs inside: not ours to end
        try:
            removed += [r for r in down_all(f"{kind}{n}") if r in spaces]
        except (TestbedError, OSError, subprocess.SubprocessError, ConfigError) as exc:
            log.warning("could not remove the orphaned testbed %s%d: %s", kind, n, exc)
    if removed:
        log.warning("removed %d namespaces of killed runs: %s", len(removed), " ".join(removed))
    return removed
