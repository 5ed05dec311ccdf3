"""Phase 3, faults: kill -9 of a rank, of the daemon and of a trainer, and a path that goes
silent mid-step. Each case measures how soon the survivors hear, and whether what they hear
names the culprit.

Cases
-----
``kill_rank``
    three rank processes all-reduce in a loop; rank 2 is killed (SIGKILL) mid-run. Each
    survivor's collective fails with ``PeerTimeout`` naming rank 2, at most the hard deadline
    after the kill (``kill_rank_error_s``: the later survivor's, from the kill).
``kill_daemon``
    two trainers (clients in this process) of a daemon; one has a step in flight (its slot
    waits for the other) when the daemon is killed. The in-flight step fails at once, saying
    the daemon disconnected (``kill_daemon_error_s``, from the kill); a daemon started again on
    the same socket then serves both, exactly.
``kill_trainer``
    a trainer process and a client here; the trainer is killed, the client submits: its step
    fails after the slot timeout (the daemon's hard deadline) naming the missing local rank; a
    new trainer process takes the rank back and the next step is exact.
``path_death``
    two ranks over two paths; a receive tap on every rank drops everything on path 1 from a
    moment inside a step on (both directions at once). No step may fail
    (``path_death_failed_steps``); the sender moves path 1 out of UP within a few RTTs
    (``path_death_moved_rtts``: the time from the silence to the path leaving UP over the
    live path's smoothed RTT).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from gradlane.bench.hardening.common import Budget
from gradlane.bench.hardening.daemons import (
    DaemonProc,
    TrainerProc,
    daemon_clients,
    exact_step,
    job_token,
    remove_segments,
)
from gradlane.bench.hardening.ranks import RankGroup
from gradlane.bench.hardening.trainer import bucket
from gradlane.transport.daemon.client import DaemonPlane

__all__ = ["run_faults"]

#: Steps every rank completes before the kill.
BEFORE_KILL = 5
#: Elements of the trainers' buckets.
TRAINER_N = 4096


def run_faults(
    budget: Budget,
    *,
    hard_deadline_s: float = 2.0,
    elems: int = 262_144,
    path_steps: int = 40,
    secret: str | None = None,
) -> dict[str, Any]:
    """Run every case; returns the phase's JSON section (``summary`` and each case)."""
    out: dict[str, Any] = {"hard_deadline_s": hard_deadline_s}
    cases = (
        ("kill_rank", lambda: _kill_rank(budget, hard_deadline_s, elems, secret)),
        ("kill_daemon", lambda: _kill_daemon(budget)),
        ("kill_trainer", lambda: _kill_trainer(budget, hard_deadline_s)),
        ("path_death", lambda: _path_death(budget, hard_deadline_s, elems, path_steps, secret)),
    )
    for name, case in cases:
        budget.check(name)
        try:
            out[name] = case()
        except Exception as e:  # one case's failure is reported; the others still run
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    kr, kd, kt, pd = (out[n] for n, _ in cases)
    out["summary"] = {
        "kill_rank_error_s": kr.get("error_s"),
        "kill_rank_named": kr.get("named"),
        "kill_daemon_error_s": kd.get("error_s"),
        "kill_daemon_named": kd.get("named"),
        "kill_daemon_restart_exact": kd.get("restart_exact"),
        "kill_trainer_error_s": kt.get("error_s"),
        "kill_trainer_named": kt.get("named"),
        "kill_trainer_rejoin_exact": kt.get("rejoin_exact"),
        "path_death_failed_steps": pd.get("failed_steps"),
        "path_death_moved_s": pd.get("moved_s"),
        "path_death_moved_rtts": pd.get("moved_rtts"),
    }
    return out


def _kill_rank(budget: Budget, hard: float, n: int, secret: str | None) -> dict[str, Any]:
    with RankGroup(3, secret, hard) as ranks:
        ranks.send_all("loop", {"first_step": 1, "n": n, "seed": 1, "wait_s": hard * 10})
        while ranks.current_step() < 1 + BEFORE_KILL:
            budget.check("kill_rank: waiting for the first steps")
            time.sleep(0.005)
        t_kill = ranks.kill(2)
        answers = {r: ranks.receive(r, "loop", budget.left()) for r in (0, 1)}
    errors = {r: a["error"] for r, a in answers.items()}
    named = all(
        e is not None and e["type"] == "PeerTimeout" and 2 in e["ranks"] for e in errors.values()
    )
    late = [e["t_error"] - t_kill for e in errors.values() if e is not None]
    return {
        "killed": 2,
        "steps_before_kill": [a["steps"] for a in answers.values()],
        "errors": errors,
        "named": named,
        "error_s": max(late) if len(late) == len(errors) else None,
        "target_s": hard + 0.5,
    }


