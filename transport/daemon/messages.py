"""The trainer ↔ daemon IPC messages (ARCHITECTURE §6): small JSON control frames, validated.

Theory of operation
-------------------
Tensors never travel over the socket: they sit in shared memory
(:mod:`gradlane.transport.daemon.shm`) and a message names the segment, offset, element count and
dtype. A message is two ZeroMQ frames, ``[kind, body]``: ``kind`` one of the ASCII names in
:data:`SCHEMAS`, ``body`` a JSON object (UTF-8, at most :data:`MAX_MESSAGE_BYTES`). Nothing is ever
unpickled. :func:`decode` checks the frame count, size, kind, JSON, and every field's presence, type
and range against the kind's schema before a caller sees a value; anything else is an
:class:`IpcError` whose ``reason`` (one of :data:`REASONS`) the daemon counts before it answers
``REJECT`` and goes on serving.

Conversation (trainer DEALER → daemon ROUTER)::

    HELLO  {job, rank, world, local_rank, local_world, pid}  -> WELCOME {generation, host, ...}
    SUBMIT {generation, step, bucket, shm, offset, numel,
            dtype, layer_position, pinned}                   -> DONE {.., report} | FAIL {.., error}
    BYE    {}                                                (the daemon frees the rank's slots)
    anything malformed                                       -> REJECT {reason, detail}
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from gradlane.transport.core.events import CollectiveReport, LossReport, SenderReport
from gradlane.transport.errors import GradlaneError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "REASONS",
    "SCHEMAS",
    "IpcError",
    "daemon_pid",
    "decode",
    "encode",
    "lock_path",
    "report_from_wire",
    "report_to_wire",
]

#: Largest body accepted (a CollectiveReport of a many-host job fits with room to spare).
MAX_MESSAGE_BYTES = 64 << 10
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
    "stale_generation",
    "mismatch",
    "duplicate_submit",
)


class IpcError(GradlaneError):
    """A malformed or unacceptable IPC message; ``why`` is one of :data:`REASONS`.

    (Not a :class:`~gradlane.transport.errors.ProtocolError`: those carry the wire format's
    reasons.)
    """

    def __init__(self, why: str, detail: str) -> None:
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
    try:
        fields = json.loads(bytes(body))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IpcError("malformed", f"{kind}: body is not JSON ({e})") from None
    if not isinstance(fields, dict):
        raise IpcError("malformed", f"{kind}: body must be a JSON object")
    extra = sorted(set(fields) - set(schema))
    missing = sorted(set(schema) - set(fields))
    if extra or missing:
        raise IpcError("bad_field", f"{kind}: missing {missing}, unexpected {extra}")
    for name, (typ, bounds) in schema.items():
        fields[name] = _check(kind, name, fields[name], typ, bounds)
    return kind, fields


def _check(kind: str, name: str, value: Any, typ: type, bounds: Any) -> Any:
    if typ is bool:  # JSON true/false only: not 0/1, which would pass for an int elsewhere
        if not isinstance(value, bool):
            raise IpcError("bad_field", f"{kind}.{name}={value!r}: expected bool")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or isinstance(value, bool):
        raise IpcError("bad_field", f"{kind}.{name}={value!r}: expected {typ.__name__}")
    if isinstance(value, str) and len(value) > 4096:
        raise IpcError("bad_field", f"{kind}.{name}: string of {len(value)} characters")
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise IpcError("bad_field", f"{kind}.{name}={value!r}: outside [{bounds[0]}, {bounds[1]}]")
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
            ),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise IpcError("bad_field", f"DONE.report is not a collective report ({e!r})") from None
