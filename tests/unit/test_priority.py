"""Unit tests of gradlane.scheduling.priority: config validation, the built-in policies, send
order."""

from __future__ import annotations

import numpy as np
import pytest
from gradlane.scheduling.errors import ConfigError, GradlaneError
from gradlane.scheduling.priority import (
    Classes,
    PriorityConfig,
    PriorityPolicy,
    make_priority_policy,
    priority_policy_names,
    register_priority_policy,
    send_order_key,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

DETERMINISTIC = settings(derandomize=True, deadline=None, max_examples=200)

norms_st = hnp.arrays(
    np.float32,
    st.integers(0, 200),
    # Few distinct values so ties are common; ties must still be broken deterministically.
    elements=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 1e-6, 7.5, 100.0]),
)


def policy(name: str = "layer+magnitude", **kw: object) -> PriorityPolicy:
    return make_priority_policy(PriorityConfig(policy=name, **kw))  # type: ignore[arg-type]


# -- config ----------------------------------------------------------------------------------------


def test_default_config_is_valid() -> None:
    cfg = PriorityConfig()
    assert cfg.n_classes == len(cfg.dscp) == 4
    assert cfg.tos(0) == 46 << 2 == 184
    assert cfg.tos(3) == 8 << 2
    assert cfg.tos_table().tolist() == [184, 136, 104, 32]
    assert cfg.tos_table().dtype == np.uint8


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"n_classes": 1, "dscp": (46,)}, "n_classes"),
        ({"n_classes": 9, "dscp": tuple(range(9))}, "n_classes"),
        ({"protected_fraction": -0.1}, "protected_fraction"),
        ({"droppable_fraction": 1.5}, "droppable_fraction"),
        ({"protected_fraction": 0.6, "droppable_fraction": 0.5}, "<= 1"),
        ({"dscp": (46, 34, 26)}, "one code point per class"),
        ({"dscp": (46, 34, 26, 64)}, "DSCP"),
        ({"dscp": (46, 34, -1, 8)}, "DSCP"),
        ({"pinned_layers": (3, -2)}, "pinned_layers"),
        ({"policy": "nope"}, "valid names: flat, layer, layer+magnitude, magnitude"),
    ],
)
def test_config_validation(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("+", r"\+")) as info:
        PriorityConfig(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, GradlaneError)


@pytest.mark.parametrize("drop", [0.3, 0.3 + 1e-12], ids=["exact", "rounding"])
def test_fractions_summing_to_one_are_accepted(drop: float) -> None:
    """Fractions summing to one, exactly or above it by a rounding error, are valid: every
    chunk is then either protected (the 7 largest of 10) or droppable (the other 3)."""
    cfg = PriorityConfig(protected_fraction=0.7, droppable_fraction=drop)
    norms = np.arange(10, 0, -1, dtype=np.float32)  # chunk 0 the largest
    got = make_priority_policy(cfg).classify(norms=norms, layer_position=0.5)
    assert got.protected.tolist() == [True] * 7 + [False] * 3
    assert got.droppable.tolist() == [False] * 7 + [True] * 3


def test_tos_out_of_range() -> None:
    with pytest.raises(ValueError, match="out of range"):
        PriorityConfig().tos(4)


def test_pins() -> None:
    cfg = PriorityConfig(pinned_layers=(0, 10))
    assert cfg.pins([3, 2, 1, 0])
    assert cfg.pins(range(8, 13))
    assert not cfg.pins([1, 9])
    assert not cfg.pins([9, 11])  # membership: a bucket of layers 9 and 11 does not hold 10
    assert not cfg.pins([])
    assert not PriorityConfig().pins(range(1000))
    assert PriorityConfig(pinned_layers=[4, 1]).pinned_layers == (4, 1)  # a list is kept as a tuple
    with pytest.raises(ConfigError, match="tuple of layer indices"):
        PriorityConfig(pinned_layers=(1.5,))


# -- registry --------------------------------------------------------------------------------------


def test_registry_lists_builtins() -> None:
    assert {"flat", "layer", "layer+magnitude", "magnitude"} <= set(priority_policy_names())
    for name in ("flat", "layer", "layer+magnitude", "magnitude"):
        assert isinstance(policy(name), PriorityPolicy)


