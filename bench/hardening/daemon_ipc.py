"""Phase 2, forged IPC: hostile messages against a ``gradlane daemon``, then a trainer that
truncates its segment after SUBMIT, then a real all-reduce through the same daemon.

Theory of operation
-------------------
A daemon process (:class:`~gradlane.bench.hardening.daemons.DaemonProc`, two local ranks)
serves one *session* socket that said a valid HELLO as local rank 0, and a few *attacker*
sockets that did not. Windows of messages go out on all of them (each socket's messages are
answered in order), then every answer is read (bounded): every message of the barrage is
answered exactly once (REJECT, FAIL, WELCOME), and each answer must itself decode. The
messages, drawn by a seeded generator:

==============  =============================================================================
category        what it is
==============  =============================================================================
frames          1, 3 or 4 frames of random bytes, or two with a random kind
bad_json        a known kind with a body that is not acceptable JSON: not UTF-8, NaN,
                Infinity, 1e999, a 5000-digit integer, nesting 40 to 30,000 deep, not an object
bad_fields      HELLO, SUBMIT or BYE with a field missing, added, of the wrong type, out of
                range, or a 5000-character string or key
mutation        a valid HELLO or SUBMIT with one field replaced by a hostile value
reply_kinds     a daemon's own kinds (WELCOME, DONE, FAIL, REJECT) sent to it
foreign_job     a valid HELLO of another job
rank_abuse      HELLO for a local rank that is taken by a live process, or beyond the host's
submit_abuse    the session's SUBMITs naming segments that do not exist, other ranks' prefixes,
                paths out of ``/dev/shm``, stale generations, misaligned or huge offsets
oversized       bodies just over the 64 KiB limit (answered ``oversized``)
==============  =============================================================================

Bodies past ZeroMQ's own limit are sent on throwaway sockets: ZeroMQ closes such a connection
before the body is buffered, so they are not answered (``cut_by_zmq``). After the barrage every
socket says BYE, a trainer process truncates its segment after its SUBMIT
(:mod:`gradlane.bench.hardening.trainer`; with a sealed segment the truncate is refused and
that is recorded), and two fresh clients all-reduce once: the result must be exact and the
daemon alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import zmq
from gradlane.bench.hardening.common import Budget
from gradlane.bench.hardening.daemons import (
    DaemonProc,
    TrainerProc,
    daemon_clients,
    exact_step,
    job_token,
    remove_segments,
)
from gradlane.bench.hardening.trainer import bucket
from gradlane.transport.daemon import messages as ipc
from gradlane.transport.daemon.client import DaemonPlane

__all__ = ["CATEGORIES", "run_daemon_ipc"]

CATEGORIES = (
    "frames", "bad_json", "bad_fields", "mutation", "reply_kinds", "foreign_job", "rank_abuse",
    "submit_abuse", "oversized",
)  # fmt: skip
#: Messages per socket per window (each socket's answers come in order).
WINDOW = 128
#: Attacker sockets besides the session.
ATTACKERS = 4
#: Longest wait for a window's answers.
ANSWER_S = 10.0
#: Messages past ZeroMQ's size limit (each on a throwaway socket).
CUT = 12
#: Elements of the truncated bucket (several pages, so a truncate leaves most unmapped).
TRUNC_N = 16384
#: Values a mutation puts into a field.
HOSTILE: list[Any] = [
    None, True, False, -1, 0, 1, 2, 65535, 65536, 2**32, 2**63, 2**64, -(2**63), 10**30, 1.5,
    -0.0, 1e308, "", "x" * 5000, "../../etc/passwd", "gradlane-../../x", [], [1] * 3000, {},
    {"a": {"b": [1, 2]}}, "\u0000", "\ud800",
]  # fmt: skip
_RAW_BODIES = [
    b"", b"{", b"[]", b'"s"', b"null", b"\xff\xfe{}", b'{"a":NaN}', b'{"a":Infinity}',
    b'{"a":-Infinity}', b'{"a":1e999}', b'{"a":' + b"9" * 5000 + b"}",
    b"[" * 2000 + b"]" * 2000, b"[" * 30000, b'{"a":' * 40 + b"1" + b"}" * 40,
    b"\xef\xbb\xbf{}", b"   ", b'{"a":"\x01"}',
]  # fmt: skip


class _Messages:
    """Draws the barrage's messages (module docstring) from a seeded generator. ``fds``: this
    process's descriptors a SUBMIT may name (the daemon reaches them through ``/proc``), by
    what they are; ``memfd``: the name of the unsealed memfd among them."""

    def __init__(
        self,
        job: int,
        generation: int,
        prefix: str,
        rng: np.random.Generator,
        fds: dict[str, int],
        memfd: str,
    ):
        self.job, self.generation, self.prefix, self.rng = job, generation, prefix, rng
        self.fds, self.memfd = fds, memfd
        self.hello = {
            "job": job,
            "rank": 0,
            "world": 2,
            "local_rank": 0,
            "local_world": 2,
            "pid": os.getpid(),
        }
        self._step = 0

    def submit(self) -> dict[str, Any]:
        """A SUBMIT valid in every field of the schema, naming a segment of the session's that
        does not exist (a fresh serial each time, a descriptor this process does not have).
        Fields the schema has and this campaign does not know get their lowest valid value."""
        self._step += 1
        known = {
            "generation": self.generation,
            "step": self._step % (1 << 32),
            "bucket": 0,
            "shm": f"{self.prefix}b0.0-{900000 + self._step}",
            "fd": self.fds["closed"],
            "offset": 0,
            "numel": 16,
            "dtype": 0,
            "layer_position": 0.5,
            "pinned": False,
        }
        body: dict[str, Any] = {}
        for name, (typ, bounds) in ipc.SCHEMAS["SUBMIT"].items():
            if name in known:
                body[name] = known[name]
            elif typ is bool:
                body[name] = False
            elif bounds is not None:
                body[name] = typ(bounds[0])
            else:
                body[name] = typ()
        return body

    def _pick(self, seq: list[Any]) -> Any:
        return seq[int(self.rng.integers(len(seq)))]

    def make(self, category: str) -> list[bytes]:
        """One message's frames."""
        rng = self.rng
        if category == "frames":
            k = self._pick([1, 2, 3, 4])
            frames = [rng.bytes(int(rng.integers(0, 300))) for _ in range(k)]
            if k == 2:
                frames[0] = rng.bytes(int(rng.integers(1, 24)))
            return frames
        if category == "bad_json":
            body = self._pick(_RAW_BODIES)
            # BYE takes an empty object, and a byte-order mark before one is accepted (JSON
            # read from bytes): that would be a real BYE, which is not answered.
            kinds = [b"HELLO", b"SUBMIT"] if body.endswith(b"{}") else [b"HELLO", b"SUBMIT", b"BYE"]
            return [self._pick(kinds), body]
        if category == "bad_fields":
            kind, body = self._pick([("HELLO", self.hello), ("SUBMIT", self.submit()), ("BYE", {})])
            body = dict(body)
            what = int(rng.integers(4))
            if what == 0 and body:
                body.pop(self._pick(sorted(body)))
            elif what == 1:
                body[self._pick(["extra", "k" * 5000, "", "job2"])] = 1
            elif body:
                body[self._pick(sorted(body))] = self._pick(
                    ["s" * 5000, [1] * 3000, {"x": 1}, -5, 2**70, 1e300, None]
                )
            else:
                body["x"] = 1
            return [kind.encode(), json.dumps(body).encode()]
        if category == "mutation":
            kind, body = self._pick([("HELLO", self.hello), ("SUBMIT", self.submit())])
            body = dict(body)
            field = self._pick(sorted(body))
            value = self._pick(HOSTILE)
            if kind == "HELLO" and field == "local_rank" and value in (0, 1):
                value = 7  # a valid HELLO for a free rank would hold it: keep it out of range
            body[field] = value
            return [kind.encode(), json.dumps(body).encode()]
        if category == "reply_kinds":
            kind = self._pick(["WELCOME", "DONE", "FAIL", "REJECT"])
            body = {"reason": "x", "detail": "y"} if kind == "REJECT" else self.submit()
            return [kind.encode(), json.dumps(body).encode()]
        if category == "foreign_job":
            return [b"HELLO", json.dumps({**self.hello, "job": self.job ^ 0x5A5A}).encode()]
        if category == "rank_abuse":
            lr = self._pick([0, 2, 3, 65535])
            lw = 2 if rng.random() < 0.8 else self._pick([1, 3, 65535])
            return [
                b"HELLO",
                json.dumps({**self.hello, "local_rank": lr, "local_world": lw}).encode(),
            ]
        if category == "submit_abuse":
            body = self.submit()
            what = int(rng.integers(7))
            if what == 0:
                body["shm"] = self._pick(
                    [
                        "/etc/passwd",
                        "gradlane-../../etc/passwd",
                        "..",
                        "gradlane-" + "a" * 300,
                        f"{self.prefix[:-3]}l1-b0",
                    ]
                )
            elif what == 1:
                body["generation"] = (self.generation + 1 + int(rng.integers(100))) % (1 << 63)
            elif what == 2:
                body["offset"] = self._pick([1, 2, 3, 1 << 39])
            elif what == 3:
                body["numel"] = 1 << 40
            elif what == 4:
                body["dtype"], body["numel"] = self._pick([1, 2]), 7
            elif "fd" in body:  # a descriptor of this process that is no sealed segment
                what_fd = self._pick(sorted(self.fds))
                body["fd"] = self.fds[what_fd]
                if what_fd == "unsealed_memfd" or rng.random() < 0.3:
                    body["shm"] = self.memfd
            return [b"SUBMIT", json.dumps(body).encode()]
        if category == "oversized":
            n = ipc.MAX_MESSAGE_BYTES + int(rng.integers(1, 64))
            return [b"HELLO", b" " * n] if rng.random() < 0.8 else [b"H" * 17, b"{}"]
        raise ValueError(f"unknown category {category!r}")


