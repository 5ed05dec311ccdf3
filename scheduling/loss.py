"""Loss budget and deadlines: when may a receiving transfer stop waiting?

Theory of operation
-------------------
A receiving transfer (one phase of one shard at one rank) expects chunks from several senders.
After every change it asks :meth:`LossPolicy.decide`, which answers with a :class:`Verdict`:

1. **Everything arrived** → ``COMPLETE``, whatever the time. This is the only way to complete
   with ``loss_bound == 0`` before the hard deadline, so a bound of 0 is an exact all-reduce.
2. **Before the soft deadline** (``started + soft_deadline(gather)``) → ``CONTINUE`` and every
   missing chunk is needed: on a clean network nothing is ever given up.
3. **After the soft deadline** → ``COMPLETE`` when, for *every sender separately*,
   ``missing elements / expected elements <= bound`` (the phase's bound), no protected chunk is
   missing, and the receiver knows the sender's protected set (it cannot prove that nothing
   protected is missing otherwise). Fairness per sender matters: a bound over the sum would let
   one slow sender lose everything while the others delivered all.
   Otherwise ``CONTINUE``, and ``need`` lists what to ask for: every missing protected chunk,
   every missing chunk of a sender whose protected set is unknown, and, per sender, the most
   important missing chunks whose recovery brings that sender within its bound.
4. **At or after the hard deadline** (``started + hard_deadline_s``), unless step 1 or 3
   completes: ``COMPLETE_DEGRADED`` (complete with what arrived, report the loss) when
   ``on_hard_deadline == "degrade"``, else ``FAIL``.

The gather phase has its own, stricter bound (by default half the reduce bound): a chunk lost in
the reduce phase is filled with an unbiased average of the contributors that did arrive, but a
chunk lost in the gather phase leaves the rank's own stale value in place.

The soft deadline adapts like a retransmission timeout (RFC 6298): an EWMA of recent *clean*
completion durations plus ``k`` times the EWMA of their absolute deviation, clamped to
``[soft_deadline_min_s, soft_deadline_max_s]``. A clean completion ended because its data arrived
(or its senders gave the rest up within the bound), not because a deadline fired: one that ended
at the deadline would drag the estimate down onto itself. Reduce and gather phases keep
separate estimates because their transfers differ in fan-in and size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

import numpy as np
from gradlane.scheduling._kernels import loss as _lk
from gradlane.scheduling.errors import ConfigError

__all__ = ["Decision", "LossConfig", "LossPolicy", "Verdict"]

MAX_LOSS_BOUND = 0.5
_HARD_DEADLINE_ACTIONS = ("degrade", "raise")
# Class used to order the missing chunks of a sender whose classes the receiver does not know
# yet: treat them as urgent, since asking for them early is also how the receiver learns them.
_UNKNOWN_CLASS = 0
_NO_NEED = np.empty((0, 2), dtype=np.int64)
_NO_NEED.flags.writeable = False


@dataclass(frozen=True)
class LossConfig:
    """Configuration of the loss budget and deadlines of receiving transfers.

    Attributes:
        loss_bound: fraction of a sender's elements a receiver may miss in the reduce phase,
            in [0, 0.5]. 0 is fully reliable (an exact all-reduce).
        gather_loss_bound: the same for the gather phase; None → ``loss_bound / 2``, because a
            gathered chunk that never comes leaves a stale value rather than an unbiased one.
        soft_deadline_min_s: lower clamp of the adaptive soft deadline (seconds).
        soft_deadline_max_s: upper clamp; also the soft deadline before any history.
        soft_deadline_k: weight of the deviation term. 1 aims at a typical completion, not a
            worst case: the deadline exists to cut stragglers. (RFC 6298 uses 4 for a timeout
            that must not fire early; here a generous deadline feeds on itself — a later
            deadline lets senders skip fewer late droppable chunks, steps take longer, and the
            learned deadline grows — and the tail step time grows with it.)
        ewma_alpha: weight of a new sample in the duration EWMA (RFC 6298: 1/8).
        ewma_beta: weight of a new sample in the deviation EWMA (RFC 6298: 1/4).
        hard_deadline_s: after this long a transfer completes degraded or fails.
        on_hard_deadline: ``"raise"`` (the default: fail the transfer, the transport raises
            ``PeerTimeout``; never hand back partial data unasked, and with ``loss_bound = 0``
            the only reading of "reliable") or ``"degrade"`` (complete with what arrived and
            report it, for jobs that prefer progress over exactness).
    """

    loss_bound: float = 0.0
    gather_loss_bound: float | None = None
    soft_deadline_min_s: float = 0.002
    soft_deadline_max_s: float = 0.5
    soft_deadline_k: float = 1.0
    ewma_alpha: float = 0.125
    ewma_beta: float = 0.25
    hard_deadline_s: float = 5.0
    on_hard_deadline: Literal["degrade", "raise"] = "raise"

    def __post_init__(self) -> None:
        for name in ("loss_bound", "gather_loss_bound"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= MAX_LOSS_BOUND:
                raise ConfigError(
                    f"{name} must be in [0, {MAX_LOSS_BOUND}] (a fraction of elements), got {value}"
                )
        if not 0.0 < self.soft_deadline_min_s <= self.soft_deadline_max_s <= self.hard_deadline_s:
            raise ConfigError(
                "deadlines must satisfy 0 < soft_deadline_min_s <= soft_deadline_max_s <= "
                f"hard_deadline_s, got {self.soft_deadline_min_s}, {self.soft_deadline_max_s}, "
                f"{self.hard_deadline_s}"
            )
        if not math.isfinite(self.hard_deadline_s):
            raise ConfigError(f"hard_deadline_s must be finite, got {self.hard_deadline_s}")
        if not 0.0 <= self.soft_deadline_k < math.inf:
            raise ConfigError(f"soft_deadline_k must be >= 0, got {self.soft_deadline_k}")
        for name in ("ewma_alpha", "ewma_beta"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")
        if self.on_hard_deadline not in _HARD_DEADLINE_ACTIONS:
            raise ConfigError(
                f"on_hard_deadline must be one of {', '.join(_HARD_DEADLINE_ACTIONS)}, "
                f"got {self.on_hard_deadline!r}"
            )

    def bound(self, gather: bool) -> float:
        """The loss bound of a phase (reduce when ``gather`` is False)."""
        if not gather:
            return self.loss_bound
        if self.gather_loss_bound is None:
            return self.loss_bound / 2.0
        return self.gather_loss_bound


class Decision(IntEnum):
    """What a receiving transfer should do now."""

    CONTINUE = 0
    """Keep waiting; ask for the chunks in :attr:`Verdict.need`."""
    COMPLETE = 1
    """Done: everything arrived, or what is missing is within the bound and unprotected."""
    COMPLETE_DEGRADED = 2
    """Hard deadline reached with policy ``degrade``: complete with what arrived, report loss."""
    FAIL = 3
    """Hard deadline reached with policy ``raise``."""


@dataclass(frozen=True, eq=False)
class Verdict:
    """Answer of :meth:`LossPolicy.decide`.

    Attributes:
        decision: the :class:`Decision`.
        need: ``int64`` array of shape ``(k, 2)``, rows ``(sender index, chunk)`` the receiver
            still needs, most important first: protected chunks, then by class (unknown classes
            count as class 0), then chunk index, then sender index. Empty unless ``CONTINUE``.
        missing_fraction: ``float64`` per sender, missing elements over expected elements
            (0 for a sender that owes nothing).
        missing_elems: ``int64`` per sender, elements not received.
        expected_elems: ``int64`` per sender, elements expected.
        next_deadline: absolute time at which the decision may change without a packet
            arriving (soft deadline, then hard deadline); ``inf`` once complete or failed.
    """

    decision: Decision
    need: np.ndarray
    missing_fraction: np.ndarray
    missing_elems: np.ndarray
    expected_elems: np.ndarray
    next_deadline: float

    @property
    def done(self) -> bool:
        """True for every decision but ``CONTINUE``."""
        return self.decision != Decision.CONTINUE


class LossPolicy:
    """Decides completion of receiving transfers and keeps the adaptive soft deadlines.

    One instance serves every transfer of a rank: the soft-deadline estimate is shared (per
    phase) across buckets and steps, which is what makes it adapt.
    """

    def __init__(self, config: LossConfig | None = None) -> None:
        self.config = config if config is not None else LossConfig()
        # Per phase (index 0 = reduce, 1 = gather): smoothed duration and mean deviation;
        # NaN until the first clean completion. Python floats, not NumPy arrays: receivers ask
        # for their deadlines dozens of times per rank and lossy collective, and NumPy scalar
        # arithmetic is several times slower than float arithmetic on the same IEEE doubles.
        self._srtt = [math.nan, math.nan]
        self._rttvar = [math.nan, math.nan]
        # Per phase: smoothed size (elements) of the transfers those durations come from.
        self._mean_elems = [math.nan, math.nan]
        # budget_elems per (gather, expected elements): every transfer start and receiver check
        # asks, for the few sizes a job's buckets have (kept bounded by _BUDGETS_KEPT).
        self._budgets: dict[tuple[bool, int], int] = {}

    # -- soft deadline ----------------------------------------------------------------------------

    def soft_deadline(self, gather: bool, elems: int | None = None) -> float:
        """Soft deadline of a phase in seconds after a transfer's start.

        ``elems``, the size of the transfer asking, scales the learned deadline up when it is
        larger than the transfers it was learned from (a 100 MB bucket takes longer than the
        25 MB ones before it, and NACKing it early only resends what is still queued); never
        down, since small transfers are bound by latency, not size.
        """
        return self._deadline(gather, elems, self.config.soft_deadline_k)

    def nack_deadline(self, gather: bool, elems: int | None = None) -> float:
        """When a receiver starts asking for what is missing (NACK), in seconds after start.

        With a loss bound, at the soft deadline: that is when it decides. A reliable phase
        (bound 0) cannot complete without the data, so a NACK there only helps once the data is
        surely late: RFC 6298's four deviations (not the soft deadline's k) — an earlier NACK
        re-sends packets that are still queued on their way.
        """
        cfg = self.config
        k = cfg.soft_deadline_k if cfg.bound(gather) > 0 else max(cfg.soft_deadline_k, 4.0)
        return self._deadline(gather, elems, k)

    def _deadline(self, gather: bool, elems: int | None, k: float) -> float:
        """Learned duration + ``k`` deviations, scaled up for a larger transfer, clamped."""
        cfg = self.config
        p = int(gather)
        if math.isnan(self._srtt[p]):
            return cfg.soft_deadline_max_s
        value = float(self._srtt[p] + k * self._rttvar[p])
        mean = self._mean_elems[p]
        if elems is not None and mean > 0.0:
            value *= max(1.0, elems / mean)
        return min(cfg.soft_deadline_max_s, max(cfg.soft_deadline_min_s, value))

    def record(
        self, *, gather: bool, duration: float, clean: bool, elems: int | None = None
    ) -> None:
        """Feed one completed transfer's duration (and size, in elements); only clean
        completions count.

        A completion is *clean* when it ended because its data arrived (or its senders declared
        the rest given up within the bound), not because a deadline fired: with a loss bound,
        most completions miss a few droppable chunks yet say how long a normal step takes.
        """
        if not duration >= 0.0 or not math.isfinite(duration):
            raise ValueError(f"duration must be a finite number >= 0, got {duration}")
        if not clean:
            return
        cfg = self.config
        p = int(gather)
        if elems is not None and elems > 0:
            mean = self._mean_elems[p]
            self._mean_elems[p] = (
                elems
                if math.isnan(mean)
                else (1.0 - cfg.ewma_alpha) * mean + cfg.ewma_alpha * elems
            )
        if math.isnan(self._srtt[p]):
            self._srtt[p] = duration
            self._rttvar[p] = duration / 2.0
            return
        # RFC 6298 §2.3: update the deviation with the old mean first.
        self._rttvar[p] = (1.0 - cfg.ewma_beta) * self._rttvar[p] + cfg.ewma_beta * abs(
            self._srtt[p] - duration
        )
        self._srtt[p] = (1.0 - cfg.ewma_alpha) * self._srtt[p] + cfg.ewma_alpha * duration

    # -- budget -------------------------------------------------------------------------------

    def budget_elems(self, *, gather: bool, expected_elems: int) -> int:
        """Elements one sender may lose toward one receiver: the largest ``m`` with
        ``m / expected_elems <= bound``. The sender uses it to decide how many droppable chunks
        it may skip; the receiver uses the same number to decide completion."""
        if expected_elems < 0:
            raise ValueError(f"expected_elems must be >= 0, got {expected_elems}")
        key = (bool(gather), int(expected_elems))
        m = self._budgets.get(key)
        if m is None:  # remembered: NumPy on a one-element array costs far more than a lookup
            if len(self._budgets) >= _BUDGETS_KEPT:
                self._budgets.clear()
            m = self._budgets[key] = int(_budget(self.config.bound(gather), np.array([key[1]]))[0])
        return m

    # -- decision -------------------------------------------------------------------------------

    def decide(
        self,
        *,
        gather: bool,
        received: Sequence[np.ndarray],
        chunk_elems: Sequence[np.ndarray],
        protected: Sequence[np.ndarray | None],
        prio: Sequence[np.ndarray | None],
        started: float,
        now: float,
    ) -> Verdict:
        """Decide a receiving transfer (see the module's theory of operation).

        Args:
            gather: True for the gather phase (its bound applies), False for reduce.
            received: per sender, ``bool`` per chunk.
            chunk_elems: per sender, elements per chunk (>= 1; the last chunk may be short).
            protected: per sender, ``bool`` per chunk, or None while the receiver does not
                know that sender's protected set.
            prio: per sender, priority class per chunk, or None when unknown.
            started: time the transfer started (seconds, same clock as ``now``).
            now: current time.
        """
        n = len(received)
        if not len(chunk_elems) == len(protected) == len(prio) == n:
            raise ValueError(
                "received, chunk_elems, protected and prio need one entry per sender; got "
                f"{len(received)}, {len(chunk_elems)}, {len(protected)}, {len(prio)}"
            )
        cfg = self.config
        f = _Flat.build(received, chunk_elems, protected, prio)
        frac = np.divide(
            f.missing_elems, f.expected_elems, out=np.zeros(n), where=f.expected_elems > 0
        )

        def verdict(decision: Decision, need: np.ndarray, next_deadline: float) -> Verdict:
            return Verdict(decision, need, frac, f.missing_elems, f.expected_elems, next_deadline)

        done_need = np.empty((0, 2), dtype=np.int64)
        if not f.missing.any():
            return verdict(Decision.COMPLETE, done_need, math.inf)

        elapsed = now - started
        soft = self.soft_deadline(gather, int(f.expected_elems.sum()))
        if elapsed < soft:
            return verdict(Decision.CONTINUE, f.need(f.missing), started + soft)

        budget = _budget(cfg.bound(gather), f.expected_elems)
        # A sender that delivered everything proves nothing is missing, known set or not.
        blocked = (f.n_missing > 0) & (~f.known | (f.protected_missing > 0))
        if not blocked.any() and bool(np.all(f.missing_elems <= budget)):
            return verdict(Decision.COMPLETE, done_need, math.inf)
        if elapsed >= cfg.hard_deadline_s:
            decision = (
                Decision.COMPLETE_DEGRADED if cfg.on_hard_deadline == "degrade" else Decision.FAIL
            )
            return verdict(decision, done_need, math.inf)
        return verdict(Decision.CONTINUE, f.need(f.needed(budget)), started + cfg.hard_deadline_s)

    def decide_rows(
        self,
        *,
        gather: bool,
        received: np.ndarray,
        counts: np.ndarray,
        protected: np.ndarray,
        known: np.ndarray,
        started: float,
        now: float,
    ) -> Verdict:
        """:meth:`decide` for senders that all send the same chunks — a receiver's matrices.

        ``received`` and ``protected`` are (senders, chunks), nonzero/True where the chunk came
        or is protected; ``counts`` the elements of each chunk (>= 1); ``known`` per sender,
        whether its protected set is known (its ``protected`` row is ignored otherwise). Same
        verdict as :meth:`decide` given the rows as lists and no classes (a receiver knows
        none), computed by compiled passes
        (:mod:`gradlane.scheduling._kernels.loss`) instead of ~60 NumPy calls: a lossy receiver asks
        several times per collective.
        """
        n_src, n = received.shape
        if counts.shape != (n,) or protected.shape != (n_src, n) or known.shape != (n_src,):
            raise ValueError(
                f"received {received.shape}: counts, protected and known must be ({n},), "
                f"({n_src}, {n}) and ({n_src},); got {counts.shape}, {protected.shape}, "
                f"{known.shape}"
            )
        missing_elems, expected, frac, n_missing, blocked, worst = _lk.tally(
            received, counts, protected, known
        )

        def verdict(decision: Decision, need: np.ndarray, next_deadline: float) -> Verdict:
            return Verdict(decision, need, frac, missing_elems, expected, next_deadline)

        if not n_missing:
            return verdict(Decision.COMPLETE, _NO_NEED, math.inf)
        cfg = self.config
        elapsed = now - started
        per_sender = int(expected[0])
        soft = self.soft_deadline(gather, per_sender * n_src)
        if elapsed < soft:
            need = _lk.need_rows(received, counts, protected, known, 0, True)
            return verdict(Decision.CONTINUE, need, started + soft)
        # Every sender expects the same elements, so one budget serves all (remembered).
        budget = self.budget_elems(gather=gather, expected_elems=per_sender)
        if not blocked and worst <= budget:
            return verdict(Decision.COMPLETE, _NO_NEED, math.inf)
        if elapsed >= cfg.hard_deadline_s:
            decision = (
                Decision.COMPLETE_DEGRADED if cfg.on_hard_deadline == "degrade" else Decision.FAIL
            )
            return verdict(decision, _NO_NEED, math.inf)
        need = _lk.need_rows(received, counts, protected, known, budget, False)
        return verdict(Decision.CONTINUE, need, started + cfg.hard_deadline_s)


# -- private helpers -----------------------------------------------------------------------------


#: Most (phase, size) budgets a policy remembers (a job has a few bucket sizes).
_BUDGETS_KEPT = 1024


def _budget(bound: float, expected: np.ndarray) -> np.ndarray:
    """Largest integer ``m`` per entry with ``m / expected <= bound`` in float arithmetic.

    ``floor(bound × expected)`` alone disagrees with the fraction test at float rounding edges
    (0.29 × 100 = 28.999999999999996); one correction step each way makes both agree.
    """
    exp = expected.astype(np.int64)
    m = np.floor(bound * exp).astype(np.int64)
    safe = np.maximum(exp, 1)
    m += ((m + 1) / safe <= bound) & (m + 1 <= exp)
    m -= (m > 0) & (m / safe > bound)
    return np.asarray(m, dtype=np.int64)


@dataclass
class _Flat:
    """All senders' chunks concatenated into flat arrays, so the decision is a handful of
    vector operations however many senders there are (hundreds at scale)."""

    n: int
    sid: np.ndarray  # int64 sender index per chunk
    chunk: np.ndarray  # int64 chunk index within its sender
    elems: np.ndarray  # int64 elements per chunk
    missing: np.ndarray  # bool per chunk
    protected: np.ndarray  # bool per chunk (False where the sender's set is unknown)
    prio: np.ndarray  # int64 per chunk (unknown → _UNKNOWN_CLASS)
    known: np.ndarray  # bool per sender: protected set known
    n_missing: np.ndarray  # int64 per sender
    missing_elems: np.ndarray  # int64 per sender
    expected_elems: np.ndarray  # int64 per sender
    protected_missing: np.ndarray  # int64 per sender

    @classmethod
    def build(
        cls,
        received: Sequence[np.ndarray],
        chunk_elems: Sequence[np.ndarray],
        protected: Sequence[np.ndarray | None],
        prio: Sequence[np.ndarray | None],
    ) -> _Flat:
        n = len(received)
        rec = [np.asarray(r, dtype=bool) for r in received]
        for i, r in enumerate(rec):
            if r.ndim != 1:
                raise ValueError(f"sender {i}: received must be 1-D, got shape {r.shape}")
            for name, arr in (("chunk_elems", chunk_elems[i]), ("protected", protected[i]),
                              ("prio", prio[i])):  # fmt: skip
                if arr is not None and np.shape(arr) != r.shape:
                    raise ValueError(
                        f"sender {i}: {name} has shape {np.shape(arr)}, received has {r.shape}"
                    )
        lengths = np.array([r.shape[0] for r in rec], dtype=np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        total = int(ends[-1]) if n else 0
        sid = np.repeat(np.arange(n, dtype=np.int64), lengths)
        chunk = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
        elems = _cat([np.asarray(e, dtype=np.int64) for e in chunk_elems], np.int64)
        if elems.size and elems.min() < 1:
            bad = int(sid[np.argmin(elems)])
            raise ValueError(f"sender {bad}: every chunk holds at least one element")
        missing = ~_cat(rec, bool)
        known = np.array([p is not None for p in protected], dtype=bool)
        # Unknown protected sets read as "nothing protected" and unknown classes as
        # _UNKNOWN_CLASS; only the known ones are copied in.
        prot = np.zeros(total, dtype=bool)
        cls_ = np.full(total, _UNKNOWN_CLASS, dtype=np.int64)
        for i, (p_i, c_i) in enumerate(zip(protected, prio, strict=True)):
            if p_i is not None:
                prot[starts[i] : ends[i]] = p_i
            if c_i is not None:
                cls_[starts[i] : ends[i]] = c_i

        def per_sender(values: np.ndarray) -> np.ndarray:
            # Senders' chunks are contiguous: segment sums from one exact integer cumsum.
            c = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
            return np.asarray(c[ends] - c[starts], dtype=np.int64)

        return cls(
            n=n,
            sid=sid,
            chunk=chunk,
            elems=elems,
            missing=missing,
            protected=prot,
            prio=cls_,
            known=known,
            n_missing=per_sender(missing),
            missing_elems=per_sender(np.where(missing, elems, 0)),
            expected_elems=per_sender(elems),
            protected_missing=per_sender(missing & prot),
        )

    def needed(self, budget: np.ndarray) -> np.ndarray:
        """Mask of the missing chunks to ask for so every sender can satisfy its bound.

        Every missing protected chunk; every missing chunk of a sender whose protected set is
        unknown (any of them may be protected); and per known sender, the shortest prefix of its
        other missing chunks, most important first (class, then chunk index), whose recovery
        brings it within its budget.
        """
        unknown = ~self.known[self.sid]
        take = self.missing & (self.protected | unknown)
        prot_elems = np.where(self.missing & self.protected, self.elems, 0)
        prot_missing_elems = np.bincount(self.sid, weights=prot_elems, minlength=self.n)
        excess = self.missing_elems - prot_missing_elems - budget  # per sender
        cand = np.flatnonzero(self.missing & ~self.protected & ~unknown)
        cand = cand[excess[self.sid[cand]] > 0]
        if cand.size:
            # Sort by sender, then importance; cumulative elements within each sender's group.
            cand = cand[np.lexsort((self.chunk[cand], self.prio[cand], self.sid[cand]))]
            sid = self.sid[cand]
            cum = np.cumsum(self.elems[cand])
            first = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
            group_base = np.repeat(
                cum[first] - self.elems[cand][first], np.diff(np.r_[first, sid.size])
            )
            before = cum - group_base - self.elems[cand]  # elements recovered before this chunk
            take[cand[before < excess[sid]]] = True
        return take

    def need(self, mask: np.ndarray) -> np.ndarray:
        """``(k, 2)`` rows (sender, chunk) of the masked chunks, most important first."""
        idx = np.flatnonzero(mask)
        # lexsort: the last key is the primary one.
        idx = idx[
            np.lexsort((self.sid[idx], self.chunk[idx], self.prio[idx], ~self.protected[idx]))
        ]
        return np.stack([self.sid[idx], self.chunk[idx]], axis=1).astype(np.int64)


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
