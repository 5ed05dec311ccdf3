"""How fast could a Python UDP all-reduce be on this machine? A protocol-free floor against gloo.

Usage::

    python -m gradlane.bench.perf.udp_floor --ranks 2,4 --sizes 25,100 --reps 15 --json out.json

Each rank runs the same transpose all-reduce as gradlane (reduce-scatter by direct all-to-all,
then all-gather) over one raw UDP socket on loopback, with nothing of a transport around it: no
acknowledgements, retransmissions, priorities, paths, pacing or integrity tags — ``sendmsg`` of a
16-byte header and a view of the buffer, ``recv_into`` and a numpy add or copy per datagram
(65000 bytes by default). It is what the interpreter and the kernel cost by themselves, so it
bounds what any Python transport can reach here; gradlane's own all-reduce
(``gradlane.bench.perf.allreduce``) adds its protocol on top.

A second floor, ``udp_floor_mmsg``, is the same exchange the way gradlane's engine moves bytes:
``sendmmsg`` of up to 16 messages per call (header and buffer view gathered by the kernel, no
copy in user space), ``recvmmsg`` of up to 64 datagrams into rows, and one compiled pass per
batch that adds or copies the rows into the buffer. It uses the kernel's offloads as the engine
does: UDP GSO (a peer's equal-sized datagrams share messages, up to 64 datagrams and 65507
bytes each) where the kernel has it, and UDP GRO on receive for datagrams of at most 4 KB.
Python is left with a few calls per batch, so this floor is close to what the kernel's copies
and the sums cost by themselves: a transport that is slower than gloo where even this floor is
has no room left for any protocol. ``gradlane.bench.perf.allreduce`` runs this floor too,
interleaved with gloo and gradlane's engine at the same datagram sizes.

``--chunk-bytes`` sets the payload per datagram (a multiple of 4; 64984 by default, which makes
65000-byte datagrams with the 16-byte header); ``--no-gso`` sends one datagram per message.

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
import errno
import json
import logging
import resource
import select
import socket
import struct
import sys
import time
import weakref
from datetime import timedelta
from typing import Any

import numpy as np
from numba import njit

log = logging.getLogger(__name__)

MB = 1 << 20
DATAGRAM = 65000
HDR = struct.Struct("<IIII")  # repetition, phase, element offset, element count
HDR_BYTES = 16  # HDR.size, as a constant compiled code can read
assert HDR.size == HDR_BYTES
#: Payload per datagram by default: whole datagrams of ``DATAGRAM`` bytes.
CHUNK_BYTES = DATAGRAM - HDR_BYTES
#: Largest payload per datagram: a UDP datagram's largest over IPv4, less the header.
MAX_CHUNK_BYTES = 65507 - HDR_BYTES
TIMEOUT_S = 5.0


def check_chunk_bytes(chunk_bytes: int) -> int:
    """``chunk_bytes`` if it is a payload the floors can carry (whole float32 elements, from 4
    bytes to ``MAX_CHUNK_BYTES``); ValueError otherwise."""
    if chunk_bytes % 4 or not 4 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(
            f"chunk_bytes={chunk_bytes}: use a multiple of 4 between 4 and {MAX_CHUNK_BYTES}"
        )
    return chunk_bytes


def _exchange(
    sock: socket.socket,
    ports: list[int],
    me: int,
    buf: np.ndarray,
    bounds: np.ndarray,
    rep: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> bool:
    """One all-reduce of ``buf`` in place, ``chunk_bytes`` of payload per datagram; False if a
    datagram never came (timed out)."""
    world = len(ports)
    el = check_chunk_bytes(chunk_bytes) // 4
    raw = memoryview(buf.data).cast("B")
    rbuf = bytearray(HDR.size + chunk_bytes)
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


BATCH_SEND = 16  # messages per sendmmsg call (destinations alternate call by call)
BATCH_RECV = 64  # datagrams per recvmmsg call
#: Receive with UDP GRO only for datagrams of at most this many bytes (the engine's threshold,
#: ``gradlane.transport.drivers.udp.sockets.GRO_MAX_ROW``: beyond it the split's copy costs
#: more than the kernel saves).
GRO_MAX_DATAGRAM = 4096
#: What a kernel answers a GSO send it cannot do (the engine's adapter reads the same errors).
_GSO_REFUSED = (errno.EINVAL, errno.EIO, errno.EMSGSIZE, errno.ENOPROTOOPT, errno.EOPNOTSUPP)
#: Sockets whose kernel refused a GSO send: every floor on them sends without GSO.
_NO_GSO: weakref.WeakSet[socket.socket] = weakref.WeakSet()
#: Datagrams kept for a later repetition (a DDP hook's next bucket), by repetition.
Stash = dict[int, list[np.ndarray]]


def floor_socket() -> socket.socket:
    """A non-blocking UDP socket on 127.0.0.1 with 64 MiB buffers (forced past ``rmem_max``
    when permitted, like gradlane's loopback preset)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, force in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):
        sock.setsockopt(socket.SOL_SOCKET, opt, 64 * MB)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, force, 64 * MB)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


