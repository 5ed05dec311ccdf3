"""Engine ranks of the campaign: one spawned process per rank, each a :class:`UdpPlane` on
loopback, driven over a pipe by the parent's :class:`RankGroup`.

Theory of operation
-------------------
A rank binds its paths (port 0), sends its bound addresses, receives every rank's and then
serves commands until ``close``:

``loop``
    all-reduce bucket ``bucket`` at steps ``first_step, first_step + 1, ...`` with the seeded
    :func:`~gradlane.bench.hardening.common.input_sets` (step ``s`` uses set ``s % 4``), each
    result compared with the exact sum, until a ``("stop_at", S)`` message has been answered by
    step ``S``, ``max_steps`` have run, or a collective fails. The rank writes the step it is
    about to submit into its slot of a shared array (the sprayer and the parent read it), and
    answers with the per-step times, how many results were exact and the first error (its type,
    the ranks it names, its text and its ``time.monotonic()``, a clock every process shares).
    Ranks stop together because the parent names a stop step ahead of every rank.
``path_death``
    ``loop`` whose rank silences a path (a shared flag that every rank's :class:`PathSilence`
    tap reads) ``arm_after_s`` into step ``first_step + arm_step``, then watches its path
    statistics, on a thread while the steps go on, until the silent path toward the peer
    leaves UP.
``stats``
    the plane's :meth:`~gradlane.transport.drivers.udp.plane.UdpPlane.stats`.

Errors are sent back as plain tuples (gradlane's errors do not survive pickling), and every wait
of the parent has a timeout; :meth:`RankGroup.close` kills what does not exit.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
from gradlane.bench.hardening.common import die_with_parent, engine_config, input_sets
from gradlane.transport.drivers.peers import StaticPeers
from gradlane.transport.drivers.udp.plane import ArenaWrapper, UdpPlane, default_local_addrs
from gradlane.transport.drivers.udp.sockets import RxArena

__all__ = ["PathSilence", "RankGroup", "RankSpec", "rank_main"]

CTX = mp.get_context("spawn")
#: How long the parent waits for a rank to start (imports and kernel loading included).
START_S = 180.0
#: How often a watching rank reads its path statistics (each read runs on the plane's loop).
WATCH_PERIOD_S = 0.0005


@dataclass(frozen=True)
class RankSpec:
    """What a rank process runs: its rank, the world and its engine's configuration."""

    rank: int
    world: int
    secret: str | None
    hard_deadline_s: float
    n_paths: int = 2
    silence_path: int = -1
    """The path a :class:`PathSilence` tap silences when the shared flag is set (-1: no tap)."""


class _SilentArena(ArenaWrapper):
    """The core's arena, except that once ``flag`` is set nothing that arrives on ``path`` is
    committed: the path is silent in this direction (counted as ``silenced``)."""

    def __init__(self, arena: RxArena, path: int, flag: Any) -> None:
        super().__init__(arena)
        self._path = path
        self._flag = flag
        self.silenced = 0

    def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
        """Commit the rows, or drop them all when they came on the silenced path."""
        if path == self._path and self._flag.value:
            self.silenced += int(lengths.shape[0])
            return
        self._arena.commit_datagrams(lengths, path, now)

    def stats(self) -> dict[str, int]:
        """``silenced``: datagrams dropped on the silent path."""
        return {"silenced": self.silenced}


@dataclass(frozen=True)
class PathSilence:
    """A receive tap (:class:`~gradlane.transport.drivers.udp.plane.RxTap`) that silences
    ``path`` once the shared ``flag`` (a ``multiprocessing`` value) is set: with it on every
    rank, the path goes silent both ways at once, mid-step, as a dead link does."""

    path: int
    flag: Any

    def wrap(self, arena: RxArena, rank: int) -> _SilentArena:
        """Rank ``rank``'s silencing arena in front of ``arena``."""
        return _SilentArena(arena, self.path, self.flag)