def _socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def run_daemon_ipc(messages: int, budget: Budget, seed: int = 0) -> dict[str, Any]:
    """Run the phase with about ``messages`` hostile messages; returns its JSON section."""
    job = job_token()
    daemon = DaemonProc(job, hard_deadline_s=5.0).start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sockets: list[zmq.Socket] = []
    out: dict[str, Any] = {"job": job}
    stack = contextlib.ExitStack()
    try:
        endpoint = f"ipc://{daemon.socket}"
        session = _socket(ctx, endpoint)
        sockets.append(session)
        session.send_multipart(
            ipc.encode(
                "HELLO", job=job, rank=0, world=2, local_rank=0, local_world=2, pid=os.getpid()
            )
        )
        if not session.poll(int(ANSWER_S * 1000)):
            raise RuntimeError(f"the daemon did not answer HELLO; {daemon.tail()}")
        kind, welcome = ipc.decode(session.recv_multipart())
        if kind != "WELCOME":
            raise RuntimeError(f"HELLO answered {kind}: {welcome}")
        attackers = [_socket(ctx, endpoint) for _ in range(ATTACKERS)]
        sockets += attackers
        memfd = f"{welcome['prefix']}b0.0-777"
        fds = _descriptors(memfd, stack)
        gen = _Messages(
            job,
            welcome["generation"],
            welcome["prefix"],
            np.random.default_rng([seed, 0x1BC]),
            fds,
            memfd,
        )
        before = daemon.rejected()
        barrage = _barrage(gen, session, attackers, messages, daemon, budget, seed)
        cut = _cut(ctx, endpoint)
        _leave(sockets)
        crashed = not daemon.alive()
        after = daemon.rejected() if not crashed else {}
        counted = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        truncation = _truncation(daemon, job, budget) if not crashed else {"skipped": "crashed"}
        exact = _exact_allreduce(daemon, job) if daemon.alive() else False
        crashes = int(not daemon.alive())
        out.update(
            barrage=barrage,
            cut_by_zmq=cut,
            rejected_counted=counted,
            truncation=truncation,
            summary={
                # the barrage, the cut ones, the session's HELLO, every socket's BYE and probe
                "daemon_messages_sent": barrage["sent"] + cut + 1 + 2 * len(sockets),
                "daemon_messages_answered": barrage["answered"],
                "daemon_unanswered": barrage["unanswered"],
                "daemon_bad_answers": barrage["bad_answers"],
                "daemon_internal_errors": int(counted.get("internal", 0)),
                "daemon_crashes": crashes,
                "daemon_truncation": truncation.get("outcome", "not_run"),
                "daemon_truncation_ok": bool(truncation.get("ok")),
                "daemon_exact_after": exact,
            },
        )
        if crashes:
            out["daemon_log"] = daemon.tail()
            out["daemon_exit_code"] = daemon.exit_code()
    finally:
        for s in sockets:
            s.close(0)
        stack.close()
        daemon.close()
        remove_segments(job)
    return out


