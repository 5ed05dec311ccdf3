"""The trainer ↔ daemon IPC messages (ARCHITECTURE §6): small JSON control frames, validated.

Theory of operation
-------------------
Tensors never travel over the socket: they sit in shared memory
(:mod:`gradlane.transport.daemon.shm`: sealed memfds) and a message names the segment (the
trainer's descriptor number and the memfd's name), offset, element count and dtype. A message
is two ZeroMQ frames, ``[kind, body]``: ``kind`` one of the ASCII names in :data:`SCHEMAS`,
``body`` a JSON object (UTF-8, at most :data:`MAX_MESSAGE_BYTES`). Nothing is ever
unpickled. Every message is treated as hostile: :func:`decode` checks the frame count and sizes,
the kind, the nesting depth of the raw bytes (at most :data:`MAX_DEPTH`, scanned before
``json.loads`` so a deeply nested body cannot exhaust the parser's recursion), the JSON itself
(huge integer literals, ``NaN`` and ``Infinity`` included), and every field's presence, type and
range against the kind's schema before a caller sees a value. Any failure is an :class:`IpcError`
whose ``why`` (one of :data:`REASONS`) the daemon counts before it answers ``REJECT`` and goes on
serving; the error's detail is clipped to :data:`MAX_DETAIL` characters and never holds more than
a bounded ``repr`` of what was received, so the ``REJECT`` that carries it always fits its field.

Conversation (trainer DEALER → daemon ROUTER)::

    HELLO  {job, rank, world, local_rank, local_world, pid}  -> WELCOME {generation, host, ...}
    SUBMIT {generation, step, bucket, shm, fd, offset, numel,
            dtype, layer_position, pinned}                   -> DONE {.., report} | FAIL {.., error}
    BYE    {}                                                (the daemon frees the rank's slots)
    anything malformed                                       -> REJECT {reason, detail}

``shm`` is the segment's memfd name, ``fd`` its descriptor number in the trainer; the daemon
opens it as ``/proc/<pid>/fd/<fd>`` with the pid the kernel gives for the socket's peer (HELLO's
``pid`` only where the socket cannot say) and checks that the two agree.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
from gradlane.transport.core.events import CollectiveReport, LossReport, SenderReport
from gradlane.transport.errors import GradlaneError

__all__ = [
    "MAX_DEPTH",
    "MAX_DETAIL",
    "MAX_MESSAGE_BYTES",
    "MAX_STRING",
    "REASONS",
    "SCHEMAS",
    "IpcError",
    "clip",
    "daemon_pid",
    "decode",
    "encode",
    "lock_path",
    "report_from_wire",
    "report_to_wire",
    "short",
]

#: Largest body accepted (a CollectiveReport of a many-host job fits with room to spare).
MAX_MESSAGE_BYTES = 64 << 10
#: Deepest nesting of arrays and objects accepted in a body (a DONE report nests 4 deep).
MAX_DEPTH = 32
#: Longest string field accepted.
MAX_STRING = 4096
#: Longest detail an :class:`IpcError` (and so a REJECT) carries; well under :data:`MAX_STRING`.
MAX_DETAIL = 1024
_U16 = (0, 0xFFFF)
_U32 = (0, 0xFFFFFFFF)
_U63 = (0, (1 << 63) - 1)
_COUNT = (0, 1 << 40)

#: kind -> {field: (type, (lo, hi) or None)}; bool is not accepted where int is asked.
SCHEMAS: dict[str, dict[str, tuple[type, tuple[float, float] | None]]] = {
    "HELLO": {
        "job": (int, _U32),
        "rank": (int, _U16),
        "world": (int, (1, 0xFFFF)),
        "local_rank": (int, _U16),
        "local_world": (int, (1, 0xFFFF)),
        "pid": (int, _U32),
    },
    "WELCOME": {
        "generation": (int, _U63),
        "host": (int, _U16),
        "hosts": (int, (1, 0xFFFF)),
        "prefix": (str, None),
        "hard_deadline_s": (float, (0.0, 1e9)),
    },
    "SUBMIT": {
        "generation": (int, _U63),
        "step": (int, _U32),
        "bucket": (int, _U16),
        "shm": (str, None),
        "fd": (int, (0, 0x7FFFFFFF)),
        "offset": (int, _COUNT),
        "numel": (int, _COUNT),
        "dtype": (int, (0, 2)),
        "layer_position": (float, (0.0, 1.0)),
        "pinned": (bool, None),
    },
    "DONE": {
        "generation": (int, _U63),
        "step": (int, _U32),
        "bucket": (int, _U16),
        "report": (dict, None),
    },
    "FAIL": {
        "generation": (int, _U63),
        "step": (int, _U32),
        "bucket": (int, _U16),
        "error": (str, None),
    },
    "REJECT": {"reason": (str, None), "detail": (str, None)},
    "BYE": {},
}

#: Why a message was rejected (the daemon counts each).
REASONS = (
    "malformed",
    "oversized",
    "unknown_kind",
    "bad_field",
    "foreign_job",
    "unknown_rank",
    "duplicate_rank",
    "bad_segment",
    "segment_access",
    "stale_generation",
    "mismatch",
    "duplicate_submit",
    "internal",
    "reply_failed",
)
"""``segment_access``: the daemon cannot reach a trainer's descriptors (``/proc/<pid>/fd``), so
it refuses its HELLO. ``internal``: handling the message raised an error the daemon did not
expect (logged with its traceback; serving goes on). ``reply_failed``: the daemon's own answer
could not be built."""

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxset = 8
_SHORT.maxlevel = 3


def short(value: Any) -> str:
    """A bounded ``repr`` of a received value (a long string, list or number is elided)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"<integer of {value.bit_length()} bits>"
    return _SHORT.repr(value)


