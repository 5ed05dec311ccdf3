"""Unit tests of gradlane.scheduling.pacing: controllers, registry and the token bucket."""

from __future__ import annotations

import copy

import pytest
from gradlane.scheduling.errors import ConfigError
from gradlane.scheduling.pacing import (
    BurstControl,
    CongestionController,
    FixedRate,
    LossTolerant,
    Pacer,
    PacingConfig,
    controller_names,
    make_controller,
    register_controller,
)
from hypothesis import given, settings
from hypothesis import strategies as st

DETERMINISTIC = settings(derandomize=True, deadline=None, max_examples=200)
RATE = 1e8


def controller(**kw: float) -> LossTolerant:
    c = make_controller(PacingConfig(initial_rate_Bps=RATE, **kw))  # type: ignore[arg-type]
    assert isinstance(c, LossTolerant)
    return c


def warm(c: CongestionController, rtt: float = 0.001) -> None:
    """Give the controller a base RTT without changing its rate."""
    c.on_ack(now=0.0, acked_bytes=0, rtt=rtt)


# -- config and registry ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"controller": "cubic"}, "valid names: fixed, loss-tolerant"),
        ({"min_rate_Bps": 0.0}, "rates"),
        ({"initial_rate_Bps": 1e5}, "rates"),
        ({"max_rate_Bps": 1e7}, "rates"),
        ({"burst_bytes": 0}, "burst_bytes"),
        ({"delay_threshold": 0.0}, "delay_threshold"),
        ({"delay_floor_s": -1.0}, "delay_floor_s"),
        ({"decrease": 1.0}, "decrease"),
        ({"decrease": 0.0}, "decrease"),
        ({"increase_Bps_per_s": -1.0}, "increase_Bps_per_s"),
        ({"increase_gain": -0.1}, "increase_gain"),
        ({"initial_rtt_s": 0.0}, "initial_rtt_s"),
        ({"rtt_alpha": 0.0}, "rtt_alpha"),
    ],
)
def test_config_validation(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        PacingConfig(**kwargs)  # type: ignore[arg-type]


def test_registry() -> None:
    assert {"fixed", "loss-tolerant"} <= set(controller_names())
    assert isinstance(make_controller(PacingConfig()), LossTolerant)
    assert isinstance(make_controller(PacingConfig(controller="fixed")), FixedRate)

    @register_controller("test-half")
    class Half(FixedRate):
        @property
        def rate_Bps(self) -> float:  # noqa: N802
            return self.config.initial_rate_Bps / 2

    assert Pacer(PacingConfig(controller="test-half")).rate_Bps == pytest.approx(0.625e9)
    with pytest.raises(ConfigError, match="already registered"):
        register_controller("test-half")(Half)


def test_abc_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError):
        CongestionController(PacingConfig())  # type: ignore[abstract]


# -- loss-tolerant controller ----------------------------------------------------------------------


def test_protected_loss_decreases_once_per_rtt() -> None:
    c = controller(decrease=0.7)
    warm(c, rtt=0.001)
    c.on_loss(now=0.0, lost_bytes=1000, protected=True)
    assert c.rate_Bps == pytest.approx(0.7 * RATE)
    # Same congestion event (within one RTT): no second decrease.
    c.on_loss(now=0.0005, lost_bytes=1000, protected=True)
    assert c.rate_Bps == pytest.approx(0.7 * RATE)
    c.on_loss(now=0.0011, lost_bytes=1000, protected=True)
    assert c.rate_Bps == pytest.approx(0.49 * RATE)
    assert c.decreases == 2


def test_droppable_loss_is_not_a_congestion_signal() -> None:
    c = controller()
    warm(c)
    for k in range(100):
        c.on_loss(now=k * 0.01, lost_bytes=10_000, protected=False)
    assert c.rate_Bps == RATE
    assert c.decreases == 0


def test_delay_growth_decreases() -> None:
    c = controller(delay_threshold=0.5, delay_floor_s=0.0001, decrease=0.7)
    warm(c, rtt=0.001)
    c.on_ack(now=0.001, acked_bytes=1000, rtt=0.0014)  # +40%: not congestion
    assert c.rate_Bps >= RATE
    before = c.rate_Bps
    c.on_ack(now=0.002, acked_bytes=1000, rtt=0.0016)  # +60%: congestion
    assert c.rate_Bps == pytest.approx(0.7 * before)


def test_delay_floor_ignores_jitter_on_tiny_rtts() -> None:
    c = controller(delay_threshold=0.5, delay_floor_s=0.0001)
    warm(c, rtt=20e-6)
    c.on_ack(now=0.001, acked_bytes=1000, rtt=60e-6)  # 3× min_rtt but only 40 µs of queue
    assert c.decreases == 0
    c.on_ack(now=0.002, acked_bytes=1000, rtt=200e-6)
    assert c.decreases == 1


