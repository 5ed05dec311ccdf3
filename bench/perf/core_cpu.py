"""CPU of the sans-I/O all-reduce core per collective: N ranks in one process, no sockets.

Usage::

    python -m gradlane.bench.perf.core_cpu --ranks 2,4 --sizes 1,25 --reps 20 --json out.json
    python -m gradlane.bench.perf.core_cpu --ranks 4 --sizes 25 --profile /tmp/core.prof
        # (cProfile of the cores)
    python -m gradlane.bench.perf.core_cpu --ranks 4 --sizes 1 --chunk-bytes 8972 --burst 8
        # (datagrams a few at a time, as from a paced network: the per-batch work counts)

Every rank is a :class:`~gradlane.transport.core.collective.TransposeAllReduce` driven the way the
engine drives one (``start``, then service passes: ``datagrams_to_send`` — which processes the
received batch first — timers, events), on a simulated clock that advances per round by the longest
pass of the round (the ranks run side by side in reality), at least ``--tick-us``. Between passes
the harness moves each rank's datagrams into its peers' receive arenas, at most ``READ_BURST``
(:mod:`gradlane.transport.drivers.udp.sockets`) per peer and pass, committed as one batch: what
``recvmmsg`` does in the engine. Only the cores' calls are timed (``time.thread_time``): the
harness's own copying stands in for the kernel's and is not counted.

What it measures is the user-space CPU one rank spends per collective — the numba kernels and
the Python around them — without the system calls, the scheduler and the other processes that
make the loopback benchmarks swing on a small machine. It repeats far more closely from run
to run, so it shows a change to the core's per-batch or per-transfer work that the end-to-end
benchmarks cannot resolve. It is a regression measure for the core, not a
transport benchmark: there is no network, no loss and no contention in it.

The JSON has one row per (ranks, MB) with ``cpu_ms_per_rank`` (median over repetitions of the
per-rank mean), its spread, and the number of service passes, and a ``summary`` map
``"<ranks>x<MB>"`` → ``cpu_ms_per_rank``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
from gradlane.bench.host import HostWatch

MB = 1 << 20


def _deliver(
    eps: list[Any], queues: list[list[Any]], r: int, now: float, burst: int | None = None
) -> None:
    """Move up to ``burst`` (default READ_BURST) queued datagrams per path into rank ``r``'s
    arena, one commit per path (as one ``recvmmsg`` per socket would)."""
    from gradlane.transport.drivers.udp.sockets import READ_BURST

    if burst is None:
        burst = READ_BURST
    ep = eps[r].endpoint
    q = queues[r]
    if not q:
        return
    by_path: dict[int, list[tuple[Any, ...]]] = {}
    rest = []
    for item in q:
        lst = by_path.setdefault(item[0], [])
        if len(lst) < burst:
            lst.append(item)
        else:
            rest.append(item)
    queues[r] = rest
    for path, batch in by_path.items():
        items = batch
        while items:
            arena, free = ep.rx_arena, ep.rx_free
            room = min(len(items), arena.shape[0] - free)
            lengths = np.empty(room, dtype=np.int64)
            for k in range(room):
                _, parts = items[k]
                row = arena[free + k]
                at = 0
                for part in parts:
                    b = np.frombuffer(part, dtype=np.uint8)
                    row[at : at + b.shape[0]] = b
                    at += b.shape[0]
                lengths[k] = at
            items = items[room:]
            ep.commit_datagrams(lengths, path, now)  # processes the arena when it is full


def _route(out: list[Any], queues: list[list[Any]], lose: Any = None) -> None:
    """Queue every datagram of a service pass at its destination; ``lose()`` True drops one."""
    from gradlane.transport.core.events import DatagramRun

    for item in out:
        if isinstance(item, DatagramRun):
            hdr = np.frombuffer(item.hdr, dtype=np.uint8).reshape(-1, item.header_bytes)
            pay = item.payload
            for i in range(len(item)):
                if lose is not None and lose():
                    continue
                s, z = int(item.starts[i]), int(item.sizes[i])
                parts = (hdr[int(item.chunks[i])].copy(), bytes(pay[s : s + z]))
                queues[item.peer].append((int(item.paths[i]), parts))
        elif lose is None or not lose():
            whole: tuple[bytes, ...] = (bytes(item.data),) if item.payload is None else (
                bytes(item.data), bytes(item.payload))  # fmt: skip
            queues[item.peer].append((item.path, whole))


def run_one(
    world: int,
    mb: float,
    reps: int,
    tick_s: float,
    profile: Any = None,
    *,
    chunk_bytes: int = 65000,
    loss: float = 0.0,
    loss_bound: float = 0.0,
    seed: int = 0,
    round_s: float = 0.0,
    burst: int | None = None,
) -> dict[str, Any]:
    """``reps`` all-reduces of ``mb`` MB float32 among ``world`` in-process cores; ``loss``: the
    fraction of datagrams (data and control) the harness drops, seeded; ``loss_bound`` the
    cores' (then the result is not checked against the exact sum). ``round_s`` > 0: the clock
    moves by exactly that much per round instead of the round's longest pass, so the same seed
    replays the same protocol run (the measured CPU decides nothing). ``burst``: at most this
    many datagrams per path reach a rank per pass (default READ_BURST): small bursts stand for a
    paced network, whose datagrams arrive a few at a time, so every batch's fixed work counts."""
    from gradlane.scheduling.loss import LossConfig
    from gradlane.transport.config import loopback_config
    from gradlane.transport.core.collective import TransposeAllReduce
    from gradlane.transport.core.events import AllReduceComplete, AllReduceFailed

    cfg = loopback_config(chunk_bytes=chunk_bytes, loss=LossConfig(loss_bound=loss_bound))
    drops = np.random.default_rng(seed + 1)
    lose = (lambda: bool(drops.random() < loss)) if loss > 0 else None
    eps = [TransposeAllReduce(r, world, cfg) for r in range(world)]
    n = int(mb * MB) // 4
    rng = np.random.default_rng(0)
    datas = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    bufs = [d.copy() for d in datas]
    queues: list[list[Any]] = [[] for _ in range(world)]
    now = 0.0
    per_rep: list[float] = []
    passes = 0
    clock = time.thread_time

    def timed(r: int, fn: Any, *a: Any, **k: Any) -> Any:
        t0 = clock()
        if prof is not None:
            prof.enable()
        try:
            return fn(*a, **k)
        finally:
            if prof is not None:
                prof.disable()
            spent[r] += clock() - t0

    def untimed(r: int, fn: Any, *a: Any) -> Any:
        return fn(*a)

    def serve(r: int, now: float, call: Any) -> list[Any]:
        """One service pass of rank ``r`` as the engine makes it (input, timer, output), each
        call made through ``call`` (``timed`` or ``untimed``); the events it produced."""
        _deliver(eps, queues, r, now, burst)
        when = eps[r].get_timer()
        if when is not None and when <= now:
            call(r, eps[r].handle_timer, now)
        _route(call(r, eps[r].datagrams_to_send, now), queues, lose)
        return list(iter(lambda: call(r, eps[r].next_event), None))

    for rep in range(reps + 2):  # two untimed warm-up collectives
        spent = [0.0] * world
        prof = profile if rep >= 2 else None  # the warm-up loads numba's cached kernels
        for r in range(world):
            np.copyto(bufs[r], datas[r])
        step = rep + 1
        for r in range(world):
            timed(r, eps[r].start, step, 0, bufs[r], 0.5, now, out=bufs[r])
            _route(timed(r, eps[r].datagrams_to_send, now, process_input=False), queues, lose)
        done = [False] * world
        rounds = 0
        while not all(done):
            rounds += 1
            if rounds > 200_000:
                raise RuntimeError(f"{world} x {mb} MB: no completion after {rounds} rounds")
            # The ranks run one after another here but side by side in reality: the clock
            # moves by the longest pass of the round (and at least a tick), so pacing and
            # timers see about the time the work would take.
            before = list(spent)
            for r in range(world):
                passes += 1
                for ev in serve(r, now, timed):
                    if isinstance(ev, AllReduceFailed):
                        raise RuntimeError(f"rank {r}: {ev}")
                    if isinstance(ev, AllReduceComplete):
                        done[r] = True
            if round_s > 0:
                now += round_s
            else:
                now += max(tick_s, *(a - b for a, b in zip(spent, before, strict=True)))
        # Let the last acknowledgements land (and, under loss, the last resends and STOPs) so no
        # rank carries owed data into the next rep; untimed.
        for _ in range(5000):
            if not any(queues) and not any(e.endpoint.sender.transfers for e in eps):
                break
            now += tick_s
            for r in range(world):
                serve(r, now, untimed)
        expect = np.sum(datas, axis=0, dtype=np.float64)
        for r in range(world):
            if loss_bound == 0.0:
                np.testing.assert_allclose(bufs[r], expect, rtol=1e-4, atol=1e-4)
        if rep >= 2:
            per_rep.append(sum(spent) / world)
    ms = np.array(per_rep) * 1000.0
    return {
        "ranks": world,
        "MB": mb,
        "reps": reps,
        "cpu_ms_per_rank": round(float(np.median(ms)), 3),
        "cpu_ms_p10": round(float(np.percentile(ms, 10)), 3),
        "cpu_ms_p90": round(float(np.percentile(ms, 90)), 3),
        "passes_per_rank_per_collective": round(passes / (reps + 2) / world, 1),
        "chunk_bytes": chunk_bytes,
        "loss": loss,
        "loss_bound": loss_bound,
        "burst": burst,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    ap.add_argument("--sizes", default="1,25", help="comma-separated sizes in MB (default 1,25)")
    ap.add_argument("--reps", type=int, default=20, help="timed collectives per case")
    ap.add_argument("--tick-us", type=float, default=20.0, help="least simulated time per round")
    ap.add_argument("--chunk-bytes", type=int, default=65000, help="payload per datagram")
    ap.add_argument(
        "--loss", type=float, default=0.0, help="fraction of datagrams dropped (seeded)"
    )
    ap.add_argument("--loss-bound", type=float, default=0.0, help="the cores' loss bound")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--round-us",
        type=float,
        default=0.0,
        help="simulated time per round (default: the round's longest pass, at least --tick-us); "
        "fixed, the same seed replays the same run",
    )
    ap.add_argument(
        "--burst",
        type=int,
        default=None,
        help="most datagrams per path delivered to a rank per pass (default: the UDP driver's "
        "READ_BURST); a few, e.g. 8, stands for a paced network",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", help="write a cProfile of the cores' calls here")
    args = ap.parse_args(argv)
    host = HostWatch()
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    rows = []
    for world in (int(x) for x in args.ranks.split(",")):
        for mb in (float(x) for x in args.sizes.split(",")):
            row = run_one(
                world, mb, args.reps, args.tick_us * 1e-6, prof, chunk_bytes=args.chunk_bytes,
                loss=args.loss, loss_bound=args.loss_bound, seed=args.seed,
                round_s=args.round_us * 1e-6, burst=args.burst,
            )  # fmt: skip
            rows.append(row)
            print(
                f"{world} ranks {mb:g} MB: {row['cpu_ms_per_rank']:.2f} ms CPU per rank "
                f"(p10 {row['cpu_ms_p10']:.2f}, p90 {row['cpu_ms_p90']:.2f}), "
                f"{row['passes_per_rank_per_collective']} passes",
                flush=True,
            )
    out = {
        "host": host.record(),
        "rows": rows,
        "summary": {
            "cpu_ms_per_rank": {f"{r['ranks']}x{r['MB']:g}": r["cpu_ms_per_rank"] for r in rows}
        },
    }
    if prof is not None:
        prof.dump_stats(args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