# -- the rank process ----------------------------------------------------------------------------
def rank_main(spec: RankSpec, conn: Any, steps: Any, flag: Any) -> None:
    """A rank process: start the plane, exchange addresses, serve commands (module docstring)."""
    die_with_parent()
    plane = None
    try:
        cfg = engine_config(spec.secret, spec.hard_deadline_s, n_paths=spec.n_paths)
        tap = PathSilence(spec.silence_path, flag) if spec.silence_path >= 0 else None
        plane = UdpPlane(
            spec.rank, spec.world, cfg, local_addrs=default_local_addrs(spec.n_paths), rx_tap=tap
        )
        conn.send(("addrs", plane.start()))
        table = conn.recv()
        plane.set_peers(StaticPeers({r: [tuple(a) for a in t] for r, t in table.items()}))
        conn.send(("ready", None))
        while True:
            cmd, args = conn.recv()
            if cmd == "close":
                break
            if cmd == "stats":
                conn.send(("stats", plane.stats()))
            elif cmd in ("loop", "path_death"):
                conn.send((cmd, _loop(plane, spec, conn, steps, flag, cmd, **args)))
            elif cmd == "stop_at":
                continue  # arrived after its loop ended: nothing to stop
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        raise
    finally:
        if plane is not None:
            plane.close(drain_s=1.0)


def _loop(
    plane: UdpPlane,
    spec: RankSpec,
    conn: Any,
    steps: Any,
    flag: Any,
    cmd: str,
    *,
    first_step: int,
    n: int,
    seed: int,
    bucket: int = 0,
    max_steps: int = 1 << 40,
    wait_s: float = 60.0,
    arm_step: int = -1,
    arm_after_s: float = 0.0,
    dead_path: int = 1,
) -> dict[str, Any]:
    inputs, sums = input_sets(seed, spec.world, n)
    exact_check = spec.world == 2  # a + b is the same in either order; more ranks are not
    times: list[float] = []
    exact = inexact = 0
    error: dict[str, Any] | None = None
    stop_at: int | None = None
    watcher: _PathWatch | None = None
    step = first_step
    while step < first_step + max_steps and (stop_at is None or step <= stop_at):
        while conn.poll():
            what, value = conn.recv()
            if what == "stop_at":
                stop_at = max(int(value), step - 1)
            elif what == "close":
                raise EOFError
        if stop_at is not None and step > stop_at:
            break
        k = step % len(inputs)
        steps[spec.rank] = step
        t0 = time.perf_counter()
        fut = plane.submit(step, bucket, inputs[k][spec.rank])
        if cmd == "path_death" and step - first_step == arm_step:
            watcher = _PathWatch(plane, spec, flag, arm_after_s, dead_path, wait_s)
        try:
            result, _report = fut.result(wait_s)
        except Exception as e:  # the collective failed: that is the finding, not a crash
            error = {
                "step": step,
                "type": type(e).__name__,
                "ranks": list(getattr(e, "ranks", ()) or ()),
                "message": str(e)[:2000],
                "t_error": time.monotonic(),
                "elapsed_s": time.perf_counter() - t0,
            }
            break
        times.append(time.perf_counter() - t0)
        if exact_check:
            ok = result.shape == sums[k].shape and np.array_equal(result, sums[k])
        else:
            ok = bool(np.allclose(result, sums[k], rtol=1e-5, atol=1e-5))
        exact += ok
        inexact += not ok
        step += 1
    watch = watcher.result() if watcher is not None else None
    return {
        "first_step": first_step,
        "last_step": step - 1,
        "steps": len(times),
        "times_s": times,
        "exact": exact,
        "inexact": inexact,
        "error": error,
        "watch": watch,
    }


class _PathWatch:
    """Silence path ``dead`` ``after_s`` from now (mid-step), then, on a thread of its own,
    read the path statistics toward the peer until that path leaves UP: when, and the other
    path's smoothed RTT then.

    The steps go on meanwhile: a path is judged by the traffic sent on it, so one that
    carries nothing after the silence stays UP until the next step sends on it. A watch that
    held the step loop would hold that step back too, and the peer's would then miss its
    deadline waiting for this rank.
    """

    def __init__(
        self, plane: UdpPlane, spec: RankSpec, flag: Any, after_s: float, dead: int, limit_s: float
    ) -> None:
        self._plane, self._dead, self._limit_s = plane, dead, limit_s
        self._peer = (spec.rank + 1) % spec.world
        self._stop = threading.Event()
        self._out: dict[str, Any] = {}
        t_arm = time.monotonic() + after_s
        while time.monotonic() < t_arm:  # a busy wait of a few ms: the step is in flight
            pass
        flag.value = 1
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="path-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        state, srtt = "UP", None
        while time.monotonic() - self._t0 < self._limit_s and not self._stop.is_set():
            paths = self._plane.stats()["paths"].get(self._peer)
            if paths is not None:
                state = paths["state"][self._dead]
                live = [p for p in range(len(paths["state"])) if p != self._dead]
                srtt = paths["srtt_s"][live[0]] if live else None
                if state != "UP":
                    break
            self._stop.wait(WATCH_PERIOD_S)
        moved = time.monotonic() - self._t0 if state != "UP" else None
        self._out = {"t_silence": self._t0, "moved_s": moved, "state": state, "srtt_live_s": srtt}

    def result(self) -> dict[str, Any]:
        """What the watch saw: ``moved_s`` (None: the path was still UP when the steps
        ended), ``state``, ``srtt_live_s`` and ``t_silence``."""
        if self._thread.is_alive():  # the steps ended first: one last look, then stop
            self._stop.set()
        self._thread.join(self._limit_s)
        return dict(self._out)


