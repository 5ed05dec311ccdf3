"""``TransportConfig.inject_loss``: the opt-in, seeded drop of received datagrams (tests, demos).

Loopback never loses a datagram; the demo and the DDP tests need loss that shows. The engine
drops the configured fraction of what it receives before the protocol sees it, so recovery and
the loss bound run exactly as they would after a lossy link.
"""

from __future__ import annotations

import numpy as np
import pytest

from scheduling.loss import LossConfig
from transport.config import TransportConfig
from transport.engine import Engine
from transport.errors import ConfigError
from transport.rendezvous import StaticPeers

WAIT_S = 60.0


def _pair(config: TransportConfig) -> list[Engine]:
    engines = [Engine(r, 2, config) for r in range(2)]
    try:
        table = StaticPeers({r: e.start() for r, e in enumerate(engines)})
        for e in engines:
            e.set_peers(table)
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


@pytest.mark.timeout(120)
def test_reliable_allreduce_recovers_injected_loss_exactly():
    cfg = TransportConfig(
        n_paths=2,
        chunk_bytes=1408,
        inject_loss=0.05,
        loss=LossConfig(loss_bound=0.0, hard_deadline_s=30.0),
    )
    engines = _pair(cfg)
    try:
        rng = np.random.default_rng(11)
        data = [rng.standard_normal(200_003).astype(np.float32) for _ in engines]
        for step in (1, 2):
            futs = [e.submit(step, 0, d) for e, d in zip(engines, data, strict=True)]
            for f in futs:
                res, rep = f.result(WAIT_S)
                np.testing.assert_array_equal(res, data[0] + data[1])
                assert rep.delivered_fraction == 1.0
        stats = [e.stats() for e in engines]
    finally:
        for e in engines:
            e.close()
    # ~5% of ~300 datagrams per rank and step: none dropped would mean the knob does nothing.
    assert all(s["injected_drops"] > 0 for s in stats), stats


def test_inject_loss_is_off_by_default_and_validated():
    assert TransportConfig().inject_loss == 0.0
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="inject_loss"):
            TransportConfig(inject_loss=bad)
