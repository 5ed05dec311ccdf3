"""Random loss and delay on one testbed path, in userspace (so no kernel needs netem).

Theory of operation
-------------------
The impairment lives in the spine's namespace, so real packets on the real path go through it.
:func:`start` adds a veth pair ``imA``/``imB`` inside the spine, starts the forwarder process
(:mod:`gradlane.bench.testbed.impair_forwarder`), and only then makes the spine's own forwarding
drop what arrives on the impaired ports (``ip rule add iif l{h} blackhole``: policy routing, applied
after packet taps have handed the forwarder its copy). The forwarder drops a seeded-random
fraction, delays the rest and sends them into ``imA``; they arrive on ``imB`` and the spine routes
them as usual: same egress port, same htb queue. Non-IP frames (ARP) stay with the kernel.

Teardown is the reverse: the rules go first (the kernel forwards again), then the forwarder stops
and reports its counters, then the veth pair is deleted. ``gso_max_segs 1`` on every testbed
interface makes each frame one wire packet, so ``loss`` is a per-packet probability. A 1 Gbit/s
path of jumbo frames is some 14,000 frames a second, few enough for a Python forwarder; its
counters (``received``, ``dropped``, ``forwarded``, ``overrun``) say what it saw.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from gradlane.bench.testbed.impair_forwarder import IN_DEV, OUT_DEV
from gradlane.bench.testbed.netns import Testbed, TestbedError, finish, read_ready
from gradlane.transport.errors import ConfigError

__all__ = ["ImpairSpec", "Impairment", "start"]

READY_TIMEOUT_S = 20.0
RULE_PRIO = 100


@dataclass(frozen=True)
class ImpairSpec:
    """An impairment of the traffic crossing one spine.

    Attributes:
        spine: the spine (path) to impair.
        loss: probability that a packet is dropped, in [0, 1).
        delay_ms: extra one-way delay per packet in milliseconds (each crossing).
        jitter_ms: uniform extra delay in ``[0, jitter_ms]`` (reorders packets).
        seed: seed of the loss/jitter RNG (the same seed, the same drops for the same packets).
        hosts: impair only packets entering the spine from these hosts' leaves (default all).
    """

    spine: int = 0
    loss: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    seed: int = 0
    hosts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.loss < 1.0:
            raise ConfigError(f"loss must be in [0, 1), got {self.loss}")
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not 0.0 <= value <= 10_000.0:
                raise ConfigError(f"{name} must be in [0, 10000] ms, got {value}")
        if self.loss == 0 and self.delay_ms == 0 and self.jitter_ms == 0:
            raise ConfigError("an impairment needs loss, delay_ms or jitter_ms > 0")


class Impairment:
    """A running impairment; :meth:`stop` removes it and returns the forwarder's counters."""

    def __init__(self, bed: Testbed, spec: ImpairSpec) -> None:
        self.bed = bed
        self.spec = spec
        self.ns = f"{bed.spec.prefix}-s{spec.spine}"
        hosts = range(bed.spec.hosts) if spec.hosts is None else spec.hosts
        self.ports = [f"l{h}" for h in hosts]
        self._proc: subprocess.Popen[str] | None = None
        self._rules = False
        self.stats: dict[str, Any] | None = None

    @property
    def pid(self) -> int | None:
        """Process id of the forwarder (``None`` before it started)."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> Impairment:
        """Set up the veth pair, start the forwarder, then divert the ports to it."""
        mtu = self.bed.spec.mtu
        r = self.bed.runner
        try:
            r.batch(
                "ip",
                self.ns,
                [
                    f"link add {OUT_DEV} type veth peer name {IN_DEV}",
                    f"link set {OUT_DEV} mtu {mtu} gso_max_segs 1 up",
                    f"link set {IN_DEV} mtu {mtu} gso_max_segs 1 up",
                ],
            )
        except TestbedError as exc:
            raise TestbedError(f"spine {self.spec.spine} is already impaired ({exc})") from exc
        s = self.spec
        argv = [
            sys.executable,
            "-m",
            "gradlane.bench.testbed.impair_forwarder",
            "--ports",
            ",".join(self.ports),
        ]
        argv += ["--loss", str(s.loss), "--delay-ms", str(s.delay_ms)]
        argv += ["--jitter-ms", str(s.jitter_ms), "--seed", str(s.seed)]
        try:
            self._proc = self.bed.spawn(
                self.ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            read_ready(self._proc, READY_TIMEOUT_S, f"impairment forwarder on {self.ns}")
            self._rules = True
            r.batch(
                "ip",
                self.ns,
                [f"rule add iif {port} blackhole prio {RULE_PRIO}" for port in self.ports],
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> dict[str, Any]:
        """Restore kernel forwarding, stop the forwarder (reaped), delete the veth pair."""
        if self.stats is not None:
            return self.stats
        r = self.bed.runner
        if self._rules:
            for port in self.ports:
                r.run(
                    ["ip", "-n", self.ns, "rule", "del", "iif", port, "prio", str(RULE_PRIO)],
                    check=False,
                )
        stats = finish(self._proc) if self._proc is not None else {}
        r.run(["ip", "-n", self.ns, "link", "del", OUT_DEV], check=False)
        self.bed.disown(self)
        self.stats = stats
        return stats


def start(bed: Testbed, spine: int, **kw: Any) -> Impairment:
    """Impair everything entering spine ``spine`` (see :class:`ImpairSpec` for ``kw``).

    The testbed removes it at ``down`` if the caller does not.
    """
    if not 0 <= spine < bed.spec.spines:
        raise ConfigError(f"spine {spine} out of range [0, {bed.spec.spines})")
    spec = ImpairSpec(spine=spine, **kw)
    bad = [h for h in spec.hosts or () if not 0 <= h < bed.spec.hosts]
    if bad:
        raise ConfigError(f"hosts {bad} out of range [0, {bed.spec.hosts})")
    imp = Impairment(bed, spec)
    bed.own(imp)
    return imp.start()