# -- the parent's side ---------------------------------------------------------------------------
class RankGroup:
    """``world`` rank processes with a pipe each, the shared step array and silence flag.

    Use as a context manager: :meth:`close` asks every rank to close, then kills and joins
    what has not exited, also after a failure. :attr:`pids` are the processes' pids.
    """

    def __init__(
        self,
        world: int,
        secret: str | None,
        hard_deadline_s: float,
        *,
        n_paths: int = 2,
        silence_path: int = -1,
    ) -> None:
        self.world = world
        self.steps = CTX.RawArray("q", world)
        self.flag = CTX.RawValue("b", 0)
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.addrs: dict[int, list[tuple[str, int]]] = {}
        self.dead: set[int] = set()
        self._specs = [
            RankSpec(r, world, secret, hard_deadline_s, n_paths, silence_path) for r in range(world)
        ]

    def __enter__(self) -> RankGroup:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, by rank."""
        return [int(p.pid) for p in self.procs]

    def start(self) -> None:
        """Spawn every rank, exchange the bound addresses, wait until all are ready."""
        for spec in self._specs:
            parent, child = CTX.Pipe()
            p = CTX.Process(
                target=rank_main,
                args=(spec, child, self.steps, self.flag),
                name=f"gl-hardening-r{spec.rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for r in range(self.world):
            self.addrs[r] = [tuple(a) for a in self._expect(r, "addrs", START_S)]
        for c in self.conns:
            c.send(self.addrs)
        for r in range(self.world):
            self._expect(r, "ready", START_S)

    def send(self, rank: int, cmd: str, args: Any = None) -> None:
        """Send one command to ``rank``."""
        self.conns[rank].send((cmd, args))

    def send_all(self, cmd: str, args: Any = None) -> None:
        """Send one command to every live rank."""
        for r in range(self.world):
            if r not in self.dead:
                self.send(r, cmd, args)

    def receive(self, rank: int, what: str, timeout_s: float) -> Any:
        """``rank``'s answer to command ``what`` (waits at most ``timeout_s``)."""
        return self._expect(rank, what, timeout_s)

    def stats(self, timeout_s: float = 30.0) -> dict[int, dict[str, Any]]:
        """Every live rank's plane statistics."""
        self.send_all("stats")
        return {
            r: self.receive(r, "stats", timeout_s) for r in range(self.world) if r not in self.dead
        }

    def current_step(self) -> int:
        """The lowest step any live rank is at (what every rank has reached)."""
        live = [int(self.steps[r]) for r in range(self.world) if r not in self.dead]
        return min(live) if live else 0

    def kill(self, rank: int) -> float:
        """SIGKILL rank ``rank``; returns the ``time.monotonic()`` of the kill."""
        p = self.procs[rank]
        p.kill()
        t = time.monotonic()
        self.dead.add(rank)
        p.join(10.0)
        return t

    def close(self) -> None:
        """Ask every rank to close, then join; kill what is still alive."""
        for r, c in enumerate(self.conns):
            if r not in self.dead:
                with contextlib.suppress(OSError):
                    c.send(("close", None))
        for p in self.procs:
            p.join(15.0)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(10.0)
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []

    def _expect(self, rank: int, what: str, timeout_s: float) -> Any:
        conn = self.conns[rank]
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not conn.poll(min(left, 1.0)):
                if not self.procs[rank].is_alive():
                    raise RuntimeError(
                        f"rank {rank} exited (code {self.procs[rank].exitcode}) before {what!r}"
                    )
                if left <= 0:
                    raise TimeoutError(f"rank {rank}: no {what!r} within {timeout_s:.0f}s")
                continue
            try:
                tag, value = conn.recv()
            except EOFError:
                raise RuntimeError(f"rank {rank} closed its pipe before {what!r}") from None
            if tag == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            if tag != what:
                raise RuntimeError(f"rank {rank}: expected {what!r}, got {tag!r}")
            return value
