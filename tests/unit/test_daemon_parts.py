"""The daemon's pure parts: IPC message validation, config parsing, metrics text, shared
memory lifecycle, and the local-sum kernel against its NumPy reference."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re

import numpy as np
import pytest
from gradlane.integrations.cli.stats import samples
from gradlane.scheduling.errors import GradlaneError
from gradlane.transport import kernels
from gradlane.transport.core.events import CollectiveReport, LossReport, SenderReport
from gradlane.transport.daemon import messages as ipc
from gradlane.transport.daemon.config import DaemonConfig, load, parse_address
from gradlane.transport.daemon.metrics import DaemonMetrics
from gradlane.transport.daemon.shm import Segment, SegmentError, check_name
from gradlane.transport.errors import ConfigError
from gradlane.transport.wire.header import SHARD_DTYPES, DType
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from tests.support import naive

SUBMIT = {"generation": 5, "step": 3, "bucket": 1, "shm": "gradlane-1-h0-5-l0-b1.0-0",
          "fd": 7, "offset": 0, "numel": 100, "dtype": 0, "layer_position": 0.25,
          "pinned": True}  # fmt: skip


# -- IPC messages -----------------------------------------------------------------------------
def test_encode_decode_round_trip():
    kind, msg = ipc.decode(ipc.encode("SUBMIT", **SUBMIT))
    assert kind == "SUBMIT" and msg == SUBMIT


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"SUBMIT"], "malformed"),
        ([b"SUBMIT", b"{}", b"extra"], "malformed"),
        ([b"SUBMIT", b"\xff\xfe"], "malformed"),
        ([b"SUBMIT", b"[1, 2]"], "malformed"),
        ([b"SUBMIT", b" " * (ipc.MAX_MESSAGE_BYTES + 1)], "oversized"),
        ([b"PICKLE", b"{}"], "unknown_kind"),
        ([b"SUBMIT", json.dumps({**SUBMIT, "step": -1}).encode()], "bad_field"),
        ([b"SUBMIT", json.dumps({**SUBMIT, "step": True}).encode()], "bad_field"),
        ([b"SUBMIT", json.dumps({**SUBMIT, "numel": "100"}).encode()], "bad_field"),
        ([b"SUBMIT", json.dumps({**SUBMIT, "dtype": 3}).encode()], "bad_field"),
        ([b"SUBMIT", json.dumps({**SUBMIT, "pinned": 1}).encode()], "bad_field"),
        ([b"SUBMIT", json.dumps({**SUBMIT, "pinned": "yes"}).encode()], "bad_field"),
        ([b"SUBMIT", json.dumps({**SUBMIT, "evil": 1}).encode()], "bad_field"),
        ([b"SUBMIT", json.dumps({**SUBMIT, "fd": -1}).encode()], "bad_field"),
        ([b"SUBMIT", json.dumps({**SUBMIT, "fd": 1 << 31}).encode()], "bad_field"),
        ([b"SUBMIT", json.dumps({k: v for k, v in SUBMIT.items() if k != "shm"}).encode()],
         "bad_field"),
    ],
)  # fmt: skip
def test_bad_messages_are_typed_errors(frames, why):
    with pytest.raises(ipc.IpcError) as info:
        ipc.decode(frames)
    assert info.value.why == why


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=4))
def test_any_bytes_decode_or_raise_ipc_error(frames):
    try:
        kind, msg = ipc.decode(frames)
    except ipc.IpcError as e:
        assert e.why in ipc.REASONS
    else:
        assert kind in ipc.SCHEMAS and set(msg) == set(ipc.SCHEMAS[kind])


def test_encode_refuses_a_bad_message():
    with pytest.raises(ipc.IpcError):
        ipc.encode("SUBMIT", **{**SUBMIT, "bucket": 70000})


def test_report_round_trip():
    loss = LossReport(3, 1, 0, 0, 100, 2, {0: 0.98, 1: 1.0}, 0.01, True, 400, 1, 0, 0)
    rep = CollectiveReport(3, 1, 0.02, loss, (loss,), SenderReport((1, 2), (0, 1), (0, 0), 9, (9,)))
    wire = json.loads(json.dumps(ipc.report_to_wire(rep)))
    assert ipc.report_from_wire(wire) == rep
    # The wire precision's figures travel too (daemon mode's step statistics show them).
    snd = SenderReport((1, 2), (0, 1), (0, 0), 9, (9,), (400, 200, 100), 70, 100, 0.25, 4.0)
    lossy = CollectiveReport(3, 1, 0.02, loss, (loss,), snd, 0.01, precision_level=1.5)
    assert ipc.report_from_wire(json.loads(json.dumps(ipc.report_to_wire(lossy)))) == lossy
    with pytest.raises(ipc.IpcError):
        ipc.report_from_wire({"step": 1})


# -- configuration ----------------------------------------------------------------------------
def test_toml_env_and_flags_in_order(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text(
        '[daemon]\njob = 7\nhost_rank = 1\nhosts = 2\nsecret = "s"\n'
        'paths = ["127.0.0.2:47001"]\n'
        'peers = [["127.0.0.1:47000"], ["127.0.0.2:47001"]]\n'
        "[transport]\nchunk_bytes = 8192\n[transport.loss]\nloss_bound = 0.02\n"
    )
    cfg = load(str(path), environ={"GRADLANE_DAEMON__LOCAL_WORLD": "4"}, flags={"job": 9})
    assert (cfg.job, cfg.host_rank, cfg.hosts, cfg.local_world) == (9, 1, 2, 4)
    assert cfg.transport.job == 9 and cfg.transport.secret == "s"
    assert cfg.transport.chunk_bytes == 8192 and cfg.transport.loss.loss_bound == 0.02
    assert cfg.transport.n_paths == 1  # one address per path
    assert cfg.peer_table() == [[("127.0.0.1", 47000)], [("127.0.0.2", 47001)]]
    assert cfg.socket_path.endswith("gradlane-9.sock")
    loss = load(str(path), transport_flags={"loss": {"hard_deadline_s": 3.0}}).transport.loss
    assert loss.hard_deadline_s == 3.0 and loss.loss_bound == 0.02


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[daemon]\nhosts = 2\n", "peers"),
        ("[daemon]\nhost_rank = 3\nhosts = 2\n", "host_rank=3"),
        ("[daemon]\nbogus = 1\n", "bogus"),
        ("[other]\n", "unknown table"),
        ("[transport]\nchunk_bytes = 3\n", "chunk_bytes"),
        ("[daemon]\nhosts = 2\npeers = [['127.0.0.1'], ['127.0.0.2']]\n", "fixed port"),
        ("[daemon\n", "not valid TOML"),
    ],
)
def test_bad_config_names_the_problem(tmp_path, text, needle):
    path = tmp_path / "d.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load(str(path), environ={})


def test_parse_address():
    assert parse_address("10.0.0.1:5") == ("10.0.0.1", 5)
    assert parse_address("10.0.0.1") == ("10.0.0.1", 0)
    assert parse_address("[::1]:7") == ("::1", 7)
    with pytest.raises(ConfigError):
        parse_address("h:notaport")


def test_config_dataclass_validates():
    with pytest.raises(ConfigError, match="n_paths"):
        DaemonConfig(paths=("127.0.0.1", "127.0.0.2"))
    cfg = DaemonConfig(job=3, secret="x")
    assert cfg.transport.job == 3 and dataclasses.replace(cfg, job=4).transport.job == 4


# -- metrics ----------------------------------------------------------------------------------
#: Every family the daemon exposes: type, label names, help text.
DAEMON_METRICS = {
    "gradlane_step_latency_seconds": (
        "histogram", (), "first local submission to the all-reduced result, per (step, bucket)"),
    "gradlane_collectives_total": ("counter", ("outcome",), "all-reduces by outcome"),
    "gradlane_delivered_fraction": ("gauge", (), "delivered fraction of the last all-reduce"),
    "gradlane_delivered_fraction_min": ("gauge", (), "smallest delivered fraction so far"),
    "gradlane_drops_total": (
        "counter", ("class", "reason"), "chunks dropped, by priority class and reason"),
    "gradlane_retransmits_total": (
        "counter", ("class",), "chunks retransmitted, by priority class"),
    "gradlane_path_bytes_total": ("counter", ("path",), "bytes sent per path"),
    "gradlane_path_rate_bytes_per_second": (
        "gauge", ("peer", "path"), "estimated rate per peer and path"),
    "gradlane_path_loss_ratio": ("gauge", ("peer", "path"), "loss EWMA per peer and path"),
    "gradlane_packets_rejected": ("gauge", ("reason",), "datagrams rejected, by reason (engine)"),
    "gradlane_ipc_rejected_total": ("counter", ("reason",), "IPC messages rejected, by reason"),
    "gradlane_slot_timeouts_total": ("counter", (), "slots freed at their deadline"),
    "gradlane_local_ranks": ("gauge", (), "trainers connected"),
    "gradlane_collectives_in_flight": ("gauge", (), "inter-host all-reduces running"),
    "gradlane_generation": ("gauge", (), "this daemon's generation"),
}  # fmt: skip


def _report(missing: int) -> CollectiveReport:
    loss = LossReport(3, 1, 0, 0, 100, missing, {0: 1.0}, 0.01, False)
    sender = SenderReport((5, 5, 5), (0, 0, 4), (1, 0, 0), 900, (600, 300))
    return CollectiveReport(3, 1, 0.02, loss, (loss,), sender)


def _exercised(generation: int = 1_768_000_123_456_789) -> DaemonMetrics:
    """Metrics with a sample in every family, through the calls the daemon makes."""
    m = DaemonMetrics(generation)
    m.collective(_report(missing=2), 0.002)
    m.collective(_report(missing=0), 0.02)
    m.step_latency.observe(20.0)
    m.collectives.labels("failed").inc()
    m.drop("local_rank_timeout", "all")
    m.slot_timeouts.inc()
    m.ipc_rejected.labels("mismatch").inc()
    m.local_ranks.set(2)
    m.in_flight.set(1)
    m.engine(
        {"rejected": {"bad_tag": 7}, "paths": {1: {"rate_Bps": [1e6, None], "loss": [0.25, None]}}}
    )
    return m


def test_daemon_metrics_names_types_labels_and_help():
    text = generate_latest(_exercised().registry).decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    ours = {n for n in types if not n.endswith("_created")}  # prometheus_client's timestamps
    assert ours == set(DAEMON_METRICS)
    labels: dict[str, set[str]] = {n: set() for n in DAEMON_METRICS}
    for name, lb, _ in samples(text):
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in labels else name
        labels[family] |= set(lb) - {"le"}
    for name, (kind, names, help_text) in DAEMON_METRICS.items():
        assert (types[name], helps[name], labels[name]) == (kind, help_text, set(names)), name


def test_daemon_metrics_text_and_values():
    fresh = DaemonMetrics(5)
    assert math.isnan(fresh.value("gradlane_delivered_fraction"))  # no all-reduce yet
    assert fresh.value("gradlane_delivered_fraction_min") == 1.0
    assert fresh.value("gradlane_ipc_rejected_total", reason="mismatch") == 0.0
    m = _exercised()
    text = generate_latest(m.registry).decode()
    assert "# TYPE gradlane_drops_total counter" in text
    assert 'gradlane_drops_total{class="2",reason="skipped_within_bound"} 8.0' in text
    assert 'gradlane_step_latency_seconds_bucket{le="0.0025"} 1.0' in text
    assert 'gradlane_step_latency_seconds_bucket{le="0.025"} 2.0' in text
    assert 'gradlane_step_latency_seconds_bucket{le="10.0"} 2.0' in text
    assert 'gradlane_step_latency_seconds_bucket{le="+Inf"} 3.0' in text
    assert "gradlane_step_latency_seconds_count 3.0" in text
    got = {(n, tuple(sorted(lb.items()))): v for n, lb, v in samples(text)}
    assert got[("gradlane_generation", ())] == 1_768_000_123_456_789  # exact: < 2**53
    assert got[("gradlane_delivered_fraction", ())] == 1.0
    assert got[("gradlane_delivered_fraction_min", ())] == 0.98
    assert got[("gradlane_drops_total", (("class", "all"), ("reason", "missing_elements")))] == 4
    assert got[("gradlane_path_bytes_total", (("path", "1"),))] == 600
    assert got[("gradlane_path_rate_bytes_per_second", (("path", "1"), ("peer", "1")))] == 0.0
    assert got[("gradlane_collectives_total", (("outcome", "ok"),))] == 2
    assert not any(n.endswith("_created") for n, _ in got)
    assert m.value("gradlane_drops_total", **{"class": "2", "reason": "skipped_within_bound"}) == 8
    with pytest.raises(ValueError):
        m.drop("late", "0", -1)  # a counter never goes down
    with pytest.raises(GradlaneError, match="not a Prometheus"):
        samples("gradlane_local_ranks{oops 1\n")


# -- shared memory ----------------------------------------------------------------------------
def test_segment_lifecycle():
    name = f"gradlane-test-{os.getpid()}-seg"
    seg = Segment.create(name, 64)
    try:
        st = os.fstat(seg.fd)
        assert oct(st.st_mode & 0o777) == oct(0o600) and st.st_nlink == 0  # no name anywhere
        assert os.readlink(f"/proc/self/fd/{seg.fd}") == f"/memfd:{name} (deleted)"
        assert not glob.glob(f"/dev/shm/*{name}*")
        seg.array(np.float32, 16)[:] = 7.0
        with pytest.raises(SegmentError, match="does not fit"):
            seg.array(np.float32, 17)
        with pytest.raises(ConfigError, match="must be > 0"):
            Segment.create(name, 0)
    finally:
        seg.close()
    seg.close()  # idempotent
    with pytest.raises(SegmentError, match="closed"):
        seg.array(np.float32, 1)
    with pytest.raises(SegmentError, match="closed"):
        _ = seg.fd


@pytest.mark.parametrize(
    "name", ["../etc/passwd", "gradlane-../x", "other-name", "gradlane-a/b", ""]
)
def test_segment_names_cannot_escape(name):
    with pytest.raises(SegmentError):
        check_name(name)
    with pytest.raises(SegmentError):
        Segment.create(name, 8)


# -- the local-sum kernel ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(SHARD_DTYPES))
@pytest.mark.parametrize("n_src", [1, 2, 3])
def test_local_sum_matches_reference(dtype, n_src):
    rng = np.random.default_rng([int(dtype), n_src])
    srcs = [rng.standard_normal(1001).astype(np.float32) for _ in range(n_src)]
    if dtype == DType.F16:
        srcs = [s.astype(np.float16) for s in srcs]
    elif dtype == DType.BF16:
        srcs = [(s.view(np.uint32) >> 16).astype(np.uint16) for s in srcs]
    out = np.empty(1001, dtype=np.float32)
    kernels.local_sum(out, srcs, dtype)
    np.testing.assert_array_equal(out, naive.local_sum(srcs, dtype))


def test_local_sum_checks_its_inputs():
    out = np.empty(4, dtype=np.float32)
    with pytest.raises(ValueError, match="elements"):
        kernels.local_sum(out, [np.ones(5, np.float32)], DType.F32)
    with pytest.raises(ValueError, match="at least one"):
        kernels.local_sum(out, [], DType.F32)
    with pytest.raises(ValueError, match="must be one of"):
        kernels.local_sum(out, [np.ones(4, np.float64)], DType.F32)
