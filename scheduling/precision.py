"""Wire precision: which format each chunk of a float32 shard travels in, and how much to round.

Theory of operation
-------------------
Every DATA chunk of a float32 gradient shard may travel as float32 (:data:`F32`, 4 bytes per
element), bfloat16 (:data:`BF16`, 2 bytes: float32's exponent, 8 bits of mantissa) or an 8-bit
float (:data:`E4M3`, 1 byte, OCP FP8 E4M3FN times a per-chunk float32 scale). When a transfer
starts, its :class:`PrecisionPolicy` answers one format code per chunk
(:meth:`PrecisionPolicy.formats`); the transport encodes, and the receiver widens back to
float32 as it reduces or places. Three rules hold for every built-in policy:

* a chunk whose norm is not finite (NaN or inf: a diverged value) travels float32 — E4M3 has no
  infinities, and rounding a chunk that holds a NaN saves bytes of a value that is lost anyway;
  sent as it is, the divergence reaches every rank unchanged;
* with ``protect``, protected chunks (the largest norms, or a pinned layer:
  :mod:`gradlane.scheduling.priority`) travel float32: they carry most of the gradient's energy,
  and it is their error that would dominate the step's;
* an all-zero chunk (norm 0) rounds exactly in every format, so it may take the smallest one
  the policy allows (the adaptive policy ranks it first).

**Fixed policies.** ``f32`` (the default) sends everything as float32: bit-for-bit the sums of a
transport without this module, and :attr:`PrecisionPolicy.lossy` is False so the transport
keeps its zero-copy path. ``bf16`` and ``e4m3`` send every eligible chunk in that format.

**The adaptive policy** holds a *level* in ``[0, MAX_LEVEL]``. Its eligible chunks are ranked
by norm, smallest first (ties: lower chunk index first); the first ``min(level, 1)`` of them
(as a share of the eligible chunks, rounded half up) travel bf16, and of those the first
``max(level - 1, 0)`` travel E4M3 instead. Level 0 is all float32, 1 all eligible chunks bf16,
2 all of them E4M3; raising the level never makes any chunk's format larger. Small chunks go
first because a chunk's rounding error is proportional to its norm: for a given number of bytes
saved, rounding the smallest chunks costs the least relative error.

**The adaptive amount** (:class:`AdaptiveController`) is moved once per training step, from
what the step measured: the share of the step the trainer spent waiting for communication
(*exposed* communication) and the relative error of what the rank sent,
``sqrt(Σ err² / Σ x²)`` over all its chunks, rounded or not (:func:`relative_error`):

====================================  ================================================
condition (first that holds)          level
====================================  ================================================
``rel_error > error_bound``           down by :data:`DOWN_STEP` (0.5)
``exposed share > exposed_min``       up by :data:`UP_STEP` (0.25)
otherwise (communication is hidden)   down by :data:`HIDDEN_STEP` (0.125)
====================================  ================================================

then clamped to ``[0, MAX_LEVEL]``. This is TCP's additive increase / multiplicative decrease
read for precision: while communication shows in the step time, fewer bytes buy time, so the
level climbs in small steps; an error over the bound is the one signal that must be obeyed at
once, so the level backs off by twice the increase (a whole format's worth in two steps); and
once communication is hidden, precision is free to take back, so the level releases slowly,
by half an increase, and settles where communication is just hidden. Every step is a binary
fraction, so levels are exact and the same inputs give the same levels everywhere.

``error_feedback`` (:class:`PrecisionConfig`) is the transport's: what a rank's rounding removed
from its contribution is added to its next contribution to the same bucket (error-feedback SGD:
Seide et al. 2014; Karimireddy et al. ICML'19), so rounding delays gradient mass rather than
losing it. The policies here only choose formats.

Policies are pluggable: subclass :class:`PrecisionPolicy`, decorate with
:func:`register_precision_policy`, and select it with ``PrecisionConfig(policy=name)``. A
policy's answer reaches compiled encoders: the transport passes it through
:func:`check_formats`. Everything is vectorised over the chunks of one transfer.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, TypeVar

import numpy as np
from gradlane.scheduling.errors import ConfigError

__all__ = [
    "BF16",
    "BYTES",
    "DOWN_STEP",
    "E4M3",
    "F32",
    "HIDDEN_STEP",
    "HISTORY_LEN",
    "MAX_LEVEL",
    "UP_STEP",
    "AdaptiveController",
    "AdaptivePolicy",
    "LevelSample",
    "PrecisionConfig",
    "PrecisionPolicy",
    "check_formats",
    "make_precision_policy",
    "precision_policy_names",
    "register_precision_policy",
    "relative_error",
    "wire_bytes",
]

#: float32: the wire's dtype code (``gradlane.transport.wire.header.DType.F32``), 4 bytes.
F32 = 0
#: bfloat16: the wire's dtype code (``DType.BF16``), 2 bytes per element.
BF16 = 2
#: 8-bit float E4M3 with a per-chunk scale: the wire's dtype code (``DType.E4M3``), 1 byte.
E4M3 = 3
#: Bytes per element of each format a float32 chunk may travel in, by code (read-only).
BYTES: Mapping[int, int] = MappingProxyType({F32: 4, BF16: 2, E4M3: 1})

#: Highest adaptive level: 0 all float32, 1 all eligible chunks bf16, 2 all of them E4M3.
MAX_LEVEL = 2.0
#: Level increase after a step whose communication was exposed.
UP_STEP = 0.25
#: Level decrease after a step whose relative error exceeded the bound.
DOWN_STEP = 0.5
#: Level decrease after a step whose communication was hidden.
HIDDEN_STEP = 0.125
#: Updates an :class:`AdaptiveController` keeps in its :attr:`~AdaptiveController.history`.
HISTORY_LEN = 10_000

# Bytes per element indexed by code (0 where a code is not a valid format): one gather maps a
# whole array of codes, and a zero marks the invalid ones for the checks.
_ITEMSIZE = np.zeros(256, dtype=np.int64)
for _code, _size in BYTES.items():
    _ITEMSIZE[_code] = _size
_ITEMSIZE.flags.writeable = False

# Relative slack when turning a share into a count, so that e.g. 0.15 × 10 (1.4999999999999998
# in binary floating point) rounds half up to the 2 a person would expect.
_COUNT_EPS = 1e-9


@dataclass(frozen=True)
class PrecisionConfig:
    """Configuration of the wire precision of float32 shards.

    Attributes:
        policy: registered name of the :class:`PrecisionPolicy` (see
            :func:`precision_policy_names`): ``"f32"`` (the default: everything float32,
            bit-exact), ``"bf16"``, ``"e4m3"`` (fixed formats) or ``"adaptive"``.
        protect: protected chunks always travel float32.
        error_bound: adaptive only: the bound on a step's relative error,
            ``sqrt(Σ err² / Σ x²)`` over all the chunks a rank sent in the step, rounded or
            not; in (0, 1]. A step above it lowers the level.
        error_feedback: what a rank's rounding removed is added to its next step's
            contribution to the same bucket (carried out by the transport).
        exposed_min: adaptive only: the share of a step's duration that exposed communication
            must exceed for the level to go up; in [0, 1).
        initial_level: adaptive only: the level before the first step, in [0, MAX_LEVEL].
    """

    policy: str = "f32"
    protect: bool = True
    error_bound: float = 0.05
    error_feedback: bool = True
    exposed_min: float = 0.1
    initial_level: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or self.policy not in _POLICIES:
            raise ConfigError(
                f"precision policy {self.policy!r} is not registered; "
                f"valid names: {', '.join(precision_policy_names())}"
            )
        for name in ("protect", "error_feedback"):
            value = getattr(self, name)
            if not isinstance(value, bool | np.bool_):
                raise ConfigError(f"{name} must be a boolean (true or false), got {value!r}")
            object.__setattr__(self, name, bool(value))
        for name in ("error_bound", "exposed_min", "initial_level"):
            value = getattr(self, name)
            if not _is_real(value):
                raise ConfigError(f"{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))  # an int from TOML is taken
        if not 0.0 < self.error_bound <= 1.0:  # also rejects NaN
            raise ConfigError(
                f"error_bound must be in (0, 1] (a relative error), got {self.error_bound}"
            )
        if not 0.0 <= self.exposed_min < 1.0:
            raise ConfigError(
                f"exposed_min must be in [0, 1) (a share of the step), got {self.exposed_min}"
            )
        if not 0.0 <= self.initial_level <= MAX_LEVEL:
            raise ConfigError(
                f"initial_level must be in [0, {MAX_LEVEL}] (0: all float32, 1: bf16, 2: e4m3), "
                f"got {self.initial_level}"
            )


class PrecisionPolicy(ABC):
    """Picks the wire format of each chunk of a float32 transfer.

    Subclasses implement :meth:`formats`; the constructor only stores the config. A policy that
    only ever answers :data:`F32` says so with :attr:`lossy` (the transport then skips encoding).
    """

    def __init__(self, config: PrecisionConfig) -> None:
        self.config = config

    @property
    def lossy(self) -> bool:
        """Whether this policy may ever choose a format other than :data:`F32`. When False,
        the transport keeps its zero-copy float32 path and never asks :meth:`formats`."""
        return True

    @abstractmethod
    def formats(
        self, *, norms: np.ndarray, protected: np.ndarray, droppable: np.ndarray, gather: bool
    ) -> np.ndarray:
        """The format code of each chunk of one transfer.

        Args:
            norms: per-chunk L2 norms (``float32``; any float dtype is accepted), >= 0 or not
                finite.
            protected: ``bool`` per chunk: must arrive before a lossy completion.
            droppable: ``bool`` per chunk: may be skipped within the loss budget.
            gather: True for the gather phase (sums travel), False for the reduce phase. The
                built-in policies treat both alike: the error bound covers both phases'
                rounding of what a rank sends.

        Returns:
            ``uint8`` array of shape ``(len(norms),)`` with values in {F32, BF16, E4M3}.
        """

    # -- helpers shared by the built-in policies ------------------------------------------------

    def _eligible(
        self, norms: np.ndarray, protected: np.ndarray, droppable: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Checked norms and the mask of chunks that may travel in fewer bits: finite norm,
        and not protected while ``protect`` is set."""
        norms, protected, _ = _check_inputs(norms, protected, droppable)
        eligible = np.isfinite(norms)
        if self.config.protect:
            eligible &= ~protected
        return norms, eligible