def test_clean_acks_increase_additively_up_to_max() -> None:
    c = controller(increase_Bps_per_s=1e9, max_rate_Bps=2e8)
    warm(c, rtt=0.001)
    c.on_ack(now=0.0, acked_bytes=1000, rtt=0.001)
    c.on_ack(now=0.001, acked_bytes=1000, rtt=0.001)
    assert c.rate_Bps == pytest.approx(RATE + 1e6)
    t = 0.001
    for _ in range(1000):
        t += 0.001
        c.on_ack(now=t, acked_bytes=1000, rtt=0.001)
    assert c.rate_Bps == 2e8


def test_multiplicative_probe() -> None:
    c = controller(increase_Bps_per_s=0.0, increase_gain=0.1)
    warm(c, rtt=0.001)
    c.on_ack(now=0.0, acked_bytes=1000, rtt=0.001)
    c.on_ack(now=0.001, acked_bytes=1000, rtt=0.001)
    assert c.rate_Bps == pytest.approx(1.1 * RATE)


def test_idle_gap_earns_no_increase() -> None:
    c = controller(increase_Bps_per_s=1e9)
    warm(c, rtt=0.001)
    c.on_ack(now=0.0, acked_bytes=1000, rtt=0.001)
    c.on_ack(now=10.0, acked_bytes=1000, rtt=0.001)
    assert c.rate_Bps == pytest.approx(RATE + 1e6)  # one RTT's worth, not ten seconds'


def test_rate_never_below_min() -> None:
    c = controller(min_rate_Bps=1e7)
    for k in range(100):
        c.on_loss(now=float(k), lost_bytes=1, protected=True)
    assert c.rate_Bps == 1e7


def test_fixed_controller_ignores_feedback() -> None:
    c = make_controller(PacingConfig(controller="fixed", initial_rate_Bps=RATE))
    c.on_loss(now=0.0, lost_bytes=1000, protected=True)
    c.on_ack(now=1.0, acked_bytes=1000, rtt=10.0)
    assert c.rate_Bps == RATE


# -- pacer -----------------------------------------------------------------------------------------


def fixed_pacer(rate: float = 1e6, burst: int = 10_000) -> Pacer:
    return Pacer(
        PacingConfig(controller="fixed", initial_rate_Bps=rate, min_rate_Bps=1.0, burst_bytes=burst)
    )


def test_bucket_starts_full_and_refills_at_rate() -> None:
    p = fixed_pacer()
    assert p.allowance(10.0) == 10_000
    p.consume(10_000, 10.0)
    assert p.allowance(10.0) == 0
    assert p.allowance(10.005) == 5_000
    assert p.allowance(20.0) == 10_000  # capped at the burst


def test_next_send_time() -> None:
    p = fixed_pacer()
    p.consume(10_000, 0.0)
    t = p.next_send_time(0.0, 3000)
    assert t == pytest.approx(0.003, abs=1e-5)
    assert p.allowance(t) >= 3000
    assert p.next_send_time(t, 3000) == t
    # Larger than the bucket: goes once the bucket is full.
    big = p.next_send_time(t, 50_000)
    assert big == pytest.approx(0.01, abs=1e-5)
    assert p.allowance(big) >= 10_000 - 1


def test_consume_beyond_allowance_is_debt() -> None:
    p = fixed_pacer()
    p.allowance(0.0)
    p.consume(15_000, 0.0)
    assert p.allowance(0.0) == 0
    assert p.allowance(0.004) == 0  # still repaying 5000 bytes
    assert p.allowance(0.006) == 1000


def test_clock_going_backwards_earns_nothing() -> None:
    p = fixed_pacer()
    p.consume(10_000, 1.0)
    assert p.allowance(0.5) == 0
    assert p.allowance(1.001) == 1000


def test_consume_validates() -> None:
    with pytest.raises(ValueError):
        fixed_pacer().consume(-1, 0.0)


def test_pacer_follows_controller_rate() -> None:
    p = Pacer(PacingConfig(initial_rate_Bps=1e6, min_rate_Bps=1e3, burst_bytes=1000))
    p.consume(1000, 0.0)
    p.controller.on_loss(now=0.0, lost_bytes=100, protected=True)
    assert p.rate_Bps == pytest.approx(0.7e6)
    assert p.allowance(0.001) == 700


@DETERMINISTIC
@given(
    rate=st.floats(1e3, 1e10),
    burst=st.integers(1, 1 << 20),
    events=st.lists(
        st.tuples(st.floats(0.0, 0.01), st.integers(0, 1 << 20)), min_size=1, max_size=60
    ),
)
def test_token_bucket_never_exceeds_rate_times_time_plus_burst(
    rate: float, burst: int, events: list[tuple[float, int]]
) -> None:
    p = fixed_pacer(rate, burst)
    start = now = 1000.0
    sent = 0
    for dt, want in events:
        now += dt
        n = min(want, p.allowance(now))
        p.consume(n, now)
        sent += n
        assert sent <= rate * (now - start) + burst + 1
        t = p.next_send_time(now, want)
        assert t >= now
        if want <= burst:
            # Probe a copy: asking the pacer itself would move its clock to ``t``.
            assert copy.deepcopy(p).allowance(t) >= want


