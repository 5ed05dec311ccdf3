"""Priority classes: which chunks go first, which are protected, which may be lost.

Theory of operation
-------------------
Every chunk of a gradient bucket gets a *class* (0 = most urgent), and two flags:

* **protected** chunks must arrive before a collective may complete with loss (the loss policy
  waits for them until the hard deadline); they carry the largest part of the gradient's energy
  (top ``protected_fraction`` of chunks by L2 norm) or belong to a layer the user pinned;
* **droppable** chunks (bottom ``droppable_fraction`` by norm) are the ones a sender may skip
  when the loss budget allows and the ones the network should drop first (lowest DSCP class).

The class orders the sender's queue across all transfers in flight and picks the DSCP mark.
Layer position matters because the next forward pass consumes the *front* layer first
(P3, Jayarajan et al. MLSys'19; ByteScheduler, Peng et al. SOSP'19): finishing its bucket early
lets compute overlap the rest. Magnitude matters because SGD tolerates the loss of small
coordinates far better than large ones (gradient sparsification, e.g. Lin et al. ICLR'18).

Policies are pluggable: subclass :class:`PriorityPolicy`, decorate with
:func:`register_priority_policy`, and select it with ``PriorityConfig(policy=name)``.
Everything is vectorised over the chunks of one transfer; no per-chunk Python loops.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from gradlane.scheduling._kernels import priority as _pk
from gradlane.scheduling.errors import ConfigError

__all__ = [
    "Classes",
    "PriorityConfig",
    "PriorityPolicy",
    "make_priority_policy",
    "priority_policy_names",
    "register_priority_policy",
    "send_order_key",
]

MIN_CLASSES = 2
MAX_CLASSES = 8
MAX_DSCP = 63

# Bit layout of :func:`send_order_key` (int64, non-negative): class | layer position | chunk.
_CHUNK_BITS = 32
_POS_BITS = 24
_POS_SCALE = (1 << _POS_BITS) - 1

# Relative slack when turning a fraction into a count, so that e.g. 0.1 × 30 (which is
# 3.0000000000000004 in binary floating point) and 0.29 × 100 (28.999999999999996) both give
# the count a person would expect.
_COUNT_EPS = 1e-9


@dataclass(frozen=True)
class PriorityConfig:
    """Configuration of the priority classifier.

    Attributes:
        policy: registered name of the :class:`PriorityPolicy` (see
            :func:`priority_policy_names`).
        n_classes: number of priority classes, 2..8; class 0 is the most urgent.
        protected_fraction: fraction of a transfer's chunks (largest L2 norm first) that must
            arrive before a lossy completion; at least one chunk when > 0.
        droppable_fraction: fraction of chunks (smallest norm first) that a sender may skip and
            the network may drop first. Never overlaps the protected set.
        pinned_layers: layer indices whose buckets are always fully protected and sent in
            class 0 (for example the embedding, or a layer known to be sensitive); see
            :meth:`pins`. In the DDP hook a layer is a parameter's index in
            ``model.parameters()`` order (0: the first weight).
        dscp: DSCP code point per class (``len(dscp) == n_classes``), 0..63. The default maps
            class 0 to EF (46), then AF41 (34), AF31 (26) and CS1 (8, "lower effort").
    """

    policy: str = "layer+magnitude"
    n_classes: int = 4
    protected_fraction: float = 0.1
    droppable_fraction: float = 0.25
    pinned_layers: tuple[int, ...] = ()
    dscp: tuple[int, ...] = (46, 34, 26, 8)

    def __post_init__(self) -> None:
        if self.policy not in _POLICIES:
            raise ConfigError(
                f"priority policy {self.policy!r} is not registered; "
                f"valid names: {', '.join(priority_policy_names())}"
            )
        if not MIN_CLASSES <= self.n_classes <= MAX_CLASSES:
            raise ConfigError(
                f"n_classes must be in [{MIN_CLASSES}, {MAX_CLASSES}], got {self.n_classes}"
            )
        for name in ("protected_fraction", "droppable_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        if self.protected_fraction + self.droppable_fraction > 1.0 + _COUNT_EPS:
            raise ConfigError(
                "protected_fraction + droppable_fraction must be <= 1 "
                f"(got {self.protected_fraction} + {self.droppable_fraction}); "
                "a chunk cannot be both protected and droppable"
            )
        if len(self.dscp) != self.n_classes:
            raise ConfigError(
                f"dscp needs one code point per class: n_classes={self.n_classes} but "
                f"dscp has {len(self.dscp)} values {self.dscp}"
            )
        bad = [d for d in self.dscp if not 0 <= d <= MAX_DSCP]
        if bad:
            raise ConfigError(f"DSCP values must be in [0, {MAX_DSCP}], got {bad}")
        layers = self.pinned_layers
        if not isinstance(layers, tuple | list) or not all(
            isinstance(layer, int) and not isinstance(layer, bool) for layer in layers
        ):
            raise ConfigError(f"pinned_layers must be a tuple of layer indices, got {layers!r}")
        object.__setattr__(self, "pinned_layers", tuple(layers))  # a list is taken, kept hashable
        negative = [layer for layer in layers if layer < 0]
        if negative:
            raise ConfigError(f"pinned_layers must be non-negative layer indices, got {negative}")

    def tos(self, cls: int) -> int:
        """IP TOS byte for priority class ``cls``: its DSCP shifted past the two ECN bits."""
        if not 0 <= cls < self.n_classes:
            raise ValueError(f"class {cls} out of range [0, {self.n_classes})")
        return self.dscp[cls] << 2

    def tos_table(self) -> np.ndarray:
        """TOS byte per class as a ``uint8`` array, so a batch maps with ``table[prio]``."""
        return (np.asarray(self.dscp, dtype=np.uint8) << 2).astype(np.uint8)

    def pins(self, layers: Iterable[int]) -> bool:
        """True when a bucket holding ``layers`` (their indices) holds a pinned layer.

        Membership, not a range: a bucket's layers need not be contiguous. The integration
        passes the result as ``classify(..., pinned=...)`` (the DDP hook: ``submit(...,
        pinned=...)``, with a parameter's index in ``model.parameters()`` order as its layer).
        """
        pinned = self.pinned_layers
        return bool(pinned) and any(layer in pinned for layer in layers)


@dataclass(frozen=True, eq=False)
class Classes:
    """Per-chunk classification of one transfer (all arrays have one entry per chunk).

    Attributes:
        prio: ``uint8`` priority class, 0 = most urgent.
        protected: ``bool``, must arrive before a lossy completion.
        droppable: ``bool``, may be skipped by the sender within the loss budget.
    """

    prio: np.ndarray
    protected: np.ndarray
    droppable: np.ndarray

    def __len__(self) -> int:
        return int(self.prio.shape[0])


class PriorityPolicy(ABC):
    """Maps per-chunk norms and a bucket's layer position to :class:`Classes`.

    Subclasses implement :meth:`classify`; the constructor only stores the config.
    """

    def __init__(self, config: PriorityConfig) -> None:
        self.config = config

    @abstractmethod
    def classify(
        self, *, norms: np.ndarray, layer_position: float, pinned: bool = False
    ) -> Classes:
        """Classify the chunks of one transfer.

        Args:
            norms: per-chunk L2 norms (``float32``; any float dtype is accepted).
            layer_position: where the bucket sits in the model, in [0, 1]: 0 is the front
                layer (needed first by the next forward pass; in DDP the *highest* bucket
                index), 1 the last layer.
            pinned: the bucket holds a pinned layer: every chunk is protected, class 0.
        """

    def send_position(self, layer_position: float) -> float:
        """Where a transfer sorts among the transfers of its class in the sender's queue, and a
        collective among those waiting to start (lower first): its layer position, so a
        front-layer bucket, which the next forward pass needs first, preempts a back-layer
        one."""
        return layer_position

    # -- helpers shared by the built-in policies ------------------------------------------------

    def _pinned(self, n: int) -> Classes:
        """Every chunk protected and in class 0."""
        return Classes(
            prio=np.zeros(n, dtype=np.uint8),
            protected=np.ones(n, dtype=bool),
            droppable=np.zeros(n, dtype=bool),
        )

    def _extreme_sets(self, norms: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Magnitude rank and the protected / droppable masks of one transfer.

        Returns ``(rank, protected, droppable)`` where ``rank[i]`` is chunk ``i``'s position in
        descending norm order (0 = largest), ties broken by the lower chunk index first.
        """
        order, protected, droppable = self._extreme_masks(norms)
        rank = np.empty(order.shape[0], dtype=np.int64)
        rank[order] = np.arange(order.shape[0])
        return rank, protected, droppable

    def _extreme_masks(self, norms: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The descending norm order and the protected / droppable masks, marked through
        that order (policies that need no rank stop here: :meth:`_extreme_sets` adds it)."""
        n = norms.shape[0]
        order = _descending_order(norms)
        n_prot, n_drop = self._extreme_counts(n)
        protected = np.zeros(n, dtype=bool)
        protected[order[:n_prot]] = True
        droppable = np.zeros(n, dtype=bool)
        droppable[order[n - n_drop :]] = True
        return order, protected, droppable

    def _extreme_counts(self, n: int) -> tuple[int, int]:
        """How many of ``n`` chunks are protected (at least one) and droppable (never one that
        is protected)."""
        cfg = self.config
        n_prot = _count(cfg.protected_fraction, n, at_least_one=True)
        return n_prot, min(_count(cfg.droppable_fraction, n, at_least_one=False), n - n_prot)

    def _middle_band(self) -> tuple[int, int]:
        """Classes left for chunks that are neither protected nor droppable: 1..n_classes-2.

        With two or three classes the band collapses to class 1 (a middle chunk is then in the
        droppable chunks' class but is not itself droppable).
        """
        lo = 1
        return lo, max(lo, self.config.n_classes - 2)


_P = TypeVar("_P", bound=type[PriorityPolicy])
_POLICIES: dict[str, type[PriorityPolicy]] = {}


def register_priority_policy(name: str) -> Callable[[_P], _P]:
    """Class decorator registering a :class:`PriorityPolicy` under ``name``."""

    def decorate(cls: _P) -> _P:
        if name in _POLICIES:
            raise ConfigError(f"priority policy {name!r} is already registered")
        _POLICIES[name] = cls
        return cls

    return decorate


def priority_policy_names() -> list[str]:
    """Names of the registered priority policies, sorted."""
    return sorted(_POLICIES)


def make_priority_policy(config: PriorityConfig) -> PriorityPolicy:
    """Instantiate the policy named by ``config.policy``."""
    try:
        cls = _POLICIES[config.policy]
    except KeyError:
        raise ConfigError(
            f"priority policy {config.policy!r} is not registered; "
            f"valid names: {', '.join(priority_policy_names())}"
        ) from None
    return cls(config)


# -- built-in policies -------------------------------------------------------------------------


@register_priority_policy("layer+magnitude")
class LayerMagnitudePolicy(PriorityPolicy):
    """Default: protected (top norms) → class 0, droppable (bottom norms) → last class, the
    rest by layer position over classes 1..n-2 (front layer → class 1)."""

    def classify(
        self, *, norms: np.ndarray, layer_position: float, pinned: bool = False
    ) -> Classes:
        """See :meth:`PriorityPolicy.classify`."""
        arr = np.asarray(norms)
        if arr.ndim != 1:
            raise ValueError(f"norms must be 1-D (one per chunk), got shape {arr.shape}")
        if arr.dtype.kind != "f":
            arr = arr.astype(np.float32)
        pos = _check_position(layer_position)
        n = arr.shape[0]
        if pinned:
            return self._pinned(n)
        n_prot, n_drop = self._extreme_counts(n)
        lo, hi = self._middle_band()
        # One compiled call (NaN ranked largest there, as _as_norms does): the numpy
        # formulation, _extreme_masks and three assignments, is the reference the tests hold
        # it to, and costs a dozen small-array operations per transfer.
        prio, protected, droppable = _pk.layer_magnitude(
            arr, n_prot, n_drop, _position_class(pos, lo, hi), self.config.n_classes - 1
        )
        return Classes(prio=prio, protected=protected, droppable=droppable)


@register_priority_policy("layer")
class LayerPolicy(PriorityPolicy):
    """P3 / ByteScheduler: the class follows layer position alone, spread over all classes.

    Nothing is protected or droppable (unless the bucket is pinned), so with a loss bound > 0
    any chunk may be lost: use it with ``loss_bound = 0`` or as a baseline.
    """

    def classify(
        self, *, norms: np.ndarray, layer_position: float, pinned: bool = False
    ) -> Classes:
        """See :meth:`PriorityPolicy.classify`."""
        norms = _as_norms(norms)
        pos = _check_position(layer_position)
        n = norms.shape[0]
        if pinned:
            return self._pinned(n)
        cls = _position_class(pos, 0, self.config.n_classes - 1)
        return Classes(
            prio=np.full(n, cls, dtype=np.uint8),
            protected=np.zeros(n, dtype=bool),
            droppable=np.zeros(n, dtype=bool),
        )


@register_priority_policy("magnitude")
class MagnitudePolicy(PriorityPolicy):
    """Class by norm percentile alone: protected → 0, droppable → last class, the middle
    chunks in equal-count percentile bands over classes 1..n-2 (larger norm → lower class)."""

    def classify(
        self, *, norms: np.ndarray, layer_position: float, pinned: bool = False
    ) -> Classes:
        """See :meth:`PriorityPolicy.classify`."""
        norms = _as_norms(norms)
        _check_position(layer_position)
        n = norms.shape[0]
        if pinned:
            return self._pinned(n)
        rank, protected, droppable = self._extreme_sets(norms)
        lo, hi = self._middle_band()
        n_prot = int(protected.sum())
        n_mid = n - n_prot - int(droppable.sum())
        # Middle chunks occupy ranks n_prot .. n_prot+n_mid-1; cut them into equal bands.
        band = ((rank - n_prot) * (hi - lo + 1)) // max(n_mid, 1)
        prio = (lo + np.clip(band, 0, hi - lo)).astype(np.uint8)
        prio[protected] = 0
        prio[droppable] = self.config.n_classes - 1
        return Classes(prio=prio, protected=protected, droppable=droppable)


@register_priority_policy("flat")
class FlatPolicy(PriorityPolicy):
    """Baseline: every chunk in class 1, nothing protected or droppable (pinned still is), and
    transfers served in the order they start (no layer order): a transport without priority."""

    def send_position(self, layer_position: float) -> float:
        """0 for every transfer: the sender's queue falls back to start order (FIFO)."""
        return 0.0

    def classify(
        self, *, norms: np.ndarray, layer_position: float, pinned: bool = False
    ) -> Classes:
        """See :meth:`PriorityPolicy.classify`."""
        norms = _as_norms(norms)
        _check_position(layer_position)
        n = norms.shape[0]
        if pinned:
            return self._pinned(n)
        return Classes(
            prio=np.ones(n, dtype=np.uint8),
            protected=np.zeros(n, dtype=bool),
            droppable=np.zeros(n, dtype=bool),
        )


# -- send order ----------------------------------------------------------------------------------


def send_order_key(
    prio: np.ndarray, layer_position: float | np.ndarray, chunk_index: np.ndarray
) -> np.ndarray:
    """Sortable ``int64`` key merging the chunks of many transfers into one send order.

    Order: class first (0 first), then layer position (front, 0.0, first), then chunk index.
    ``layer_position`` is a scalar for one transfer or an array aligned with ``prio`` when the
    chunks of several transfers are concatenated. Positions are quantised to 24 bits; chunks that
    tie on the whole key keep their input order under ``np.argsort(key, kind="stable")``.
    """
    prio_a = np.asarray(prio)
    chunk_a = np.asarray(chunk_index)
    pos_a = np.asarray(layer_position, dtype=np.float64)
    if prio_a.size and (prio_a.min() < 0 or prio_a.max() >= MAX_CLASSES):
        raise ValueError(f"priority classes must be in [0, {MAX_CLASSES})")
    if chunk_a.size and (chunk_a.min() < 0 or chunk_a.max() >= (1 << _CHUNK_BITS)):
        raise ValueError("chunk indices must fit in 32 bits (the wire format's chunk field)")
    if pos_a.size and not (np.all(pos_a >= 0.0) and np.all(pos_a <= 1.0)):
        raise ValueError("layer_position must be in [0, 1]")
    qpos = np.rint(pos_a * _POS_SCALE).astype(np.int64)
    key = (prio_a.astype(np.int64) << (_POS_BITS + _CHUNK_BITS)) | (qpos << _CHUNK_BITS)
    return np.asarray(key | chunk_a.astype(np.int64), dtype=np.int64)


# -- private helpers -----------------------------------------------------------------------------


def _as_norms(norms: np.ndarray) -> np.ndarray:
    """1-D float array of norms; NaN counts as the largest norm.

    A NaN (or inf) norm means the chunk holds a diverged value; ranking it first keeps it
    protected rather than silently dropping the evidence of a divergence.
    """
    arr = np.asarray(norms)
    if arr.ndim != 1:
        raise ValueError(f"norms must be 1-D (one per chunk), got shape {arr.shape}")
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float32)
    # One reduction decides the common case: a sum is finite only if every norm is (an
    # overflowing sum of finite norms just takes the exact path below, which changes nothing).
    if not np.isfinite(arr.sum()):
        arr = np.where(np.isnan(arr), np.inf, arr)
    return arr


def _check_position(layer_position: float) -> float:
    pos = float(layer_position)
    if not 0.0 <= pos <= 1.0:  # also rejects NaN
        raise ValueError(f"layer_position must be in [0, 1], got {layer_position}")
    return pos


def _position_class(pos: float, lo: int, hi: int) -> int:
    """Equal-width bands of [0, 1] over classes lo..hi; position 1.0 falls in the last band."""
    return min(hi, lo + int(pos * (hi - lo + 1)))


def _count(fraction: float, n: int, *, at_least_one: bool) -> int:
    if fraction <= 0.0 or n == 0:
        return 0
    k = math.floor(fraction * n * (1.0 + _COUNT_EPS))
    return min(n, max(1, k) if at_least_one else k)


def _descending_order(norms: np.ndarray) -> np.ndarray:
    """Chunks in descending norm order, ties → lower chunk index first."""
    # A stable sort keeps equal norms in chunk order: the order is total and deterministic.
    # Negation is exact in the norms' own float type (inf → -inf), so no widening copy.
    return np.argsort(-norms, kind="stable")
