"""What every phase of the hardening campaign shares: the engines' configuration, the ranks'
inputs, time budgets, and readings of processes and sockets from ``/proc``.

Everything here is loopback-only and bounded: :class:`Budget` is the one clock a phase checks
before each wait, and every reading of ``/proc`` returns None (not an exception) for a process
or socket that is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.config import TransportConfig, loopback_config

__all__ = [
    "JOB",
    "SECRET",
    "Budget",
    "PhaseTimeout",
    "check_loopback",
    "die_with_parent",
    "engine_config",
    "fd_count",
    "input_sets",
    "isolate_cpus",
    "memory_mb",
    "udp_socket_drops",
]

#: The campaign's job token (engines and daemons); far from the defaults a real job uses.
JOB = 0x6A7D
#: The job secret of keyed engines: the spray attacks engines whose packets carry a MAC, as a
#: job under a rendezvous store has. Known to the campaign only to sign the packets a peer
#: could send (replays are verbatim; everything else is forged without it).
SECRET = "hardening-campaign"
#: Input sets the ranks cycle through (step s uses set s % INPUT_SETS).
INPUT_SETS = 4


#: ``prctl`` option: the signal a process gets when its parent exits (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits, even by SIGKILL, so nothing a
    campaign starts outlives it (elsewhere, or when refused, nothing happens)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


class PhaseTimeout(RuntimeError):
    """A phase ran past its time budget (the message says where)."""


@dataclass
class Budget:
    """A phase's time limit: every wait asks :meth:`left` for its timeout, and :meth:`check`
    raises :class:`PhaseTimeout` once the limit has passed."""

    seconds: float
    name: str = "phase"

    def __post_init__(self) -> None:
        self._end = time.monotonic() + self.seconds

    def left(self, floor: float = 0.1) -> float:
        """Seconds left (at least ``floor``, so a last wait still gets a chance)."""
        return max(self._end - time.monotonic(), floor)

    def expired(self) -> bool:
        """True once the limit has passed."""
        return time.monotonic() >= self._end

    def check(self, where: str) -> None:
        """Raise :class:`PhaseTimeout` naming ``where`` once the limit has passed."""
        if self.expired():
            raise PhaseTimeout(f"{self.name}: over its {self.seconds:.0f}s budget at {where}")


def engine_config(
    secret: str | None, hard_deadline_s: float, *, n_paths: int = 2, **overrides: Any
) -> TransportConfig:
    """The ranks' transport: :func:`loopback_config` (``n_paths`` paths, 65000-byte chunks) with
    an exact all-reduce that fails at ``hard_deadline_s``; keyed tags with ``secret``. The
    spray's offline recorder builds the same, so its packets are the engines' own."""
    return loopback_config(
        n_paths=n_paths,
        job=JOB,
        secret=secret if secret else "off",
        loss=LossConfig(
            loss_bound=0.0,
            hard_deadline_s=hard_deadline_s,
            soft_deadline_max_s=min(0.5, hard_deadline_s),
            on_hard_deadline="raise",
        ),
        **overrides,
    )


def input_sets(seed: int, world: int, n: int) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
    """The ranks' buckets and their sums: ``inputs[k][r]`` is rank ``r``'s bucket in set ``k``
    (seeded), ``sums[k]`` their float32 sum in rank order (exact for two ranks, whose sum is
    the same in either order)."""
    inputs = [
        [
            np.random.default_rng([seed, r, k]).standard_normal(n).astype(np.float32)
            for r in range(world)
        ]
        for k in range(INPUT_SETS)
    ]
    sums = []
    for k in range(INPUT_SETS):
        total = inputs[k][0].copy()
        for r in range(1, world):
            total += inputs[k][r]
        sums.append(total)
    return inputs, sums


#: The core the sprayer runs on when the machine has more than one (the ranks get the others):
#: a remote attacker's CPU is not its victim's, and on a small host the sprayer's own work (its
#: system calls carry the loopback delivery too) would otherwise be charged to the engines.
SPRAY_CPU = 0


def isolate_cpus(pids: list[int]) -> dict[str, list[int]] | None:
    """Pin every thread of the processes ``pids`` to all cores but :data:`SPRAY_CPU`; the
    cores each side gets, or None where there are not two cores to split (or no affinity)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if len(cores) < 2 or SPRAY_CPU not in cores:
        return None
    rest = [c for c in cores if c != SPRAY_CPU]
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, rest)
    return {"spray": [SPRAY_CPU], "ranks": rest}


def check_loopback(host: str) -> str:
    """``host`` if it is in 127.0.0.0/8, else ``ValueError``: the campaign sends nowhere else."""
    packed = socket.inet_aton(host)
    if packed[0] != 127:
        raise ValueError(f"{host} is not a loopback address (127.0.0.0/8)")
    return host


# -- readings from /proc --------------------------------------------------------------------------
def memory_mb(pid: int, arena_bytes: int) -> tuple[float, float] | None:
    """``(resident MiB, of which the receive arena)`` of process ``pid``, from its ``smaps``
    (None when it is gone). The arena is the endpoint's preallocated receive buffer
    (``arena_bytes``, one mapping of that size rounded up to pages): the kernel makes its pages
    resident only as deep as batches of datagrams reach, so a flood touches more of it once
    and for good, which is neither growth nor a leak, and is reported apart."""
    total = arena = 0
    size = 0
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    lo, hi = line.split(" ", 1)[0].split("-")
                    size = int(hi, 16) - int(lo, 16)
                elif line.startswith("Rss:"):
                    kb = int(line.split()[1])
                    total += kb
                    if arena_bytes <= size <= arena_bytes + 2 * 4096:
                        arena += kb
    except (OSError, ValueError):
        return None
    return total / 1024.0, arena / 1024.0


def fd_count(pid: int) -> int | None:
    """Open file descriptors of process ``pid`` (None when it is gone or unreadable)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def udp_socket_drops(addrs: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, int]]:
    """``(drops, rx_queue bytes)`` of the IPv4 UDP sockets bound to ``addrs``, from
    ``/proc/net/udp``: the datagrams the kernel dropped at each socket (a full receive buffer)
    since it was opened, and what it still holds unread. Addresses not found are left out."""
    want = {(socket.inet_aton(h), p): (h, p) for h, p in addrs}
    out: dict[tuple[str, int], tuple[int, int]] = {}
    try:
        with open("/proc/net/udp") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        cols = line.split()
        if len(cols) < 13:
            continue
        ip_hex, port_hex = cols[1].split(":")
        # The address is the raw 32-bit value printed in host order (%08X): on a little-endian
        # host 127.0.0.1 reads 0100007F.
        ip = int(ip_hex, 16).to_bytes(4, "little" if _LITTLE else "big")
        key = want.get((ip, int(port_hex, 16)))
        if key is not None:
            rx_queue = int(cols[4].split(":")[1], 16)
            out[key] = (int(cols[12]), rx_queue)
    return out


_LITTLE = np.little_endian