def clip(text: str, limit: int = MAX_DETAIL) -> str:
    """``text`` cut to at most ``limit`` characters (an ellipsis says it was cut)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class IpcError(GradlaneError):
    """A malformed or unacceptable IPC message; ``why`` is one of :data:`REASONS`.

    (Not a :class:`~gradlane.transport.errors.ProtocolError`: those carry the wire format's
    reasons.)
    """

    def __init__(self, why: str, detail: str) -> None:
        detail = clip(detail)
        super().__init__(f"{why}: {detail}")
        self.why = why
        self.detail = detail


def lock_path(socket_path: str) -> str:
    """The lock file a daemon holds while it starts and serves on ``socket_path`` (its pid in
    it): one daemon per socket, and a sign of life for trainers that wait for it."""
    return socket_path + ".lock"


def daemon_pid(socket_path: str) -> int | None:
    """The pid of the live process that holds ``socket_path``'s daemon lock file, else None
    (no file, no pid written yet, or that process is gone). Reads only: taking the lock to
    test it could make a daemon that starts at that moment think another one serves."""
    try:
        with open(lock_path(socket_path), "rb") as f:
            pid = int(f.read(32).decode(errors="replace").strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)  # PermissionError: alive, another user's
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


def encode(kind: str, **fields: Any) -> list[bytes]:
    """The frames of one message; ``fields`` are checked against the kind's schema."""
    body = json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()
    frames = [kind.encode(), body]
    decode(frames)  # a bug that builds a bad message fails here, not at the other end
    return frames


def decode(frames: Sequence[bytes]) -> tuple[str, dict[str, Any]]:
    """``(kind, fields)`` of a received message, every field checked; else :class:`IpcError`."""
    if len(frames) != 2:
        raise IpcError("malformed", f"{len(frames)} frame(s), expected 2 (kind, JSON body)")
    raw_kind, body = bytes(frames[0]), frames[1]
    if len(body) > MAX_MESSAGE_BYTES or len(raw_kind) > 16:
        raise IpcError("oversized", f"{len(body)} B body, at most {MAX_MESSAGE_BYTES} B")
    kind = raw_kind.decode("ascii", "replace")
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise IpcError("unknown_kind", f"kind {kind!r}; valid: {sorted(SCHEMAS)}")
    raw = bytes(body)
    depth = _depth(raw)
    if depth > MAX_DEPTH:
        raise IpcError("malformed", f"{kind}: body nests {depth} deep, at most {MAX_DEPTH}")
    try:
        fields = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        # ValueError covers bad UTF-8, bad JSON and integer literals past Python's digit limit.
        raise IpcError("malformed", f"{kind}: body is not acceptable JSON ({short(e)})") from None
    if not isinstance(fields, dict):
        raise IpcError("malformed", f"{kind}: body must be a JSON object")
    extra = sorted(set(fields) - set(schema))
    missing = sorted(set(schema) - set(fields))
    if extra or missing:
        raise IpcError("bad_field", f"{kind}: missing {missing}, unexpected {short(extra)}")
    for name, (typ, bounds) in schema.items():
        fields[name] = _check(kind, name, fields[name], typ, bounds)
    return kind, fields