def _leave(sockets: list[zmq.Socket]) -> None:
    """Every socket says BYE (freeing whatever rank it holds: the session's, or one a mutated
    HELLO took), then a malformed probe; its REJECT, the last answer on that connection, says
    the BYE has been handled (a connection's messages are handled in order)."""
    for s in sockets:
        with contextlib.suppress(zmq.Again):
            s.send_multipart(ipc.encode("BYE"), zmq.NOBLOCK)
            s.send_multipart([b"BYE", b"{"], zmq.NOBLOCK)
    for s in sockets:
        while s.poll(int(ANSWER_S * 1000)):
            try:
                kind, body = ipc.decode(s.recv_multipart())
            except ipc.IpcError:  # counted in the barrage already; not this probe's answer
                continue
            if kind == "REJECT" and body["reason"] == "malformed":
                break


def _descriptors(memfd: str, stack: contextlib.ExitStack) -> dict[str, int]:
    """Descriptors of this process a hostile SUBMIT names, each closed by ``stack``: a regular
    file, a pipe, ``/dev/null``, an unsealed memfd with a valid segment name, a memfd with
    another name, and numbers that are no descriptor at all."""
    fds: dict[str, int] = {"closed": 1_000_000, "stdin": 0, "stdout": 1}
    tmp = stack.enter_context(tempfile.NamedTemporaryFile(prefix="gradlane-"))  # noqa: SIM115
    tmp.write(b"\0" * 65536)
    tmp.flush()
    fds["regular_file"] = tmp.fileno()
    r, w = os.pipe()
    stack.callback(os.close, r)
    stack.callback(os.close, w)
    fds["pipe"] = r
    null = os.open(os.devnull, os.O_RDWR)
    stack.callback(os.close, null)
    fds["dev_null"] = null
    if hasattr(os, "memfd_create"):
        for key, name in (("unsealed_memfd", memfd), ("other_memfd", "not-gradlane")):
            fd = os.memfd_create(name, 0)
            stack.callback(os.close, fd)
            os.ftruncate(fd, 1 << 20)
            fds[key] = fd
    return fds