def test_next_send_time_is_a_pure_query() -> None:
    p = fixed_pacer()
    p.consume(10_000, 5.0)
    # A driver's get_timer() may not know ``now``; the answer is still absolute and nothing moves.
    assert p.next_send_time(0.0, 1000) == pytest.approx(5.001, abs=1e-5)
    assert p.next_send_time(0.0, 1000) == p.next_send_time(5.0, 1000)
    assert p.allowance(5.0) == 0
    assert fixed_pacer().next_send_time(3.0, 10**9) == 3.0


def test_a_smaller_depth_caps_the_tokens_and_the_wait() -> None:
    p = fixed_pacer()  # 1 MB/s, 10 kB deep
    assert p.depth == 10_000 and p.allowance(0.0) == 10_000
    p.set_depth(4_000)
    assert p.depth == 4_000 and p.allowance(0.0) == 4_000  # tokens above it dropped
    assert p.allowance(1.0) == 4_000  # and never refilled past it
    p.consume(4_000, 1.0)
    # Larger than the bucket: goes once the (smaller) bucket is full, 4 ms later.
    assert p.next_send_time(1.0, 9_000) == pytest.approx(1.004, abs=1e-5)
    p.set_depth(10_000)  # deeper again: tokens accrue up to it
    assert p.allowance(1.02) == 10_000
    with pytest.raises(ValueError, match="depth"):
        p.set_depth(0)


def test_a_burst_halves_on_loss_once_per_hold_and_grows_back_one_packet_at_a_time() -> None:
    b = BurstControl(32, 8, hold_s=0.002, grow_s=0.01, loss_thresh=0.0)  # every loss counts
    assert b.packets(0.0) == 32
    b.on_loss(1.0)
    assert b.packets(1.0) == 16
    b.on_loss(1.001)  # the same burst's other losses: no second cut within the hold...
    assert b.packets(1.001) == 16
    assert b.packets(1.0109) == 16  # ...but the growth restarts from the last loss
    assert b.packets(1.011) == 17
    b.on_loss(1.011)
    assert b.packets(1.011) == 8
    b.on_loss(1.02)
    assert b.packets(1.02) == 8  # never below the floor
    assert b.packets(1.02 + 0.01 * 23.5) == 31
    assert b.packets(1.02 + 0.01 * 1000) == 32  # nor above the top


def test_a_burst_is_cut_by_a_loss_rate_not_by_a_stray_loss() -> None:
    """2% of a window of at least four full bursts (128 datagrams here): two losses among
    them are no reason to shorten the bursts, a third is; among 1000 sent, 20 are not."""
    b = BurstControl(32, 8, hold_s=0.002, grow_s=0.01)
    b.on_sent(0.0, 100)
    b.on_loss(0.001, 2)
    assert b.packets(0.001) == 32 and b.cuts == 0
    b.on_loss(0.002)  # 3 of 128: the queue drops a share of every burst
    assert b.packets(0.002) == 16 and b.cuts == 1
    # A new window opened at the cut: the same burst's other losses found later count in it.
    b.on_loss(0.0021, 2)
    assert b.packets(0.0021) == 16
    # Many datagrams later (a window closes once 128 left and the hold passed; the rate is over
    # it and the one before): 20 lost of 1000 is 2%, not above it.
    b.on_sent(1.0, 200)
    b.on_sent(1.1, 1000)
    b.on_loss(1.1, 20)
    assert b.cuts == 1 and b.packets(1.1) == 32  # and the growth went on meanwhile
    b.on_loss(1.1)
    assert b.cuts == 2 and b.packets(1.1) == 16


def test_a_burst_with_equal_bounds_is_fixed() -> None:
    b = BurstControl(4, 4, hold_s=0.0, grow_s=0.001)
    b.on_loss(0.0)
    assert b.packets(0.0) == 4 and b.packets(5.0) == 4


@pytest.mark.parametrize(
    ("args", "fragment"),
    [((8, 16, 0.001, 0.01), "min_packets <= max_packets"), ((8, 0, 0.001, 0.01), "1 <="),
     ((8, 4, -1.0, 0.01), "hold_s"), ((8, 4, 0.001, 0.0), "grow_s"),
     ((8, 4, 0.001, 0.01, 1.0), "loss_thresh"), ((8, 4, 0.001, 0.01, -0.1), "loss_thresh")],
)  # fmt: skip
def test_burst_bounds_are_checked(args: tuple[float, ...], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        BurstControl(*args)