def _kill_daemon(budget: Budget) -> dict[str, Any]:
    job = job_token()
    # A long slot timeout: the step in flight must be failed by the disconnect, not by it.
    daemon = DaemonProc(job, hard_deadline_s=30.0).start()
    clients: list[DaemonPlane] = []
    again: DaemonProc | None = None
    try:
        clients = daemon_clients(daemon.socket, job, (0, 1))
        first_exact = exact_step(clients, 1, TRAINER_N, budget.left())
        before = clients[0].stats()["submitted"]
        fut = clients[0].submit(2, 0, bucket(0, TRAINER_N))  # waits in its slot for rank 1
        while clients[0].stats()["submitted"] == before:
            budget.check("kill_daemon: waiting for the submission to leave")
            time.sleep(0.001)
        failed: list[float] = []
        fut.add_done_callback(lambda _: failed.append(time.monotonic()))
        t_kill = daemon.kill()
        try:
            fut.result(budget.left())
            text = "the step completed"
        except Exception as e:  # expected: the disconnect fails it
            text = f"{type(e).__name__}: {e}"
        error_s = failed[0] - t_kill if failed else None
        # The same socket, a new daemon: the clients say HELLO again and go on.
        again = DaemonProc(job, hard_deadline_s=30.0, socket_dir=daemon.dir).start()
        restart_exact = exact_step(clients, 3, TRAINER_N, budget.left())
        return {
            "first_exact": first_exact,
            "error": text[:1000],
            "error_s": error_s,
            "named": "disconnected" in text,
            "restart_exact": restart_exact,
            "target_s": 1.0,
        }
    finally:
        for c in clients:
            c.close()
        if again is not None:
            again.close()
        daemon.close()
        remove_segments(job)


def _kill_trainer(budget: Budget, hard: float) -> dict[str, Any]:
    job = job_token()
    daemon = DaemonProc(job, hard_deadline_s=hard).start()
    trainers: list[TrainerProc] = []
    clients: list[DaemonPlane] = []
    try:
        trainers.append(TrainerProc(daemon.socket, job, local_rank=1))
        trainers[0].expect("ready", budget.left())
        clients = daemon_clients(daemon.socket, job, (0,))
        trainers[0].send(cmd="submit", step=1, n=TRAINER_N)
        first = exact_step(clients, 1, TRAINER_N, budget.left())
        first = first and trainers[0].expect("result", budget.left()).get("exact", False)
        trainers[0].kill()
        t0 = time.monotonic()
        try:
            clients[0].submit(2, 0, bucket(0, TRAINER_N)).result(budget.left())
            text = "the step completed"
        except Exception as e:  # expected: the slot times out naming local rank 1
            text = f"{type(e).__name__}: {e}"
        error_s = time.monotonic() - t0
        trainers.append(TrainerProc(daemon.socket, job, local_rank=1))
        trainers[1].expect("ready", budget.left())
        trainers[1].send(cmd="submit", step=3, n=TRAINER_N)
        rejoin = exact_step(clients, 3, TRAINER_N, budget.left())
        rejoin = rejoin and trainers[1].expect("result", budget.left()).get("exact", False)
        return {
            "first_exact": first,
            "error": text[:1000],
            "error_s": error_s,
            "named": "local rank(s) [1]" in text,
            "rejoin_exact": rejoin,
            "daemon_alive": daemon.alive(),
            "target_s": hard + 0.5,
        }
    finally:
        for c in clients:
            c.close()
        for t in trainers:
            t.close()
        daemon.close()
        remove_segments(job)


def _path_death(
    budget: Budget, hard: float, n: int, steps: int, secret: str | None
) -> dict[str, Any]:
    arm = max(2, steps // 4)
    # Generous deadlines: a step that loses path 1 mid-flight must complete, not time out.
    deadline = max(hard, 10.0)
    with RankGroup(2, secret, deadline, silence_path=1) as ranks:
        common = {"first_step": 1, "n": n, "seed": 2, "max_steps": steps, "wait_s": deadline * 3}
        ranks.send(0, "path_death", {**common, "arm_step": arm, "arm_after_s": 0.002})
        ranks.send(1, "path_death", common)
        answers = [ranks.receive(r, "path_death", budget.left()) for r in range(2)]
        stats = ranks.stats()
    watch = answers[0]["watch"] or {}
    moved, srtt = watch.get("moved_s"), watch.get("srtt_live_s")
    times = [max(a, b) for a, b in zip(answers[0]["times_s"], answers[1]["times_s"], strict=False)]
    failed = sum(a["error"] is not None for a in answers) + sum(a["inexact"] for a in answers)
    return {
        "steps": min(a["steps"] for a in answers),
        "silenced_at_step": arm + 1,
        "failed_steps": failed,
        "errors": [a["error"] for a in answers if a["error"] is not None],
        "moved_s": moved,
        "srtt_live_s": srtt,
        "moved_rtts": moved / srtt if moved is not None and srtt else None,
        "path_state": watch.get("state"),
        "median_before_s": float(np.median(times[:arm])) if times[:arm] else None,
        "silenced_step_s": times[arm] if len(times) > arm else None,
        "median_after_s": float(np.median(times[arm + 1 :])) if times[arm + 1 :] else None,
        "silenced_datagrams": [s.get("silenced") for s in stats.values()],
        "paths_after": {r: s["paths"] for r, s in stats.items()},
    }
