"""Configuration is validated where it enters: a bad address, name or size is a ConfigError that
names the value and where it came from, not a timeout or a TypeError later."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from gradlane.integrations.ddp import HookConfig
from gradlane.integrations.rendezvous import StoreRendezvous
from gradlane.scheduling.pacing import PacingConfig
from gradlane.transport.config import TransportConfig, loopback_config
from gradlane.transport.daemon.config import DaemonConfig, load
from gradlane.transport.drivers import peers
from gradlane.transport.drivers.peers import StaticPeers
from gradlane.transport.errors import ConfigError

BAD = "not-an-ip.invalid"  # .invalid never resolves (RFC 6761)


# -- addresses -------------------------------------------------------------------------------
def test_static_peers_name_a_bad_host_with_its_rank_and_path():
    with pytest.raises(ConfigError, match=rf"peer 2 path 0: '{BAD}' is not an IP address and"):
        StaticPeers({0: [("127.0.0.1", 5000)], 2: [(BAD, 5000)]})
    with pytest.raises(ConfigError, match="peer 1 path 1: port 70000"):
        StaticPeers([[("127.0.0.1", 1)], [("127.0.0.1", 2), ("127.0.0.2", 70000)]])
    with pytest.raises(ConfigError, match="peer 0 path 0: port 0"):
        StaticPeers([[("127.0.0.1", 0)]])


def test_static_peers_keep_literals_and_resolve_names_once():
    table = StaticPeers({0: [("127.0.0.1", 5000), ("::1", 5001)], 1: [("localhost", 5002)]})
    assert table.addresses(0) == [("127.0.0.1", 5000), ("::1", 5001)]
    [(host, port)] = table.addresses(1)
    assert host.startswith("127.") and port == 5002  # numeric: the sendmmsg path needs it


def test_check_host_rejects_empty_and_non_text():
    for bad in ("", " ", None, 12):
        with pytest.raises(ConfigError, match="where: "):
            peers.check_host(bad, "where")


def test_daemon_config_names_the_bad_peer_and_path():
    base = dict(host_rank=0, hosts=2, paths=("127.0.0.1:47000",), metrics="")
    with pytest.raises(ConfigError, match=rf"peers\[1\] path 0: '{BAD}' is not an IP address"):
        DaemonConfig(**base, peers=(("127.0.0.1:47000",), (f"{BAD}:47001",)))
    with pytest.raises(ConfigError, match=rf"paths\[0\]: '{BAD}' is not an IP address"):
        DaemonConfig(paths=(BAD,), metrics="")
    with pytest.raises(ConfigError, match=r"metrics: 'nowhere.invalid'"):
        DaemonConfig(metrics="nowhere.invalid:9000")


def test_daemon_flags_and_env_name_the_bad_address(tmp_path):
    with pytest.raises(ConfigError, match=rf"peers\[1\] path 0: '{BAD}'"):
        load(
            flags={
                "hosts": 2,
                "paths": ["127.0.0.1:47000"],
                "peers": [["127.0.0.1:47000"], [f"{BAD}:47000"]],
            },
            environ={},
        )
    env = {
        "GRADLANE_DAEMON__HOSTS": "2",
        "GRADLANE_DAEMON__PATHS": "127.0.0.1:47000",
        "GRADLANE_DAEMON__PEERS": f"127.0.0.1:47000;{BAD}:47000",
    }
    with pytest.raises(ConfigError, match=rf"peers\[1\] path 0: '{BAD}'"):
        load(environ=env)
    env["GRADLANE_DAEMON__PEERS"] = "127.0.0.1:47000;127.0.0.2:47000"
    assert load(environ=env).peer_table() == [[("127.0.0.1", 47000)], [("127.0.0.2", 47000)]]


def test_daemon_config_resolves_names_once():
    cfg = DaemonConfig(
        paths=("localhost:47000",),
        hosts=2,
        peers=(("localhost:47000",), ("127.0.0.2:47001",)),
        metrics="",
    )
    assert cfg.local_addrs()[0][0].startswith("127.")
    assert cfg.peer_table()[0][0][0].startswith("127.")


def test_hook_hosts_are_checked():
    with pytest.raises(ConfigError, match=r"hosts\[0\] \(GRADLANE_HOOK__HOSTS\): '10.0.0.1:5'"):
        HookConfig(hosts=("10.0.0.1:5",))
    bad = HookConfig.from_env({"GRADLANE_HOOK__HOSTS": f"127.0.0.1,{BAD}"})
    with pytest.raises(ConfigError, match=rf"hosts\[1\] \(GRADLANE_HOOK__HOSTS\): '{BAD}' is not"):
        bad.resolved_hosts()
    assert HookConfig(hosts=("127.0.0.1", "::1")).resolved_hosts() == ("127.0.0.1", "::1")


def test_store_rendezvous_checks_published_addresses_with_the_rank():
    store = dist.HashStore()
    rdv = StoreRendezvous(store, "gradlane/t/0/x/", timeout_s=0.5)
    with pytest.raises(ConfigError, match=rf"rank 0 path 0: '{BAD}'"):
        rdv.publish(0, [(BAD, 5000)])
    # Another rank's entry, written by a peer that did not check: named when read.
    dist.PrefixStore("gradlane/t/0/x", store).set("3", json.dumps([["127.0.0.1", 1], [BAD, 2]]))
    with pytest.raises(ConfigError, match=rf"rank 3 path 1 \(published in .*x/3\): '{BAD}'"):
        rdv.addresses(3)
    dist.PrefixStore("gradlane/t/0/x", store).set("4", json.dumps([["127.0.0.1", 0]]))
    with pytest.raises(ConfigError, match=r"rank 4 path 0 .*port 0"):
        rdv.addresses(4)


def test_master_port_out_of_range_is_named():
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        StoreRendezvous.from_env(environ={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"})


# -- environment -----------------------------------------------------------------------------
def test_mixed_case_fields_come_from_the_environment():
    cfg = TransportConfig.from_env(
        {
            "GRADLANE_NIC_RATE_BPS": "1e9",
            "GRADLANE_PACING__INITIAL_RATE_BPS": "2e9",
            "GRADLANE_PACING__INCREASE_BPS_PER_S": "3e9",
            "GRADLANE_PATHS__INITIAL_RATE_BPS": "4e8",
        }
    )
    assert cfg.nic_rate_Bps == 1e9 and cfg.pacing.initial_rate_Bps == 2e9
    assert cfg.pacing.increase_Bps_per_s == 3e9 and cfg.paths.initial_rate_Bps == 4e8


def test_values_are_parsed_by_the_fields_type():
    cfg = TransportConfig.from_env(
        {
            "GRADLANE_SECRET": "123456",
            "GRADLANE_ACK_DELAY_S": "1",
            "GRADLANE_ROTATE": "1",
            "GRADLANE_LOSS__ON_HARD_DEADLINE": "degrade",
            "GRADLANE_LOSS__GATHER_LOSS_BOUND": "none",
            "GRADLANE_PACING__CONTROLLER": "fixed",
        }
    )
    assert cfg.secret == "123456" and cfg.tag_key == TransportConfig(secret="123456").tag_key
    assert isinstance(cfg.ack_delay_s, float) and cfg.rotate is True
    assert cfg.loss.on_hard_deadline == "degrade" and cfg.loss.gather_loss_bound is None
    assert cfg.pacing.controller == "fixed"
    with pytest.raises(ConfigError, match="GRADLANE_CHUNK_BYTES='lots': an integer"):
        TransportConfig.from_env({"GRADLANE_CHUNK_BYTES": "lots"})
    with pytest.raises(ConfigError, match="GRADLANE_ROTATE='maybe': a boolean"):
        TransportConfig.from_env({"GRADLANE_ROTATE": "maybe"})
    with pytest.raises(ConfigError, match="GRADLANE_LOSS__ON_HARD_DEADLINE='shrug': one of"):
        TransportConfig.from_env({"GRADLANE_LOSS__ON_HARD_DEADLINE": "shrug"})
    with pytest.raises(ConfigError, match="unknown setting GRADLANE_LOSS__NOPE"):
        TransportConfig.from_env({"GRADLANE_LOSS__NOPE": "1"})
    with pytest.raises(ConfigError, match="GRADLANE_LOSS: \\[loss\\] is a table"):
        TransportConfig.from_env({"GRADLANE_LOSS": "1"})


def test_other_components_variables_are_not_transport_settings():
    env = {"GRADLANE_NO_MMSG": "1", "GRADLANE_LOG": "debug", "GRADLANE_DAEMON__HOSTS": "2"}
    assert TransportConfig.from_env(env) == TransportConfig()


def test_overrides_merge_into_a_table_from_the_environment():
    cfg = TransportConfig.from_env(
        {"GRADLANE_LOSS__LOSS_BOUND": "0.02"}, loss={"hard_deadline_s": 3.0}
    )
    assert cfg.loss.loss_bound == 0.02 and cfg.loss.hard_deadline_s == 3.0
    pacing = PacingConfig(controller="fixed")
    assert TransportConfig.from_env({}, pacing=pacing).pacing == pacing


def test_daemon_secret_from_the_environment_stays_text():
    cfg = load(environ={"GRADLANE_DAEMON__SECRET": "0042", "GRADLANE_DAEMON__JOB": "7"})
    assert cfg.secret == "0042" and cfg.transport.secret == "0042" and cfg.job == 7


# -- values that used to fail later ----------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"seed": -1}, "seed=-1"),
        ({"linger_s": -1.0}, "linger_s=-1.0"),
        ({"early_buffer_bytes": -1}, "early_buffer_bytes=-1"),
        ({"chunk_bytes": "8192"}, "chunk_bytes='8192': must be an integer"),
        ({"tick_s": "0.001"}, "tick_s='0.001': must be a number"),
        ({"rotate": "no"}, "rotate='no': must be a boolean"),
        ({"secret": 1234}, "secret=<hidden>: must be text"),
    ],
)
def test_transport_config_rejects(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        TransportConfig(**kwargs)


def test_daemon_config_rejects_what_would_fail_later(tmp_path):
    with pytest.raises(ConfigError, match="hosts=0"):
        DaemonConfig(hosts=0)
    with pytest.raises(ConfigError, match=r"socket: .* at most 107"):
        DaemonConfig(socket="/tmp/" + "x" * 120, metrics="")
    with pytest.raises(ConfigError, match="peers\\[1\\] has 2 address"):
        DaemonConfig(
            hosts=2, paths=("127.0.0.1:1",), peers=(("127.0.0.1:1",), ("a:1", "b:2")), metrics=""
        )
    # This host's bound port must be the one the peer list gives the others.
    with pytest.raises(ConfigError, match=r"paths\[0\] '127.0.0.1' binds port any"):
        DaemonConfig(hosts=2, paths=("127.0.0.1",), peers=(("127.0.0.1:1",), ("127.0.0.2:2",)))
    with pytest.raises(ConfigError, match="different IP versions"):
        DaemonConfig(
            hosts=2, paths=("127.0.0.1:1",), peers=(("127.0.0.1:1",), ("[::1]:2",)), metrics=""
        )
    with pytest.raises(ConfigError, match="store: "):
        DaemonConfig(hosts=2, rendezvous="store", store="127.0.0.1:0", metrics="")
    with pytest.raises(ConfigError, match="job='7': must be an integer"):
        DaemonConfig(job="7")


def test_hook_config_rejects_what_would_fail_later():
    with pytest.raises(ConfigError, match="daemon_socket"):
        HookConfig(daemon_socket="/tmp/" + "y" * 120)
    with pytest.raises(ConfigError, match="log_every='5': must be an integer"):
        HookConfig(log_every="5")


def test_valid_configurations_still_build():
    assert loopback_config().n_paths == 2
    assert TransportConfig(seed=2**40, linger_s=0.0, early_buffer_bytes=0).seed == 2**40
    DaemonConfig(paths=("127.0.0.1", "127.0.0.2"), transport=loopback_config(), metrics="")
    HookConfig(hosts=("127.0.0.1", "127.0.0.2"), daemon_socket="/tmp/g.sock")
