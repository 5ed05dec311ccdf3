"""The DDP hook, the trace recorder and the rendezvous in this process: a world of one.

A one-rank gloo group on a ``HashStore`` is enough for DDP to call the hooks (buckets, the
rebuild after the first backward, ``is_last``), and a one-rank engine completes at once, so
these tests cover the hook's edges — a closed engine, a data plane that returns the wrong
thing, an unsupported dtype, configuration from the environment — in seconds. Several ranks
are the multiproc tier's job.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gradlane.integrations.ddp import GradlaneState, HookConfig, gradlane_hook
from gradlane.integrations.rendezvous import RendezvousError, StoreRendezvous, local_hosts
from gradlane.integrations.trace import TraceRecorder, read_trace
from gradlane.scheduling.errors import ConfigError
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import CollectiveReport, LossReport
from gradlane.transport.daemon.client import DaemonPlane
from gradlane.transport.daemon.config import DaemonConfig
from gradlane.transport.daemon.server import Daemon
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from tests.support.ddp import hook_state, one_rank_group, tiny_model


@pytest.fixture
def store() -> Iterator[dist.Store]:
    """A one-rank gloo process group on a HashStore (destroyed after the test)."""
    with one_rank_group() as s:
        yield s


def _step(ddp: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    ddp(torch.randn(4, 8, dtype=dtype)).float().sum().backward()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_rank_hook_keeps_the_gradients_and_counts_steps(store, dtype):
    model = tiny_model().to(dtype)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)
    with hook_state(store, model=model) as state:
        ddp.register_comm_hook(state, gradlane_hook)
        for _ in range(3):
            _step(ddp, dtype)
            for p in model.parameters():
                p.grad = None
        stats = state.stats(plane=True)
        per_step = state.step_stats()
    assert stats["steps"] == 3 and stats["next_step"] == 3
    assert stats["failed_buckets"] == 0 and stats["delivered_fraction"]["min"] == 1.0
    assert per_step[0].buckets == 1 and per_step[-1].buckets > 1
    assert stats["generation"] == 1  # one rebuild after the first backward
    assert stats["plane"]["in_flight"] == 0


@pytest.mark.timeout(60)
def test_hook_on_a_closed_engine_fails_backward_with_a_clear_message(store):
    model = tiny_model()
    ddp = DistributedDataParallel(model)
    state = hook_state(store, model=model)
    ddp.register_comm_hook(state, gradlane_hook)
    _step(ddp)
    state.close()
    with pytest.raises(RuntimeError) as exc:
        _step(ddp)
    text = str(exc.value)
    assert "HookError: gradlane hook on rank 0: step 1 bucket 0" in text, text
    assert "data plane of rank 0 is closed" in text, text
    assert state.stats()["failed_buckets"] >= 1


class _WrongPlane:
    """A data plane that answers with the wrong dtype, or the wrong size."""

    def __init__(self, how: str) -> None:
        self.how = how

    def submit(
        self, step, bucket, data, layer_position=0.5, dtype=None, servers=None, out=None, *,
        scale=1.0, pinned=False,
    ):  # fmt: skip
        fut: concurrent.futures.Future = concurrent.futures.Future()
        result = data.astype(np.int32) if self.how == "dtype" else data[:-1].copy()
        lr = LossReport(step, bucket, 0, 0, data.size, 0, {}, 0.0, False)
        fut.set_result((result, CollectiveReport(step, bucket, 0.0, lr, ())))
        return fut

    def stats(self):
        return {}

    def close(self):
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["dtype", "size"])
def test_a_wrong_result_is_refused_not_written(store, how):
    model = tiny_model()
    ddp = DistributedDataParallel(model)
    state = GradlaneState(rank=0, world=1, plane=_WrongPlane(how), model=model)
    ddp.register_comm_hook(state, gradlane_hook)
    with pytest.raises(RuntimeError, match="the data plane returned"):
        _step(ddp)


@pytest.mark.timeout(60)
def test_unsupported_dtype_fails_the_future_not_the_hook(store):
    model = tiny_model().double()
    ddp = DistributedDataParallel(model)
    with hook_state(store, model=model) as state:
        ddp.register_comm_hook(state, gradlane_hook)
        with pytest.raises(
            RuntimeError, match=r"float32, float16 and bfloat16 buckets, not torch\.float64"
        ):
            _step(ddp, torch.float64)


class _Noting:
    """A real data plane, wrapped to note what the hook asked of each submit."""

    def __init__(self, plane) -> None:
        self.plane = plane
        self.asked: list[tuple[int, float, bool]] = []  # (step, layer position, pinned)

    def submit(self, step, bucket, data, layer_position=0.5, dtype=None, servers=None, out=None,
               *, scale=1.0, pinned=False):  # fmt: skip
        self.asked.append((step, layer_position, pinned))
        return self.plane.submit(
            step, bucket, data, layer_position, dtype, servers, out, scale=scale, pinned=pinned
        )

    def stats(self):
        return self.plane.stats()

    def close(self):
        self.plane.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("known_order", [True, False])
def test_a_bucket_holding_a_pinned_layer_is_submitted_pinned(store, known_order):
    # Parameters in model order: 0 and 1 the first Linear, 2 and 3 the second, 4 and 5 the
    # last. DDP's rebuilt buckets (2 KB cap, but 1 MB for the first one) hold 5..2 and 1..0.
    model = tiny_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)
    transport = TransportConfig(chunk_bytes=65000, priority=PriorityConfig(pinned_layers=(2,)))
    state = GradlaneState(
        transport, HookConfig(), rendezvous=StoreRendezvous(store),
        model=model if known_order else None,
    )  # fmt: skip
    with state:
        noting = state.plane = _Noting(state.plane)
        ddp.register_comm_hook(state, gradlane_hook)
        for _ in range(2):
            _step(ddp)
    first = [a for a in noting.asked if a[0] == 0]
    assert first == [(0, 0.0, True)]  # DDP's first step: one bucket, the whole model
    rebuilt = [a for a in noting.asked if a[0] == 1]
    assert sorted(rebuilt) == [(1, 0.0, False), (1, 0.4, True)], rebuilt  # position 2 / 5


def test_layer_positions_follow_the_model_order(store):
    model = tiny_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)
    rec = TraceRecorder(allreduce_hook, None, model=model).attach(ddp)
    for _ in range(2):
        _step(ddp)
    records = rec.records()
    first = [r for r in records if r["step"] == 0]
    assert len(first) == 1 and first[0]["layer_span"] == [0.0, 1.0]
    after = [r for r in records if r["step"] == 1]
    assert len(after) > 1
    # Rebuilt buckets come in reverse order: bucket 0 holds the last layers.
    assert after[0]["layer_span"][1] == 1.0 and after[-1]["layer_span"][0] == 0.0
    assert sum(r["bytes"] for r in after) == sum(p.numel() * 4 for p in model.parameters())
    # Without the model the order is learned from the first, whole-model bucket: the same spans.
    learned_model = tiny_model()
    learned_ddp = DistributedDataParallel(learned_model, bucket_cap_mb=0.002)
    learned = TraceRecorder(allreduce_hook, None).attach(learned_ddp)
    for _ in range(2):
        _step(learned_ddp)
    spans = [(r["step"], r["bucket"], r["layer_span"]) for r in records]
    assert [(r["step"], r["bucket"], r["layer_span"]) for r in learned.records()] == spans


@pytest.mark.timeout(60)
def test_trace_file_is_json_lines_with_a_meta_record(store, tmp_path):
    model = tiny_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)
    path = tmp_path / "t.jsonl"
    with hook_state(store, model=model) as state:
        rec = TraceRecorder(gradlane_hook, state, path=path, model=model, meta={"model": "tiny"})
        rec.attach(ddp)
        for _ in range(3):
            _step(ddp)
        rec.close()
    metas, buckets = read_trace(path)
    assert len(metas) == 1 and metas[0]["model"] == "tiny" and metas[0]["hook"] == "gradlane_hook"
    assert {r["step"] for r in buckets} == {0, 1, 2}
    for r in buckets:
        # comm_s timed the hook's Future: never zero, even on a world of one
        assert r["ok"] and r["comm_s"] > 0 and r["ready_s"] >= r["gap_s"] >= 0
        assert r["dtype"] == "float32" and r["bytes"] == 4 * r["numel"]
    last = [r for r in buckets if r["last"]]
    assert len(last) == 3
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)


def test_hook_config_from_env():
    cfg = HookConfig.from_env(
        {
            "GRADLANE_HOOK__TRANSPORT": "zmq",
            "GRADLANE_HOOK__HOSTS": "10.0.0.1, 10.0.1.1",
            "GRADLANE_HOOK__LOG_EVERY": "5",
            "GRADLANE_CHUNK_BYTES": "1408",  # a transport setting: not the hook's
        }
    )
    assert cfg.transport == "zmq" and cfg.hosts == ("10.0.0.1", "10.0.1.1") and cfg.log_every == 5
    # Every field can be set from the environment.
    samples = {"transport": "zmq", "hosts": "h1,h2", "log_every": "5", "history": "7",
               "rendezvous_timeout_s": "1.5", "name": "job", "mode": "daemon",
               "daemon_socket": "/run/d.sock", "connect_timeout_s": "3",
               "inject_loss": "0", "timeline": "/tmp/t.json", "timeline_events": "9"}  # fmt: skip
    assert set(samples) == {f.name for f in dataclasses.fields(HookConfig)}
    every = HookConfig.from_env({f"GRADLANE_HOOK__{k.upper()}": v for k, v in samples.items()})
    assert every == HookConfig(
        "zmq", ("h1", "h2"), 5, 7, 1.5, "job", "daemon", "/run/d.sock", 3.0,
        timeline="/tmp/t.json", timeline_events=9,
    )  # fmt: skip
    # Injected loss (tests, demos) is the UDP plane's: ZeroMQ is reliable.
    assert HookConfig.from_env({"GRADLANE_HOOK__INJECT_LOSS": "0.05"}).inject_loss == 0.05
    with pytest.raises(ConfigError, match="inject_loss"):
        HookConfig(transport="zmq", inject_loss=0.05)
    assert HookConfig.from_env({"GRADLANE_MODE": "daemon"}).mode == "daemon"
    with pytest.raises(ConfigError, match="mode="):
        HookConfig.from_env({"GRADLANE_MODE": "sideways"})
    with pytest.raises(ConfigError, match="GRADLANE_HOOK__NOPE"):
        HookConfig.from_env({"GRADLANE_HOOK__NOPE": "1"})
    with pytest.raises(ConfigError, match="transport="):
        HookConfig.from_env({"GRADLANE_HOOK__TRANSPORT": "carrier-pigeon"})


@pytest.mark.timeout(60)
def test_state_from_env_reads_transport_and_hook_settings(store):
    env = {
        "GRADLANE_HOOK__LOG_EVERY": "0",
        "GRADLANE_CHUNK_BYTES": "1408",
        "GRADLANE_LOSS__LOSS_BOUND": "0.02",
    }
    with GradlaneState.from_env(env, rendezvous=StoreRendezvous(store)) as state:
        assert state.transport.chunk_bytes == 1408
        assert state.transport.loss.loss_bound == 0.02
        assert state.config.log_every == 0
        # No MASTER_ADDR: loopback, so loopback_config() is the base (two paths).
        assert state.transport.n_paths == 2 and state.config.hosts == ("127.0.0.1", "127.0.0.2")
    env["GRADLANE_HOOK__TRANSPORT"] = "zmq"
    with GradlaneState.from_env(env, rendezvous=StoreRendezvous(store)) as state:
        # ZeroMQ defaults (reliable, long recovery timers) with the environment on top.
        assert state.transport.chunk_bytes == 1408 and state.transport.min_rto_s == 1.0


def test_rendezvous_round_trip_and_timeout_message():
    rdv = StoreRendezvous(dist.HashStore(), "gradlane/run/0/x/", timeout_s=0.2)
    rdv.publish(3, [("127.0.0.1", 5000), ("127.0.0.2", 5001)])
    assert rdv.addresses(3) == [("127.0.0.1", 5000), ("127.0.0.2", 5001)]
    assert rdv.channel("a").prefix == "gradlane/run/0/x/a/"
    with pytest.raises(RendezvousError, match=r"rank 7 did not publish .* gradlane/run/0/x/7"):
        rdv.addresses(7)


def test_rendezvous_from_env_needs_master_addr_and_a_store():
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT"):
        StoreRendezvous.from_env(environ={})
    with pytest.raises(ConfigError, match="not a port"):
        StoreRendezvous.from_env(environ={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x"})
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with pytest.raises(RendezvousError, match=f"cannot reach the TCPStore at 127.0.0.1:{port}"):
        StoreRendezvous.from_env(environ=env, timeout_s=1.0)


def test_rendezvous_namespace_comes_from_torchelastic_variables():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_RUN_ID": "job42",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    rdv = StoreRendezvous.from_env("hook", environ=env, timeout_s=5.0)
    assert rdv.prefix == "gradlane/job42/2/hook/"
    rdv.publish(0, [("127.0.0.1", 1234)])
    assert json.loads(server.get("gradlane/job42/2/hook/0")) == [["127.0.0.1", 1234]]


def test_local_hosts():
    assert local_hosts(2, None) == ["127.0.0.1", "127.0.0.2"]
    assert local_hosts(1, "localhost") == ["127.0.0.1"]
    with pytest.raises(ConfigError, match="one local address per path"):
        local_hosts(2, "10.1.2.3")


@pytest.mark.timeout(60)
def test_state_from_env_in_daemon_mode_talks_to_the_daemon(tmp_path):
    sock = str(tmp_path / "d.sock")
    job = 300_000 + os.getpid() % 100_000
    cfg = DaemonConfig(job=job, socket=sock, metrics="", local_world=1)
    env = {
        "GRADLANE_MODE": "daemon",
        "GRADLANE_JOB": str(job),
        "GRADLANE_HOOK__DAEMON_SOCKET": sock,
        "GRADLANE_HOOK__LOG_EVERY": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    with Daemon(cfg) as daemon, GradlaneState.from_env(env, rank=0, world=1) as state:
        assert isinstance(state.plane, DaemonPlane)
        assert state.plane.generation == daemon.generation
        x = np.arange(8, dtype=np.float32)
        result, _ = state.plane.submit(0, 0, x.copy()).result(30)
        np.testing.assert_array_equal(result, x)  # one rank: the sum is its own bucket
        assert state.stats()["transport"] == "daemon"
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        GradlaneState.from_env({"GRADLANE_MODE": "daemon"}, rank=0, world=1)