_P = TypeVar("_P", bound=type[PrecisionPolicy])
_POLICIES: dict[str, type[PrecisionPolicy]] = {}


def register_precision_policy(name: str) -> Callable[[_P], _P]:
    """Class decorator registering a :class:`PrecisionPolicy` under ``name``."""

    def decorate(cls: _P) -> _P:
        if name in _POLICIES:
            raise ConfigError(f"precision policy {name!r} is already registered")
        _POLICIES[name] = cls
        return cls

    return decorate


def precision_policy_names() -> list[str]:
    """Names of the registered precision policies, sorted."""
    return sorted(_POLICIES)


def make_precision_policy(config: PrecisionConfig) -> PrecisionPolicy:
    """Instantiate the policy named by ``config.policy``."""
    try:
        cls = _POLICIES[config.policy]
    except KeyError:
        raise ConfigError(
            f"precision policy {config.policy!r} is not registered; "
            f"valid names: {', '.join(precision_policy_names())}"
        ) from None
    return cls(config)


# -- built-in policies -------------------------------------------------------------------------


@register_precision_policy("f32")
class Float32Policy(PrecisionPolicy):
    """Default: every chunk float32 (not lossy: the transport sends the shard as it is)."""

    @property
    def lossy(self) -> bool:
        """False: this policy never rounds."""
        return False

    def formats(
        self, *, norms: np.ndarray, protected: np.ndarray, droppable: np.ndarray, gather: bool
    ) -> np.ndarray:
        """See :meth:`PrecisionPolicy.formats`: all :data:`F32`."""
        norms, _, _ = _check_inputs(norms, protected, droppable)
        return np.zeros(norms.shape[0], dtype=np.uint8)


