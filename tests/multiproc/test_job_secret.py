"""Packets keyed by default under a TCPStore rendezvous, in real torch.distributed processes.

With no secret configured, every rank's engines end up keyed, each gradlane state with its own
key and every rank with the same one per state, under ``torchrun`` and under
``init_process_group("gloo", init_method="tcp://...")``; collectives stay exact; DATA forged with
the unkeyed checksum is rejected and counted (``bad_tag``); the secret shows in no repr, stats
or log line. ``GRADLANE_SECRET=off`` (or ``secret="off"``) gives unkeyed tags, and a configured
secret is used as given.

Spawned ranks (``tests.multiproc.secret_workers``) report on a queue read with a timeout and are
joined or killed by the fixture; ``torchrun`` runs in its own session, killed whole on a timeout.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gradlane.transport.wire.tag import TagKey

from tests.multiproc import secret_workers
from tests.support.procs import RankProcs, free_port, owned, run_in_session

ROOT = Path(__file__).resolve().parents[2]


class Group(RankProcs):
    """``world`` spawned ranks running one scenario; results by rank."""

    def start(self, scenario: str, world: int, args: dict) -> None:
        port = free_port()
        for rank in range(world):
            self.spawn(
                secret_workers.rank_main,
                (scenario, rank, world, port, args, self.up),
                f"gl-secret-{scenario}-r{rank}",
            )

    def results(self, n: int | None = None, wait_s: float = 2 * secret_workers.WAIT_S) -> dict:
        """Every rank's payload; a rank's error fails the test."""
        return super().results(wait_s, n)


@pytest.fixture
def group() -> Iterator[Group]:
    yield from owned(Group(), None)


def _check_auto(results: dict[int, dict]) -> None:
    """Keyed through the store, one key per state shared by every rank, exact, forgeries
    counted, nothing leaked."""
    ranks = sorted(results)
    for name in ("udp", "zmq"):
        reports = [results[r][name] for r in ranks]
        assert all(r["keyed"] and r["stats_keyed"] for r in reports), reports
        assert {r["source"] for r in reports} == {"shared"}, reports
        assert len({tuple(r["key"]) for r in reports}) == 1, f"{name}: ranks disagree"
        assert all(r["exact"] for r in reports), reports
    assert results[0]["udp"]["key"] != results[0]["zmq"]["key"]  # each state its own key
    assert results[0]["forged"] >= 1
    assert results[0]["bad_tag"] >= results[0]["forged"], results[0]
    for r in ranks:
        assert not any(results[r]["leaks"].values()), (r, results[r]["leaks"])


@pytest.mark.timeout(300)
def test_states_are_keyed_by_default_under_init_method_tcp(group: Group):
    group.start("auto", 3, {})
    _check_auto(group.results())


@pytest.mark.timeout(300)
def test_off_and_a_configured_secret_are_used_as_given(group: Group):
    secrets = {"env": "the secret from the environment", "code": "the secret from code"}
    group.start("explicit", 2, secrets)
    results = group.results()
    for rank, res in results.items():
        for name in ("env_off", "code_off"):
            assert not res[name]["keyed"] and not res[name]["stats_keyed"], (rank, name)
            assert res[name]["source"] == "off" and res[name]["key"] == [0, 0]
        for name, secret in (("env_given", secrets["env"]), ("code_given", secrets["code"])):
            key = TagKey.from_secret(secret)
            assert res[name]["keyed"] and res[name]["key"] == [key.k0, key.k1], (rank, name)
            assert res[name]["source"] == "configured"
        assert all(r["exact"] for r in res.values()), (rank, res)


@pytest.mark.timeout(300)
def test_states_are_keyed_by_default_under_torchrun():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADLANE_", "MASTER_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "tests.multiproc.secret_workers"]  # fmt: skip
    code, out = run_in_session(cmd, 240, cwd=ROOT, env=env)
    assert code == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith(secret_workers.RESULT)]
    assert len(lines) == 2, out
    per_rank = [json.loads(ln[len(secret_workers.RESULT) :]) for ln in lines]
    # Which rank printed which line does not matter, except that rank 0 forged: it is the one
    # with a count.
    per_rank.sort(key=lambda r: -r["forged"])
    _check_auto(dict(enumerate(per_rank)))
