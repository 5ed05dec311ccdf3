"""Unit tests of gradlane.scheduling.precision: config validation, the registry, the built-in
policies' rules, the adaptive ranking, the controller's state machine and the output checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradlane.scheduling.errors import ConfigError, GradlaneError
from gradlane.scheduling.precision import (
    BF16,
    BYTES,
    DOWN_STEP,
    E4M3,
    F32,
    HIDDEN_STEP,
    HISTORY_LEN,
    MAX_LEVEL,
    UP_STEP,
    AdaptiveController,
    AdaptivePolicy,
    LevelSample,
    PrecisionConfig,
    PrecisionPolicy,
    check_formats,
    make_precision_policy,
    precision_policy_names,
    register_precision_policy,
    relative_error,
    wire_bytes,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

DETERMINISTIC = settings(derandomize=True, deadline=None, max_examples=200)
BUILT_IN = ["adaptive", "bf16", "e4m3", "f32"]
ITEMSIZE = np.array([4, 0, 2, 1], dtype=np.int64)  # bytes per element by code (reference)

# Few distinct values so ties are common, plus the non-finite norms a diverged chunk has.
norm_values = st.sampled_from([0.0, 1e-6, 0.5, 1.0, 2.0, 7.5, 100.0, math.nan, math.inf])


@st.composite
def transfers(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(norms, protected, droppable) of one transfer, up to 120 chunks."""
    n = draw(st.integers(0, 120))
    norms = draw(hnp.arrays(np.float32, n, elements=norm_values))
    protected = draw(hnp.arrays(np.bool_, n))
    droppable = draw(hnp.arrays(np.bool_, n)) & ~protected
    return norms, protected, droppable


levels = st.floats(0.0, MAX_LEVEL, allow_nan=False)


def make(name: str = "adaptive", **kw: object) -> PrecisionPolicy:
    return make_precision_policy(PrecisionConfig(policy=name, **kw))  # type: ignore[arg-type]


def adaptive(level: float = 0.0, **kw: object) -> AdaptivePolicy:
    p = make("adaptive", initial_level=level, **kw)
    assert isinstance(p, AdaptivePolicy)
    return p


def pick(
    p: PrecisionPolicy,
    norms: np.ndarray | list[float],
    protected: np.ndarray | list[bool] | None = None,
    *,
    gather: bool = False,
) -> np.ndarray:
    a = np.asarray(norms, dtype=np.float32)
    prot = np.zeros(a.shape, bool) if protected is None else np.asarray(protected, bool)
    return p.formats(norms=a, protected=prot, droppable=np.zeros(a.shape, bool), gather=gather)


def histogram(codes: np.ndarray) -> tuple[int, int, int]:
    """Chunks in (F32, BF16, E4M3)."""
    return (int((codes == F32).sum()), int((codes == BF16).sum()), int((codes == E4M3).sum()))


# -- constants -------------------------------------------------------------------------------------


def test_codes_and_sizes() -> None:
    assert (F32, BF16, E4M3) == (0, 2, 3)
    assert dict(BYTES) == {0: 4, 2: 2, 3: 1}
    with pytest.raises(TypeError):
        BYTES[F32] = 8  # type: ignore[index]


def test_codes_match_the_wire_format() -> None:
    """The scheduling layer may not import the transport; the test may, and pins the copy."""
    from gradlane.transport.wire.header import ITEMSIZE as WIRE_ITEMSIZE
    from gradlane.transport.wire.header import DType

    assert (DType.F32, DType.BF16, DType.E4M3) == (F32, BF16, E4M3)
    assert {code: WIRE_ITEMSIZE[code] for code in BYTES} == dict(BYTES)


# -- config and registry ---------------------------------------------------------------------------


def test_default_config_is_float32() -> None:
    cfg = PrecisionConfig()
    assert (cfg.policy, cfg.protect, cfg.error_feedback) == ("f32", True, True)
    assert (cfg.error_bound, cfg.exposed_min, cfg.initial_level) == (0.05, 0.1, 0.0)
    p = make_precision_policy(cfg)
    assert not p.lossy
    assert p.config is cfg


