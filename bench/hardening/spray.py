"""Phase 1, the spray: live collectives between two engines while their ports are flooded.

Theory of operation
-------------------
Two rank processes (:class:`~gradlane.bench.hardening.ranks.RankGroup`, keyed tags unless
``--unkeyed``) warm up, then run a quiet stretch of collectives (the baseline times), and the
parent records the real packets of some of those finished collectives offline
(:func:`~gradlane.bench.hardening.forge.record_packets`). Then, for each flood *level* (a rate in
datagrams per second, 0 = as fast as the sprayer goes), a :class:`~gradlane.bench.hardening.
blaster.Sprayer` sprays every path address of both engines while the ranks all-reduce, until
the level's share of the datagrams has gone and at least ``min_collectives`` ran. Every result
is compared with the exact sum; every failure is counted. A sampler reads the ranks' resident
memory meanwhile. After the last level the engines are left idle for longer than anything is
held (the linger time, or the hard deadline), a few quiet collectives run, and memory is read
again.

Accounting
----------
Every datagram that reaches an engine's receive socket is either dropped there by the kernel
(``drops`` of ``/proc/net/udp``: the spray is *not* paced to avoid those, they are read and
included) or read by the engine (``udp.rx_datagrams`` of its stats), and every datagram read
is counted exactly once by the endpoint: accepted, rejected by reason, answered as ``late``,
dropped for want of early-buffer room (``early_dropped``) or expired there (``early_expired``).
So, over the engines' whole life (their own traffic included, since the spray's cannot be told
from it on a socket)::

    delivery:    sprayed + Σ engine tx_datagrams  =  Σ (rx_datagrams + socket drops)
    processing:  rx_datagrams  =  accepted + Σ rejected + late + early_dropped + early_expired

``unaccounted_datagrams`` is the sum of the absolute differences (delivery once, processing per
engine); it is 0 when every sprayed datagram shows up in a counter.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gradlane.bench.hardening.blaster import Sprayer
from gradlane.bench.hardening.common import (
    Budget,
    engine_config,
    fd_count,
    isolate_cpus,
    memory_mb,
    udp_socket_drops,
)
from gradlane.bench.hardening.forge import DEFAULT_MIX, PacketFactory, record_packets
from gradlane.bench.hardening.ranks import RankGroup
from gradlane.transport.core.endpoint import RX_BATCH

__all__ = ["SprayOptions", "run_spray"]

#: Collectives run before anything is measured (kernel caches, first buffers).
WARM_STEPS = 8
#: Finished collectives whose packets are recorded for replays and mutations.
RECORDED = 6
#: Datagrams of the unmetered burst before the baseline is read.
BURST = 4096
#: How often the memory sampler reads the ranks' RSS.
SAMPLE_S = 0.1


@dataclass(frozen=True)
class SprayOptions:
    """The spray phase's sizes (see ``--help`` of the campaign)."""

    datagrams: int = 1_050_000
    """Datagrams to spray in all (split evenly over the levels; a minimum)."""
    levels: tuple[float, ...] = (20_000.0, 50_000.0, 100_000.0)
    """Flood rates in datagrams per second, one stretch of collectives each (0: unpaced). The
    worst level, whose median sets ``flood_slowdown_p50``, is the highest rate (0 above all)."""
    min_collectives: int = 200
    """Collectives per level at least."""
    quiet_collectives: int = 100
    """Collectives of the quiet baseline."""
    elems: int = 262_144
    """float32 elements per bucket (1 MiB)."""
    secret: str | None = "hardening-campaign"
    hard_deadline_s: float = 5.0
    seed: int = 0
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))


class _Sampler(threading.Thread):
    """Reads the memory of ``pids`` (:func:`memory_mb`) every :data:`SAMPLE_S` until stopped;
    keeps each one's peak, resident and resident apart from the receive arena."""

    def __init__(self, pids: list[int], arena_bytes: int) -> None:
        super().__init__(name="gl-hardening-rss", daemon=True)
        self.pids = pids
        self.arena_bytes = arena_bytes
        self.peak = {p: (0.0, 0.0) for p in pids}  # (resident, resident apart from the arena)
        self._halt = threading.Event()

    def run(self) -> None:
        """Sample until stopped."""
        while not self._halt.wait(SAMPLE_S):
            for p in self.pids:
                m = memory_mb(p, self.arena_bytes)
                if m is not None:
                    raw, net = self.peak[p]
                    self.peak[p] = (max(raw, m[0]), max(net, m[0] - m[1]))

    def stop(self) -> dict[int, tuple[float, float]]:
        """Stop and return the peaks."""
        self._halt.set()
        self.join(5.0)
        return self.peak


