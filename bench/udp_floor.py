"""How fast could a Python UDP all-reduce be on this machine? A protocol-free floor against gloo.

``python -m bench.udp_floor [--ranks 2,4] [--sizes 25,100] [--reps 15] [--json out.json]``

Each rank runs the same transpose all-reduce as gradlane (reduce-scatter by direct all-to-all,
then all-gather) over one raw UDP socket on loopback, with nothing of a transport around it: no
acknowledgements, retransmissions, priorities, paths, pacing or integrity tags — ``sendmsg`` of a
16-byte header and a view of the buffer, ``recv_into`` and a numpy add or copy per 64 KB
datagram. It is what the interpreter and the kernel cost by themselves, so it bounds what any
Python transport can reach here; gradlane's own all-reduce (``bench.allreduce``) adds its
protocol on top.

A second floor, ``udp_floor_mmsg``, is the same exchange the way gradlane's engine moves bytes:
``sendmmsg`` of up to 16 datagrams per call (header and buffer view gathered by the kernel, no
copy in user space), ``recvmmsg`` of up to 64 into rows, and one compiled pass per batch that
adds or copies the rows into the buffer. Python is left with a few calls per batch, so this
floor is close to what the kernel's copies and the sums cost by themselves: a transport that is
slower than gloo where even this floor is has no room left for any protocol.

gloo's ``all_reduce`` runs in the same processes, interleaved, timed the same
way (a gloo barrier, then the slowest rank's time). Each call's user and system CPU time is
measured too (``getrusage`` of the rank's process, summed over ranks; medians per row): the
system part is the kernel's work of moving the bytes, which no user-space design avoids, the
user part what the floor's Python and NumPy cost. Loopback with 64 MiB socket buffers does
not drop; should a datagram be lost anyway the repetition times out after 5 s and is counted
as ``lost_reps`` (its time is left out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import select
import socket
import struct
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
from numba import njit

MB = 1 << 20
DATAGRAM = 65000
HDR = struct.Struct("<IIII")  # repetition, phase, element offset, element count
HDR_BYTES = 16  # HDR.size, as a constant compiled code can read
assert HDR.size == HDR_BYTES
TIMEOUT_S = 5.0


def _exchange(
    sock: socket.socket,
    ports: list[int],
    me: int,
    buf: np.ndarray,
    bounds: np.ndarray,
    rep: int,
) -> bool:
    """One all-reduce of ``buf`` in place; False if a datagram never came (timed out)."""
    world = len(ports)
    el = (DATAGRAM - HDR.size) // 4
    raw = memoryview(buf.data).cast("B")
    rbuf = bytearray(DATAGRAM + HDR.size)
    rview = memoryview(rbuf)
    hdr = bytearray(HDR.size)
    lo, hi = int(bounds[me]), int(bounds[me + 1])
    got = [0, 0]
    need = [
        (world - 1) * -(-(hi - lo) // el),
        sum(-(-(int(bounds[j + 1]) - int(bounds[j])) // el) for j in range(world) if j != me),
    ]
    for phase in (0, 1):
        sends = []
        for j in range(world):
            if j == me:
                continue
            a, b = (int(bounds[j]), int(bounds[j + 1])) if phase == 0 else (lo, hi)
            sends += [(off - a, j, off, min(b, off + el)) for off in range(a, b, el)]
        sends.sort()  # interleave destinations
        i = 0
        deadline = time.monotonic() + TIMEOUT_S
        while got[phase] < need[phase] or i < len(sends):
            for _ in range(8):
                if i >= len(sends):
                    break
                _, j, a, b = sends[i]
                HDR.pack_into(hdr, 0, rep, phase, a, b - a)
                try:
                    sock.sendmsg((hdr, raw[4 * a : 4 * b]), (), 0, ("127.0.0.1", ports[j]))
                except BlockingIOError:
                    break
                i += 1
            while True:
                try:
                    n = sock.recv_into(rview)
                except BlockingIOError:
                    break
                r, ph, off, cnt = HDR.unpack_from(rbuf, 0)
                if r != rep or n != HDR.size + 4 * cnt:
                    continue
                data = np.frombuffer(rbuf, np.float32, cnt, HDR.size)
                if ph == 0:
                    buf[off : off + cnt] += data
                else:
                    buf[off : off + cnt] = data
                got[ph] += 1
            if got[phase] < need[phase] and i >= len(sends):
                if time.monotonic() > deadline:
                    return False
                select.select([sock], [], [], 0.05)
    return True


BATCH_SEND = 16  # datagrams per sendmmsg call (destinations alternate call by call)
BATCH_RECV = 64  # datagrams per recvmmsg call


@njit(cache=True)
def _apply_rows(
    words: np.ndarray, floats: np.ndarray, lengths: np.ndarray, buf: np.ndarray, rep: int,
    got: np.ndarray,
) -> None:  # fmt: skip
    """Add (phase 0) or copy (phase 1) each received row's payload into ``buf``; rows of
    another repetition or with a wrong length are skipped. ``got`` counts rows per phase."""
    for i in range(lengths.shape[0]):
        off, cnt, phase = np.int64(words[i, 2]), np.int64(words[i, 3]), np.int64(words[i, 1])
        if words[i, 0] != rep or lengths[i] != HDR_BYTES + 4 * cnt or phase > 1:
            continue
        if off < 0 or off + cnt > buf.shape[0]:
            continue
        dst = buf[off : off + cnt]
        src = floats[i, 4 : 4 + cnt]
        if phase == 0:
            for j in range(cnt):
                dst[j] += src[j]
        else:
            for j in range(cnt):
                dst[j] = src[j]
        got[phase] += 1


class _MmsgFloor:
    """The batched floor's tables for one buffer size: a ``SendBatch`` with one "path" per
    peer (so each path's messages name that peer), the header rows, and the receive rows."""

    def __init__(self, sock: socket.socket, ports: list[int], me: int, bounds: np.ndarray) -> None:
        from transport import _mmsg

        self.sock, self.me, self.bounds, self.world = sock, me, bounds, len(ports)
        self._mmsg = _mmsg
        self.el = (DATAGRAM - HDR.size) // 4
        self.rows = np.zeros((BATCH_RECV, HDR.size + DATAGRAM), dtype=np.uint8)
        self.words = self.rows.view(np.uint32)
        self.floats = self.rows.view(np.float32)
        self.table = _mmsg.RecvTable(self.rows)
        addrs = [_mmsg.sockaddr(("127.0.0.1", p)) for p in ports]
        tos = [_mmsg.tos_cmsg(0, False) for _ in ports]
        self._keep = addrs + tos  # the send table points into them
        self.names = np.array([(a.ctypes.data, a.shape[0]) for a in addrs], dtype=np.uint64)
        self.controls = np.array([(c.ctypes.data, c.shape[0]) for c in tos], dtype=np.uint64)
        self.batch = _mmsg.SendBatch(self.world)
        self.got = np.zeros(2, dtype=np.int64)

    def _lay_out(self, phase: int, rep: int, buf: np.ndarray) -> np.ndarray:
        """Every datagram of ``phase`` in the send table; returns the rows per peer."""
        b, me, el = self.bounds, self.me, self.el
        self.batch.clear()
        plan = []
        for j in range(self.world):
            if j == me:
                continue
            lo, hi = (int(b[j]), int(b[j + 1])) if phase == 0 else (int(b[me]), int(b[me + 1]))
            offs = np.arange(lo, hi, el, dtype=np.int64)
            plan.append((j, offs, np.minimum(offs + el, hi) - offs))
        n = sum(len(offs) for _, offs, _ in plan)
        self.hdrs = np.zeros((max(n, 1), 4), dtype=np.uint32)
        at = 0
        for j, offs, cnts in plan:
            k = len(offs)
            self.hdrs[at : at + k] = np.stack(
                [np.full(k, rep), np.full(k, phase), offs, cnts], axis=1
            ).astype(np.uint32)
            self.batch.append(
                j, int(self.hdrs.ctypes.data), HDR.size, np.arange(at, at + k, dtype=np.int64),
                int(buf.ctypes.data), 4 * offs, 4 * cnts, np.full(k, j, dtype=np.int64),
                self.names, self.controls,
            )  # fmt: skip
            at += k
        return self.batch.fill.copy()

    def exchange(self, buf: np.ndarray, rep: int) -> bool:
        """One all-reduce of ``buf`` in place; False if a datagram never came (timed out)."""
        b, me, el, fd = self.bounds, self.me, self.el, self.sock.fileno()
        peers = [j for j in range(self.world) if j != me]
        need = [
            len(peers) * -(-(int(b[me + 1]) - int(b[me])) // el),
            sum(-(-(int(b[j + 1]) - int(b[j])) // el) for j in peers),
        ]
        self.got[:] = 0
        for phase in (0, 1):
            fill = self._lay_out(phase, rep, buf)
            pos = np.zeros(self.world, dtype=np.int64)
            deadline = time.monotonic() + TIMEOUT_S
            while self.got[phase] < need[phase] or (pos < fill).any():
                moved = False
                for j in peers:
                    k = min(BATCH_SEND, int(fill[j] - pos[j]))
                    if k > 0:
                        sent, _ = self.batch.send(fd, j, int(pos[j]), k)  # EAGAIN: later
                        pos[j] += sent
                        moved |= sent > 0
                while True:
                    lengths, err = self.table.receive(fd, 0, BATCH_RECV)
                    if err or lengths.shape[0] == 0:
                        break
                    _apply_rows(self.words, self.floats, lengths, buf, rep, self.got)
                    moved = True
                if not moved:
                    if time.monotonic() > deadline:
                        return False
                    select.select([self.sock], [], [], 0.05)
        return True


def _cpu() -> tuple[float, float]:
    """User and system CPU seconds of this process so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def _rank(rank: int, world: int, port: int, args: dict[str, Any], out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, force in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):
        sock.setsockopt(socket.SOL_SOCKET, opt, 64 * MB)
        with contextlib.suppress(OSError):  # past rmem_max when permitted, like gradlane's
            sock.setsockopt(socket.SOL_SOCKET, force, 64 * MB)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    store.set(f"port{rank}", str(sock.getsockname()[1]))
    ports = [int(store.get(f"port{r}")) for r in range(world)]
    rows = []
    rep = 0
    for mb in args["sizes"]:
        n = int(mb * MB) // 4
        data = np.random.default_rng([rank, n]).standard_normal(n).astype(np.float32)
        bounds = np.linspace(0, n, world + 1).astype(np.int64)
        names = ("gloo", "udp_floor", "udp_floor_mmsg")
        times: dict[str, list[float]] = {t: [] for t in names}
        cpu: dict[str, list[list[float]]] = {t: [] for t in names}  # (user, sys) sums
        lost = 0
        results: dict[str, np.ndarray] = {}
        mmsg = _MmsgFloor(sock, ports, rank, bounds)
        for k in range(args["reps"] + 1):  # the first repetition warms up, untimed
            for name in names[k % 3 :] + names[: k % 3]:
                rep += 1
                buf = data.copy()
                dist.barrier()
                c0, t0 = _cpu(), time.perf_counter()
                if name == "gloo":
                    dist.all_reduce(torch.from_numpy(buf))
                    ok = True
                elif name == "udp_floor":
                    ok = _exchange(sock, ports, rank, buf, bounds, rep)
                else:
                    ok = mmsg.exchange(buf, rep)
                c1 = _cpu()
                if k == 0:
                    results[name] = buf  # the warm-up's sums, compared below
                dt = torch.tensor([time.perf_counter() - t0, 0.0 if ok else 1.0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                dc = torch.tensor([c1[0] - c0[0], c1[1] - c0[1]], dtype=torch.float64)
                dist.all_reduce(dc, op=dist.ReduceOp.SUM)
                if k and dt[1] == 0.0:
                    times[name].append(float(dt[0]))
                    cpu[name].append(dc.tolist())
                elif k:
                    lost += 1
        # The floors must compute the same sum as gloo (else their times mean nothing).
        err = torch.tensor(
            [max(float(np.max(np.abs(results[t] - results["gloo"]))) for t in names[1:])]
        )
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if rank == 0:
            med = {t: float(np.median(v)) if v else float("nan") for t, v in times.items()}
            split = {
                t: np.median(np.asarray(v), axis=0) if v else np.full(2, np.nan)
                for t, v in cpu.items()
            }
            rows.append(
                {
                    "gloo_cpu_user_median_s": float(split["gloo"][0]),
                    "gloo_cpu_sys_median_s": float(split["gloo"][1]),
                    "floor_cpu_user_median_s": float(split["udp_floor"][0]),
                    "floor_cpu_sys_median_s": float(split["udp_floor"][1]),
                    "floor_mmsg_cpu_user_median_s": float(split["udp_floor_mmsg"][0]),
                    "floor_mmsg_cpu_sys_median_s": float(split["udp_floor_mmsg"][1]),
                    "ranks": world,
                    "MB": mb,
                    "gloo_median_s": med["gloo"],
                    "floor_median_s": med["udp_floor"],
                    "ratio": med["udp_floor"] / med["gloo"],
                    "floor_mmsg_median_s": med["udp_floor_mmsg"],
                    "ratio_mmsg": med["udp_floor_mmsg"] / med["gloo"],
                    "lost_reps": lost,
                    "max_abs_err_vs_gloo": float(err[0]),
                }
            )
    sock.close()
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def _collect(out: Any, procs: list[Any], timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Rank 0's rows; a rank that died first (its traceback is on stderr) is an error at once,
    not a wait for the whole timeout."""
    import queue

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return list(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a rank process exited with code {dead[0]}") from None
    raise TimeoutError(f"the ranks did not report within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    """Run the floor against gloo for each rank count; print a table and write JSON."""
    import multiprocessing as mp

    p = argparse.ArgumentParser(
        prog="python -m bench.udp_floor", description=__doc__.split("\n")[0]
    )
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--sizes", default="25,100", help="comma-separated sizes in MB")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    args = {"sizes": [float(x) for x in a.sizes.split(",")], "reps": a.reps}
    ctx = mp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    for world in (int(x) for x in a.ranks.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, out)) for r in range(world)]
        for proc in procs:
            proc.start()
        try:
            rows += _collect(out, procs)
        finally:
            for proc in procs:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
    print(
        f"{'ranks x MB':>10}  {'gloo ms':>8}  {'floor ms':>8}  {'x gloo':>6}  {'mmsg ms':>8}  "
        f"{'x gloo':>6}  lost  max err  CPU ms (user/sys, all ranks): gloo, floor, mmsg floor"
    )
    for r in rows:
        ms = {t: 1e3 * r[f"{t}_median_s"] for t in ("gloo", "floor", "floor_mmsg")}
        split = ", ".join(
            f"{1e3 * r[f'{t}_cpu_user_median_s']:.1f}/{1e3 * r[f'{t}_cpu_sys_median_s']:.1f}"
            for t in ("gloo", "floor", "floor_mmsg")
        )
        print(
            f"{r['ranks']:>4} x {r['MB']:<4g}  {ms['gloo']:8.1f}  {ms['floor']:8.1f}  "
            f"{r['ratio']:6.2f}  {ms['floor_mmsg']:8.1f}  {r['ratio_mmsg']:6.2f}  "
            f"{r['lost_reps']:4d}  {r['max_abs_err_vs_gloo']:.1e}  {split}"
        )
    summary = {
        "floor_vs_gloo": {f"{r['ranks']}x{r['MB']:g}": r["ratio"] for r in rows},
        "floor_mmsg_vs_gloo": {f"{r['ranks']}x{r['MB']:g}": r["ratio_mmsg"] for r in rows},
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"config": {**args, "ranks": a.ranks}, "rows": rows, "summary": summary},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