def test_built_in_names() -> None:
    names = precision_policy_names()
    assert names == sorted(names)
    assert set(BUILT_IN) <= set(names)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"policy": "nope"}, "valid names: adaptive, bf16, e4m3, f32"),
        ({"policy": 3}, "not registered"),
        ({"protect": 1}, "protect must be a boolean"),
        ({"protect": "yes"}, "protect must be a boolean"),
        ({"error_feedback": 0}, "error_feedback must be a boolean"),
        ({"error_feedback": None}, "error_feedback must be a boolean"),
        ({"error_bound": 0.0}, r"error_bound must be in \(0, 1\]"),
        ({"error_bound": -0.1}, "error_bound"),
        ({"error_bound": 1.5}, "error_bound"),
        ({"error_bound": math.nan}, "error_bound"),
        ({"error_bound": True}, "error_bound must be a number"),
        ({"error_bound": "0.1"}, "error_bound must be a number"),
        ({"exposed_min": -0.01}, r"exposed_min must be in \[0, 1\)"),
        ({"exposed_min": 1.0}, "exposed_min"),
        ({"exposed_min": math.nan}, "exposed_min"),
        ({"exposed_min": False}, "exposed_min must be a number"),
        ({"initial_level": -0.25}, r"initial_level must be in \[0, 2.0\]"),
        ({"initial_level": 2.25}, "initial_level"),
        ({"initial_level": math.inf}, "initial_level"),
        ({"initial_level": math.nan}, "initial_level"),
        ({"initial_level": None}, "initial_level must be a number"),
        ({"initial_level": True}, "initial_level must be a number"),
    ],
)
def test_config_validation(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        PrecisionConfig(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, GradlaneError)


def test_config_takes_integers_and_numpy_scalars() -> None:
    """TOML writes ``error_bound = 1`` as an integer; it is a valid bound, stored as a float."""
    cfg = PrecisionConfig(
        error_bound=1,
        exposed_min=np.float32(0.5),  # type: ignore[arg-type]
        initial_level=2,
        protect=np.True_,  # type: ignore[arg-type]
    )
    assert type(cfg.error_bound) is float and cfg.error_bound == 1.0
    assert type(cfg.exposed_min) is float and cfg.exposed_min == 0.5
    assert type(cfg.initial_level) is float and cfg.initial_level == 2.0
    assert cfg.protect is True
    assert PrecisionConfig(error_bound=1) == PrecisionConfig(error_bound=1.0)


def test_config_accepts_the_bounds() -> None:
    cfg = PrecisionConfig(policy="adaptive", error_bound=1.0, exposed_min=0.0, initial_level=2.0)
    assert adaptive(cfg.initial_level).level == MAX_LEVEL


def test_register_custom_policy_and_reject_duplicates() -> None:
    @register_precision_policy("zz-test-all-bf16-int64")
    class Sloppy(PrecisionPolicy):
        """Answers bf16 everywhere, in the wrong dtype."""

        def formats(
            self, *, norms: np.ndarray, protected: np.ndarray, droppable: np.ndarray, gather: bool
        ) -> np.ndarray:
            return np.full(len(norms), BF16, dtype=np.int64)

    p = make("zz-test-all-bf16-int64")
    assert isinstance(p, Sloppy)
    assert p.lossy  # the default for a policy that does not say otherwise
    assert "zz-test-all-bf16-int64" in precision_policy_names()
    with pytest.raises(ValueError, match="uint8"):
        check_formats(pick(p, [1.0, 2.0]), 2)
    with pytest.raises(ConfigError, match="already registered"):
        register_precision_policy("zz-test-all-bf16-int64")(Sloppy)
    with pytest.raises(ConfigError, match="already registered"):
        register_precision_policy("f32")(Sloppy)


def test_abc_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError):
        PrecisionPolicy(PrecisionConfig())  # type: ignore[abstract]


# -- rules every built-in policy follows -----------------------------------------------------------


NORMS = [1.0, math.nan, math.inf, 0.0, 2.0, -math.inf, 3.0]
PROTECTED = [False, False, False, False, True, False, False]