def _barrage(
    gen: _Messages,
    session: zmq.Socket,
    attackers: list[zmq.Socket],
    total: int,
    daemon: DaemonProc,
    budget: Budget,
    seed: int,
) -> dict[str, Any]:
    """Windows of messages on every socket until ``total`` went; each answer is read."""
    rng = np.random.default_rng([seed, 0xA77])
    weights = np.array([0.14, 0.14, 0.16, 0.16, 0.06, 0.05, 0.08, 0.19, 0.02])
    weights /= weights.sum()
    sent = answered = bad = unanswered = blocked = 0
    t0 = time.monotonic()
    by_category: dict[str, int] = {}
    answers: dict[str, int] = {}
    while sent < total and not budget.expired():
        expected: dict[zmq.Socket, int] = {}
        for sock in [session, *attackers]:
            for _ in range(min(WINDOW, total - sent)):
                cat = CATEGORIES[int(rng.choice(len(CATEGORIES), p=weights))]
                if cat == "submit_abuse" and sock is not session:
                    cat = "bad_fields"
                frames = gen.make(cat)
                try:  # never blocks: a daemon that stopped reading leaves its queue full
                    sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    blocked += 1
                    break
                by_category[cat] = by_category.get(cat, 0) + 1
                expected[sock] = expected.get(sock, 0) + 1
                sent += 1
        for sock, want in expected.items():  # each socket's answers come in order
            got = 0
            while got < want and sock.poll(int(ANSWER_S * 1000)):
                frames = sock.recv_multipart()
                got += 1
                try:
                    kind, body = ipc.decode(frames)
                except ipc.IpcError:
                    bad += 1
                    continue
                key = f"{kind}:{body.get('reason', '')}" if kind == "REJECT" else kind
                answers[key] = answers.get(key, 0) + 1
            answered += got
            unanswered += want - got
        if blocked or not daemon.alive():
            break
    return {
        "sent": sent,
        "answered": answered,
        "unanswered": unanswered,
        "bad_answers": bad,
        "send_blocked": blocked,
        "by_category": by_category,
        "answers": answers,
        "seconds": time.monotonic() - t0,
    }


