"""ZeroMQ control plane: the HELLO handshake and a tiny stats request/reply (ARCHITECTURE §6).

Theory of operation
-------------------
Every rank runs a :class:`ControlServer`: one ROUTER socket bound on the rank's control endpoint,
served by a thread for the server's whole life. A rank joins with :func:`hello`: it opens one
DEALER per peer, sends ``[b"HELLO", packet]`` and waits for each peer's answer. The packet is a
regular gradlane packet of kind ``HELLO`` (:func:`gradlane.transport.wire.header.encode`), so the
job token and the integrity tag (keyed by the job's secret) are checked by
:func:`gradlane.transport.wire.header.validate` exactly as for data; its payload is the JSON
:class:`Announcement`.

* A server that accepts a HELLO answers ``[b"HELLO", its own HELLO packet]`` addressed to the
  asker, so both sides authenticate each other in one round trip.
* A server that rejects one answers ``[b"REJECT", reason]`` and counts it; the asker raises
  :class:`HandshakeError` naming the rank and endpoint that refused it, and why.
* A peer that does not answer before ``timeout_s`` makes :func:`hello` raise
  :class:`HandshakeTimeout` naming every missing rank.

Why DEALER → ROUTER rather than REQ/REP: a DEALER can be polled with a deadline and closed at
any time without wedging a lock-step state machine, and ZeroMQ queues the HELLO until the peer's
ROUTER binds, so ranks may start in any order without sleeps or retries. The server stays up
after the handshake (it also serves stats), so a late rank is always answered — the answer of a
one-shot exchange could be lost to a peer that had already closed.

``[b"STATS", b""]`` is answered ``[b"STATS", json]`` with the dict of the server's
``stats_source`` (typically :meth:`gradlane.transport.drivers.zmq.plane.ZmqPlane.stats`) plus
the server's own counters. Stats requests are not authenticated: they expose counters, never data.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from gradlane.transport.config import TransportConfig
from gradlane.transport.errors import GradlaneError, PeerTimeout
from gradlane.transport.wire.header import (
    Header,
    Kind,
    Reason,
    SessionSpec,
    decode_header,
    encode,
    validate,
)

__all__ = [
    "Announcement",
    "ControlServer",
    "HandshakeError",
    "HandshakeTimeout",
    "hello",
    "request_stats",
]

log = logging.getLogger(__name__)

_HELLO = b"HELLO"
_REJECT = b"REJECT"
_STATS = b"STATS"
_WAKE = b"STOP"


class HandshakeError(GradlaneError):
    """A peer refused our HELLO, or answered with one we cannot accept (names rank and why)."""


class HandshakeTimeout(PeerTimeout):
    """Peers did not answer the HELLO handshake in time; ``ranks`` are the missing ones."""

    def __init__(self, ranks: tuple[int, ...], endpoints: tuple[str, ...], waited_s: float):
        # PeerTimeout's own message speaks of a step and bucket; a handshake has neither.
        self.ranks = ranks
        self.step = 0
        self.bucket = 0
        self.phase = "hello"
        self.waited_s = waited_s
        who = ", ".join(f"{r} ({e})" for r, e in zip(ranks, endpoints, strict=True))
        GradlaneError.__init__(
            self, f"HELLO handshake: rank(s) {who} did not answer within {waited_s:.3f}s"
        )


@dataclass(frozen=True)
class Announcement:
    """What a rank tells its peers: who it is, and where its data plane listens, per path."""

    rank: int
    world: int
    job: int
    data: tuple[str, ...]
    """Data-plane endpoints of this rank, one per path (``tcp://…`` or ``ipc://…``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form fields (host name, pid…); carried, never interpreted."""

    def to_json(self) -> bytes:
        """The HELLO payload."""
        doc = {"rank": self.rank, "world": self.world, "job": self.job, "data": list(self.data)}
        return json.dumps({**doc, "extra": self.extra}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview) -> Announcement:
        """Parse a HELLO payload; malformed JSON or fields raise ``ValueError``."""
        doc = json.loads(bytes(raw))
        data = doc["data"]
        if not isinstance(data, list) or not all(isinstance(e, str) for e in data):
            raise ValueError("'data' must be a list of endpoint strings")
        return cls(int(doc["rank"]), int(doc["world"]), int(doc["job"]), tuple(data),
                   dict(doc.get("extra") or {}))  # fmt: skip


def _hello_packet(config: TransportConfig, ann: Announcement, dst: int) -> bytes:
    header = Header(kind=Kind.HELLO, job=config.job, src=ann.rank, dst=dst)
    return encode(header, ann.to_json(), config.tag_key)


def _check_hello(
    raw: bytes, config: TransportConfig, me: int, world: int, expect: int | None
) -> Announcement:
    """Validate a HELLO packet addressed to ``me``; raise ``HandshakeError`` with the reason."""
    session = SessionSpec(job=config.job, me=me, world=world, key=config.tag_key)
    why = validate(raw, session)
    if why == Reason.FOREIGN_JOB:
        job = decode_header(raw).job
        raise HandshakeError(f"foreign job: the HELLO is of job {job}, expected job {config.job}")
    if why == Reason.BAD_TAG:
        raise HandshakeError(
            "bad integrity tag: the two ranks use different secrets (or one has none)"
        )
    if why != Reason.OK:
        raise HandshakeError(f"malformed HELLO ({why.name.lower()})")
    h = decode_header(raw)
    if h.kind != Kind.HELLO:
        raise HandshakeError(f"expected a HELLO packet, got kind {Kind(h.kind).name}")
    try:
        ann = Announcement.from_json(raw[48:])
    except (ValueError, KeyError, TypeError) as exc:
        raise HandshakeError(f"unreadable HELLO payload: {exc}") from None
    if ann.rank != h.src or ann.job != config.job or (expect is not None and ann.rank != expect):
        raise HandshakeError(
            f"inconsistent HELLO: header src {h.src}, announced rank {ann.rank}, job {ann.job}"
            + (f", expected rank {expect}" if expect is not None else "")
        )
    if ann.rank == me:
        raise HandshakeError(f"the HELLO claims the receiver's own rank {me}")
    if ann.world != world:
        raise HandshakeError(f"world size mismatch: the HELLO says {ann.world}, expected {world}")
    return ann


class ControlServer:
    """A rank's control endpoint: answers HELLOs and stats requests on its own thread.

    ``bind`` may use a wildcard port (``tcp://127.0.0.1:*``); :attr:`endpoint` is the resolved
    address. Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        config: TransportConfig,
        announcement: Announcement,
        bind: str,
        *,
        stats_source: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.announcement = announcement
        self.stats_source = stats_source
        """Called on the server thread for every stats request; must be thread-safe."""
        self.peers: dict[int, Announcement] = {}
        """Announcements of the peers whose HELLO this server accepted."""
        self.rejected: deque[str] = deque(maxlen=100)
        """Why the last (up to 100) refused HELLOs were refused, most recent last."""
        self.n_rejected = 0
        """Requests refused since the server started."""
        self._ctx = zmq.Context(io_threads=1)
        self._lock = threading.Lock()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.linger = 0
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        for s in (self._wake_rx, self._wake_tx):
            s.linger = 0
        try:
            self._router.bind(bind)
            addr = f"inproc://gl-control-wake-{id(self)}"
            self._wake_rx.bind(addr)
            self._wake_tx.connect(addr)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound address (wildcard port resolved)."""
        self._thread = threading.Thread(
            target=self._serve, name=f"gl-control-{announcement.rank}", daemon=True
        )
        self._closed = False
        self._thread.start()

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread and close every socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._wake_tx.send(_WAKE)
        self._thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._router, self._wake_rx, self._wake_tx):
            s.close(linger=0)
        self._ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_rx in ready:
                return
            while True:
                try:
                    msg = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._answer(msg)

    def _answer(self, msg: list[bytes]) -> None:
        if len(msg) != 3:
            self._refused(f"malformed request of {len(msg)} frames")
            return
        ident, op, body = msg
        if op == _STATS:
            self._router.send_multipart([ident, _STATS, json.dumps(self._stats()).encode()])
            return
        if op != _HELLO:
            self._router.send_multipart([ident, _REJECT, b"unknown request " + op[:32]])
            return
        me, world = self.announcement.rank, self.announcement.world
        try:
            ann = _check_hello(body, self.config, me, world, None)
        except HandshakeError as exc:
            claimed = int.from_bytes(body[20:22], "little") if len(body) >= 22 else -1
            log.warning("rank %s refused a HELLO claiming rank %s: %s", me, claimed, exc)
            self._refused(str(exc))
            self._router.send_multipart([ident, _REJECT, str(exc).encode()])
            return
        with self._lock:
            self.peers[ann.rank] = ann
        reply = _hello_packet(self.config, self.announcement, ann.rank)
        self._router.send_multipart([ident, _HELLO, reply])

    def _refused(self, why: str) -> None:
        with self._lock:
            self.rejected.append(why)
            self.n_rejected += 1

    def _stats(self) -> dict[str, Any]:
        with self._lock:
            own = {"rank": self.announcement.rank, "peers": sorted(self.peers),
                   "hello_rejected": self.n_rejected}  # fmt: skip
        try:
            extra = self.stats_source() if self.stats_source is not None else {}
        except Exception as exc:  # a stats bug must not kill the control thread
            extra = {"stats_error": repr(exc)}
        return {**extra, "control": own}