def test_register_custom_policy_and_reject_duplicates() -> None:
    @register_priority_policy("test-all-droppable")
    class AllDroppable(PriorityPolicy):
        def classify(
            self, *, norms: np.ndarray, layer_position: float, pinned: bool = False
        ) -> Classes:
            n = len(norms)
            return Classes(
                prio=np.full(n, self.config.n_classes - 1, np.uint8),
                protected=np.zeros(n, bool),
                droppable=np.ones(n, bool),
            )

    got = policy("test-all-droppable").classify(norms=np.ones(3), layer_position=0.0)
    assert got.droppable.all()
    with pytest.raises(ConfigError, match="already registered"):
        register_priority_policy("test-all-droppable")(AllDroppable)


def test_abc_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError):
        PriorityPolicy(PriorityConfig())  # type: ignore[abstract]


# -- layer+magnitude -------------------------------------------------------------------------------


def test_layer_magnitude_basic() -> None:
    norms = np.arange(20, dtype=np.float32)  # chunk i has norm i
    got = policy().classify(norms=norms, layer_position=0.0)
    # 10% of 20 = 2 protected: the two largest norms.
    assert np.flatnonzero(got.protected).tolist() == [18, 19]
    # 25% of 20 = 5 droppable: the five smallest.
    assert np.flatnonzero(got.droppable).tolist() == [0, 1, 2, 3, 4]
    assert (got.prio[got.protected] == 0).all()
    assert (got.prio[got.droppable] == 3).all()
    middle = ~got.protected & ~got.droppable
    assert (got.prio[middle] == 1).all()  # front layer → class 1
    back = policy().classify(norms=norms, layer_position=1.0)
    assert (back.prio[middle] == 2).all()  # last layer → class n-2
    assert got.prio.dtype == np.uint8
    assert got.protected.dtype == bool
    assert got.droppable.dtype == bool
    assert len(got) == 20


def test_at_least_one_protected_chunk() -> None:
    got = policy().classify(norms=np.array([1.0, 5.0, 2.0], np.float32), layer_position=0.5)
    assert got.protected.tolist() == [False, True, False]
    none = policy(protected_fraction=0.0).classify(norms=np.ones(3), layer_position=0.5)
    assert not none.protected.any()


def test_ties_broken_by_chunk_index() -> None:
    got = policy(protected_fraction=0.25, droppable_fraction=0.25).classify(
        norms=np.ones(8, np.float32), layer_position=0.0
    )
    assert np.flatnonzero(got.protected).tolist() == [0, 1]
    assert np.flatnonzero(got.droppable).tolist() == [6, 7]


def test_nan_norm_is_protected() -> None:
    norms = np.array([1.0, np.nan, 3.0, 2.0, 0.5, 0.1, 0.2, 0.3, 0.4, 0.6], np.float32)
    got = policy().classify(norms=norms, layer_position=0.0)
    assert np.flatnonzero(got.protected).tolist() == [1]