def _cut(ctx: zmq.Context, endpoint: str) -> int:
    """Messages past ZeroMQ's size limit, each on a throwaway socket (never answered)."""
    body = b" " * (ipc.MAX_MESSAGE_BYTES + 4096)
    for _ in range(CUT):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 1000)  # the message leaves before the socket closes
        s.connect(endpoint)
        s.send_multipart([b"HELLO", body])
        s.close()
    return CUT


def _truncation(daemon: DaemonProc, job: int, budget: Budget) -> dict[str, Any]:
    """A trainer (local rank 0, its own process) truncates its segment after SUBMIT; local rank
    1 submits the same step here. The daemon must fail the request by name and keep serving."""
    trainer = TrainerProc(daemon.socket, job, local_rank=0)
    partner = DaemonPlane(
        daemon.socket,
        job=job,
        rank=1,
        world=2,
        local_rank=1,
        local_world=2,
        connect_timeout_s=60.0,
        request_timeout_s=60.0,
    )
    try:
        trainer.expect("ready", budget.left())
        partner.start()
        trainer.send(cmd="truncate", step=1, n=TRUNC_N)
        cut = trainer.expect("truncated", budget.left())
        fut = partner.submit(1, 0, bucket(1, TRUNC_N))
        theirs = trainer.expect("result", budget.left())
        try:
            fut.result(60.0)
            mine = "completed"
        except Exception as e:  # expected when the truncate took: the step fails by name
            mine = f"{type(e).__name__}: {e}"
        if cut.get("truncated"):
            # The request must fail, saying the segment was truncated; the daemon lives on.
            named = not theirs["ok"] and "truncat" in theirs.get("error", "")
            outcome = "failed_by_name" if named else "not_failed_by_name"
        elif cut.get("refused"):
            # A segment its owner cannot shrink: the step simply completes, exactly.
            outcome = "refused_by_seal" if theirs.get("exact") else "refused_but_not_exact"
        else:
            outcome = "nothing_to_truncate"
        return {
            "outcome": outcome,
            "truncated": cut.get("truncated"),
            "refused": cut.get("refused"),
            "note": cut.get("note"),
            "trainer_result": theirs,
            "partner_result": mine,
            "daemon_alive": daemon.alive(),
            "ok": outcome in ("failed_by_name", "refused_by_seal") and daemon.alive(),
        }
    finally:
        partner.close()
        trainer.close()


def _exact_allreduce(daemon: DaemonProc, job: int, n: int = 4096) -> bool:
    """Two fresh clients all-reduce one bucket through the daemon: exact?"""
    try:
        clients = daemon_clients(daemon.socket, job, (0, 1))
    except Exception:  # not even a client is the finding; the caller records False
        return False
    try:
        return exact_step(clients, 2, n, 60.0)
    finally:
        for c in clients:
            c.close()
