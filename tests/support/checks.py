"""Checks shared by the loopback tests of the three data planes (UDP engine, ZeroMQ, daemon)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def check_pinned_goes_in_class_0(planes: Sequence[Any], data: Sequence[np.ndarray], wait_s: float):
    """Step 1 pinned, step 2 not, on two ranks: both exact; the pinned bucket's chunks all go
    in class 0, the other's mostly in the lower classes (layer+magnitude: only the protected
    ones in class 0)."""
    for step, pinned in ((1, True), (2, False)):
        futs = [p.submit(step, 0, d, pinned=pinned) for p, d in zip(planes, data, strict=True)]
        for f in futs:
            res, rep = f.result(wait_s)
            np.testing.assert_array_equal(res, data[0] + data[1])
            sent = rep.sender.sent
            if pinned:
                assert sent[0] > 0 and sum(sent[1:]) == 0, sent
            else:
                assert sent[0] > 0 and sum(sent[1:]) > sent[0], sent