def test_f32_sends_everything_as_float32() -> None:
    p = make("f32")
    assert not p.lossy
    got = pick(p, NORMS, PROTECTED)
    assert got.dtype == np.uint8
    assert got.tolist() == [F32] * len(NORMS)
    assert pick(make("f32", protect=False), NORMS, PROTECTED).tolist() == [F32] * len(NORMS)


@pytest.mark.parametrize(("name", "code"), [("bf16", BF16), ("e4m3", E4M3)])
def test_fixed_formats(name: str, code: int) -> None:
    p = make(name)
    assert p.lossy
    got = pick(p, NORMS, PROTECTED)
    assert got.dtype == np.uint8
    # Non-finite (1, 2, 5) and protected (4) chunks travel float32; the zero chunk is rounded.
    assert got.tolist() == [code, F32, F32, code, F32, F32, code]
    # Without protect, the protected chunk is rounded too; non-finite ones still are not.
    unprotected = pick(make(name, protect=False), NORMS, PROTECTED)
    assert unprotected.tolist() == [code, F32, F32, code, code, F32, code]
    # Both phases alike.
    assert pick(p, NORMS, PROTECTED, gather=True).tolist() == got.tolist()


@pytest.mark.parametrize("level", [1.0, 2.0])
def test_adaptive_follows_the_same_rules(level: float) -> None:
    code = BF16 if level == 1.0 else E4M3
    got = pick(adaptive(level), NORMS, PROTECTED)
    assert got.tolist() == [code, F32, F32, code, F32, F32, code]
    unprotected = pick(adaptive(level, protect=False), NORMS, PROTECTED)
    assert unprotected.tolist() == [code, F32, F32, code, code, F32, code]


@pytest.mark.parametrize("name", BUILT_IN)
def test_empty_transfer(name: str) -> None:
    p = make(name, initial_level=1.5)
    got = pick(p, [])
    assert got.dtype == np.uint8
    assert got.shape == (0,)