class _FixedPolicy(PrecisionPolicy):
    """Every eligible chunk in the subclass's ``_format``."""

    _format: int

    def formats(
        self, *, norms: np.ndarray, protected: np.ndarray, droppable: np.ndarray, gather: bool
    ) -> np.ndarray:
        """See :meth:`PrecisionPolicy.formats`: eligible chunks in the fixed format."""
        _, eligible = self._eligible(norms, protected, droppable)
        return np.where(eligible, np.uint8(self._format), np.uint8(F32))


@register_precision_policy("bf16")
class BFloat16Policy(_FixedPolicy):
    """Every eligible chunk bfloat16 (non-finite and, with ``protect``, protected: float32)."""

    _format = BF16


@register_precision_policy("e4m3")
class E4M3Policy(_FixedPolicy):
    """Every eligible chunk E4M3 (non-finite and, with ``protect``, protected: float32)."""

    _format = E4M3


@register_precision_policy("adaptive")
class AdaptivePolicy(PrecisionPolicy):
    """Rounds the smallest eligible chunks, as many as its :attr:`level` says (module
    docstring); an :class:`AdaptiveController` moves the level once per step."""

    def __init__(self, config: PrecisionConfig) -> None:
        super().__init__(config)
        self._level = _check_level(config.initial_level)

    @property
    def level(self) -> float:
        """The level now, in [0, MAX_LEVEL]: 0 all float32, 1 all eligible chunks bf16, 2 all
        of them E4M3; in between, the smallest eligible chunks first."""
        return self._level

    @level.setter
    def level(self, value: float) -> None:
        self._level = _check_level(value)

    def formats(
        self, *, norms: np.ndarray, protected: np.ndarray, droppable: np.ndarray, gather: bool
    ) -> np.ndarray:
        """See :meth:`PrecisionPolicy.formats`: the smallest eligible chunks first, as many as
        the level says."""
        norms, eligible = self._eligible(norms, protected, droppable)
        out = np.zeros(norms.shape[0], dtype=np.uint8)
        level = self._level
        if level <= 0.0:
            return out
        idx = np.flatnonzero(eligible)
        # Stable: equal norms keep chunk order, so the choice is total and deterministic.
        order = idx[np.argsort(norms[idx], kind="stable")]
        m = order.shape[0]
        n_bf16 = _count(min(level, 1.0), m)
        n_e4m3 = _count(max(level - 1.0, 0.0), m)  # <= n_bf16: a prefix of the same ranking
        out[order[:n_bf16]] = BF16
        out[order[:n_e4m3]] = E4M3
        return out


