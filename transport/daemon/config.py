"""Configuration of ``gradlane daemon``: one dataclass, built from TOML, flags and environment.

Precedence, lowest first: defaults, the TOML file (``[daemon]`` and ``[transport]`` tables),
``GRADLANE_DAEMON__<FIELD>`` environment variables, command-line flags. :func:`load` is the one
place that merges them (STYLE rule 8). Example file::

    [daemon]
    job = 7
    secret = "change-me"          # keys the inter-host packet tags (a keyed MAC)
    host_rank = 0                 # this host among `hosts` daemons
    hosts = 2
    socket = "/tmp/gradlane-7.sock"
    paths = ["10.0.0.1:47000", "10.0.1.1:47000"]   # local address (and port) per path
    rendezvous = "static"         # or "store"
    peers = [["10.0.0.1:47000", "10.0.1.1:47000"], ["10.0.0.2:47000", "10.0.1.2:47000"]]
    # store = "10.0.0.1:29600"    # rendezvous = "store": host 0 serves this TCPStore
    local_world = 4               # trainer ranks on this host (0: from the first HELLO)
    metrics = "127.0.0.1:9464"    # Prometheus text endpoint ("" = off)

    [transport]                   # any TransportConfig setting, nested tables too
    chunk_bytes = 8192
    [transport.loss]
    loss_bound = 0.02
    hard_deadline_s = 5.0
    on_hard_deadline = "degrade"
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gradlane.transport.config import (
    TransportConfig,
    check_types,
    env_settings,
    loopback_config,
)
from gradlane.transport.drivers.peers import Address, check_host
from gradlane.transport.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "DAEMON_ENV_PREFIX",
    "MAX_IPC_PATH",
    "DaemonConfig",
    "check_ipc_path",
    "default_socket",
    "load",
    "parse_address",
    "resolve_address",
]

#: Environment variables of :class:`DaemonConfig` (``GRADLANE_DAEMON__HOST_RANK=1``).
DAEMON_ENV_PREFIX = "GRADLANE_DAEMON__"
_RENDEZVOUS = ("static", "store")


def default_socket(job: int) -> str:
    """The IPC socket path a daemon and its trainers agree on when none is configured."""
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gradlane-{job}.sock")


def parse_address(text: str, default_port: int = 0, *, where: str = "address") -> Address:
    """``"host:port"`` (or ``"[v6]:port"``, or a bare host with ``default_port``); the syntax
    only (:func:`resolve_address` also checks that the host exists)."""
    if not isinstance(text, str):
        raise ConfigError(f"{where}: {text!r} is not a 'host:port' string")
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or (text.count(":") > 1 and not text.startswith("[")):
        host, port = text, str(default_port)
    host = host.strip("[]")
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"{where}: {text!r}: the port {port!r} is not a number") from None
    if not host or not 0 <= p < 65536:
        raise ConfigError(f"{where}: {text!r}: use host:port with a port in 0..65535")
    return host, p


def resolve_address(text: str, where: str, *, fixed_port: bool = False) -> Address:
    """:func:`parse_address` with the host checked (an IP literal, or a name that resolves;
    returned numeric) and, with ``fixed_port``, a port other than 0."""
    host, port = parse_address(text, where=where)
    if fixed_port and port == 0:
        raise ConfigError(f"{where}: {text!r} needs a fixed port (host:port, port 1..65535)")
    return check_host(host, where), port


#: Longest path of an ``ipc://`` (AF_UNIX) socket: ``sun_path`` holds 108 bytes with the NUL.
MAX_IPC_PATH = 107


def check_ipc_path(path: str, where: str) -> None:
    """``ConfigError`` when ``path`` cannot name an ``ipc://`` socket (too long for AF_UNIX)."""
    if len(os.fsencode(path)) > MAX_IPC_PATH:
        raise ConfigError(
            f"{where}: {path!r} is {len(os.fsencode(path))} bytes; an IPC socket path is at "
            f"most {MAX_IPC_PATH} (AF_UNIX): use a shorter path"
        )