def hello(
    config: TransportConfig,
    announcement: Announcement,
    control_endpoints: Sequence[str],
    *,
    timeout_s: float = 10.0,
) -> dict[int, Announcement]:
    """Exchange HELLOs with every other rank; returns their announcements by rank.

    ``control_endpoints[r]`` is rank r's :class:`ControlServer` address (this rank's own entry is
    ignored). Raises :class:`HandshakeError` when a peer refuses us or answers something we refuse
    (foreign job, wrong secret, world mismatch), :class:`HandshakeTimeout` naming the ranks that
    did not answer within ``timeout_s``.
    """
    me, world = announcement.rank, announcement.world
    if len(control_endpoints) != world:
        raise ValueError(f"{len(control_endpoints)} control endpoints for a world of {world}")
    ctx = zmq.Context(io_threads=1)
    dealers: dict[zmq.Socket[bytes], int] = {}
    poller = zmq.Poller()
    got: dict[int, Announcement] = {}
    try:
        for r, ep in enumerate(control_endpoints):
            if r == me:
                continue
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            dealers[s] = r
            s.connect(ep)
            # Queued by ZeroMQ until the peer's ROUTER is up: no ordering between ranks needed.
            s.send_multipart([_HELLO, _hello_packet(config, announcement, r)])
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while len(got) < len(dealers):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = tuple(r for r in range(world) if r != me and r not in got)
                eps = tuple(control_endpoints[r] for r in missing)
                raise HandshakeTimeout(missing, eps, timeout_s)
            for s, _ in poller.poll(max(1, int(left * 1000) + 1)):
                r = dealers[s]
                frames = s.recv_multipart()
                where = f"rank {r} ({control_endpoints[r]})"
                if len(frames) != 2:
                    raise HandshakeError(f"{where} answered {len(frames)} frames, expected 2")
                if frames[0] == _REJECT:
                    raise HandshakeError(
                        f"{where} refused our HELLO: {frames[1].decode(errors='replace')}"
                    )
                try:
                    got[r] = _check_hello(frames[1], config, me, world, r)
                except HandshakeError as exc:
                    raise HandshakeError(f"{where} answered a HELLO we refuse: {exc}") from None
                poller.unregister(s)
        return got
    finally:
        for s in dealers:
            s.close(linger=0)
        ctx.term()


def request_stats(endpoint: str, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """Ask the :class:`ControlServer` at ``endpoint`` for its stats dict (JSON over ZeroMQ)."""
    ctx = zmq.Context(io_threads=1)
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    try:
        s.connect(endpoint)
        s.send_multipart([_STATS, b""])
        if not s.poll(max(1, int(timeout_s * 1000))):
            raise TimeoutError(f"no stats answer from {endpoint} within {timeout_s:.3f}s")
        frames = s.recv_multipart()
        if len(frames) != 2 or frames[0] != _STATS:
            raise GradlaneError(f"{endpoint} answered a stats request with {frames[:1]!r}")
        out: dict[str, Any] = json.loads(frames[1])
        return out
    finally:
        s.close(linger=0)
        ctx.term()
