"""The cross-traffic processes: a paced UDP/TCP sender and a counting sink (stdlib only).

Started by :mod:`gradlane.bench.testbed.crosstraffic` inside testbed host namespaces, so it imports
nothing of gradlane (a process starts in tens of milliseconds and costs no CPU importing numba).

UDP senders hand the kernel 64 KiB buffers with ``UDP_SEGMENT`` (UDP GSO): one system call per
~7 jumbo datagrams, segmented in the kernel, which lets one Python process on a shared core hold
hundreds of Mbit/s. Pacing is a token clock over wire bytes (Ethernet + IP + UDP headers
included, as htb counts them). TCP flows are bulk (no ``--rate-mbit``) or paced by the kernel
(``SO_MAX_PACING_RATE``: TCP's internal pacing needs no fq) plus the same token clock on writes.
``--pattern onoff`` alternates bursts and silences with exponential lengths (means ``--on-s``,
``--off-s``) drawn from a seeded RNG. Each process prints ``ready`` once its socket is set up,
and one JSON line of counters when SIGTERM stops it.

``python -m gradlane.bench.testbed.trafficgen sink --proto udp --bind ADDR --port P``
``python -m gradlane.bench.testbed.trafficgen send --proto udp --src ADDR --dst ADDR --port P
--rate-mbit R``
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import sys
import time
from typing import Any

__all__ = ["PATTERNS", "PROTOS", "main"]

SOL_UDP = 17
UDP_SEGMENT = 103  # linux/udp.h; not exported by the socket module
SO_MAX_PACING_RATE = 47
SO_RCVBUFFORCE = 33  # asm-generic/socket.h; not exported by the socket module
#: Sink receive buffer: ~0.25 s of 1 Gbit/s.
SINK_RCVBUF = 32 << 20
#: Ethernet (14) + IPv4 (20) + UDP (8) bytes around every datagram's payload.
UDP_OVERHEAD = 42
#: TCP writes this much per call.
TCP_WRITE = 1 << 16
#: A sender that fell this far behind its clock (CPU stolen) restarts the clock, not bursts.
MAX_LAG_S = 0.05
#: Seconds a TCP sender waits for its connection.
CONNECT_TIMEOUT_S = 20.0
#: Wake-up period of blocking socket calls, so SIGTERM is served promptly.
POLL_S = 0.2
PROTOS = ("udp", "tcp")
PATTERNS = ("steady", "onoff")


class _Stop:
    """Set by SIGTERM/SIGINT; the loops poll it."""

    def __init__(self) -> None:
        self.flag = False
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, *_: object) -> None:
        self.flag = True


class _Schedule:
    """On/off schedule: ``on(now)`` says whether a burst is running at ``now``."""

    def __init__(self, pattern: str, on_s: float, off_s: float, seed: int, now: float) -> None:
        self.steady = pattern == "steady"
        self.rng = random.Random(seed)
        self.on_s, self.off_s = on_s, off_s
        self.is_on = True
        self.until = now + self.rng.expovariate(1.0 / on_s)

    def on(self, now: float) -> bool:
        while not self.steady and now >= self.until:
            self.is_on = not self.is_on
            mean = self.on_s if self.is_on else self.off_s
            self.until += self.rng.expovariate(1.0 / mean)
        return self.steady or self.is_on


def _send(args: argparse.Namespace) -> dict[str, Any]:
    stop = _Stop()
    udp = args.proto == "udp"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, args.dscp << 2)
    sock.bind((args.src, 0))
    rate = None if args.rate_mbit is None else args.rate_mbit * 1e6 / 8  # bytes/s on the wire
    if udp:
        per_write = max(1, 65000 // args.payload)
        try:
            sock.setsockopt(SOL_UDP, UDP_SEGMENT, args.payload)
        except OSError:  # no UDP GSO: one datagram per call
            per_write = 1
        buf = bytes(args.payload * per_write)
        wire = per_write * (args.payload + UDP_OVERHEAD)
        sock.connect((args.dst, args.port))
    else:
        buf = bytes(TCP_WRITE)
        wire = TCP_WRITE
        if rate is not None:
            sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(rate))
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect((args.dst, args.port))
    sock.settimeout(POLL_S)
    print("ready", flush=True)
    t0 = time.monotonic()
    sched = _Schedule(args.pattern, args.on_s, args.off_s, args.seed, t0)
    sent = writes = errors = 0
    clock = t0
    while not stop.flag:
        now = time.monotonic()
        if not sched.on(now):
            time.sleep(min(POLL_S, max(sched.until - now, 0.0)))
            clock = time.monotonic()
            continue
        if rate is not None:
            if clock > now:
                time.sleep(clock - now)
            elif now - clock > MAX_LAG_S:
                clock = now
        try:
            n = sock.send(buf)
        except (TimeoutError, BlockingIOError):
            continue
        except OSError:  # ENOBUFS, an ICMP error reported late: count it, keep the rate
            errors += 1
            n = 0
        if udp and n:
            n = wire
        sent += n
        writes += 1
        if rate is not None:
            clock += (n or wire) / rate
    seconds = time.monotonic() - t0
    sock.close()
    return {
        "role": "sender",
        "proto": args.proto,
        "bytes": sent,
        "writes": writes,
        "send_errors": errors,
        "seconds": seconds,
        "mbit": sent * 8 / 1e6 / max(seconds, 1e-9),
    }


def _sink(args: argparse.Namespace) -> dict[str, Any]:
    stop = _Stop()
    udp = args.proto == "udp"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # A deep receive buffer rides out the moments a shared CPU takes this process away; what
    # still overflows is the sink's loss, not the network's (compare with the tc counters).
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, SINK_RCVBUF)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SINK_RCVBUF)
    sock.bind((args.bind, args.port))
    if not udp:
        sock.listen(4)
    sock.settimeout(POLL_S)
    print("ready", flush=True)
    buf = bytearray(1 << 16)
    received = packets = 0
    t_first = t_last = 0.0
    conns: list[socket.socket] = []
    while not stop.flag:
        try:
            if not udp and not conns:
                conn, _ = sock.accept()
                conn.settimeout(POLL_S)
                conns.append(conn)
                continue
            n = (sock if udp else conns[0]).recv_into(buf)
        except (TimeoutError, BlockingIOError):
            continue
        except OSError:
            break
        if not udp and n == 0:  # the sender closed
            conns.pop().close()
            continue
        now = time.monotonic()
        t_first = t_first or now
        t_last = now
        received += n + (UDP_OVERHEAD if udp else 0)
        packets += 1
    for c in conns:
        c.close()
    sock.close()
    seconds = t_last - t_first
    return {
        "role": "sink",
        "proto": args.proto,
        "bytes": received,
        "reads": packets,
        "seconds": seconds,
        "mbit": received * 8 / 1e6 / seconds if seconds > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of the sender and sink processes (``python -m
    gradlane.bench.testbed.trafficgen``)."""
    p = argparse.ArgumentParser(prog="python -m gradlane.bench.testbed.trafficgen")
    p.add_argument("role", choices=["send", "sink"])
    p.add_argument("--proto", choices=PROTOS, default="udp")
    p.add_argument("--src", help="sender's source address")
    p.add_argument("--dst", help="sender's destination address")
    p.add_argument("--bind", help="sink's address")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rate-mbit", type=float, default=None, help="omit for bulk TCP")
    p.add_argument("--pattern", choices=PATTERNS, default="steady")
    p.add_argument("--on-s", type=float, default=0.05)
    p.add_argument("--off-s", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dscp", type=int, default=0)
    p.add_argument("--payload", type=int, default=8972)
    args = p.parse_args(argv)
    record = _send(args) if args.role == "send" else _sink(args)
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
