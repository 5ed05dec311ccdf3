"""Path probes are not tied to a training step: a path that went SUSPECT or DOWN is probed
back UP at step 1000 as at step 1. (Probes and their answers once said step 0; past the
receivers' step window — 64 steps — every one was rejected as stale, so after the first
minute of a training job a path that went down never came back.)"""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.paths import PathConfig, PathState
from gradlane.transport.wire.header import Kind, Reason

from tests.support.cores import kind_of, make, random_datas, run_allreduce
from tests.support.wire import Wire


@pytest.mark.parametrize(("interval", "latency"), [(0.02, 0.002), (0.0005, 0.002), (0.0005, 50e-6)])
def test_a_dead_path_comes_back_through_probes_past_the_step_window(
    interval: float, latency: float
) -> None:
    """Also where the round trip (4 ms) outlasts the probe interval (0.5 ms): the answer to an
    older probe still in flight counts; and where every collective ends before the sender's
    first tick (50 us latency): probes due go out when a transfer starts."""
    eps = make(
        2,
        n_paths=2,
        min_rto_s=0.002,
        # No trickle of data on a SUSPECT path: only a probe's answer can bring it back.
        paths=PathConfig(suspect_after_s=0.01, probe_interval_s=interval, suspect_share=0.0),
    )
    datas = random_datas(2, 4000, 5)
    dead = {"on": False}
    probes = {"sent": 0, "answered": 0}

    def drop(src, dg, seq):
        kind = kind_of(dg)
        if kind == Kind.PROBE and src == 0:
            probes["sent"] += 1
        if kind == Kind.PROBE_ACK and src == 1:
            probes["answered"] += 1
        return dead["on"] and dg.path == 1  # path 1 carries nothing, either way

    wire = Wire(eps, drop=drop, latency=latency)
    first = 1000  # far past step_window (64) from step 0
    for step in range(first, first + 2):
        run_allreduce(eps, datas, wire, step=step)
    dead["on"] = True
    step = first + 2
    # Steps while path 1 is dead: rank 0's sender takes it out.
    while eps[0].endpoint.sender.paths[1].state(1) == PathState.UP and step < first + 100:
        run_allreduce(eps, datas, wire, step=step)
        step += 1
    assert eps[0].endpoint.sender.paths[1].state(1) != PathState.UP
    dead["on"] = False
    # Path 1 works again: the next probe's answer brings it back, within a few steps.
    for _ in range(100):
        out = run_allreduce(eps, datas, wire, step=step)
        np.testing.assert_allclose(out[0].result, datas[0] + datas[1], rtol=1e-6, atol=1e-6)
        step += 1
        if eps[0].endpoint.sender.paths[1].state(1) == PathState.UP:
            break
    assert eps[0].endpoint.sender.paths[1].state(1) == PathState.UP, probes
    assert probes["answered"] > 0
    for ep in eps:
        assert ep.endpoint.counters[Reason.STALE_STEP] == 0
