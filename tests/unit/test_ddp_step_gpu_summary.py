"""``gradlane.bench.perf.ddp_step`` without running a step: the GPU run's summary from synthetic
per-step records, the plane's busy time, the options per device, the ResNet's size and pooling,
and the refusal of ``--device cuda`` where torch sees no CUDA device."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch
from gradlane.bench.perf import ddp_step
from gradlane.bench.perf.ddp_step import NOOP, TimedPlane, busy_s, overlap_fraction, summarize

GPU_KEYS = {
    "gpu_step_ratio_vs_default",
    "gpu_exposed_comm_ratio_vs_default",
    "gpu_overlap_fraction",
}


def _world(times: dict[str, list[float]], busy: dict[str, list[float]]) -> dict:
    """One rank count's measurements, as ``_measure`` returns them (CPU time alike)."""
    return {
        "times": times,
        "cpu": {v: [t * 2 for t in ts] for v, ts in times.items()},
        "param_gap": {v: 0.0 for v in times if v not in ("default", NOOP)},
        "hook_comm_p50_s": {v: 0.02 for v in busy},
        "plane_busy_s": busy,
        "engine_per_step": {},
    }


def test_busy_time_is_the_union_of_the_collectives_in_flight():
    assert busy_s([]) == 0.0
    assert busy_s([(1.0, 2.0)]) == 1.0
    assert busy_s([(1.0, 2.0), (3.0, 3.5)]) == 1.5  # apart
    assert busy_s([(1.0, 2.0), (1.5, 3.0)]) == 2.0  # overlapping
    assert busy_s([(1.0, 4.0), (2.0, 3.0)]) == 3.0  # nested
    assert busy_s([(2.0, 3.0), (1.0, 2.0)]) == 2.0  # touching, in any order


def test_overlap_is_the_hidden_share_of_the_busy_time():
    assert overlap_fraction(0.002, 0.010) == pytest.approx(0.8)
    assert overlap_fraction(0.0, 0.010) == 1.0
    assert overlap_fraction(-0.001, 0.010) == 1.0  # a step faster than the no-op: all hidden
    assert overlap_fraction(0.020, 0.010) == 0.0  # more exposed than busy: nothing hidden
    assert overlap_fraction(0.002, None) is None and overlap_fraction(0.002, 0.0) is None
    assert overlap_fraction(None, 0.010) is None


def test_gpu_summary_from_per_step_records():
    times = {
        "default": [0.050, 0.052, 0.060],
        "udp": [0.045, 0.047, 0.049],
        NOOP: [0.040, 0.041, 0.042],
    }
    busy = {"udp": [0.020, 0.025, 0.030]}
    report = summarize({2: _world(times, busy)}, "cuda")
    s = report["summary"]
    assert set(s) == GPU_KEYS  # and none of the CPU run's keys
    # Exposed: the median of the per-step differences to the no-op hook's step.
    exposed_default = float(np.median([0.010, 0.011, 0.018]))
    exposed_udp = float(np.median([0.005, 0.006, 0.007]))
    assert s["gpu_step_ratio_vs_default"]["2"] == pytest.approx(0.047 / 0.052)
    assert s["gpu_exposed_comm_ratio_vs_default"]["2"] == pytest.approx(
        exposed_udp / exposed_default
    )
    assert s["gpu_overlap_fraction"]["2"] == pytest.approx(1 - exposed_udp / 0.025)
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["udp"]["exposed_comm_s"] == pytest.approx(exposed_udp)
    assert rows["udp"]["plane_busy_s"] == pytest.approx(0.025)
    assert rows["default"]["exposed_comm_s"] == pytest.approx(exposed_default)
    assert rows["default"]["overlap_fraction"] is None  # DDP's own all-reduce is not timed
    assert rows[NOOP]["exposed_comm_s"] == 0.0
    assert rows["udp"]["cpu_ratio_to_default"] == pytest.approx(0.094 / 0.104)


def test_gpu_summary_names_other_planes_and_has_no_ratio_over_nothing():
    times = {
        "default": [0.040, 0.040],
        "udp": [0.050, 0.052],
        "zmq": [0.060, 0.060],
        NOOP: [0.041, 0.041],  # the default hook hid all of its communication
    }
    busy = {"udp": [0.02, 0.02], "zmq": [0.03, 0.03]}
    s = summarize({2: _world(times, busy), 4: _world(times, busy)}, "cuda")["summary"]
    assert set(s) == GPU_KEYS | {f"{k}_zmq" for k in GPU_KEYS}
    assert s["gpu_exposed_comm_ratio_vs_default"] == {"2": None, "4": None}
    assert s["gpu_step_ratio_vs_default_zmq"]["4"] == pytest.approx(1.5)


