"""Traffic control on the testbed's switch ports: htb shaping, DSCP priority classes, counters.

Every switch egress port gets an htb root with one shaped class (the link rate) and a pfifo
queue under it. With ``priority`` the shaped class is split into one htb class per priority
class of :class:`gradlane.scheduling.priority.PriorityConfig` plus a best-effort class for
everything else (gloo, unmarked cross traffic), selected by the u32 classifier on the IP TOS byte:

=========  ======  ==========  =====================================================
htb prio   DSCP    queue       role
=========  ======  ==========  =====================================================
0          46 EF   Q           gradlane class 0 (protected)
1          34      Q/2         gradlane class 1
2          26      Q/4         gradlane class 2
3          other   Q/8         best effort: unmarked traffic
4          8 CS1   Q/16        gradlane's droppable class ("lower effort", RFC 8622)
=========  ======  ==========  =====================================================

Each class is guaranteed a small share (:data:`ASSURED_SHARE`) so none starves, and may borrow
up to the link rate; htb lends spare tokens to the lowest ``prio`` first, which makes the order
close to strict priority. Shorter queues for the lower classes make them drop first.

Only htb, pfifo and the u32 classifier are used: kernels built without netem, prio or fq (as some
container and VM kernels are) still have them. Functions here build ``tc -batch`` lines and parse
``tc -s -j`` output; running them is the testbed's job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gradlane.scheduling.priority import PriorityConfig

__all__ = [
    "ASSURED_SHARE",
    "PortShape",
    "class_table",
    "parse_qdisc_stats",
    "port_commands",
]

#: Fraction of the link each priority class is guaranteed before the borrowing order applies.
ASSURED_SHARE = 0.05
#: Smallest per-class queue, in packets (so a short burst of a low class still fits).
MIN_QUEUE = 8
#: htb's deficit per round; above the 9000-byte MTU and below htb's "quantum is big" warning.
QUANTUM = 60000
#: Handle minor of the first leaf class; classes are 1:10, 1:11, ...
FIRST_MINOR = 0x10
#: TOS mask of the DSCP bits (the two ECN bits are ignored).
DSCP_MASK = 0xFC


@dataclass(frozen=True)
class PortShape:
    """How one switch egress port is shaped.

    Attributes:
        rate_mbit: the port's rate in Mbit/s.
        queue_packets: queue limit of the (highest) class in packets.
        priority: split the port into DSCP classes (see the module docstring).
        dscp: gradlane's DSCP code point per priority class, most urgent first.
        mtu: the link MTU, used for the minimum htb burst.
    """

    rate_mbit: float
    queue_packets: int
    priority: bool = False
    dscp: tuple[int, ...] = PriorityConfig().dscp
    mtu: int = 9000


def class_table(shape: PortShape) -> list[tuple[str, int | None, int]]:
    """The port's leaf classes as ``(name, dscp or None for best effort, queue packets)``.

    Ordered by htb ``prio`` (index = prio). Without priority there is one class, ``all``.
    """
    if not shape.priority:
        return [("all", None, shape.queue_packets)]
    *marked, last = shape.dscp
    names: list[tuple[str, int | None]] = [(f"dscp{d}", d) for d in marked]
    names += [("best-effort", None), (f"dscp{last}", last)]
    return [
        (name, dscp, max(MIN_QUEUE, shape.queue_packets >> i))
        for i, (name, dscp) in enumerate(names)
    ]


def _burst_bytes(shape: PortShape) -> int:
    # One millisecond of tokens (htb's timer granularity is about that under load), at least
    # two full frames so a jumbo frame never waits for tokens that cannot accumulate.
    return max(2 * (shape.mtu + 14), int(shape.rate_mbit * 1e6 / 8 / 1000))


def port_commands(dev: str, shape: PortShape) -> list[str]:
    """``tc -batch`` lines that shape egress port ``dev`` as ``shape`` says."""
    rate = f"{shape.rate_mbit:.6g}mbit"
    burst = _burst_bytes(shape)
    classes = class_table(shape)
    default = FIRST_MINOR + next(i for i, (_, dscp, _) in enumerate(classes) if dscp is None)
    lines = [
        f"qdisc replace dev {dev} root handle 1: htb default {default:x}",
        f"class add dev {dev} parent 1: classid 1:1 htb rate {rate} ceil {rate} "
        f"burst {burst} cburst {burst} quantum {QUANTUM}",
    ]
    assured = f"{shape.rate_mbit * ASSURED_SHARE:.6g}mbit" if shape.priority else rate
    for prio, (_, dscp, limit) in enumerate(classes):
        minor = FIRST_MINOR + prio
        lines.append(
            f"class add dev {dev} parent 1:1 classid 1:{minor:x} htb rate {assured} "
            f"ceil {rate} burst {burst} cburst {burst} quantum {QUANTUM} prio {prio}"
        )
        lines.append(
            f"qdisc add dev {dev} parent 1:{minor:x} handle {minor:x}: pfifo limit {limit}"
        )
        if dscp is not None:
            lines.append(
                f"filter add dev {dev} parent 1: protocol ip prio 1 u32 "
                f"match ip tos {dscp << 2:#04x} {DSCP_MASK:#04x} flowid 1:{minor:x}"
            )
    return lines


def parse_qdisc_stats(text: str, shapes: dict[str, PortShape]) -> dict[str, dict[str, Any]]:
    """Per-port counters from ``tc -s -j qdisc show`` of one namespace.

    Only ports named in ``shapes`` are reported. Each port has ``sent_bytes``,
    ``sent_packets``, ``drops``, ``overlimits``, ``backlog_bytes`` and ``qlen`` of its htb root
    (drops of every class are counted there too), and ``classes``: the same counters per
    leaf class (by the names of :func:`class_table`).
    """
    try:
        entries = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as exc:  # a tc that cannot write JSON: say so, do not guess
        raise ValueError(f"tc -s -j qdisc show returned no JSON: {text[:200]!r}") from exc
    ports: dict[str, dict[str, Any]] = {}
    for entry in entries:
        dev = entry.get("dev")
        if dev not in shapes:
            continue
        counters = {
            "sent_bytes": int(entry.get("bytes", 0)),
            "sent_packets": int(entry.get("packets", 0)),
            "drops": int(entry.get("drops", 0)),
            "overlimits": int(entry.get("overlimits", 0)),
            "backlog_bytes": int(entry.get("backlog", 0)),
            "qlen": int(entry.get("qlen", 0)),
        }
        port = ports.setdefault(dev, {"classes": {}})
        if entry.get("root"):
            port.update(counters)
            continue
        parent = str(entry.get("parent", ""))
        minor = int(parent.split(":")[1] or "0", 16) if ":" in parent else -1
        table = class_table(shapes[dev])
        if 0 <= minor - FIRST_MINOR < len(table):
            port["classes"][table[minor - FIRST_MINOR][0]] = counters
    return ports