# -- the adaptive amount -------------------------------------------------------------------------


class LevelSample(NamedTuple):
    """One :meth:`AdaptiveController.update`: the level it set and what it was given."""

    level: float
    """The level after the update."""
    exposed_share: float
    """Exposed communication over the step's duration (0 for a step of no duration)."""
    rel_error: float
    """The step's relative error."""


class AdaptiveController:
    """Moves an :class:`AdaptivePolicy`'s level once per training step (module docstring).

    A pure state machine: the caller measures the step and passes the numbers in.
    """

    def __init__(self, config: PrecisionConfig, policy: PrecisionPolicy) -> None:
        if not isinstance(policy, AdaptivePolicy):
            raise TypeError(
                f"AdaptiveController drives an AdaptivePolicy, got {type(policy).__name__}"
            )
        self.config = config
        self.policy = policy
        self._history: deque[LevelSample] = deque(maxlen=HISTORY_LEN)

    @property
    def level(self) -> float:
        """The driven policy's level now."""
        return self.policy.level

    @property
    def history(self) -> list[LevelSample]:
        """The last :data:`HISTORY_LEN` updates, oldest first (a copy)."""
        return list(self._history)

    def update(self, *, exposed_s: float, step_s: float, rel_error: float) -> float:
        """Feed one finished step; set and return the new level.

        Args:
            exposed_s: how long the trainer waited for communication in the step (seconds,
                finite, >= 0).
            step_s: the step's duration (seconds, finite, >= 0; 0 counts as nothing exposed).
            rel_error: the step's relative error (>= 0; inf, an unmeasurable step, is over any
                bound).
        """
        _check_measure("exposed_s", exposed_s, allow_inf=False)
        _check_measure("step_s", step_s, allow_inf=False)
        _check_measure("rel_error", rel_error, allow_inf=True)
        cfg = self.config
        share = float(exposed_s) / float(step_s) if step_s > 0 else 0.0
        level = self.policy.level
        if rel_error > cfg.error_bound:
            level -= DOWN_STEP
        elif share > cfg.exposed_min:
            level += UP_STEP
        else:
            level -= HIDDEN_STEP
        level = min(MAX_LEVEL, max(0.0, level))
        self.policy.level = level
        self._history.append(LevelSample(level, share, float(rel_error)))
        return level


def relative_error(err2_sum: float, norm2_sum: float) -> float:
    """``sqrt(err2_sum / norm2_sum)``: the relative error of a step's contribution from its
    squared rounding errors and squared values, summed over all its chunks.

    0 when ``norm2_sum`` is 0 (nothing was sent, or only zeros). ``inf`` when either sum is not
    finite: a step whose gradient diverged has no measurable error, and ``inf`` makes the
    controller back off rather than round a diverging gradient harder. Negative sums raise
    ``ValueError``.
    """
    err2, norm2 = float(err2_sum), float(norm2_sum)
    if err2 < 0.0 or norm2 < 0.0:
        raise ValueError(
            f"sums of squares must be >= 0, got err2_sum={err2_sum}, norm2_sum={norm2_sum}"
        )
    if not (math.isfinite(err2) and math.isfinite(norm2)):
        return math.inf
    if norm2 == 0.0:
        return 0.0
    return math.sqrt(err2 / norm2)


