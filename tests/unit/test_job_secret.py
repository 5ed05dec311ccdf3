"""The job secret's pure parts: the ``off`` spelling and its look-alikes, a secret hidden from
``repr`` and error messages, and :func:`with_job_secret` choosing and sharing a secret through a
store (a real in-memory ``HashStore``: no sockets)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from gradlane.integrations.rendezvous import (
    SECRET_KEY,
    RendezvousError,
    StoreRendezvous,
    with_job_secret,
)
from gradlane.scheduling.loss import LossConfig
from gradlane.transport.config import SECRET_OFF, TransportConfig, loopback_config
from gradlane.transport.drivers.peers import StaticPeers
from gradlane.transport.errors import ConfigError
from gradlane.transport.wire.tag import TagKey

SECRET = "a real secret, 2f8c1e"


# -- the off spelling ------------------------------------------------------------------------------
def test_off_gives_unkeyed_tags_from_code_and_environment():
    assert SECRET_OFF == "off"
    assert not TransportConfig(secret="off").tag_key.keyed
    cfg = TransportConfig.from_env({"GRADLANE_SECRET": "off"})
    assert cfg.secret == "off" and not cfg.tag_key.keyed


def test_a_real_secret_is_used_as_given():
    cfg = TransportConfig.from_env({"GRADLANE_SECRET": SECRET})
    assert cfg.secret == SECRET
    assert cfg.tag_key == TagKey.from_secret(SECRET) and cfg.tag_key.keyed


@pytest.mark.parametrize("unset", [{}, {"GRADLANE_SECRET": ""}])
def test_unset_or_empty_is_no_secret(unset: dict[str, str]):
    cfg = TransportConfig.from_env(unset)
    assert cfg.secret is None and not cfg.tag_key.keyed


LOOKALIKES = ["Off", "OFF", " off", "off ", "false", "False", "none", "None", "no", "0",
              "null", "disabled", "unkeyed", "auto", "on", "true", "1"]  # fmt: skip


@pytest.mark.parametrize("value", LOOKALIKES)
def test_a_switch_word_is_refused_naming_it(value: str):
    with pytest.raises(ConfigError, match="reads as a switch") as e:
        TransportConfig(secret=value)
    assert repr(value) in str(e.value) and "'off'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        TransportConfig.from_env({"GRADLANE_SECRET": value})
    assert repr(value) in str(e.value) and "GRADLANE_SECRET" in str(e.value)


# -- masking ---------------------------------------------------------------------------------------
def test_repr_hides_a_secret_and_shows_everything_else():
    cfg = loopback_config(secret=SECRET, loss=LossConfig(loss_bound=0.01))
    text = repr(cfg)
    assert SECRET not in text and "secret=<hidden>" in text
    assert text.startswith("TransportConfig(job=1, ")
    assert "chunk_bytes=65000" in text and "loss_bound=0.01" in text
    assert SECRET not in repr(dataclasses.replace(cfg, chunk_bytes=8192))
    assert SECRET not in str(cfg) and SECRET not in f"{cfg!r} {cfg}"


@pytest.mark.parametrize(("secret", "shown"), [(None, "secret=None"), ("off", "secret='off'")])
def test_repr_shows_no_secret_and_off_as_they_are(secret: str | None, shown: str):
    assert shown in repr(TransportConfig(secret=secret))


def test_a_secret_of_the_wrong_type_is_refused_without_showing_it():
    with pytest.raises(ConfigError, match="secret=<hidden>: must be text") as e:
        TransportConfig(secret=918273645)  # type: ignore[arg-type]
    assert "918273645" not in str(e.value)


# -- choosing and sharing the secret ---------------------------------------------------------------
def test_ranks_of_one_channel_share_one_fresh_secret():
    store = dist.HashStore()
    rdv = [StoreRendezvous(store, "gradlane/run/0/default/") for _ in range(3)]
    got = [with_job_secret(TransportConfig(), r) for r in rdv]
    assert [source for _, source in got] == ["shared"] * 3
    secrets = {cfg.secret for cfg, _ in got}
    assert len(secrets) == 1
    secret = secrets.pop()
    assert secret is not None and len(secret) == 64 and int(secret, 16) >= 0  # 32 bytes as hex
    assert all(cfg.tag_key.keyed for cfg, _ in got)
    assert store.get(f"gradlane/run/0/default/{SECRET_KEY}").decode() == secret


def test_channels_and_stores_get_their_own_secrets():
    store = dist.HashStore()
    base = StoreRendezvous(store, "gradlane/run/0/default/")
    a = base.channel("default.0.udp").shared_secret()
    b = base.channel("default.1.udp").shared_secret()
    other = StoreRendezvous(dist.HashStore(), "gradlane/run/0/default/").shared_secret()
    assert len({a, b, other}) == 3
    assert base.channel("default.0.udp").shared_secret() == a  # asked again: the same one


@pytest.mark.parametrize(
    ("secret", "source"), [(SECRET, "configured"), ("off", "off")], ids=["configured", "off"]
)
def test_a_configured_secret_or_off_wins_and_leaves_the_store_alone(secret: str, source: str):
    store = dist.HashStore()
    cfg = TransportConfig(secret=secret)
    assert with_job_secret(cfg, StoreRendezvous(store)) == (cfg, source)
    assert store.num_keys() == 0


def test_without_a_store_nothing_is_shared():
    cfg = TransportConfig()
    assert with_job_secret(cfg, None) == (cfg, "none")
    assert with_job_secret(cfg, StaticPeers({0: [("127.0.0.1", 1)]})) == (cfg, "none")


def test_a_foreign_value_under_the_key_is_an_error_that_does_not_show_it():
    store = dist.HashStore()
    store.set(f"gradlane/x/{SECRET_KEY}", "not-a-gradlane-secret")
    with pytest.raises(RendezvousError, match=f"gradlane/x/{SECRET_KEY}") as e:
        with_job_secret(TransportConfig(), StoreRendezvous(store, "gradlane/x/"))
    assert "not-a-gradlane-secret" not in str(e.value)
