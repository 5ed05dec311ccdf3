"""The impairment forwarder process (stdlib only): AF_PACKET in, seeded loss and delay, out.

Started by :mod:`gradlane.bench.testbed.impair` inside a spine namespace, after it created the veth
pair ``imA``/``imB`` there; see that module for how traffic reaches this process and returns to the
spine's forwarding. One ``AF_PACKET`` socket per impaired port receives a copy of every frame
arriving from a leaf (taps run before routing, whose ``blackhole`` rule then drops the
kernel's copy). Each IPv4 frame is dropped with probability ``--loss`` (a seeded RNG), else its
Ethernet addresses become ``imA -> imB`` and it is sent on ``imA``, at once or when a heap timer
says (``--delay-ms`` plus uniform ``--jitter-ms``). The sockets use ``PACKET_VNET_HDR``: a
local sender's checksum is still "partial" (offloaded) in the frame we read, and handing the
virtio header back out tells the kernel to finish it.

Prints ``ready`` once its sockets are bound and one JSON line of counters at SIGTERM:
``received`` (IPv4 frames seen), ``dropped`` (by the RNG), ``forwarded``, ``overrun`` (frames the
kernel dropped because the forwarder fell behind: loss it did not choose), and a few more.
``python -m gradlane.bench.testbed.impair_forwarder --ports l0,l1 --loss 0.01 --delay-ms 2``
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import random
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["IN_DEV", "OUT_DEV", "main"]

ETH_P_ALL = 0x0003
ETH_P_IP = b"\x08\x00"
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23
PACKET_VNET_HDR = 15
PACKET_STATISTICS = 6  # struct tpacket_stats {packets, drops}
SO_RCVBUFFORCE = 33  # asm-generic/socket.h; not exported by the socket module
#: struct virtio_net_hdr before every frame on a PACKET_VNET_HDR socket.
VNET = 10
#: Largest frame read; bigger ones (only possible with GSO on) are counted and dropped.
FRAME_MAX = 1 << 16
#: Frames read from one socket per wake-up before the others get a turn.
BATCH = 256
#: Wake-up period when nothing is due, so SIGTERM is served promptly.
POLL_S = 0.2
#: Receive buffer per port: a few milliseconds of 1 Gbit/s, so a busy forwarder loses nothing.
RCVBUF = 8 << 20
OUT_DEV, IN_DEV = "imA", "imB"


def _mac(dev: str) -> bytes:
    return bytes.fromhex(Path(f"/sys/class/net/{dev}/address").read_text().strip().replace(":", ""))


def _forward(args: argparse.Namespace) -> dict[str, Any]:
    stop = [False]

    def _set(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _set)
    signal.signal(signal.SIGINT, _set)
    rng = random.Random(args.seed)
    delay = args.delay_ms / 1000.0
    jitter = args.jitter_ms / 1000.0
    rewrite = _mac(IN_DEV) + _mac(OUT_DEV)  # dst, src of the frames sent on imA
    out = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    out.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    out.bind((OUT_DEV, 0))
    sel = selectors.DefaultSelector()
    socks = []
    for port in args.ports.split(","):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
        except OSError:  # unprivileged: the capped SO_RCVBUF still helps
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        s.bind((port, ETH_P_ALL))
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        socks.append(s)
    print("ready", flush=True)
    counts = dict.fromkeys(
        ("received", "dropped", "forwarded", "non_ip", "oversize", "send_errors"), 0
    )
    heap: list[tuple[float, int, bytes]] = []
    seq = 0
    buf = bytearray(FRAME_MAX)
    view = memoryview(buf)
    max_queue = 0
    t0 = time.monotonic()

    def send(frame: bytes) -> None:
        try:
            out.send(frame)
            counts["forwarded"] += 1
        except OSError:
            counts["send_errors"] += 1

    while not stop[0]:
        timeout = POLL_S if not heap else max(0.0, heap[0][0] - time.monotonic())
        for key, _ in sel.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            for _ in range(BATCH):
                try:
                    n = sock.recv_into(buf, FRAME_MAX, socket.MSG_TRUNC)
                except (BlockingIOError, InterruptedError):
                    break
                if buf[VNET + 12 : VNET + 14] != ETH_P_IP:
                    counts["non_ip"] += 1
                    continue
                counts["received"] += 1
                if n > FRAME_MAX:
                    counts["oversize"] += 1
                    continue
                if args.loss and rng.random() < args.loss:
                    counts["dropped"] += 1
                    continue
                # The virtio header goes back out as it came: a local sender's checksum is
                # still "partial" (offloaded), and the header tells the kernel to finish it.
                frame = bytes(view[:VNET]) + rewrite + bytes(view[VNET + 12 : n])
                if delay == 0 and jitter == 0:
                    send(frame)
                    continue
                due = time.monotonic() + delay + (rng.uniform(0.0, jitter) if jitter else 0.0)
                heapq.heappush(heap, (due, seq, frame))
                seq += 1
        max_queue = max(max_queue, len(heap))
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            send(heapq.heappop(heap)[2])
    # Frames the kernel dropped because this process fell behind: loss we did not choose.
    overrun = 0
    for s in socks:
        with contextlib.suppress(OSError):
            overrun += struct.unpack("II", s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))[1]
        s.close()
    out.close()
    return {
        **counts,
        "overrun": overrun,
        "still_delayed": len(heap),
        "max_delayed": max_queue,
        "seconds": time.monotonic() - t0,
        "loss_observed": counts["dropped"] / counts["received"] if counts["received"] else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of the forwarder process (``python -m gradlane.bench.testbed.impair_forwarder``,
    inside a spine)."""
    p = argparse.ArgumentParser(prog="python -m gradlane.bench.testbed.impair_forwarder")
    p.add_argument("--ports", required=True, help="comma-separated ports to impair, e.g. l0,l1")
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(_forward(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