def _memory(pids: list[int], arena_bytes: int) -> dict[int, tuple[float, float, float]]:
    """(resident, receive arena, resident apart from it) in MiB, per pid (zeros when gone)."""
    out = {}
    for p in pids:
        raw, arena = memory_mb(p, arena_bytes) or (0.0, 0.0)
        out[p] = (raw, arena, raw - arena)
    return out


class _Clock:
    """Seconds between named moments of the phase (where its time goes)."""

    def __init__(self) -> None:
        self._t = time.monotonic()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        """The time since the last lap, under ``name``."""
        now = time.monotonic()
        self.laps[name] = round(now - self._t, 3)
        self._t = now


def _loop(ranks: RankGroup, first: int, budget: Budget, **args: Any) -> list[dict[str, Any]]:
    """Run a fixed-length ``loop`` on every rank and collect the answers."""
    ranks.send_all("loop", {"first_step": first, **args})
    return [ranks.receive(r, "loop", budget.left()) for r in range(ranks.world)]


def _step_times(answers: list[dict[str, Any]]) -> list[float]:
    """Per step, the slowest rank's time (steps every rank completed)."""
    n = min(len(a["times_s"]) for a in answers)
    return [max(a["times_s"][i] for a in answers) for i in range(n)]


def _tally(answers: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(collectives run, exact results on every rank, failed) of one stretch: a collective
    that fails on any rank counts once (a rank's loop ends at its first failure)."""
    run = max(a["steps"] + (a["error"] is not None) for a in answers)
    exact = min(a["exact"] for a in answers)
    failed = max(int(a["error"] is not None) for a in answers)
    return run, exact, failed


def run_spray(opts: SprayOptions, budget: Budget) -> dict[str, Any]:
    """Run the phase; returns its JSON section (``summary`` keys and details)."""
    out: dict[str, Any] = {"options": {**opts.__dict__, "secret": bool(opts.secret)}}
    common = {"n": opts.elems, "seed": opts.seed, "wait_s": opts.hard_deadline_s * 3}
    clock = _Clock()
    with RankGroup(2, opts.secret, opts.hard_deadline_s) as ranks:
        clock.lap("start")
        pids = ranks.pids
        # Quiet and flooded alike: the ranks on their cores, the sprayer on its own.
        cpus = isolate_cpus(pids)
        out["cpus"] = cpus
        spray_cpu = cpus["spray"][0] if cpus else None
        _loop(ranks, 1, budget, max_steps=WARM_STEPS, **common)
        first = WARM_STEPS + 1
        quiet = _loop(ranks, first, budget, max_steps=opts.quiet_collectives, **common)
        q_run, q_exact, q_failed = _tally(quiet)
        quiet_times = _step_times(quiet)
        first += opts.quiet_collectives
        clock.lap("quiet")
        cfg = engine_config(opts.secret, opts.hard_deadline_s)
        hold = max(opts.hard_deadline_s, cfg.linger_s) + 1.0
        recorded_steps = [first - 1 - i for i in range(RECORDED)] + [1, 2]
        real = record_packets(cfg, 2, recorded_steps, opts.elems, opts.seed)
        factory = PacketFactory(
            cfg,
            2,
            real,
            np.random.default_rng([opts.seed, 0x5B2A]),
            lambda r: int(ranks.steps[r]),
        )
        targets = [(r, a) for r in range(2) for a in ranks.addrs[r]]
        clock.lap("record")
        # An unmetered burst first, then idle past every hold: the receive arena (512 rows of
        # a datagram each, touched only as deep as batches go) and the reject paths' first
        # allocations belong in the baseline, not in the flood's growth.
        burst = _burst(factory, targets, opts, spray_cpu)
        sprayed = 0
        time.sleep(min(hold, budget.left()))
        arena = RX_BATCH * cfg.slot_bytes
        baseline = _memory(pids, arena)
        fds0 = {p: fd_count(p) for p in pids}
        clock.lap("burst")
        per_level = -(-opts.datagrams // max(len(opts.levels), 1))
        levels: list[dict[str, Any]] = []
        by_category: dict[str, int] = {}
        peaks = {p: (baseline[p][0], baseline[p][2]) for p in pids}
        for i, rate in enumerate(opts.levels):
            budget.check(f"flood level {i}")
            level = _flood(
                ranks, factory, targets, opts, rate, per_level, first, budget, i, arena, spray_cpu
            )
            first = level.pop("next_step")
            for p, (raw, net) in level.pop("rss_peak").items():
                peaks[p] = (max(peaks[p][0], raw), max(peaks[p][1], net))
            sprayed += level["datagrams_sent"]
            for k, v in level["by_category"].items():
                by_category[k] = by_category.get(k, 0) + v
            levels.append(level)
        clock.lap("levels")
        # Idle past the longest anything is held (early data, tombstones), then quiet steps.
        time.sleep(min(hold, budget.left()))
        after = _loop(ranks, first, budget, max_steps=20, **common)
        a_run, a_exact, a_failed = _tally(after)
        rss_after = _memory(pids, arena)
        fds_after = {p: fd_count(p) for p in pids}
        stats = ranks.stats()
        sockets = udp_socket_drops([a for r in range(2) for a in ranks.addrs[r]])
        accounting = _account(stats, sockets, ranks.addrs, burst + sprayed)
        clock.lap("after")
    flood_run = sum(lv["collectives"] for lv in levels)
    flood_exact = sum(lv["exact"] for lv in levels)
    flood_failed = sum(lv["failed"] for lv in levels)
    quiet_med = float(np.median(quiet_times)) if quiet_times else float("nan")
    worst = max(levels, key=lambda lv: lv["rate"] or float("inf")) if levels else None
    out.update(
        quiet={"collectives": q_run, "exact": q_exact, "failed": q_failed, "median_s": quiet_med},
        levels=levels,
        after={"collectives": a_run, "exact": a_exact, "failed": a_failed},
        by_category=by_category,
        recorded_packets=len(real),
        burst_datagrams=burst,
        memory_mb={
            "note": "per rank: resident, receive arena (preallocated, resident as deep as "
            "batches reach), resident apart from the arena; the summary uses the last",
            "baseline": [baseline[p] for p in pids],
            "peak": [(peaks[p][0], None, peaks[p][1]) for p in pids],
            "after": [rss_after[p] for p in pids],
        },
        fds_before=list(fds0.values()),
        fds_after=list(fds_after.values()),
        accounting=accounting,
        seconds=clock.laps,
        summary={
            "datagrams_sent": sprayed,
            "spray_collectives": flood_run,
            "collectives_exact_fraction": flood_exact / flood_run if flood_run else None,
            "collectives_failed_by_injection": flood_failed,
            "unaccounted_datagrams": accounting["unaccounted_datagrams"],
            "socket_drops": accounting["socket_drops"],
            "rss_growth_mb_under_flood": max(peaks[p][1] - baseline[p][2] for p in pids),
            "rss_after_flood_mb_over_baseline": max(rss_after[p][2] - baseline[p][2] for p in pids),
            "flood_slowdown_p50": worst["median_s"] / quiet_med if worst else None,
            "quiet_exact_after_flood": a_exact == a_run and a_failed == 0,
        },
    )
    return out


def _burst(
    factory: PacketFactory,
    targets: list[tuple[int, tuple[str, int]]],
    opts: SprayOptions,
    spray_cpu: int | None,
) -> int:
    """:data:`BURST` datagrams of the mix, unpaced, with no collective running; returns how
    many went (they count in the accounting like any other)."""
    rng = np.random.default_rng([opts.seed, 0xB0B])
    sprayer = Sprayer(factory, targets, opts.mix, rng, rate=0.0, quota=BURST, cpu=spray_cpu)
    sprayer.start()
    sprayer.join(60.0)
    sprayer.stop()
    if sprayer.error is not None:
        raise RuntimeError(f"the sprayer failed: {sprayer.error!r}") from sprayer.error
    return sprayer.sent


def _flood(
    ranks: RankGroup,
    factory: PacketFactory,
    targets: list[tuple[int, tuple[str, int]]],
    opts: SprayOptions,
    rate: float,
    quota: int,
    first: int,
    budget: Budget,
    index: int,
    arena_bytes: int,
    spray_cpu: int | None,
) -> dict[str, Any]:
    """One flood level: spray while the ranks loop, stop both once the quota and the minimum
    count of collectives are reached (or the budget runs low)."""
    rng = np.random.default_rng([opts.seed, index, 0x5B2A])
    sprayer = Sprayer(factory, targets, opts.mix, rng, rate=rate, quota=1 << 62, cpu=spray_cpu)
    sampler = _Sampler(ranks.pids, arena_bytes)
    sampler.start()
    ranks.send_all(
        "loop",
        {
            "first_step": first,
            "n": opts.elems,
            "seed": opts.seed,
            "wait_s": opts.hard_deadline_s * 3,
        },
    )
    sprayer.start()
    stop_sent = False
    answers: dict[int, dict[str, Any]] = {}
    try:
        while len(answers) < ranks.world:
            for r in range(ranks.world):
                if r not in answers and ranks.conns[r].poll(0.02):
                    answers[r] = ranks.receive(r, "loop", 1.0)
            done = ranks.current_step() - first
            enough = sprayer.sent >= quota and done >= opts.min_collectives
            low = budget.left(0.0) < opts.hard_deadline_s * 4
            if not stop_sent and (enough or low or answers or sprayer.error):
                ranks.send_all("stop_at", ranks.current_step() + 2)
                stop_sent = True
            if budget.expired():
                raise TimeoutError(f"flood level {index}: the ranks did not stop in time")
    finally:
        sprayer.stop()
        peak = sampler.stop()
    if sprayer.error is not None:
        raise RuntimeError(f"the sprayer failed: {sprayer.error!r}") from sprayer.error
    loops = [answers[r] for r in range(ranks.world)]
    run, exact, failed = _tally(loops)
    times = _step_times(loops)
    errors = [a["error"] for a in loops if a["error"] is not None]
    return {
        "rate": rate,
        "datagrams_sent": sprayer.sent,
        "send_errors": int(sprayer.blaster.errors.sum()),
        "spray_s": sprayer.elapsed_s,
        "achieved_rate": sprayer.sent / sprayer.elapsed_s if sprayer.elapsed_s else 0.0,
        "by_category": dict(sprayer.by_category),
        "collectives": run,
        "exact": exact,
        "failed": failed,
        "errors": errors,
        "median_s": float(np.median(times)) if times else float("nan"),
        "p99_s": float(np.percentile(times, 99)) if times else float("nan"),
        "next_step": max(a["last_step"] for a in loops) + 1,
        "rss_peak": peak,
    }


def _account(
    stats: dict[int, dict[str, Any]],
    sockets: dict[tuple[str, int], tuple[int, int]],
    addrs: dict[int, list[tuple[str, int]]],
    sprayed: int,
) -> dict[str, Any]:
    """The two balances of the module docstring, per engine and in all."""
    engines: dict[int, dict[str, Any]] = {}
    tx = rx = drops = queued = 0
    unaccounted = 0
    for r, st in stats.items():
        udp = st["udp"]
        counted = (
            st["accepted"]
            + sum(st["rejected"].values())
            + st["late"]
            + st["early_dropped"]
            + st["early_expired"]
        )
        r_drops = r_queued = 0
        for a in addrs[r]:
            dropped, unread = sockets.get(a, (0, 0))
            r_drops += dropped
            r_queued += unread
        missing = [a for a in addrs[r] if a not in sockets]
        engines[r] = {
            "rx_datagrams": udp["rx_datagrams"],
            "tx_datagrams": udp["tx_datagrams"],
            "socket_drops": r_drops,
            "socket_unread_bytes": r_queued,
            "sockets_not_found": missing,
            "accepted": st["accepted"],
            "rejected": st["rejected"],
            "late": st["late"],
            "early_dropped": st["early_dropped"],
            "early_expired": st["early_expired"],
            "early_control_dropped": st["early_control_dropped"],
            "processing_residual": udp["rx_datagrams"] - counted,
        }
        unaccounted += abs(udp["rx_datagrams"] - counted)
        tx += udp["tx_datagrams"]
        rx += udp["rx_datagrams"]
        drops += r_drops
        queued += r_queued
    delivery = sprayed + tx - (rx + drops)
    unaccounted += abs(delivery)
    return {
        "engines": engines,
        "sprayed": sprayed,
        "engine_tx": tx,
        "engine_rx": rx,
        "socket_drops": drops,
        "socket_unread_bytes": queued,
        "delivery_residual": delivery,
        "unaccounted_datagrams": unaccounted,
        "socket_drops_source": "/proc/net/udp drops of each receive socket (read, not paced away)",
    }
