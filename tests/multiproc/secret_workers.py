"""Rank processes for the job-secret tests: spawned (``rank_main``) or under ``torchrun``
(``python -m tests.multiproc.secret_workers``).

A spawned rank joins a gloo group through ``init_method="tcp://..."`` (torch's own TCPStore,
which rank 0 hosts) and exports ``MASTER_ADDR``/``MASTER_PORT`` at it, as ``torchrun`` would; under
``torchrun`` the rank uses ``env://``. Either way every :class:`GradlaneState` meets its peers
through that store, with no secret configured unless a scenario sets one. A scenario returns a
JSON-friendly dict: what each state's key is (``tag_key``, a public property), where it came
from, whether a collective was exact, and whether the secret showed anywhere it must not. Nothing
sleeps: every wait is bounded (queue, Future and store timeouts, the transports' deadlines).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from gradlane.integrations.ddp import GradlaneState, HookConfig
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.config import TransportConfig, loopback_config
from gradlane.transport.drivers.udp.plane import UdpPlane
from gradlane.transport.drivers.zmq.plane import zmq_config
from gradlane.transport.wire.header import Kind, Phase

from tests.support.wire import forge

#: Longest any rank waits for a store, a collective or the group.
WAIT_S = 120.0
#: Elements of each test collective: several 65000-byte chunks per shard.
N = 100_000
#: Elements per shard of the collective a forged packet aims at: one chunk per shard, so the
#: forgery (that whole chunk) would pass every check but the key's.
FORGED = 16
#: Prefix of the one line per rank a ``torchrun`` run prints its result on.
RESULT = "gradlane-secret-result "


def exact(**overrides: Any) -> TransportConfig:
    """``loopback_config()``, exact, failing at a 30 s hard deadline (never partial data)."""
    loss = LossConfig(loss_bound=0.0, hard_deadline_s=30.0, on_hard_deadline="raise")
    return loopback_config(loss=loss, **overrides)


def rank_main(scenario: str, rank: int, world: int, port: int, args: dict, up: Any) -> None:
    """Spawned rank: join the group at ``tcp://127.0.0.1:port``, run ``SCENARIOS[scenario]``,
    report ``("ok"|"error", rank, payload)`` on ``up``."""
    torch.set_num_threads(1)
    for var in [v for v in os.environ if v.startswith("GRADLANE_")]:
        del os.environ[var]  # only what the scenario sets
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=WAIT_S),
        )
        try:
            result = SCENARIOS[scenario](rank, world, args)
        finally:
            dist.destroy_process_group()
        up.put(("ok", rank, result))
    except BaseException:
        up.put(("error", rank, traceback.format_exc()))
        raise


def main() -> None:
    """Under ``torchrun``: the ``auto`` scenario; prints :data:`RESULT` and its JSON."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=WAIT_S))
    try:
        result = auto(dist.get_rank(), dist.get_world_size(), {})
    finally:
        dist.destroy_process_group()
    # One write of less than PIPE_BUF: the ranks share torchrun's stdout, and print() writes
    # the line and its newline separately.
    sys.stdout.write(f"{RESULT}{json.dumps(result)}\n")
    sys.stdout.flush()


# -- scenarios -------------------------------------------------------------------------------------
def auto(rank: int, world: int, args: dict) -> dict:
    """No secret anywhere: two states (UDP with one path, so a forged datagram is read before
    anything rank 1 sends after the barrier; and ZeroMQ), each keyed through the store. Rank 0
    sends its UDP engine DATA that carries a valid unkeyed checksum before the collective."""
    with _captured_logs() as logs, ExitStack() as stack:
        udp = _state(stack, lambda: GradlaneState(exact(n_paths=1), HookConfig(log_every=1)))
        zmq = _state(stack, lambda: GradlaneState(zmq_config(), HookConfig(transport="zmq")))
        forged = _forge_into(udp) if rank == 0 else 0
        dist.barrier()
        out: dict[str, Any] = {"udp": _report(udp, rank, world, FORGED * world)}
        out["zmq"] = _report(zmq, rank, world)
        stats = [s.stats(plane=True) for s in (udp, zmq)]
        out.update(forged=forged, bad_tag=stats[0]["plane"]["rejected"].get("bad_tag", 0))
        _end(udp, zmq)
    secrets = [s.transport.secret or "" for s in (udp, zmq)]
    out["leaks"] = _leaks(secrets, json.dumps(stats, default=str), logs, [udp, zmq])
    return out