#: A JSON string token (escapes included); what lies between such tokens is structure.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.frombuffer(b"[{", np.uint8)
_CLOSE = np.frombuffer(b"]}", np.uint8)


def _depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (an upper bound when the text is not
    JSON). Linear in the body's size; strings are cut out first so brackets inside them don't
    count."""
    opens = body.count(b"[") + body.count(b"{")
    if opens <= MAX_DEPTH:
        return opens  # the common case: nesting cannot exceed the number of openings
    bare = np.frombuffer(_STRING.sub(b'""', body), np.uint8)
    step = np.isin(bare, _OPEN).astype(np.int32) - np.isin(bare, _CLOSE)
    return int(np.cumsum(step).max(initial=0))


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a number")  # encode never writes NaN or Infinity


def _check(kind: str, name: str, value: Any, typ: type, bounds: Any) -> Any:
    if typ is bool:  # JSON true/false only: not 0/1, which would pass for an int elsewhere
        if not isinstance(value, bool):
            raise IpcError("bad_field", f"{kind}.{name}={short(value)}: expected bool")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise IpcError("bad_field", f"{kind}.{name}={short(value)}: too large") from None
    if not isinstance(value, typ) or isinstance(value, bool):
        raise IpcError("bad_field", f"{kind}.{name}={short(value)}: expected {typ.__name__}")
    if isinstance(value, str) and len(value) > MAX_STRING:
        raise IpcError("bad_field", f"{kind}.{name}: string of {len(value)} characters")
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise IpcError(
            "bad_field", f"{kind}.{name}={short(value)}: outside [{bounds[0]}, {bounds[1]}]"
        )
    return value


def report_to_wire(report: CollectiveReport) -> dict[str, Any]:
    """A :class:`CollectiveReport` as a JSON-able dict (``delivered`` keys become strings)."""
    return asdict(report)


def report_from_wire(d: dict[str, Any]) -> CollectiveReport:
    """The inverse of :func:`report_to_wire`; a bad report is an :class:`IpcError`."""
    try:

        def loss(x: dict[str, Any]) -> LossReport:
            return LossReport(
                **{**x, "delivered": {int(k): float(v) for k, v in x["delivered"].items()}}
            )

        s = d["sender"]
        return CollectiveReport(
            step=int(d["step"]),
            bucket=int(d["bucket"]),
            duration=float(d["duration"]),
            reduce=loss(d["reduce"]),
            gather=tuple(loss(g) for g in d["gather"]),
            sender=SenderReport(
                sent=tuple(s["sent"]),
                dropped=tuple(s["dropped"]),
                retransmitted=tuple(s["retransmitted"]),
                bytes_sent=int(s["bytes_sent"]),
                per_path_bytes=tuple(s["per_path_bytes"]),
                format_bytes=tuple(int(x) for x in s.get("format_bytes", (0, 0, 0))),
                lossy_elems=int(s.get("lossy_elems", 0)),
                elems=int(s.get("elems", 0)),
                err2=float(s.get("err2", 0.0)),
                norm2=float(s.get("norm2", 0.0)),
            ),
            reduce_s=float(d.get("reduce_s", 0.0)),
            precision_level=float(d.get("precision_level", 0.0)),
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise IpcError("bad_field", f"DONE.report is not a collective report ({e!r})") from None
