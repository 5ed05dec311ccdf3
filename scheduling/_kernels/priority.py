"""The default priority policy's classification in one compiled call.

A sender classifies every transfer it starts (six a collective per rank at four ranks), a few
dozen chunks each. Written with numpy the layer+magnitude classification is a dozen small-array
operations (a negation, a stable argsort, masks, fancy assignments), whose interpreter and
dispatch overhead is most of its cost at that size; this pass does the same in one call.

It is exactly :meth:`gradlane.scheduling.priority.PriorityPolicy._extreme_masks` followed by
``LayerMagnitudePolicy``'s class assignment (the numpy formulation, kept as the reference that
``tests/unit/test_priority.py`` compares it with): the descending norm order with ties broken
by the lower chunk index (a stable sort of the negated norms, NaN ranked as +inf), the top
``n_prot`` chunks protected, the bottom ``n_drop`` droppable.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["layer_magnitude"]


@njit(cache=True, nogil=True)
def layer_magnitude(
    norms: np.ndarray, n_prot: int, n_drop: int, middle: int, last: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(prio, protected, droppable)`` of one transfer's chunks: class 0 for the ``n_prot``
    largest norms (protected), ``last`` for the ``n_drop`` smallest (droppable), ``middle`` for
    the rest. ``n_prot + n_drop <= len(norms)``; NaN counts as the largest norm."""
    n = norms.shape[0]
    neg = np.empty(n, dtype=np.float64)  # exact for float32 and float64 norms
    for i in range(n):
        v = norms[i]
        neg[i] = -np.inf if np.isnan(v) else -np.float64(v)
    order = np.argsort(neg, kind="mergesort")  # stable: equal norms stay in chunk order
    prio = np.full(n, middle, dtype=np.uint8)
    protected = np.zeros(n, dtype=np.bool_)
    droppable = np.zeros(n, dtype=np.bool_)
    for k in range(n_prot):
        c = order[k]
        protected[c] = True
        prio[c] = 0
    for k in range(n - n_drop, n):
        c = order[k]
        droppable[c] = True
        prio[c] = last
    return prio, protected, droppable