@njit(cache=True, nogil=True)
def _apply_rows(
    words: np.ndarray, floats: np.ndarray, lengths: np.ndarray, buf: np.ndarray, rep: int,
    got: np.ndarray, early: np.ndarray,
) -> int:  # fmt: skip
    """Add (phase 0) or copy (phase 1) each received row's payload into ``buf``; rows of
    another repetition or with a wrong length are skipped. ``got`` counts rows per phase.
    Rows of repetition ``rep + 1`` (a peer already on the next bucket) are marked in ``early``
    and counted in the return value: the caller keeps them for that repetition."""
    n_early = 0
    for i in range(lengths.shape[0]):
        early[i] = False
        off, cnt, phase = np.int64(words[i, 2]), np.int64(words[i, 3]), np.int64(words[i, 1])
        if np.int64(words[i, 0]) == rep + 1:
            early[i] = True
            n_early += 1
            continue
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
    return n_early


class _MmsgFloor:
    """The batched floor's tables for one buffer size: a ``SendBatch`` with one "path" per
    peer (so each path's messages name that peer), the header rows, and the receive rows.

    ``chunk_bytes``: payload per datagram, ``chunk_bytes // 4`` float32 elements after the
    16-byte header (the engine's ``chunk_bytes`` means the same); the default makes 65000-byte
    datagrams. The kernel's offloads as the engine's UDP adapter uses them: with ``gso`` and a
    kernel that has UDP GSO, a peer's equal-sized datagrams of a phase share GSO messages (up
    to 64 datagrams and 65507 bytes each; 65000-byte ones go one per message either way); a
    GSO send the kernel refuses turns GSO off for the socket, and the rest of the phase is laid
    out again without it. With ``gro``, datagrams of at most ``GRO_MAX_DATAGRAM`` bytes are
    received with UDP GRO (a coalesced run per message, split into the rows). :attr:`gso` and
    :attr:`gro` say what is in use. A socket carries one datagram size: GRO, once asked for,
    stays on for the socket, and would cut a larger size's coalesced runs.
    """

    def __init__(
        self,
        sock: socket.socket,
        ports: list[int],
        me: int,
        bounds: np.ndarray,
        chunk_bytes: int = CHUNK_BYTES,
        gso: bool = True,
        gro: bool = True,
    ) -> None:
        from gradlane.transport.drivers.udp import mmsg as _mmsg

        self.sock, self.me, self.bounds, self.world = sock, me, bounds, len(ports)
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.el = chunk_bytes // 4
        self.rows = np.zeros((BATCH_RECV, HDR.size + chunk_bytes), dtype=np.uint8)
        self.words = self.rows.view(np.uint32)
        self.floats = self.rows.view(np.float32)
        self.lengths = np.zeros(BATCH_RECV, dtype=np.int64)
        self.table = _mmsg.RecvTable(self.rows)
        small = HDR.size + chunk_bytes <= GRO_MAX_DATAGRAM
        self.gro = gro and small and _mmsg.AVAILABLE and _mmsg.gro_enable(sock)
        self.gro_table = _mmsg.GroTable() if self.gro else None
        self.gso = gso and sock not in _NO_GSO and _mmsg.gso_supported(sock)
        addrs = [_mmsg.sockaddr(("127.0.0.1", p)) for p in ports]
        tos = [_mmsg.tos_cmsg(0, False) for _ in ports]
        self._keep = addrs + tos  # the send table points into them
        self.names = np.array([(a.ctypes.data, a.shape[0]) for a in addrs], dtype=np.uint64)
        self.controls = np.array([(c.ctypes.data, c.shape[0]) for c in tos], dtype=np.uint64)
        self.gso_controls = np.stack([_mmsg.gso_control(0, False) for _ in ports])
        self.batch = _mmsg.SendBatch(self.world)
        self.got = np.zeros(2, dtype=np.int64)
        self.early = np.zeros(BATCH_RECV, dtype=np.bool_)

    def _lay_out(self, phase: int, rep: int, buf: np.ndarray, skip: np.ndarray) -> np.ndarray:
        """Every datagram of ``phase`` in the send table but the first ``skip[j]`` to each peer
        ``j`` (already sent); returns the rows (messages) per peer."""
        from gradlane.transport.drivers.udp.mmsg import RunRows

        b, me, el = self.bounds, self.me, self.el
        self.batch.clear()
        self.batch.gso[:] = self.gso
        gso_controls = self.gso_controls if self.gso else None
        plan = []
        for j in range(self.world):
            if j == me:
                continue
            lo, hi = (int(b[j]), int(b[j + 1])) if phase == 0 else (int(b[me]), int(b[me + 1]))
            offs = np.arange(lo, hi, el, dtype=np.int64)[int(skip[j]) :]
            plan.append((j, offs, np.minimum(offs + el, hi) - offs))
        n = sum(len(offs) for _, offs, _ in plan)
        self.hdrs = np.zeros((max(n, 1), 4), dtype=np.uint32)
        at = 0
        for j, offs, cnts in plan:
            k = len(offs)
            self.hdrs[at : at + k] = np.stack(
                [np.full(k, rep), np.full(k, phase), offs, cnts], axis=1
            ).astype(np.uint32)
            rows = RunRows(
                int(self.hdrs.ctypes.data),
                HDR.size,
                np.arange(at, at + k, dtype=np.int64),
                int(buf.ctypes.data),
                4 * offs,
                4 * cnts,
                np.full(k, j, dtype=np.int64),
            )
            self.batch.append(j, rows, self.names, self.controls, gso_controls)
            at += k
        return self.batch.fill.copy()

    def _refuse_gso(self, err: int) -> None:
        """The kernel refused a GSO send: no GSO on this socket from now on (as the engine's
        adapter stops using it on the path)."""
        self.gso = False
        if self.sock not in _NO_GSO:
            _NO_GSO.add(self.sock)
            log.warning(
                "udp floor: the kernel refused a UDP GSO send (%s); one datagram per message "
                "from now on",
                errno.errorcode.get(err, err),
            )

    def _take(self, lengths: np.ndarray, buf: np.ndarray, rep: int, stash: Stash | None) -> None:
        """Apply the first ``len(lengths)`` receive rows to ``buf``; keep the next repetition's
        in ``stash`` (dropped without one)."""
        early = _apply_rows(self.words, self.floats, lengths, buf, rep, self.got, self.early)
        if early and stash is not None:
            keep = stash.setdefault(rep + 1, [])
            keep += [
                self.rows[i, : lengths[i]].copy() for i in range(lengths.shape[0]) if self.early[i]
            ]

    def _receive(self, fd: int, buf: np.ndarray, rep: int, stash: Stash | None) -> bool:
        """Take every datagram waiting on the socket; True if there was any."""
        moved = False
        gro = self.gro_table
        while True:
            if gro is None:
                lengths, err = self.table.receive(fd, 0, BATCH_RECV)
                if err or lengths.shape[0] == 0:
                    return moved
                self._take(lengths, buf, rep, stash)
            else:  # coalesced runs in the staging rows, split into the receive rows
                k, err = gro.receive(fd, gro.capacity)
                if err or k == 0:
                    return moved
                m = s = 0
                while m < k:
                    w, m, s = gro.split(k, m, s, self.rows, 0, self.lengths)
                    self._take(self.lengths[:w], buf, rep, stash)
            moved = True

    def exchange(self, buf: np.ndarray, rep: int, stash: Stash | None = None) -> bool:
        """One all-reduce of ``buf`` in place; False if a datagram never came (timed out).

        ``stash``: datagrams of the next repetition that came during this one are kept there
        (and this repetition's are taken from it first). Callers that separate repetitions
        with a barrier need none; a DDP hook, whose buckets follow each other, does."""
        b, me, el, fd = self.bounds, self.me, self.el, self.sock.fileno()
        peers = [j for j in range(self.world) if j != me]
        need = [
            len(peers) * -(-(int(b[me + 1]) - int(b[me])) // el),
            sum(-(-(int(b[j + 1]) - int(b[j])) // el) for j in peers),
        ]
        self.got[:] = 0
        for row in stash.pop(rep, []) if stash is not None else []:
            self.rows[0, : row.shape[0]] = row
            self.lengths[0] = row.shape[0]
            self._take(self.lengths[:1], buf, rep, None)
        for phase in (0, 1):
            sent = np.zeros(self.world, dtype=np.int64)  # datagrams gone to each peer
            fill = self._lay_out(phase, rep, buf, sent)
            pos = np.zeros(self.world, dtype=np.int64)  # rows (messages) gone to each peer
            deadline = time.monotonic() + TIMEOUT_S
            while self.got[phase] < need[phase] or (pos < fill).any():
                moved = False
                for j in peers:
                    k = min(BATCH_SEND, int(fill[j] - pos[j]))
                    if k <= 0:
                        continue
                    i = int(pos[j])
                    went, err = self.batch.send(fd, j, i, k)  # EAGAIN: later
                    sent[j] += self.batch.row_datagrams(j, i, i + went)
                    pos[j] += went
                    moved |= went > 0
                    if err in _GSO_REFUSED and went < k and self.batch.count[j, i + went] > 1:
                        self._refuse_gso(err)
                        fill = self._lay_out(phase, rep, buf, sent)
                        pos[:] = 0
                        moved = True
                        break
                moved |= self._receive(fd, buf, rep, stash)
                if not moved:
                    if time.monotonic() > deadline:
                        return False
                    select.select([self.sock], [], [], 0.05)
        return True


class FloorHook:
    """A DDP communication hook over the batched floor: how fast a UDP hook with no protocol at
    all could train here (``gradlane.bench.perf.ddp_step --transports udp,floor``).

    ``floor_hook(state, bucket)`` hands the bucket to this state's worker thread and returns a
    Future, as gradlane's hook does; the thread all-reduces it with
    :meth:`_MmsgFloor.exchange` (the system calls and the compiled pass release the GIL),
    divides by the world size and completes the Future. Buckets go in the order DDP hands them
    over, the same on every rank, which numbers them. A lost datagram (loopback with 64 MiB
    buffers does not lose) fails the Future after 5 s: the floor has no recovery. ``ports``:
    every rank's :attr:`port`, exchanged by the caller (e.g. ``all_gather_object``) before
    :meth:`start`.
    """

    def __init__(self, rank: int, world: int) -> None:
        import queue
        import threading

        self.rank, self.world = rank, world
        self.sock = floor_socket()
        self.port = int(self.sock.getsockname()[1])
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="udp-floor-hook", daemon=True)
        self._floors: dict[int, _MmsgFloor] = {}
        self._stash: dict[int, list[np.ndarray]] = {}
        self._ports: list[int] = []
        self._rep = 0

    def start(self, ports: list[int]) -> None:
        """Every rank's port, in rank order; starts the worker thread."""
        self._ports = list(ports)
        self._thread.start()

    def submit(self, tensor: Any) -> Any:
        """All-reduce ``tensor`` (CPU, float32, contiguous) in place, averaged: a Future."""
        import torch

        fut: Any = torch.futures.Future()
        self._jobs.put((tensor, fut))
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            tensor, fut = job
            try:
                arr = tensor.numpy()
                if arr.dtype != np.float32 or arr.ndim != 1 or not arr.flags.c_contiguous:
                    raise TypeError(
                        f"udp floor: buckets must be flat contiguous float32, got {arr.dtype} "
                        f"{arr.shape}"
                    )
                n = arr.shape[0]
                floor = self._floors.get(n)
                if floor is None:
                    bounds = np.linspace(0, n, self.world + 1).astype(np.int64)
                    floor = self._floors[n] = _MmsgFloor(self.sock, self._ports, self.rank, bounds)
                self._rep += 1
                if not floor.exchange(arr, self._rep, self._stash):
                    raise TimeoutError(f"udp floor: bucket {self._rep} lost a datagram")
                tensor.div_(self.world)
                fut.set_result(tensor)
            except Exception as e:  # the Future carries it to backward()
                fut.set_exception(e)

    def close(self) -> None:
        """Stop the worker thread and close the socket."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(10.0)
        self.sock.close()


def floor_hook(state, bucket):
    """DDP communication hook: the bucket's average over the ranks through ``state``. No
    annotations: DDP accepts none or the real ``dist.GradBucket`` class, and this module's are
    strings (and it imports torch only when a rank runs)."""
    return state.submit(bucket.buffer())


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
    sock = floor_socket()
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
        chunk = args["chunk_bytes"]
        mmsg = _MmsgFloor(sock, ports, rank, bounds, chunk, args["gso"])
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
                    ok = _exchange(sock, ports, rank, buf, bounds, rep, chunk)
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
                    "chunk_bytes": chunk,
                    "mmsg_gso": mmsg.gso,  # rank 0's: in use at the end
                    "mmsg_gro": mmsg.gro,
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
        prog="python -m gradlane.bench.perf.udp_floor", description=__doc__.split("\n")[0]
    )
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--sizes", default="25,100", help="comma-separated sizes in MB")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=CHUNK_BYTES,
        help=f"payload per datagram, a multiple of 4 (default {CHUNK_BYTES}: "
        f"{DATAGRAM}-byte datagrams)",
    )
    p.add_argument("--no-gso", action="store_true", help="no UDP GSO for the batched floor")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    try:
        check_chunk_bytes(a.chunk_bytes)
    except ValueError as e:
        p.error(str(e))
    args = {
        "sizes": [float(x) for x in a.sizes.split(",")],
        "reps": a.reps,
        "chunk_bytes": a.chunk_bytes,
        "gso": not a.no_gso,
    }
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
