"""Run real UDP collectives after ``UdpPlane.start()`` and print, as JSON, every numba kernel
signature they compiled (or loaded from the cache) beyond what the start-up warm-up did.

Run in a fresh interpreter (``python -m tests.loopback.lazy_compile_probe``): in the test
process other tests have compiled kernels already, which would hide a gap in the warm-up.
Output: ``{"kernels": <dispatchers seen>, "warmed": <signatures after start>, "new": {...}}``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.precision import PrecisionConfig
from gradlane.transport.config import TransportConfig, loopback_config
from gradlane.transport.drivers.peers import StaticPeers
from gradlane.transport.drivers.udp.plane import InjectedLoss, UdpPlane
from gradlane.transport.drivers.zmq.plane import ZmqPlane, zmq_config
from gradlane.transport.wire.header import DType

WAIT_S = 120.0


def signatures() -> dict[str, set[str]]:
    """Every numba dispatcher of the project's modules → its compiled signatures."""
    out: dict[str, set[str]] = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", None) or ""
        if not name.startswith("gradlane."):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, numba.core.registry.CPUDispatcher):
                func = value.py_func
                out[f"{func.__module__}.{func.__qualname__}"] = set(map(str, value.signatures))
    return out


def udp(world: int, config: TransportConfig, inject_loss: float = 0.0) -> list[Any]:
    """Started, connected engines over UDP on loopback (dropping ``inject_loss`` of what they
    receive, seeded by the config's seed)."""
    tap = InjectedLoss(inject_loss, seed=config.seed) if inject_loss else None
    engines = [UdpPlane(r, world, config, rx_tap=tap) for r in range(world)]
    try:
        addrs = {r: e.start() for r, e in enumerate(engines)}
        for e in engines:
            e.set_peers(StaticPeers(addrs))
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


def zmq(world: int, config: TransportConfig, where: str) -> list[Any]:
    """Started ZeroMQ data planes over ipc:// sockets in ``where``."""
    eps = [f"ipc://{where}/data-{r}" for r in range(world)]
    planes: list[Any] = []
    try:
        for r in range(world):
            planes.append(ZmqPlane(r, world, config, eps).start())
    except BaseException:
        for p in planes:
            p.close()
        raise
    return planes


def collectives(start: Callable[[], list[Any]]) -> tuple[dict, dict]:
    """Start the ranks, snapshot, run a mix of collectives, snapshot again."""
    engines = start()
    try:
        before = signatures()
        jobs: list[tuple[int, str, dict]] = [
            (300_001, "f32", {}),
            (300_001, "f16", {}),
            (300_001, "bf16", {}),
            (2_000_000, "f32", {}),
            (300_001, "f32", {"servers": [0]}),
            (200_000, "f32", {"scale": 0.5}),
        ]
        if isinstance(engines[0], UdpPlane):  # the ZeroMQ plane has no pinned buckets
            jobs.append((200_000, "f32", {"pinned": True}))
        for step, (n, kind, kw) in enumerate(jobs):
            x = np.random.default_rng(step).standard_normal(n).astype(np.float32)
            data = {
                "f32": x,
                "f16": x.astype(np.float16),
                "bf16": (x.view(np.uint32) >> 16).astype(np.uint16),
            }[kind]
            dtype = DType.BF16 if kind == "bf16" else None
            futs = [e.submit(step, 0, data.copy(), dtype=dtype, **kw) for e in engines]
            for f in futs:
                f.result(WAIT_S)
        return before, signatures()
    finally:
        for e in engines:
            e.close()


#: Chunks in float32, bfloat16 and E4M3 at once (the adaptive level between the two).
MIXED = PrecisionConfig(policy="adaptive", initial_level=1.5)


def main() -> None:
    new: dict[str, set[str]] = {}
    warmed = 0
    bounded = LossConfig(loss_bound=0.05)
    where = tempfile.mkdtemp(prefix="gl-warm-", dir="/tmp")  # ipc:// paths must be short
    runs: list[Callable[[], list[Any]]] = [
        # Reliable, the losses recovered; bounded; a keyed job (its packets carry the keyed MAC).
        lambda: udp(2, loopback_config(seed=1), inject_loss=0.05),
        lambda: udp(3, loopback_config(seed=2, loss=bounded), inject_loss=0.05),
        lambda: udp(2, loopback_config(secret="warm", loss=bounded)),
        # Lossy wire formats, bfloat16 and E4M3 chunks beside float32 ones, with lost packets.
        lambda: udp(
            2,
            loopback_config(
                seed=3, precision=PrecisionConfig(policy="adaptive", initial_level=1.5)
            ),
            inject_loss=0.05,
        ),
        lambda: zmq(2, zmq_config(), where),
    ]
    try:
        results = [collectives(start) for start in runs]
    finally:
        shutil.rmtree(where, ignore_errors=True)
    for before, after in results:
        warmed = max(warmed, sum(map(len, before.values())))
        for name, sigs in after.items():
            if extra := sigs - before.get(name, set()):
                new.setdefault(name, set()).update(extra)
    kernels = len(signatures())
    listed = {k: sorted(v) for k, v in new.items()}
    print(json.dumps({"kernels": kernels, "warmed": warmed, "new": listed}))


if __name__ == "__main__":
    main()