def explicit(rank: int, world: int, args: dict) -> dict:
    """A secret set in the environment or in code is used as given; ``off`` in either gives
    unkeyed tags."""
    env = {**os.environ, "GRADLANE_HOOK__LOG_EVERY": "0"}
    hook = HookConfig(log_every=0)
    makers: dict[str, Callable[[], GradlaneState]] = {
        "env_off": lambda: GradlaneState.from_env({**env, "GRADLANE_SECRET": "off"}),
        "env_given": lambda: GradlaneState.from_env({**env, "GRADLANE_SECRET": args["env"]}),
        "code_off": lambda: GradlaneState(exact(secret="off"), hook),
        "code_given": lambda: GradlaneState(exact(secret=args["code"]), hook),
    }
    with ExitStack() as stack:
        states = {name: _state(stack, make) for name, make in makers.items()}
        out = {name: _report(s, rank, world) for name, s in states.items()}
        _end(*states.values())
    return out


SCENARIOS: dict[str, Callable[[int, int, dict], dict]] = {"auto": auto, "explicit": explicit}


# -- helpers ---------------------------------------------------------------------------------------
def _state(stack: ExitStack, make: Callable[[], GradlaneState]) -> GradlaneState:
    """``make()``, closed when ``stack`` exits (also on failure)."""
    state = make()
    stack.callback(state.close)
    return state


def _report(state: GradlaneState, rank: int, world: int, n: int = N) -> dict:
    """The state's key and its source, and whether an all-reduce (step 0, bucket 0) of ``n``
    integers was exact."""
    key = state.tag_key
    data = np.arange(n, dtype=np.float32) * (rank + 1)
    result, report = state.plane.submit(0, 0, data).result(WAIT_S)
    expected = np.arange(n, dtype=np.float32) * (world * (world + 1) // 2)
    return {
        "keyed": key.keyed,
        "key": [key.k0, key.k1],
        "source": state.secret_source,
        "exact": bool(np.array_equal(result, expected)) and not report.degraded,
        "stats_keyed": state.stats()["keyed"],
    }


def _forge_into(state: GradlaneState) -> int:
    """DATA for this rank's first collective (step 0, bucket 0, shard 0: :data:`FORGED`
    elements) from rank 1, with the unkeyed checksum anyone can compute, to every path of this
    rank's UDP engine; returns how many were sent. Unkeyed, it would be summed in place of rank
    1's chunk."""
    plane = state.plane
    assert isinstance(plane, UdpPlane)
    unkeyed = TransportConfig(job=state.transport.job)
    packet = forge(
        unkeyed, Kind.DATA, src=1, dst=0, step=0, bucket=0, phase=Phase.REDUCE, count=FORGED
    )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for addr in plane.bound:
            s.sendto(packet, addr)
    return len(plane.bound)


def _end(*states: GradlaneState) -> None:
    """The end of a job: drain, a barrier, close (docs/ddp-hook.md)."""
    for s in states:
        s.drain()
    dist.barrier()
    for s in states:
        s.close()


def _leaks(secrets: list[str], stats: str, logs: list[str], states: list[GradlaneState]) -> dict:
    """Where any of ``secrets`` shows: reprs of the configs, the stats' JSON, the log lines."""
    shown = {
        "repr": " ".join(f"{s.transport!r} {s.config!r}" for s in states),
        "stats": stats,
        "logs": "\n".join(logs),
    }
    return {where: any(sec and sec in text for sec in secrets) for where, text in shown.items()}


@contextmanager
def _captured_logs() -> Iterator[list[str]]:
    """Every gradlane log record, formatted, at DEBUG and up."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    logger = logging.getLogger("gradlane")
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


if __name__ == "__main__":
    main()