def _layer_magnitude_reference(
    pol: PriorityPolicy, norms: np.ndarray, position: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """layer+magnitude in numpy: the policy's _extreme_masks, then the class assignment."""
    arr = np.asarray(norms)
    arr = np.where(np.isnan(arr), np.inf, arr) if arr.dtype.kind == "f" else arr
    _, protected, droppable = pol._extreme_masks(arr)
    lo, hi = pol._middle_band()
    prio = np.full(arr.shape[0], min(hi, lo + int(position * (hi - lo + 1))), dtype=np.uint8)
    prio[protected] = 0
    prio[droppable] = pol.config.n_classes - 1
    return prio, protected, droppable


@DETERMINISTIC
@given(
    norms=hnp.arrays(
        st.sampled_from([np.float32, np.float64]),
        st.integers(0, 120),
        elements=st.sampled_from([0.0, -0.0, 0.5, 1.0, 3.0, 1e-30, 7.5, np.inf, np.nan]),
    ),
    position=st.floats(0.0, 1.0),
    n_classes=st.integers(2, 8),
    fractions=st.sampled_from(
        [(0.0, 0.0), (0.1, 0.25), (0.3, 0.6), (0.5, 0.5), (1.0, 0.0), (0.0, 1.0)]
    ),
)
def test_layer_magnitude_kernel_equals_numpy_reference(
    norms: np.ndarray, position: float, n_classes: int, fractions: tuple[float, float]
) -> None:
    """The compiled classification (scheduling._kernels.priority) gives exactly the numpy
    formulation's classes and flags: ties by chunk index, NaN and inf ranked largest."""
    dscp = tuple(range(n_classes))
    pol = policy(
        n_classes=n_classes, dscp=dscp, protected_fraction=fractions[0],
        droppable_fraction=fractions[1],
    )  # fmt: skip
    got = pol.classify(norms=norms, layer_position=position)
    prio, protected, droppable = _layer_magnitude_reference(pol, norms, position)
    assert got.prio.dtype == np.uint8 and got.protected.dtype == got.droppable.dtype == bool
    assert got.prio.tolist() == prio.tolist()
    assert got.protected.tolist() == protected.tolist()
    assert got.droppable.tolist() == droppable.tolist()


BUILTIN = ("flat", "layer", "layer+magnitude", "magnitude")


def test_pinned_protects_everything() -> None:
    for name in BUILTIN:
        got = policy(name).classify(norms=np.arange(10.0), layer_position=0.7, pinned=True)
        assert got.protected.all()
        assert not got.droppable.any()
        assert (got.prio == 0).all()


def test_empty_transfer() -> None:
    for name in BUILTIN:
        got = policy(name).classify(norms=np.empty(0, np.float32), layer_position=0.0)
        assert len(got) == 0
        assert got.prio.dtype == np.uint8


def test_two_classes() -> None:
    p = policy(n_classes=2, dscp=(46, 8), protected_fraction=0.2, droppable_fraction=0.2)
    got = p.classify(norms=np.arange(10.0), layer_position=0.3)
    assert set(got.prio.tolist()) == {0, 1}
    assert (got.prio[got.protected] == 0).all()


@pytest.mark.parametrize("bad", [-0.1, 1.1, float("nan")])
def test_layer_position_validated(bad: float) -> None:
    with pytest.raises(ValueError, match="layer_position"):
        policy().classify(norms=np.ones(3), layer_position=bad)


def test_norms_must_be_1d() -> None:
    with pytest.raises(ValueError, match="1-D"):
        policy().classify(norms=np.ones((2, 2)), layer_position=0.0)


@DETERMINISTIC
@given(
    norms=norms_st,
    pos=st.floats(0.0, 1.0),
    n_classes=st.integers(2, 8),
    prot=st.floats(0.0, 0.5),
    drop=st.floats(0.0, 0.5),
)
def test_layer_magnitude_invariants(
    norms: np.ndarray, pos: float, n_classes: int, prot: float, drop: float
) -> None:
    cfg = PriorityConfig(
        n_classes=n_classes,
        dscp=tuple(range(n_classes)),
        protected_fraction=prot,
        droppable_fraction=drop,
    )
    got = make_priority_policy(cfg).classify(norms=norms, layer_position=pos)
    n = len(norms)
    assert got.prio.shape == got.protected.shape == got.droppable.shape == (n,)
    assert not (got.protected & got.droppable).any()
    assert (got.prio < n_classes).all()
    assert (got.prio[got.protected] == 0).all()
    assert (got.prio[got.droppable] == n_classes - 1).all()
    n_prot = int(got.protected.sum())
    if n and prot > 0:
        assert n_prot >= 1
        assert n_prot <= max(1, int(np.floor(prot * n + 1e-6)))
    if n_prot and n_prot < n:
        assert norms[got.protected].min() >= norms[~got.protected].max()
    if got.droppable.any() and not got.droppable.all():
        assert norms[got.droppable].max() <= norms[~got.droppable].min()
    middle = ~got.protected & ~got.droppable
    assert len(set(got.prio[middle].tolist())) <= 1  # one layer position → one middle class
    # Deterministic: the same input gives the same answer.
    again = make_priority_policy(cfg).classify(norms=norms.copy(), layer_position=pos)
    assert np.array_equal(again.prio, got.prio)
    assert np.array_equal(again.protected, got.protected)


def test_layer_magnitude_middle_class_monotone_in_position() -> None:
    p = policy(n_classes=8, dscp=tuple(range(8)))
    norms = np.linspace(0.0, 1.0, 100)
    classes = []
    for pos in np.linspace(0.0, 1.0, 33):
        got = p.classify(norms=norms, layer_position=float(pos))
        middle = ~got.protected & ~got.droppable
        classes.append(int(got.prio[middle][0]))
    assert classes == sorted(classes)
    assert classes[0] == 1
    assert classes[-1] == 6


# -- layer, magnitude, flat ------------------------------------------------------------------------


def test_layer_policy_spreads_over_all_classes() -> None:
    p = policy("layer")
    norms = np.arange(10.0)
    seen = []
    for pos in (0.0, 0.2, 0.3, 0.6, 0.8, 1.0):
        got = p.classify(norms=norms, layer_position=pos)
        assert not got.protected.any()
        assert not got.droppable.any()
        assert len(set(got.prio.tolist())) == 1
        seen.append(int(got.prio[0]))
    assert seen == [0, 0, 1, 2, 3, 3]


@DETERMINISTIC
@given(norms=norms_st, n_classes=st.integers(2, 8), pos=st.floats(0.0, 1.0))
def test_magnitude_policy_class_monotone_in_norm(
    norms: np.ndarray, n_classes: int, pos: float
) -> None:
    cfg = PriorityConfig(policy="magnitude", n_classes=n_classes, dscp=tuple(range(n_classes)))
    got = make_priority_policy(cfg).classify(norms=norms, layer_position=pos)
    order = np.lexsort((np.arange(len(norms)), -norms.astype(np.float64)))
    # Walking from the largest norm down, classes never decrease.
    assert np.all(np.diff(got.prio[order].astype(int)) >= 0)
    assert not (got.protected & got.droppable).any()
    assert (got.prio[got.protected] == 0).all()
    assert (got.prio[got.droppable] == n_classes - 1).all()


def test_magnitude_policy_bands() -> None:
    cfg = PriorityConfig(
        policy="magnitude",
        n_classes=5,
        dscp=(46, 34, 26, 18, 8),
        protected_fraction=0.1,
        droppable_fraction=0.1,
    )
    got = make_priority_policy(cfg).classify(norms=np.arange(100.0)[::-1], layer_position=0.0)
    # Norm descends with index: 10 protected, 80 middle in 3 bands, 10 droppable.
    assert got.prio[:10].tolist() == [0] * 10
    assert np.bincount(got.prio[10:90]).tolist() == [0, 27, 27, 26]
    assert got.prio[90:].tolist() == [4] * 10
    # The magnitude policy ignores the layer position.
    other = make_priority_policy(cfg).classify(norms=np.arange(100.0)[::-1], layer_position=1.0)
    assert np.array_equal(other.prio, got.prio)


def test_flat_policy() -> None:
    got = policy("flat").classify(norms=np.arange(5.0), layer_position=0.9)
    assert got.prio.tolist() == [1] * 5
    assert not got.protected.any()
    assert not got.droppable.any()


# -- send order ------------------------------------------------------------------------------------


def test_send_order_key_order() -> None:
    prio = np.array([1, 0, 1, 1, 0], np.uint8)
    pos = np.array([0.5, 1.0, 0.0, 0.5, 1.0])
    chunk = np.array([3, 2, 9, 1, 0])
    key = send_order_key(prio, pos, chunk)
    assert key.dtype == np.int64
    order = np.argsort(key, kind="stable")
    assert order.tolist() == [4, 1, 2, 3, 0]


@DETERMINISTIC
@given(
    prio=st.lists(st.integers(0, 7), max_size=80),
    pos=st.floats(0.0, 1.0),
)
def test_one_transfers_send_order_is_a_stable_sort_of_its_classes(prio, pos) -> None:
    """What OutTransfer uses instead of building keys: for one transfer (one layer position,
    chunks 0..n-1) a stable argsort of the classes is send_order_key's order."""
    p = np.array(prio, dtype=np.uint8)
    key = send_order_key(p, pos, np.arange(p.size))
    assert np.argsort(p, kind="stable").tolist() == np.argsort(key, kind="stable").tolist()


def test_send_order_key_scalar_position() -> None:
    key = send_order_key(np.array([2, 0, 2], np.uint8), 0.25, np.arange(3))
    assert np.argsort(key, kind="stable").tolist() == [1, 0, 2]


@DETERMINISTIC
@given(
    st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 1000), st.integers(0, 2**32 - 1)),
        max_size=60,
    )
)
def test_send_order_key_matches_tuple_order(rows: list[tuple[int, int, int]]) -> None:
    prio = np.array([r[0] for r in rows], np.uint8)
    pos = np.array([r[1] / 1000 for r in rows])
    chunk = np.array([r[2] for r in rows], np.int64)
    key = send_order_key(prio, pos, chunk)
    got = [rows[i] for i in np.argsort(key, kind="stable")]
    assert got == sorted(rows)


@pytest.mark.parametrize(
    ("prio", "pos", "chunk"),
    [([8], 0.0, [0]), ([0], 1.5, [0]), ([0], 0.0, [-1]), ([0], 0.0, [2**32])],
)
def test_send_order_key_validates(prio: list[int], pos: float, chunk: list[int]) -> None:
    with pytest.raises(ValueError):
        send_order_key(np.array(prio), pos, np.array(chunk))