@pytest.mark.parametrize("name", BUILT_IN)
@pytest.mark.parametrize(
    ("norms", "protected", "droppable", "fragment"),
    [
        (np.ones((2, 3), np.float32), np.zeros(6, bool), np.zeros(6, bool), "norms must be 1-D"),
        (np.ones(4, np.float32), np.zeros(3, bool), np.zeros(4, bool), "protected has shape"),
        (np.ones(4, np.float32), np.zeros(4, bool), np.zeros(5, bool), "droppable has shape"),
        (np.ones(4, np.float32), np.zeros((4, 1), bool), np.zeros(4, bool), "protected"),
    ],
)
def test_input_shapes_are_checked(
    name: str, norms: np.ndarray, protected: np.ndarray, droppable: np.ndarray, fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        make(name).formats(norms=norms, protected=protected, droppable=droppable, gather=False)


@pytest.mark.parametrize("name", BUILT_IN)
def test_integer_norms_and_masks_are_taken(name: str) -> None:
    p = make(name, initial_level=2.0)
    got = p.formats(
        norms=np.array([3, 0, 5]), protected=np.array([0, 0, 1]), droppable=[0, 0, 0], gather=False
    )
    expected = {"f32": F32, "bf16": BF16, "e4m3": E4M3, "adaptive": E4M3}[name]
    assert got.tolist() == [expected, expected, F32]


# -- adaptive --------------------------------------------------------------------------------------


# Chunk i has norm PERM[i]: the ranking, not the chunk index, decides.
PERM = np.array([5, 2, 7, 0, 3, 6, 1, 4], dtype=np.float32)


@pytest.mark.parametrize(
    ("level", "counts"),
    [
        (0.0, (8, 0, 0)),
        (0.5, (4, 4, 0)),
        (1.0, (0, 8, 0)),
        (1.5, (0, 4, 4)),
        (2.0, (0, 0, 8)),
        (0.25, (6, 2, 0)),
        (1.75, (0, 2, 6)),
    ],
)
def test_adaptive_counts(level: float, counts: tuple[int, int, int]) -> None:
    got = pick(adaptive(level), PERM)
    assert histogram(got) == counts
    # The smallest norms take the smallest formats: bytes never shrink as the norm grows.
    by_norm = ITEMSIZE[got[np.argsort(PERM)]]
    assert (np.diff(by_norm) >= 0).all()


def test_adaptive_compresses_the_smallest_norms_first() -> None:
    got = pick(adaptive(0.5), PERM)
    assert np.flatnonzero(got == BF16).tolist() == np.flatnonzero(PERM < 4).tolist()
    got = pick(adaptive(1.5), PERM)
    assert np.flatnonzero(got == E4M3).tolist() == np.flatnonzero(PERM < 4).tolist()
    assert np.flatnonzero(got == BF16).tolist() == np.flatnonzero(PERM >= 4).tolist()


def test_adaptive_ranks_eligible_chunks_only() -> None:
    """Ineligible chunks neither take a format nor count toward the level's share."""
    norms = [0.1, math.nan, 0.2, 5.0, math.inf, 0.3, 4.0, 0.05, 6.0, 0.4]
    protected = [False, False, False, True, False, False, False, True, False, False]
    # Eligible: chunks 0, 2, 5, 6, 8, 9 (norms 0.1 0.2 0.3 4 6 0.4); half of six is three.
    got = pick(adaptive(0.5), norms, protected)
    assert np.flatnonzero(got == BF16).tolist() == [0, 2, 5]
    assert histogram(got) == (7, 3, 0)
    # Without protect, chunk 7 (norm 0.05, the smallest) joins; half of eight is four.
    got = pick(adaptive(0.5, protect=False), norms, protected)
    assert np.flatnonzero(got == BF16).tolist() == [0, 2, 5, 7]


def test_adaptive_breaks_ties_by_chunk_index() -> None:
    got = pick(adaptive(0.5), np.ones(6, np.float32))
    assert got.tolist() == [BF16] * 3 + [F32] * 3
    got = pick(adaptive(1.5), np.ones(6, np.float32))
    assert got.tolist() == [E4M3] * 3 + [BF16] * 3


def test_adaptive_rounds_zero_chunks_first() -> None:
    got = pick(adaptive(1 / 3), [3.0, 0.0, 1.0])
    assert got.tolist() == [F32, BF16, F32]


@pytest.mark.parametrize(
    ("level", "n", "bf16"),
    [(0.5, 5, 3), (0.5, 1, 1), (0.5, 3, 2), (0.15, 10, 2), (0.1, 30, 3), (0.25, 3, 1), (0.1, 4, 0)],
)
def test_adaptive_rounds_the_count_half_up(level: float, n: int, bf16: int) -> None:
    got = pick(adaptive(level), np.arange(1, n + 1, dtype=np.float32))
    assert histogram(got) == (n - bf16, bf16, 0)


@DETERMINISTIC
@given(transfer=transfers(), a=levels, b=levels, protect=st.booleans())
def test_adaptive_is_monotone_in_the_level(
    transfer: tuple[np.ndarray, np.ndarray, np.ndarray], a: float, b: float, protect: bool
) -> None:
    """Raising the level never increases any chunk's bytes."""
    lo, hi = min(a, b), max(a, b)
    norms, protected, droppable = transfer
    p = adaptive(lo, protect=protect)
    at_lo = p.formats(norms=norms, protected=protected, droppable=droppable, gather=False)
    p.level = hi
    at_hi = p.formats(norms=norms, protected=protected, droppable=droppable, gather=False)
    assert (ITEMSIZE[at_hi] <= ITEMSIZE[at_lo]).all()


@DETERMINISTIC
@given(transfer=transfers(), level=levels, protect=st.booleans())
def test_adaptive_answer(
    transfer: tuple[np.ndarray, np.ndarray, np.ndarray], level: float, protect: bool
) -> None:
    """Against a plain reference: which chunks are eligible, how many are rounded to each
    format, and that every rounded chunk's norm is no larger than any float32 eligible one."""
    norms, protected, droppable = transfer
    got = adaptive(level, protect=protect).formats(
        norms=norms, protected=protected, droppable=droppable, gather=True
    )
    assert check_formats(got, len(norms)) is not None
    eligible = np.isfinite(norms) & ~(protected & protect)
    assert (got[~eligible] == F32).all()
    m = int(eligible.sum())
    n_bf16 = min(m, math.floor(min(level, 1.0) * m * (1 + 1e-9) + 0.5))
    n_e4m3 = min(m, math.floor(max(level - 1.0, 0.0) * m * (1 + 1e-9) + 0.5))
    assert histogram(got) == (len(norms) - n_bf16, n_bf16 - n_e4m3, n_e4m3)
    for small, large in ((got == E4M3, got == BF16), (got != F32, (got == F32) & eligible)):
        if small.any() and large.any():
            assert norms[small].max() <= norms[large].min()


@DETERMINISTIC
@given(transfer=transfers(), name=st.sampled_from(BUILT_IN), level=levels)
def test_every_policy_answers_valid_codes(
    transfer: tuple[np.ndarray, np.ndarray, np.ndarray], name: str, level: float
) -> None:
    norms, protected, droppable = transfer
    got = make(name, initial_level=level).formats(
        norms=norms, protected=protected, droppable=droppable, gather=False
    )
    check_formats(got, len(norms))
    assert (got[~np.isfinite(norms)] == F32).all()
    assert (got[protected] == F32).all()


@pytest.mark.parametrize("bad", [-0.125, 2.125, math.nan, math.inf, True, "1.0", None])
def test_level_setter_validates(bad: object) -> None:
    p = adaptive(0.75)
    with pytest.raises(ValueError, match="level"):
        p.level = bad  # type: ignore[assignment]
    assert p.level == 0.75


def test_level_setter_takes_numbers() -> None:
    p = adaptive()
    assert p.level == 0.0
    p.level = 2
    assert p.level == 2.0 and type(p.level) is float
    p.level = np.float64(1.5)
    assert histogram(pick(p, PERM)) == (0, 4, 4)


# -- the controller --------------------------------------------------------------------------------


def controller(level: float = 1.0, **kw: object) -> AdaptiveController:
    cfg = PrecisionConfig(policy="adaptive", initial_level=level, **kw)  # type: ignore[arg-type]
    return AdaptiveController(cfg, make_precision_policy(cfg))


EXPOSED = {"exposed_s": 0.05, "step_s": 0.1}  # half the step: over exposed_min (0.1)
HIDDEN = {"exposed_s": 0.005, "step_s": 0.1}  # 5%: under it


def test_steps() -> None:
    assert (UP_STEP, DOWN_STEP, HIDDEN_STEP, MAX_LEVEL) == (0.25, 0.5, 0.125, 2.0)


def test_controller_needs_an_adaptive_policy() -> None:
    with pytest.raises(TypeError, match="AdaptivePolicy"):
        AdaptiveController(PrecisionConfig(policy="bf16"), make("bf16"))


def test_exposed_communication_raises_the_level() -> None:
    c = controller(1.0)
    assert c.update(**EXPOSED, rel_error=0.01) == 1.25
    assert c.level == c.policy.level == 1.25
    assert c.update(**EXPOSED, rel_error=0.0) == 1.5


def test_error_over_the_bound_lowers_the_level_even_when_exposed() -> None:
    c = controller(1.5, error_bound=0.05)
    assert c.update(**EXPOSED, rel_error=0.06) == 1.0
    assert c.update(**HIDDEN, rel_error=0.5) == 0.5


def test_hidden_communication_releases_slowly() -> None:
    c = controller(1.0)
    assert c.update(**HIDDEN, rel_error=0.01) == 0.875
    assert c.update(exposed_s=0.0, step_s=0.1, rel_error=0.0) == 0.75


def test_thresholds_are_strict() -> None:
    """A share equal to exposed_min counts as hidden; an error equal to the bound is within."""
    c = controller(1.0, error_bound=0.25, exposed_min=0.5)
    assert c.update(exposed_s=0.5, step_s=1.0, rel_error=0.25) == 0.875
    assert c.update(exposed_s=0.5000001, step_s=1.0, rel_error=0.25) == 1.125


def test_step_of_no_duration_counts_as_hidden() -> None:
    c = controller(1.0)
    assert c.update(exposed_s=0.3, step_s=0.0, rel_error=0.0) == 0.875
    assert c.history[-1].exposed_share == 0.0


def test_exposed_min_zero_raises_on_any_exposure() -> None:
    c = controller(0.0, exposed_min=0.0)
    assert c.update(exposed_s=1e-9, step_s=1.0, rel_error=0.0) == 0.25
    assert c.update(exposed_s=0.0, step_s=1.0, rel_error=0.0) == 0.125


def test_level_is_clamped() -> None:
    c = controller(1.875)
    assert c.update(**EXPOSED, rel_error=0.0) == MAX_LEVEL
    assert c.update(**EXPOSED, rel_error=0.0) == MAX_LEVEL
    c = controller(0.25)
    assert c.update(**EXPOSED, rel_error=1.0) == 0.0
    assert c.update(**HIDDEN, rel_error=0.0) == 0.0


def test_controller_drives_the_policy() -> None:
    c = controller(0.0)
    p = c.policy
    assert histogram(pick(p, PERM)) == (8, 0, 0)
    for _ in range(6):
        c.update(**EXPOSED, rel_error=0.0)
    assert p.level == 1.5
    assert histogram(pick(p, PERM)) == (0, 4, 4)


def test_inf_error_backs_off() -> None:
    c = controller(2.0)
    assert c.update(**EXPOSED, rel_error=math.inf) == 1.5


def test_history() -> None:
    c = controller(1.0, error_bound=0.1)
    assert c.history == []
    c.update(exposed_s=0.2, step_s=1.0, rel_error=0.01)
    c.update(exposed_s=0.2, step_s=1.0, rel_error=0.2)
    c.update(exposed_s=0.0, step_s=1.0, rel_error=0.0)
    assert c.history == [(1.25, 0.2, 0.01), (0.75, 0.2, 0.2), (0.625, 0.0, 0.0)]
    first = c.history[0]
    assert isinstance(first, LevelSample)
    assert (first.level, first.exposed_share, first.rel_error) == (1.25, 0.2, 0.01)
    snapshot = c.history
    snapshot.clear()
    assert len(c.history) == 3


def test_history_is_bounded() -> None:
    c = controller(0.0)
    for i in range(HISTORY_LEN + 5):
        c.update(exposed_s=0.0, step_s=1.0, rel_error=float(i))
    hist = c.history
    assert len(hist) == HISTORY_LEN
    assert hist[0].rel_error == 5.0  # the oldest five were dropped
    assert hist[-1].rel_error == float(HISTORY_LEN + 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"exposed_s": math.nan},
        {"exposed_s": -0.1},
        {"exposed_s": math.inf},
        {"step_s": math.nan},
        {"step_s": -1.0},
        {"step_s": math.inf},
        {"rel_error": math.nan},
        {"rel_error": -0.01},
        {"rel_error": True},
        {"step_s": "1.0"},
    ],
)
def test_controller_rejects_bad_measurements(kwargs: dict[str, object]) -> None:
    c = controller(1.0)
    args: dict[str, object] = {"exposed_s": 0.05, "step_s": 0.1, "rel_error": 0.0, **kwargs}
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        c.update(**args)  # type: ignore[arg-type]
    assert c.level == 1.0
    assert c.history == []


