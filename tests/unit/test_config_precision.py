"""``TransportConfig.precision``: set by a policy's name (in code, a mapping or the
environment) or a table, validated, and refused with ``rotate``."""

from __future__ import annotations

import pytest
from gradlane.scheduling.precision import PrecisionConfig
from gradlane.transport.config import TransportConfig
from gradlane.transport.errors import ConfigError


def test_a_policy_name_alone_selects_it():
    assert TransportConfig().precision == PrecisionConfig()  # f32: off
    assert TransportConfig(precision="adaptive").precision.policy == "adaptive"
    assert TransportConfig.from_mapping({"precision": "bf16"}).precision.policy == "bf16"
    table = TransportConfig.from_mapping({"precision": {"policy": "e4m3", "error_bound": 0.2}})
    assert table.precision == PrecisionConfig(policy="e4m3", error_bound=0.2)


def test_the_environment_takes_a_name_and_the_table_fields():
    env = {"GRADLANE_PRECISION": "adaptive", "GRADLANE_PRECISION__ERROR_BOUND": "0.1",
           "GRADLANE_PRECISION__ERROR_FEEDBACK": "false"}  # fmt: skip
    cfg = TransportConfig.from_env(env)
    assert cfg.precision == PrecisionConfig(
        policy="adaptive", error_bound=0.1, error_feedback=False
    )


def test_bad_settings_say_what_is_wrong():
    with pytest.raises(ConfigError, match="not registered"):
        TransportConfig(precision="fp4")
    with pytest.raises(ConfigError, match="error_bound"):
        TransportConfig.from_mapping({"precision": {"policy": "adaptive", "error_bound": 0}})
    with pytest.raises(ConfigError, match="cannot be combined"):
        TransportConfig(rotate=True, precision="bf16")
    assert TransportConfig(rotate=True).rotate  # float32 with rotation is fine


def test_the_daemons_toml_takes_a_name_or_a_table(tmp_path):
    from gradlane.transport.daemon.config import load

    named = tmp_path / "named.toml"
    named.write_text('[transport]\nprecision = "adaptive"\n')
    assert load(str(named)).transport.precision.policy == "adaptive"
    table = tmp_path / "table.toml"
    table.write_text('[transport.precision]\npolicy = "e4m3"\nerror_bound = 0.1\n')
    assert load(str(table)).transport.precision == PrecisionConfig(policy="e4m3", error_bound=0.1)