@dataclass(frozen=True)
class DaemonConfig:
    """Everything one host's daemon needs (see the module docstring for the TOML form)."""

    job: int = 1
    """Job token: trainers of another job are refused; also the inter-host packets' token."""
    secret: str | None = field(default=None, repr=False)  # never printed: it keys every packet
    """Shared secret of the job's daemons (keys the packet tags); None = fast unkeyed tags."""
    host_rank: int = 0
    """This daemon's rank among the job's daemons (one per host)."""
    hosts: int = 1
    """Number of daemons (hosts) in the job."""
    socket: str = ""
    """Path of the ``ipc://`` socket the trainers connect to ('' = /tmp/gradlane-<job>.sock)."""
    paths: tuple[str, ...] = ("127.0.0.1",)
    """Local address per inter-host path, ``host`` or ``host:port`` (port 0/absent: any)."""
    rendezvous: str = "static"
    """``static`` (``peers``) or ``store`` (a TCPStore at ``store``; host 0 serves it)."""
    peers: tuple[tuple[str, ...], ...] = ()
    """Static peer list: per host rank, its ``host:port`` per path (fixed ports)."""
    store: str = ""
    """``host:port`` of the rendezvous TCPStore (``rendezvous = "store"``)."""
    local_world: int = 0
    """Trainer ranks on this host; 0 = as the first trainer's HELLO says."""
    metrics: str = "127.0.0.1:0"
    """``host:port`` of the Prometheus endpoint ('' = none; port 0 = any, logged)."""
    slot_timeout_s: float = 0.0
    """How long a (step, bucket) waits for every local rank; 0 = the hard deadline."""
    max_segment_bytes: int = 8 << 30
    """Largest shared-memory segment a trainer may name."""
    rendezvous_timeout_s: float = 300.0
    """How long to wait for the other daemons' addresses."""
    transport: TransportConfig = field(default_factory=lambda: loopback_config(n_paths=1))
    """The inter-host engine's settings (``[transport]``; ``job``/``secret`` come from here)."""
    _local: list[Address] = field(init=False, repr=False, compare=False, default_factory=list)
    _table: list[list[Address]] = field(init=False, repr=False, compare=False, default_factory=list)

    def __post_init__(self) -> None:
        check_types(self)
        if self.hosts < 1:
            raise ConfigError(f"hosts={self.hosts}: at least 1 (the daemons of the job)")
        if not 0 <= self.host_rank < self.hosts:
            raise ConfigError(f"host_rank={self.host_rank} is not in [0, hosts={self.hosts})")
        if self.rendezvous not in _RENDEZVOUS:
            raise ConfigError(f"rendezvous={self.rendezvous!r}: one of {_RENDEZVOUS}")
        if not self.paths:
            raise ConfigError("paths: give at least one local address")
        local = [resolve_address(p, f"paths[{i}]") for i, p in enumerate(self.paths)]
        if len(self.paths) != self.transport.n_paths:
            raise ConfigError(
                f"{len(self.paths)} path address(es) {list(self.paths)} but transport.n_paths="
                f"{self.transport.n_paths}: give one address per path"
            )
        table: list[list[Address]] = []
        for h, entry in enumerate(self.peers):
            if isinstance(entry, str) or len(entry) != len(self.paths):
                raise ConfigError(
                    f"peers[{h}] has {1 if isinstance(entry, str) else len(entry)} "
                    f"address(es), want {len(self.paths)} (one per path)"
                )
            table.append(
                [
                    resolve_address(a, f"peers[{h}] path {p}", fixed_port=True)
                    for p, a in enumerate(entry)
                ]
            )
        if self.hosts > 1 and self.rendezvous == "static":
            if len(self.peers) != self.hosts:
                raise ConfigError(
                    f"rendezvous='static' needs peers: one entry per host ({self.hosts}), "
                    f"got {len(self.peers)}"
                )
            for h, row in enumerate(table):
                for p, ((host, _), (peer_host, _)) in enumerate(zip(local, row, strict=True)):
                    if (":" in host) != (":" in peer_host):
                        raise ConfigError(
                            f"paths[{p}] {self.paths[p]!r} and peers[{h}] path {p} "
                            f"{self.peers[h][p]!r} are of different IP versions: a path's "
                            "addresses are all IPv4 or all IPv6"
                        )
            for p, (port, (_, own)) in enumerate(
                zip((a[1] for a in local), table[self.host_rank], strict=True)
            ):
                if port != own:
                    raise ConfigError(
                        f"paths[{p}] {self.paths[p]!r} binds port {port or 'any'} but "
                        f"peers[{self.host_rank}] (this host) says {own}: the other daemons "
                        "send to the peer list's port, so bind that one"
                    )
        if self.hosts > 1 and self.rendezvous == "store":
            resolve_address(self.store or ":", "store", fixed_port=True)
        if self.metrics:
            resolve_address(self.metrics, "metrics")
        check_ipc_path(self.socket_path, "socket")
        if self.local_world < 0 or self.max_segment_bytes < 1:
            raise ConfigError("local_world must be >= 0 (0 = learn) and max_segment_bytes >= 1")
        if self.slot_timeout_s < 0 or self.rendezvous_timeout_s <= 0:
            raise ConfigError("slot_timeout_s must be >= 0 and rendezvous_timeout_s > 0")
        if self.transport.job != self.job or self.transport.secret != self.secret:
            object.__setattr__(
                self,
                "transport",
                dataclasses.replace(self.transport, job=self.job, secret=self.secret),
            )
        # Resolved once, here: the planes take numeric addresses.
        object.__setattr__(self, "_local", local)
        object.__setattr__(self, "_table", table)

    @property
    def socket_path(self) -> str:
        """The IPC socket's path."""
        return self.socket or default_socket(self.job)

    @property
    def slot_timeout(self) -> float:
        """Seconds a partially-filled slot may wait."""
        return self.slot_timeout_s or self.transport.loss.hard_deadline_s

    def local_addrs(self) -> list[Address]:
        """The local ``(host, port)`` per path (host names resolved)."""
        return list(self._local)

    def peer_table(self) -> list[list[Address]]:
        """The static peer list as addresses (host names resolved); empty with one host or a
        store rendezvous."""
        return [list(entry) for entry in self._table]