@DETERMINISTIC
@given(
    start=st.sampled_from([i / 8 for i in range(17)]),
    exposed=st.floats(0.0, 10.0),
    step=st.floats(0.0, 10.0),
    err=st.floats(0.0, 1.0),
)
def test_controller_moves_by_the_table(
    start: float, exposed: float, step: float, err: float
) -> None:
    c = controller(start)
    share = exposed / step if step > 0 else 0.0
    if err > c.config.error_bound:
        move = -DOWN_STEP
    elif share > c.config.exposed_min:
        move = UP_STEP
    else:
        move = -HIDDEN_STEP
    got = c.update(exposed_s=exposed, step_s=step, rel_error=err)
    assert got == min(MAX_LEVEL, max(0.0, start + move))
    assert 0.0 <= got <= MAX_LEVEL


# -- relative_error and wire_bytes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("err2", "norm2", "expected"),
    [
        (0.0, 0.0, 0.0),
        (3.0, 0.0, 0.0),
        (0.0, 5.0, 0.0),
        (1.0, 4.0, 0.5),
        (4.0, 4.0, 1.0),
        (1.0, math.inf, math.inf),
        (math.inf, 4.0, math.inf),
        (0.0, math.nan, math.inf),
        (math.nan, 1.0, math.inf),
    ],
)
def test_relative_error(err2: float, norm2: float, expected: float) -> None:
    assert relative_error(err2, norm2) == expected