def test_cpu_summary_keeps_its_keys():
    times = {"default": [0.2, 0.2], "udp": [0.3, 0.3], "zmq": [0.25, 0.25], NOOP: [0.1, 0.1]}
    s = summarize({2: _world(times, {"udp": [0.1, 0.1], "zmq": [0.1, 0.1]})})["summary"]
    assert set(s) == {
        "step_ratio_vs_default",
        "cpu_ratio_vs_default",
        "step_ratio_vs_default_zmq",
        "cpu_ratio_vs_default_zmq",
    }
    assert s["step_ratio_vs_default"]["2"] == pytest.approx(1.5)


def test_options_per_device():
    cpu = ddp_step.parse_args([])
    assert (cpu["device"], cpu["model"], cpu["ranks"], cpu["transports"]) == (
        "cpu", "mlp", [2, 4], ["udp", "zmq"],
    )  # fmt: skip
    assert (cpu["batch"], cpu["steps"], cpu["warmup"]) == (32, 15, 3)
    gpu = ddp_step.parse_args(["--device", "cuda"])
    assert (gpu["model"], gpu["ranks"], gpu["transports"]) == ("resnet", [2], ["udp"])
    assert (gpu["batch"], gpu["steps"], gpu["warmup"]) == (512, 30, 5)
    assert ddp_step.parse_args(["--device", "cuda", "--model", "mlp"])["batch"] == 16384
    given = ddp_step.parse_args(["--device", "cuda", "--ranks", "2,3", "--batch", "64"])
    assert given["ranks"] == [2, 3] and given["batch"] == 64


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "tpu"],
        ["--device", "cuda", "--transports", "udp,floor"],
        ["--transports", "zmq"],
        ["--warmup", "1"],
        ["--ranks", "1"],
        ["--model", "vgg"],
    ],
)
def test_bad_options_exit_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        ddp_step.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_device_cuda_without_cuda_exits_2_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_ranks(*_a, **_k):
        raise AssertionError("ranks were started without a CUDA device")

    monkeypatch.setattr(ddp_step, "run_world", no_ranks)
    assert ddp_step.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda needs a CUDA GPU" in err and torch.__version__ in err, err
    assert "Traceback" not in err


def test_resnet_has_25_mb_of_gradients_and_classifies_32px_images():
    torch.manual_seed(0)
    model = ddp_step.build_model("resnet")
    assert sum(p.numel() for p in model.parameters()) == 6_288_442
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_resnet_pools_like_the_adaptive_pool_without_its_atomic_backward():
    torch.manual_seed(0)
    x = torch.randn(3, 8, 4, 4, requires_grad=True)
    y = torch.randn(3, 8, 4, 4, requires_grad=True)
    w = torch.randn(3, 8)
    (ddp_step.GlobalAvgPool()(x) * w).sum().backward()
    (torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())(y) * w).sum().backward()
    torch.testing.assert_close(
        ddp_step.GlobalAvgPool()(x), torch.nn.AdaptiveAvgPool2d(1)(x).flatten(1)
    )
    torch.testing.assert_close(x.grad, y.grad)
    pools = [m for m in ddp_step.build_model("resnet").modules() if "Pool" in type(m).__name__]
    assert [type(m) for m in pools] == [ddp_step.GlobalAvgPool]


class _LatePlane:
    """A plane whose collectives complete when the test says so."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, step, bucket, data, *args, **kwargs):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.futures.append(fut)
        return fut

    def stats(self):
        return {"in_flight": len(self.futures)}

    def drain(self, timeout_s=2.0):
        return True

    def close(self):
        pass


def test_timed_plane_times_each_step_until_its_collectives_complete():
    inner = _LatePlane()
    plane = TimedPlane(inner)
    data = np.zeros(4, np.float32)
    first = plane.submit(7, 0, data)
    plane.submit(7, 1, data, out=data, scale=0.5)
    assert plane.busy_s(7) == 0.0  # nothing completed yet
    inner.futures[0].set_result("a")
    inner.futures[1].set_result("b")
    assert first.result() == "a"
    assert plane.busy_s(7) > 0.0 and plane.busy_s(8) == 0.0
    assert plane.stats() == {"in_flight": 2} and plane.drain()