_DAEMON_FIELDS = {f.name for f in dataclasses.fields(DaemonConfig) if f.init} - {"transport"}


def load(
    path: str | None = None,
    flags: Mapping[str, Any] | None = None,
    transport_flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DaemonConfig:
    """The daemon's config: defaults < TOML file < ``GRADLANE_DAEMON__*`` < ``flags``.

    ``flags`` are :class:`DaemonConfig` fields (None values ignored); ``transport_flags`` are
    nested :class:`TransportConfig` settings (e.g. ``{"loss": {"loss_bound": 0.02}}``).
    """
    doc: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read daemon config {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"daemon config {path} is not valid TOML: {e}") from None
        bad = sorted(set(doc) - {"daemon", "transport"})
        if bad:
            raise ConfigError(f"{path}: unknown table(s) {bad}; valid: [daemon], [transport]")
    values: dict[str, Any] = dict(doc.get("daemon", {}))
    env = os.environ if environ is None else environ
    values.update(env_settings(DaemonConfig, env, DAEMON_ENV_PREFIX))
    values.update({k: v for k, v in (flags or {}).items() if v is not None})
    bad = sorted(set(values) - _DAEMON_FIELDS)
    if bad:
        raise ConfigError(f"unknown daemon setting(s) {bad}; valid: {sorted(_DAEMON_FIELDS)}")
    for key in ("paths",):
        if key in values:
            values[key] = tuple(str(x) for x in values[key])
    if "peers" in values:
        values["peers"] = tuple(tuple(str(a) for a in entry) for entry in values["peers"])
    if values.get("secret") is not None:
        values["secret"] = str(values["secret"])
    paths = values.get("paths", DaemonConfig.paths)
    hosts = [resolve_address(p, f"paths[{i}]")[0] for i, p in enumerate(paths)]
    loopback = all(h.startswith("127.") for h in hosts)
    base = loopback_config(n_paths=len(paths)) if loopback else TransportConfig(n_paths=len(paths))
    tree = _merge(dataclasses.asdict(base), doc.get("transport", {}))
    tree = _merge(tree, dict(transport_flags or {}))
    try:
        values["transport"] = TransportConfig.from_mapping(tree)
    except TypeError as e:
        raise ConfigError(f"[transport]: {e}") from None
    try:
        return DaemonConfig(**values)
    except TypeError as e:
        raise ConfigError(f"daemon config: {e}") from None


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