@pytest.mark.parametrize(("err2", "norm2"), [(-1.0, 1.0), (1.0, -1.0)])
def test_relative_error_rejects_negative_sums(err2: float, norm2: float) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        relative_error(err2, norm2)


def test_wire_bytes() -> None:
    formats = np.array([F32, BF16, E4M3, F32], dtype=np.uint8)
    counts = np.array([10, 10, 10, 3], dtype=np.int32)
    assert wire_bytes(formats, counts) == 40 + 20 + 10 + 12
    assert wire_bytes(np.zeros(0, np.uint8), np.zeros(0, np.int64)) == 0
    big = np.full(4, 2**31 - 1, dtype=np.int32)  # no int32 overflow
    assert wire_bytes(np.zeros(4, np.uint8), big) == 4 * 4 * (2**31 - 1)


@DETERMINISTIC
@given(
    data=st.lists(
        st.tuples(st.sampled_from([F32, BF16, E4M3]), st.integers(0, 1 << 20)), max_size=50
    )
)
def test_wire_bytes_matches_a_loop(data: list[tuple[int, int]]) -> None:
    formats = np.array([f for f, _ in data], dtype=np.uint8)
    counts = np.array([c for _, c in data], dtype=np.int64)
    assert wire_bytes(formats, counts) == sum(c * BYTES[f] for f, c in data)


