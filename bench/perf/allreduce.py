"""All-reduce on loopback, one process per rank: gloo vs gradlane (UDP reliable, UDP bounded, ZMQ)
and a protocol-free UDP floor.

Usage::

    python -m gradlane.bench.perf.allreduce --ranks 2,4 --sizes 1,25,100 --chunk-bytes 65000,8972 \
        --reps 9 --json out.json
    python -m gradlane.bench.perf.allreduce --quick --json /tmp/ar.json  # 2 ranks, 1 and 25 MB
    python -m gradlane.bench.perf.allreduce --daemon --json bench/results/allreduce_daemon.json
    python -m gradlane.bench.perf.allreduce --chunk-bytes 1408 --offload-compare --no-zmq --sizes 25
    python -m gradlane.bench.perf.allreduce --zmq-batch-compare --sizes 25 --reps 9
    python -m gradlane.bench.perf.allreduce --keyed-compare --no-zmq --ranks 2 --sizes 25 --reps 9

``--chunk-bytes`` sets the UDP datagrams' payload, a comma-separated list (65000 by default,
loopback's largest; 1408 is what a 1500-byte MTU carries, 8972 a 9000-byte one's): every rank
builds the UDP engines, and the floor, once per payload size, and each repetition runs them all
(gloo first, then per size the engines and the floor; ZeroMQ or the daemon once).

The floor (``udp_floor``) is ``gradlane.bench.perf.udp_floor``'s batched exchange: the same
transpose all-reduce (reduce-scatter by all-to-all, then all-gather) over one UDP socket per
rank and payload size, with no protocol at all (no acknowledgements, retransmission, pacing,
paths or integrity tags): ``sendmmsg`` tables with UDP GSO as the engine uses it, ``recvmmsg``
(with UDP GRO for datagrams of at most 4 KB, as the engine), one compiled pass adding or
copying the rows; the same float32 elements per datagram as the engine's. What the engine
costs beyond it is its protocol's cost: ``summary.udp_reliable_vs_floor``, next to
``floor_vs_gloo`` and ``udp_reliable_vs_gloo``, all from the same run. Its result is checked
against gloo's like the reliable engines'; it has no loss recovery, so a lost datagram (5 s
without it) fails the run.

With the ZeroMQ plane comes its floor (``zmq_floor``, :mod:`gradlane.bench.perf.zmq_floor`):
the same all-reduce over ZeroMQ sockets as the plane's (TCP on loopback) with no protocol,
each shard as 4 MiB zero-copy frames added or copied straight from libzmq's messages:
``summary.zmq_vs_floor`` next to ``zmq_floor_vs_gloo`` and ``zmq_vs_gloo``.

The summary's maps are keyed ``"<ranks>x<MB>@<chunk bytes>"`` for the UDP engines and the
floor (``"4x25@8972"``) and ``"<ranks>x<MB>"`` for gloo, ZeroMQ and the daemon; each row
gives its ``chunk_bytes`` (None for those without UDP datagrams). The report's code (rows,
summary, table) is in ``gradlane.bench.perf.allreduce_report``.

``--offload-compare`` adds the reliable UDP engine with UDP GRO off (``udp_gso_only``) and
with both GSO and GRO off (``udp_no_offload``), interleaved with the others: with MTU-sized
datagrams, GSO (one message per run of equal-sized datagrams sent) and GRO (one per run
received) are what keep the kernel's per-datagram cost off the path;
``summary.gso_only_vs_offload`` and ``summary.no_offload_vs_offload`` give the ratios to the
default engine (both on).

``--zmq-batch-compare`` adds a second ZeroMQ plane that sends one packet per frame
(``zmq_unbatched``, ``batch_bytes=0``) next to the default one, which packs each run into
frames of up to 4 MiB; ``summary.zmq_unbatched_vs_zmq`` gives the ratio.

``--keyed-compare`` adds the reliable UDP engine with a job secret (``udp_keyed``: every packet
carries the keyed MAC instead of the checksum), interleaved; ``summary.udp_keyed_vs_unkeyed``
gives its ratio to the default engine: what authentication costs. ``--order-compare`` adds the
reliable engine adding contributions in rank order (``udp_ordered``: deterministic sums)
against the default, which adds them as they arrive; ``summary.udp_ordered_vs_unordered`` is
what the order costs.

``--daemon`` compares hierarchical daemon mode with the embedded engine for the same 4-rank
all-reduce: two "hosts" of two ranks, one ``gradlane daemon`` process per host (host h on
127.0.0.(h+1), one path each), every rank submitting through its host's daemon (shared memory,
local sum, the inter-host all-reduce among the daemons); against the embedded reliable UDP
engine in the same rank processes, interleaved. The JSON summary gets ``daemon_vs_embedded``
(against the embedded engine at each payload size; a row's ``ratio_to_embedded`` is the first's).

For each rank count the parent spawns one process per rank. Rank 0 hosts a ``TCPStore`` on
127.0.0.1 (a free port); the gloo group is built on it and the same store carries every rank's
bound gradlane addresses (UDP: 127.0.0.1 and 127.0.0.2 as two paths; the floor: one socket on
127.0.0.1; ZeroMQ: a tcp:// endpoint per path). Each repetition runs every transport on a fresh
copy of the same float32 buffer, reduced in place as gloo's ``all_reduce`` does
(``submit(..., out=buf)``), with a barrier before each call; each rank times its own call and
the step time is the max over ranks (a gloo MAX all-reduce of the times). The first repetition
of every (transport, size) checks the result against gloo's: the reliable modes and the floor
must match within float tolerance or the run fails; the bounded mode's delivered fraction and
error are reported.

Each call's CPU time is measured too (user + system of the rank's process across the call,
``getrusage``, summed over ranks): on a small shared machine wall times swing from run to
run while the CPU a collective costs is steadier, and with more ranks than cores
it is what the wall time comes down to. ``summary.<transport>_cpu_vs_gloo`` holds its ratios
(embedded transports only: a daemon's CPU is in another process). The rows split it into
user and system time (``cpu_user_median_s``, ``cpu_sys_median_s``): the system part is the
kernel moving the bytes (sockets, copies), the user part the transport's own work (for
gradlane the Python and the numba kernels, for gloo its C++), so the split tells which side a
gap is on.

Loopback on a shared machine: the numbers are informative, not a network measurement.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import os
import queue
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np
from gradlane.bench.host import HostWatch
from gradlane.bench.perf.allreduce_report import OFFLOAD_VARIANTS, summarize, table
from gradlane.bench.perf.zmq_floor import FloorReport

MB = 1 << 20
#: ``--keyed-compare``: the job secret of the keyed engine (the same on every rank).
KEYED_SECRET = "gradlane-bench-keyed"
#: Daemon mode: hosts (daemons) and the job token they serve.
HOSTS = 2
DAEMON_JOB = 4242
N_PATHS = 2
HARD_DEADLINE_S = 120.0
RTOL = 1e-5


def _free_port(host: str = "127.0.0.1", kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# -- rank process ----------------------------------------------------------------------------------
def _udp_config(
    loss_bound: float,
    chunk_bytes: int = 65000,
    gso: bool = True,
    gro: bool = True,
    seed: int = 0,
    **extra: Any,
) -> Any:
    from gradlane.scheduling.loss import LossConfig
    from gradlane.transport.config import loopback_config

    return loopback_config(
        **extra,
        n_paths=N_PATHS,
        chunk_bytes=chunk_bytes,
        udp_gso=gso,
        udp_gro=gro,
        seed=seed,
        loss=LossConfig(
            loss_bound=loss_bound,
            hard_deadline_s=HARD_DEADLINE_S,
            on_hard_deadline="raise" if loss_bound == 0 else "degrade",
        ),
    )


class _FloorPlane:
    """The protocol-free UDP floor (``udp_floor._MmsgFloor``) behind the calls the timed loop
    makes of gradlane's planes (``start``, ``set_peers``, ``submit``, ``drain``, ``close``).

    One socket per datagram size (``chunk_bytes`` of payload, as the engine's), one floor per
    buffer size. The step is the repetition number, the same on every rank. ``submit`` runs
    the exchange on the caller's thread and returns a done Future. The floor has no loss
    recovery: a datagram that never comes (5 s) fails the call, and with it the run."""

    def __init__(self, rank: int, world: int, chunk_bytes: int) -> None:
        from gradlane.bench.perf.udp_floor import _MmsgFloor, floor_socket

        self._make = _MmsgFloor  # imported here, not inside the timed submit
        self.rank, self.world, self.chunk_bytes = rank, world, chunk_bytes
        self.sock = floor_socket()
        self._floors: dict[int, Any] = {}  # buffer length -> _MmsgFloor
        self._ports: list[int] = []

    def start(self) -> list[tuple[str, int]]:
        """The address peers send to (one path)."""
        host, port = self.sock.getsockname()[:2]
        return [(host, int(port))]

    def set_peers(self, rendezvous: Any) -> None:
        """Every rank's address, from the same table the engines take (first path)."""
        self._ports = [int(rendezvous.addresses(r)[0][1]) for r in range(self.world)]

    def submit(
        self, step: int, bucket: int, data: np.ndarray, out: np.ndarray | None = None
    ) -> Any:
        """All-reduce ``data`` (into ``out``, which may be ``data``) as repetition ``step``: a
        done Future of ``(result, report)``."""
        buf = data.copy() if out is None else out
        if out is not None and out is not data:
            buf[:] = data
        n = buf.shape[0]
        floor = self._floors.get(n)
        if floor is None:
            bounds = np.linspace(0, n, self.world + 1).astype(np.int64)
            floor = self._floors[n] = self._make(
                self.sock, self._ports, self.rank, bounds, self.chunk_bytes
            )
        if not floor.exchange(buf, step):
            raise TimeoutError(
                f"rank {self.rank}: udp_floor ({self.chunk_bytes}-byte payloads) lost a "
                f"datagram at step {step} (bucket {bucket}, {n} floats): the protocol-free floor "
                "has no loss recovery, so the run stops; loopback loses only when the socket "
                "buffers overflow (a loaded machine): run again on a quieter one"
            )
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        fut.set_result((buf, FloorReport()))
        return fut

    @property
    def offloads(self) -> dict[str, bool]:
        """Whether the floors use UDP GSO and GRO (all of them, on this rank)."""
        floors = list(self._floors.values())
        return {
            "gso": bool(floors) and all(f.gso for f in floors),
            "gro": bool(floors) and all(f.gro for f in floors),
        }

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Nothing to drain: every exchange returns complete."""
        return True

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], results: Any) -> None:
    """One rank: gloo group, per datagram size the UDP engines and the floor, a ZeroMQ plane
    (or a daemon's client), then the timed loop."""
    import torch
    import torch.distributed as dist
    from gradlane.bench.perf.zmq_floor import ZmqFloorPlane
    from gradlane.transport.drivers.peers import StaticPeers
    from gradlane.transport.drivers.udp.plane import InjectedLoss, UdpPlane
    from gradlane.transport.drivers.zmq.plane import ZmqPlane, zmq_config

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=_td(args["timeout"]))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    closers: list[Any] = []
    try:
        # (transport, datagram payload; None for the transports without UDP datagrams)
        engines: dict[tuple[str, int | None], Any] = {}
        kinds: list[tuple[str, float, bool, bool, dict[str, Any]]] = [
            ("udp_reliable", 0.0, True, True, {})
        ]
        if args["keyed_compare"]:
            kinds.append(("udp_keyed", 0.0, True, True, {"secret": KEYED_SECRET}))
        if args["order_compare"]:
            kinds.append(("udp_ordered", 0.0, True, True, {"deterministic_sum": True}))
        if args["offload_compare"]:
            kinds += [(name, 0.0, *flags, {}) for name, flags in OFFLOAD_VARIANTS.items()]
        if not args["daemon"]:
            kinds.append(("udp_bounded", args["loss_bound"], True, True, {}))
        for chunk in args["chunk_bytes"]:
            for name, bound, gso, gro, extra in kinds:
                cfg = _udp_config(bound, chunk, gso, gro, args["seed"], **extra)
                loss = args["inject_loss"]
                tap = InjectedLoss(loss, seed=args["seed"]) if loss else None
                e = UdpPlane(rank, world, cfg, rx_tap=tap)
                closers.append(e)
                store.set(f"gl/{name}@{chunk}/{rank}", json.dumps(e.start()))
                engines[name, chunk] = e
            floor = _FloorPlane(rank, world, chunk)
            closers.append(floor)
            store.set(f"gl/udp_floor@{chunk}/{rank}", json.dumps(floor.start()))
            engines["udp_floor", chunk] = floor
        zmq_eps = [
            f"tcp://127.0.0.{1 + p}:{_free_port(f'127.0.0.{1 + p}')}" for p in range(N_PATHS)
        ]
        store.set(f"gl/zmq/{rank}", json.dumps(zmq_eps))
        store.set(f"gl/zmq_floor/{rank}", f"tcp://127.0.0.1:{_free_port('127.0.0.1')}")
        if args["zmq_batch_compare"]:
            zmq_eps = [
                f"tcp://127.0.0.{1 + p}:{_free_port(f'127.0.0.{1 + p}')}" for p in range(N_PATHS)
            ]
            store.set(f"gl/zmq1/{rank}", json.dumps(zmq_eps))
        for (name, chunk), e in engines.items():
            peers = {
                r: [tuple(a) for a in json.loads(store.get(f"gl/{name}@{chunk}/{r}"))]
                for r in range(world)
            }
            e.set_peers(StaticPeers(peers))
        if args["daemon"]:
            from gradlane.transport.daemon.client import DaemonPlane

            local = world // HOSTS
            client = DaemonPlane(
                args["daemon"][rank // local],
                job=DAEMON_JOB,
                rank=rank,
                world=world,
                local_rank=rank % local,
                local_world=local,
                request_timeout_s=HARD_DEADLINE_S * 2,
            )
            closers.append(client)
            engines["daemon", None] = client.start()
        elif args["zmq"]:
            floor_eps = [store.get(f"gl/zmq_floor/{r}").decode() for r in range(world)]
            zfloor = ZmqFloorPlane(rank, world, floor_eps)
            closers.append(zfloor)
            engines["zmq_floor", None] = zfloor
            eps = [json.loads(store.get(f"gl/zmq/{r}")) for r in range(world)]
            plane = ZmqPlane(rank, world, zmq_config(n_paths=N_PATHS), eps)
            closers.append(plane)
            engines["zmq", None] = plane.start()
            if args["zmq_batch_compare"]:
                eps = [json.loads(store.get(f"gl/zmq1/{r}")) for r in range(world)]
                plane = ZmqPlane(rank, world, zmq_config(n_paths=N_PATHS), eps, batch_bytes=0)
                closers.append(plane)
                engines["zmq_unbatched", None] = plane.start()
        out = _timed_loop(rank, world, engines, args, dist, torch)
        out["offloads"] = {k: e.offloads for k, e in engines.items() if isinstance(e, _FloorPlane)}
        for e in engines.values():  # peers have what this rank sent, while every engine answers
            e.drain()
        dist.barrier()
        if rank == 0:
            results.put(("ok", out))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        for c in reversed(closers):
            c.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _td(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _timed_loop(
    rank: int,
    world: int,
    engines: dict[tuple[str, int | None], Any],
    args: dict[str, Any],
    dist: Any,
    torch: Any,
) -> dict[str, Any]:
    """Interleave the transports per repetition, gloo first; times are the max over ranks.
    Everything is keyed by ``(transport, chunk bytes)``, as ``engines`` is."""
    gloo = ("gloo", None)
    transports = [gloo, *engines]
    times: dict[Any, dict[float, list[float]]] = {t: {} for t in transports}
    # Per call: (user, system) CPU seconds of this rank's process.
    cpu: dict[Any, dict[float, list[tuple[float, float]]]] = {t: {} for t in transports}
    checks: dict[Any, dict[float, Any]] = {t: {} for t in transports if t != gloo}
    # One untimed round first: numba loads its cached kernels and the engines their first
    # buffers on the first call, which would otherwise be the first repetition's outlier.
    warm = np.ones(MB // 4, dtype=np.float32)
    for e in engines.values():
        dist.barrier()
        e.submit(1, 1, warm).result(args["timeout"])
    dist.all_reduce(torch.from_numpy(warm.copy()))
    step = 1
    for mb in args["sizes"]:
        n = int(mb * MB) // 4
        data = np.random.default_rng([args["seed"], rank, n]).standard_normal(n).astype(np.float32)
        for t in transports:
            times[t][mb] = []
            cpu[t][mb] = []
        for rep in range(args["reps"]):
            step += 1
            mine, spent = [], []
            gloo_result = None
            for t in transports:
                if t == gloo:
                    buf = torch.from_numpy(data.copy())
                    dist.barrier()
                    c0, t0 = _cpu_s(), time.perf_counter()
                    dist.all_reduce(buf)
                    mine.append(time.perf_counter() - t0)
                    spent.extend(_cpu_s() - c0)
                    gloo_result = buf.numpy()
                    continue
                buf = data.copy()  # in place, as gloo's all_reduce (and its copy, untimed)
                dist.barrier()
                c0, t0 = _cpu_s(), time.perf_counter()
                res, report = engines[t].submit(step, 0, buf, out=buf).result(args["timeout"])
                mine.append(time.perf_counter() - t0)
                spent.extend(_cpu_s() - c0)
                if rep == 0:
                    assert gloo_result is not None  # gloo runs first in every repetition
                    checks[t][mb] = _check(*t, rank, mb, res, report, gloo_result)
            # The step time of a collective is its slowest rank's; its CPU, every rank's.
            tt = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            cc = torch.tensor(spent, dtype=torch.float64).reshape(len(transports), 2)
            dist.all_reduce(cc, op=dist.ReduceOp.SUM)
            for t, v, c in zip(transports, tt.tolist(), cc.tolist(), strict=True):
                times[t][mb].append(v)
                cpu[t][mb].append((c[0], c[1]))
        # Gather every rank's correctness check for this size (rank 0 reports all).
        flags = torch.tensor(
            [0.0 if checks[t][mb]["ok"] else 1.0 for t in checks], dtype=torch.float64
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        # This rank's delivered fraction covers only what it received; a peer's reduce loss
        # reaches it through the gather, so report the worst rank too.
        worst = torch.tensor(
            [checks[t][mb]["delivered_fraction"] for t in checks], dtype=torch.float64
        )
        dist.all_reduce(worst, op=dist.ReduceOp.MIN)
        for t, bad, low in zip(checks, flags.tolist(), worst.tolist(), strict=True):
            checks[t][mb]["ok_all_ranks"] = bad == 0.0
            checks[t][mb]["delivered_fraction_min_rank"] = low
        del data
    return {"times": times, "cpu": cpu, "checks": checks}


def _cpu_s() -> np.ndarray:
    """User and system CPU seconds of this process so far (every thread: engine loops
    included), as a pair."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([ru.ru_utime, ru.ru_stime])


def _check(
    t: str, chunk: int | None, rank: int, mb: float, res: np.ndarray, report: Any, ref: np.ndarray
) -> dict[str, Any]:
    """Compare one result (of transport ``t`` with ``chunk``-byte payloads) with gloo's; all
    but the bounded engine must agree."""
    err = np.abs(res.astype(np.float64) - ref)
    scale = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2))) or 1.0
    out = {
        "ok": bool(np.allclose(res, ref, rtol=RTOL, atol=RTOL)) and res.shape == ref.shape,
        "max_abs_err": float(err.max()) if err.size else 0.0,
        "rms_err_rel": float(np.sqrt(np.mean(err**2)) / scale) if err.size else 0.0,
        "delivered_fraction": float(report.delivered_fraction),
        "degraded": bool(report.degraded),
    }
    if t == "udp_bounded":
        out["ok"] = True  # bounded loss may differ by design; reported, not enforced
    elif not out["ok"]:
        sized = "" if chunk is None else f" ({chunk}-byte payloads)"
        raise AssertionError(
            f"rank {rank}: {t}{sized} all-reduce of {mb} MB differs from gloo's: max abs error "
            f"{out['max_abs_err']:.3g}, relative rms {out['rms_err_rel']:.3g}"
        )
    return out


# -- parent ----------------------------------------------------------------------------------------
class _Daemons:
    """``HOSTS`` ``gradlane daemon`` processes (host h on 127.0.0.(h+1)), for ``--daemon``."""

    def __init__(self, world: int, timeout: float) -> None:
        self.dir = tempfile.mkdtemp(prefix="gl-bench-")
        self.sockets = [os.path.join(self.dir, f"h{h}.sock") for h in range(HOSTS)]
        paths = [
            f"127.0.0.{h + 1}:{_free_port(f'127.0.0.{h + 1}', socket.SOCK_DGRAM)}"
            for h in range(HOSTS)
        ]
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for h in range(HOSTS):
                cmd = [
                    sys.executable,
                    "-m",
                    "gradlane.integrations.cli.main",
                    "daemon",
                    "--job",
                    str(DAEMON_JOB),
                    "--host-rank",
                    str(h),
                    "--hosts",
                    str(HOSTS),
                    "--socket",
                    self.sockets[h],
                    "--path",
                    paths[h],
                    "--peers",
                    ";".join(paths),
                    "--local-world",
                    str(world // HOSTS),
                    "--hard-deadline",
                    str(HARD_DEADLINE_S),
                    "--metrics",
                    "",
                    "--log-level",
                    "WARNING",
                ]
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
                self.procs.append(p)
                assert p.stdout is not None
                ready, _, _ = select.select([p.stdout], [], [], timeout)
                line = p.stdout.readline() if ready else ""
                if "gradlane daemon: ready" not in line:
                    raise RuntimeError(f"daemon {h} did not start: {line!r}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """SIGTERM every daemon (kill if it does not exit), remove the socket directory."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(HARD_DEADLINE_S + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)
            if p.stdout is not None:
                p.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_world(world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Spawn ``world`` rank processes, wait (bounded) for rank 0's results, clean up every one."""
    if args["daemon"] is True:
        daemons = _Daemons(world, args["timeout"])
        try:
            return run_world(world, {**args, "daemon": daemons.sockets})
        finally:
            daemons.close()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, args, results), name=f"gl-bench-{r}")
        for r in range(world)
    ]
    deadline = time.monotonic() + args["timeout"]
    try:
        for p in procs:
            p.start()
        msg = _wait_for_result(results, procs, deadline, world, args["timeout"])
        if msg[0] != "ok":
            raise RuntimeError(f"rank {msg[1]} failed:\n{msg[2]}")
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return msg[1]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(10.0)
        results.close()


def _wait_for_result(results: Any, procs: list[Any], deadline: float, world: int, limit: float):
    """Rank 0's message; raises as soon as a rank dies or the deadline passes."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            pass
        dead = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"rank process(es) died: {dead}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{world} ranks: no result within {limit}s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gradlane.bench.perf.allreduce", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    ap.add_argument("--sizes", default="1,25,100", help="comma-separated bucket sizes in MB")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per size (default 5)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="2 ranks, 1 and 25 MB, 3 reps")
    ap.add_argument("--no-zmq", action="store_true", help="skip the ZeroMQ data plane")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per rank count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--chunk-bytes",
        default="65000",
        help="comma-separated payloads per UDP datagram, each run by the UDP engines and the "
        "floor (default 65000, loopback's largest; 1408 is MTU 1500's, 8972 MTU 9000's)",
    )
    ap.add_argument(
        "--offload-compare",
        action="store_true",
        help="also run the reliable UDP engine with UDP GRO off (udp_gso_only) and with GSO "
        "and GRO off (udp_no_offload), interleaved",
    )
    ap.add_argument(
        "--keyed-compare",
        action="store_true",
        help="also run the reliable UDP engine with a job secret (udp_keyed), interleaved",
    )
    ap.add_argument(
        "--order-compare",
        action="store_true",
        help="also run the reliable UDP engine adding contributions in rank order "
        "(udp_ordered: deterministic sums; the default adds them as they arrive), interleaved",
    )
    ap.add_argument(
        "--zmq-batch-compare",
        action="store_true",
        help="also run a ZeroMQ plane sending one packet per frame (zmq_unbatched), interleaved",
    )
    ap.add_argument(
        "--inject-loss",
        type=float,
        default=0.0,
        help="the UDP engines drop this fraction of the datagrams they receive (seeded by "
        "--seed and the rank; gloo, ZeroMQ and the floor stay lossless): loss recovery's cost",
    )
    ap.add_argument(
        "--loss-bound", type=float, default=0.02, help="udp_bounded's loss bound (default 0.02)"
    )
    ap.add_argument(
        "--daemon",
        action="store_true",
        help="daemon mode (2 hosts x ranks/2) against the embedded engine; default --ranks 4",
    )
    ns = ap.parse_args(argv)
    host = HostWatch()
    if ns.quick:
        ns.ranks, ns.sizes, ns.reps = "2", "1,25", 3
    if ns.daemon and ns.ranks == "2,4":
        ns.ranks = "4"
    ranks = [int(x) for x in ns.ranks.split(",")]
    sizes = [float(x) for x in ns.sizes.split(",")]
    chunks = list(dict.fromkeys(int(x) for x in ns.chunk_bytes.split(",")))
    if ns.reps < 1 or any(r < 2 for r in ranks) or any(s <= 0 for s in sizes):
        ap.error("need --reps >= 1, rank counts >= 2 and positive sizes")
    if ns.daemon and any(r % HOSTS for r in ranks):
        ap.error(f"--daemon splits the ranks over {HOSTS} hosts: give even rank counts")
    from gradlane.transport.drivers.udp.plane import InjectedLoss
    from gradlane.transport.errors import ConfigError

    try:  # the configs' own checks, here rather than in every rank process
        for chunk in chunks:  # the engine's bounds are within the floor's
            _udp_config(ns.loss_bound, chunk)
        InjectedLoss(ns.inject_loss)
    except ConfigError as e:
        ap.error(f"--chunk-bytes, --loss-bound or --inject-loss: {e}")
    args = {"sizes": sizes, "reps": ns.reps, "timeout": ns.timeout, "seed": ns.seed,
            "zmq": not ns.no_zmq, "daemon": ns.daemon, "chunk_bytes": chunks,
            "inject_loss": ns.inject_loss, "loss_bound": ns.loss_bound,
            "offload_compare": ns.offload_compare, "keyed_compare": ns.keyed_compare,
            "order_compare": ns.order_compare,
            "zmq_batch_compare": ns.zmq_batch_compare and not ns.no_zmq}  # fmt: skip
    per_world: dict[int, dict[str, Any]] = {}
    for world in ranks:
        t0 = time.monotonic()
        per_world[world] = run_world(world, args)
        print(f"# {world} ranks done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    report = summarize(per_world)
    failed = [r for r in report["rows"] if "check" in r and not r["check"]["ok_all_ranks"]]
    print(table(report["rows"]))
    if ns.daemon:
        ratios = ", ".join(
            f"{k}: {v:.2f}" for k, v in report["summary"]["daemon_vs_embedded"].items()
        )
        print(f"daemon mode / embedded engine (ranks x MB @ chunk bytes): {ratios}")
    if ns.json:
        doc = {
            "config": {
                **args,
                "ranks": ranks,
                "n_paths": N_PATHS,
            },
            "host": host.record(),
            **report,
        }
        with open(ns.json, "w") as f:
            json.dump(doc, f, indent=2)
    if failed:
        print(f"CORRECTNESS FAILURE: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