# -- checks of a policy's answer ---------------------------------------------------------------


def check_formats(codes: np.ndarray, n: int) -> np.ndarray:
    """A policy's answer, checked for the encoders: a C-contiguous ``uint8`` array of shape
    ``(n,)`` with values in {F32, BF16, E4M3}; ``ValueError`` otherwise."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"n must be a chunk count >= 0, got {n!r}")
    if not isinstance(codes, np.ndarray):
        raise ValueError(f"formats must be a numpy array, got {type(codes).__name__}")
    if codes.dtype != np.uint8:
        raise ValueError(f"formats must be uint8 format codes, got dtype {codes.dtype}")
    if codes.shape != (n,):
        raise ValueError(f"formats must have shape ({n},) (one per chunk), got {codes.shape}")
    _check_codes(codes)
    return np.ascontiguousarray(codes)


def wire_bytes(formats: np.ndarray, counts: np.ndarray) -> int:
    """Payload bytes of chunks holding ``counts[i]`` elements in format ``formats[i]``:
    ``Σ counts[i] × BYTES[formats[i]]`` (headers and E4M3 scales not counted)."""
    codes = np.asarray(formats)
    cnt = np.asarray(counts)
    if codes.ndim != 1 or cnt.shape != codes.shape:
        raise ValueError(
            f"formats and counts must be 1-D of equal length, got shapes {codes.shape} "
            f"and {cnt.shape}"
        )
    if codes.size == 0:
        return 0
    if codes.dtype.kind not in "iu" or cnt.dtype.kind not in "iu":
        raise ValueError(
            f"formats and counts must be integer arrays, got {codes.dtype} and {cnt.dtype}"
        )
    if cnt.min() < 0:
        raise ValueError(f"counts must be >= 0, got {int(cnt.min())}")
    _check_codes(codes)
    return int(np.dot(_ITEMSIZE[codes], cnt.astype(np.int64)))


# -- private helpers -----------------------------------------------------------------------------


def _is_real(value: object) -> bool:
    """A real number, not a boolean (``True`` is an ``int`` to Python, not to a config)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def _check_level(value: float) -> float:
    if not _is_real(value):
        raise ValueError(f"level must be a number, got {value!r}")
    level = float(value)
    if not 0.0 <= level <= MAX_LEVEL:  # also rejects NaN
        raise ValueError(f"level must be in [0, {MAX_LEVEL}], got {value}")
    return level


def _check_measure(name: str, value: float, *, allow_inf: bool) -> None:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or v < 0.0 or (not allow_inf and math.isinf(v)):
        raise ValueError(f"{name} must be a {'' if allow_inf else 'finite '}number >= 0, got {v}")


def _check_codes(codes: np.ndarray) -> None:
    """``ValueError`` unless every value of the integer array ``codes`` is a format code."""
    if codes.size == 0:
        return
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= _ITEMSIZE.shape[0] or not _ITEMSIZE[codes].all():
        bad = np.unique(codes[(codes < 0) | (codes >= _ITEMSIZE.shape[0])])
        if bad.size == 0:
            bad = np.unique(codes[_ITEMSIZE[codes] == 0])
        raise ValueError(
            f"format codes must be in {{F32={F32}, BF16={BF16}, E4M3={E4M3}}}, "
            f"got {bad[:8].tolist()}"
        )


def _check_inputs(
    norms: np.ndarray, protected: np.ndarray, droppable: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """1-D float norms and boolean masks of the same shape; ``ValueError`` naming the input
    otherwise."""
    arr = np.asarray(norms)
    if arr.ndim != 1:
        raise ValueError(f"norms must be 1-D (one per chunk), got shape {arr.shape}")
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float32)
    masks = []
    for name, mask in (("protected", protected), ("droppable", droppable)):
        m = np.asarray(mask)
        if m.shape != arr.shape:
            raise ValueError(f"{name} has shape {m.shape}, norms has {arr.shape}")
        masks.append(m.astype(bool, copy=False))
    return arr, masks[0], masks[1]


def _count(share: float, n: int) -> int:
    """``share × n`` rounded half up, within [0, n]."""
    if share <= 0.0 or n == 0:
        return 0
    return min(n, math.floor(share * n * (1.0 + _COUNT_EPS) + 0.5))