@pytest.mark.parametrize(
    ("formats", "counts", "fragment"),
    [
        (np.array([0, 1], np.uint8), np.array([1, 1]), "format codes"),
        (np.array([0, 4], np.uint8), np.array([1, 1]), "format codes"),
        (np.array([0, -1], np.int64), np.array([1, 1]), "format codes"),
        (np.array([0, 300], np.int64), np.array([1, 1]), "format codes"),
        (np.array([0, 2], np.uint8), np.array([1, -1]), "counts must be >= 0"),
        (np.array([0, 2], np.uint8), np.array([1]), "equal length"),
        (np.zeros((2, 2), np.uint8), np.ones((2, 2), np.int64), "1-D"),
        (np.array([0.0, 2.0]), np.array([1, 1]), "integer"),
        (np.array([0, 2], np.uint8), np.array([1.0, 1.0]), "integer"),
    ],
)
def test_wire_bytes_rejects(formats: np.ndarray, counts: np.ndarray, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        wire_bytes(formats, counts)


# -- check_formats ---------------------------------------------------------------------------------


def test_check_formats_accepts_valid_codes() -> None:
    codes = np.array([F32, BF16, E4M3, F32], dtype=np.uint8)
    assert check_formats(codes, 4).tolist() == codes.tolist()
    assert check_formats(np.zeros(0, np.uint8), 0).shape == (0,)
    strided = np.array([BF16, 9, E4M3, 9], dtype=np.uint8)[::2]
    got = check_formats(strided, 2)
    assert got.flags.c_contiguous
    assert got.tolist() == [BF16, E4M3]


@pytest.mark.parametrize(
    ("codes", "n", "fragment"),
    [
        ([0, 2, 3], 3, "numpy array"),
        (np.array([0, 2, 3], np.int64), 3, "uint8"),
        (np.array([0, 2, 3], np.int8), 3, "uint8"),
        (np.array([0.0, 2.0]), 2, "uint8"),
        (np.array([0, 2, 3], np.uint8), 4, r"shape \(4,\)"),
        (np.array([0, 2, 3], np.uint8), 2, r"shape \(2,\)"),
        (np.zeros((3, 1), np.uint8), 3, "shape"),
        (np.array([0, 1, 3], np.uint8), 3, r"got \[1\]"),
        (np.array([0, 4, 255, 4], np.uint8), 4, r"got \[4, 255\]"),
        (np.array([0, 2], np.uint8), -1, "chunk count"),
        (np.array([0, 2], np.uint8), True, "chunk count"),
        (np.array([0, 2], np.uint8), 2.0, "chunk count"),
    ],
)
def test_check_formats_rejects(codes: object, n: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        check_formats(codes, n)  # type: ignore[arg-type]
