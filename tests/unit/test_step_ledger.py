"""The DDP hook's per-step statistics (:class:`gradlane.integrations.steps.StepLedger`): a step
completes with its last bucket, its figures add up, and non-finite results are counted and
warned about (first step, then every hundredth)."""

from __future__ import annotations

import logging

from gradlane.integrations.steps import StepLedger
from gradlane.transport.core.events import CollectiveReport, LossReport, SenderReport


def _report(nonfinite: int = 0, missing: int = 0) -> CollectiveReport:
    reduce = LossReport(1, 0, 0, 0, 100, missing, {1: 1.0 - missing / 100}, 0.0, missing > 0,
                        nonfinite_chunks=nonfinite)  # fmt: skip
    return CollectiveReport(1, 0, 0.01, reduce, (), SenderReport(retransmitted=(2, 1)))


def test_a_step_completes_with_its_last_bucket_and_adds_up() -> None:
    ledger = StepLedger(rank=0, history=10, log_every=0)
    ledger.note_start(7, 0, 400, 1.0, last=False)
    ledger.note_start(7, 0, 600, 1.1, last=True)
    ledger.note_done(7, 0, _report(missing=5), failed=False)
    assert ledger.history() == []
    ledger.note_done(7, 0, _report(nonfinite=3), failed=False)
    (st,) = ledger.history()
    assert (st.step, st.buckets, st.bytes, st.retransmitted) == (7, 2, 1000, 6)
    assert st.delivered_fraction == 0.95 and st.degraded_buckets == 1
    assert st.nonfinite_chunks == 3
    summary = ledger.summary()
    assert summary["steps"] == 1 and summary["nonfinite_chunks"] == 3
    assert summary["last"]["nonfinite_chunks"] == 3


def test_nonfinite_steps_are_warned_about_the_first_and_every_hundredth(caplog) -> None:
    ledger = StepLedger(rank=2, history=10, log_every=0)
    with caplog.at_level(logging.WARNING, logger="gradlane.integrations.ddp"):
        for step in range(250):
            ledger.note_start(step, 0, 4, 0.0, last=True)
            ledger.note_done(step, 0, _report(nonfinite=1 if step % 2 else 0), failed=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # 125 such steps: the 1st and the 101st
    assert warnings[0].startswith("rank 2 step 1: 1 chunk(s)") and "NaN" in warnings[0]
    assert ledger.summary()["nonfinite_chunks"] == 125
