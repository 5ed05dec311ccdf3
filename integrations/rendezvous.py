"""Endpoint exchange through torch's TCPStore (ARCHITECTURE §6, §7).

Under ``torchrun`` (or any ``env://`` launch) every rank already knows ``MASTER_ADDR`` and
``MASTER_PORT``: the TCPStore that ``init_process_group`` uses. :class:`StoreRendezvous` connects
to that store as one more client and keeps gradlane's keys apart from torch's in a
:class:`~torch.distributed.PrefixStore`::

    gradlane/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>/<channel>/<rank>

The run id keeps concurrent jobs on one store apart; the restart count keeps an elastic restart
from reading the addresses its crashed predecessor published. ``channel`` separates the
gradlane states of one job (each :class:`~gradlane.integrations.ddp.GradlaneState` takes its own). A
job under ``torchrun`` therefore needs no gradlane-specific configuration at all.

Every wait has a timeout, and a timeout is a :class:`RendezvousError` that says which rank was
missing, where it was looked for, and what usually causes it.

The same store shares the job secret that keys every packet's MAC when none is configured
(:func:`with_job_secret`): the first rank of a channel to ask puts a fresh random secret under
``<prefix>secret`` with one atomic ``compare_set``, and every rank of the channel gets that one.
So the ranks of one gradlane state always agree, whichever comes first, and each state (each
channel, each restart) gets its own key. The secret is only as private as the store: anyone who
can connect to ``MASTER_ADDR:MASTER_PORT`` can read it (docs/ddp-hook.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import secrets
import socket
from collections.abc import Mapping, Sequence

import torch.distributed as dist
from gradlane.scheduling.errors import ConfigError, GradlaneError
from gradlane.transport.config import SECRET_OFF, TransportConfig
from gradlane.transport.drivers.peers import Address, Rendezvous, check_address, check_port

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SECRET_KEY",
    "RendezvousError",
    "StoreRendezvous",
    "is_loopback",
    "local_hosts",
    "local_rank_and_world",
    "rank_and_world",
    "with_job_secret",
]

#: How long a rank waits for the store and for each peer's addresses (torch's default, too).
DEFAULT_TIMEOUT_S = 300.0
#: The store key, under a rendezvous' prefix, of its shared job secret.
SECRET_KEY = "secret"
#: Random bytes in a shared job secret; stored as hex text.
SECRET_BYTES = 32
_SECRET_TEXT = re.compile(f"[0-9a-f]{{{2 * SECRET_BYTES}}}")


class RendezvousError(GradlaneError):
    """The store could not be reached, or a rank did not publish its addresses in time."""


class StoreRendezvous(Rendezvous):
    """Per-rank path addresses in a torch.distributed ``Store``, under ``prefix``.

    ``store`` is any torch Store (a ``TCPStore``, the ``HashStore`` of a single-process test).
    :meth:`addresses` blocks until the rank has published, at most ``timeout_s``.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str = "gradlane/",
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        where: str = "the store",
    ) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"rendezvous timeout_s={timeout_s}: must be > 0 seconds")
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.timeout_s = timeout_s
        self.where = where
        self._base = store
        self._store = dist.PrefixStore(self.prefix.rstrip("/"), store)  # it adds the "/"

    @classmethod
    def from_env(
        cls,
        channel: str = "default",
        *,
        environ: Mapping[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> StoreRendezvous:
        """Connect to the job's TCPStore at ``MASTER_ADDR:MASTER_PORT`` (set by ``torchrun``).

        The prefix is ``gradlane/<TORCHELASTIC_RUN_ID or "none">/<TORCHELASTIC_RESTART_COUNT or
        0>/<channel>/``. Raises :class:`ConfigError` when the variables are missing and
        :class:`RendezvousError` when the store cannot be reached within ``timeout_s``.
        """
        env = os.environ if environ is None else environ
        addr, port_text = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not addr or not port_text:
            raise ConfigError(
                "MASTER_ADDR and MASTER_PORT are not set: launch with torchrun (which sets "
                "them), set them to the host and port of the job's TCPStore, or pass a "
                "rendezvous to GradlaneState"
            )
        try:
            port = int(port_text)
        except ValueError:
            raise ConfigError(f"MASTER_PORT={port_text!r} is not a port number") from None
        check_port(port, "MASTER_PORT")
        where = f"the TCPStore at {addr}:{port}"
        try:
            store = dist.TCPStore(
                addr,
                port,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as e:  # DistNetworkError/DistStoreError are RuntimeErrors
            raise RendezvousError(
                f"cannot reach {where} within {timeout_s:.0f}s ({e}); is rank 0 (or the "
                "torchrun agent) running, and are MASTER_ADDR/MASTER_PORT the job's?"
            ) from e
        run_id = env.get("TORCHELASTIC_RUN_ID", "none")
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"gradlane/{run_id}/{restart}/{channel}/"
        return cls(store, prefix, timeout_s=timeout_s, where=where)

    def channel(self, name: str) -> StoreRendezvous:
        """A rendezvous on the same store under ``<prefix><name>/`` (one per gradlane state)."""
        return StoreRendezvous(
            self._base, f"{self.prefix}{name}/", timeout_s=self.timeout_s, where=self.where
        )

    def shared_secret(self) -> str:
        """The job secret of this rendezvous' ranks (:data:`SECRET_BYTES` random bytes from
        :mod:`secrets`, as hex): the first rank to ask stores a fresh one under
        ``<prefix>secret``, every rank gets that one.

        One atomic ``compare_set``: no rank waits for another, and the store's own timeout
        bounds the request. The value appears in no log line or error message.
        """
        key = f"{self.prefix}{SECRET_KEY}"
        try:
            raw = self._store.compare_set(SECRET_KEY, "", secrets.token_hex(SECRET_BYTES))
        except (RuntimeError, OSError) as e:
            raise RendezvousError(
                f"cannot share the job secret through {self.where} (key {key}): {e}"
            ) from e
        value = raw.decode("ascii", errors="replace")
        if not _SECRET_TEXT.fullmatch(value):
            raise RendezvousError(
                f"the value under {key} in {self.where} is not a gradlane job secret (another "
                "program uses that key?): set GRADLANE_SECRET, or a distinct HookConfig.name"
            )
        return value

    def publish(self, rank: int, addrs: Sequence[Address]) -> None:
        """Store ``rank``'s addresses as JSON under ``<prefix><rank>`` (each checked as
        :func:`~gradlane.transport.drivers.peers.check_address` does, names resolved)."""
        value = [list(check_address(a, f"rank {rank} path {p}")) for p, a in enumerate(addrs)]
        if not value:
            raise ConfigError(f"rank {rank}: needs at least one path address")
        self._store.set(str(rank), json.dumps(value))

    def addresses(self, rank: int) -> list[Address]:
        """``rank``'s addresses; waits for them at most ``timeout_s``. Each is checked when
        read (an IP literal or a name that resolves, a port in 1..65535): a ``ConfigError``
        names the rank, the path and the key, rather than a timeout later."""
        key = str(rank)
        try:
            self._store.wait([key], datetime.timedelta(seconds=self.timeout_s))
            raw = self._store.get(key)
        except (RuntimeError, OSError) as e:
            raise RendezvousError(
                f"rank {rank} did not publish its gradlane addresses within "
                f"{self.timeout_s:.0f}s in {self.where} (key {self.prefix}{key}): every rank "
                "must create its GradlaneState (same order, same TORCHELASTIC_RUN_ID and "
                f"restart count); is rank {rank} alive? ({e})"
            ) from e
        try:
            entry = json.loads(raw)
            if not isinstance(entry, list) or not entry:
                raise TypeError("not a non-empty list")
        except (ValueError, TypeError) as e:
            raise RendezvousError(
                f"rank {rank}'s entry {self.prefix}{key} in {self.where} is not a list of "
                f"[host, port] pairs: {raw[:80]!r}"
            ) from e
        where = f"{self.where}, key {self.prefix}{key}"
        return [
            check_address(a, f"rank {rank} path {p} (published in {where})")
            for p, a in enumerate(entry)
        ]


def with_job_secret(
    config: TransportConfig, rendezvous: Rendezvous | None
) -> tuple[TransportConfig, str]:
    """``config`` with the secret its packets will be keyed with, and where that came from:

    - ``"configured"``: ``config.secret`` was set (code, ``GRADLANE_SECRET``, TOML): used as is;
    - ``"off"``: it is :data:`~gradlane.transport.config.SECRET_OFF`: unkeyed tags;
    - ``"shared"``: none was set and ``rendezvous`` is a :class:`StoreRendezvous`: the secret
      every rank of it gets (:meth:`StoreRendezvous.shared_secret`);
    - ``"none"``: none was set and there is no store to share one through: unkeyed tags.
    """
    if config.secret == SECRET_OFF:
        return config, "off"
    if config.secret:
        return config, "configured"
    if isinstance(rendezvous, StoreRendezvous):
        return dataclasses.replace(config, secret=rendezvous.shared_secret()), "shared"
    return config, "none"


def local_hosts(n_paths: int, master_addr: str | None) -> list[str]:
    """This rank's path addresses when none are configured.

    On loopback (no ``MASTER_ADDR``, or one that resolves to 127.0.0.0/8 or ``::1``): one
    address per path, 127.0.0.1, 127.0.0.2, ... Otherwise the address of the interface that
    routes toward ``MASTER_ADDR`` (found with an unconnected UDP ``connect``, no packet sent),
    which gives one path; more paths need their addresses configured.
    """
    if not master_addr or is_loopback(master_addr):
        return [f"127.0.0.{1 + p}" for p in range(n_paths)]
    if n_paths != 1:
        raise ConfigError(
            f"n_paths={n_paths} off loopback: give one local address per path "
            "(GRADLANE_HOOK__HOSTS=10.0.0.1,10.0.1.1 or HookConfig(hosts=...))"
        )
    try:
        info = socket.getaddrinfo(master_addr, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return [str(s.getsockname()[0])]
    except OSError as e:
        raise ConfigError(
            f"cannot find the local address that routes to MASTER_ADDR={master_addr} ({e}); "
            "set GRADLANE_HOOK__HOSTS"
        ) from e


def is_loopback(host: str) -> bool:
    """True when ``host`` is (or resolves only to) a loopback address."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return all(str(a).startswith("127.") or a == "::1" for a in addrs)


def _place(
    given: tuple[int | None, int | None],
    names: tuple[str, str],
    environ: Mapping[str, str] | None,
    hint: str,
    out_of_range: str,
) -> tuple[int, int]:
    """A (position, size) pair: the given values, else the environment variables ``names``.

    ConfigError: ``hint`` when one is missing or not an integer; ``out_of_range`` (formatted
    with ``pos`` and ``size``) when the position is not in ``[0, size)``.
    """
    env = os.environ if environ is None else environ
    try:
        pos, size = (int(env[n]) if v is None else v for v, n in zip(given, names, strict=True))
    except (KeyError, ValueError):
        raise ConfigError(hint) from None
    if not 0 <= pos < size:
        raise ConfigError(out_of_range.format(pos=pos, size=size))
    return pos, size


def rank_and_world(
    rank: int | None, world: int | None, environ: Mapping[str, str] | None = None
) -> tuple[int, int]:
    """This rank and the world size: arguments, else the process group, else RANK/WORLD_SIZE."""
    if (rank is None or world is None) and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world = dist.get_world_size() if world is None else world
    return _place(
        (rank, world),
        ("RANK", "WORLD_SIZE"),
        environ,
        "cannot tell this rank and the world size: call init_process_group first, "
        "set RANK and WORLD_SIZE (torchrun does), or pass rank= and world=",
        "rank {pos} is not in a world of {size}",
    )


def local_rank_and_world(
    local_rank: int | None, local_world: int | None, environ: Mapping[str, str] | None = None
) -> tuple[int, int]:
    """This rank among its host's trainers: arguments, else ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``."""
    return _place(
        (local_rank, local_world),
        ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        environ,
        "daemon mode needs this rank's place on its host: set LOCAL_RANK and "
        "LOCAL_WORLD_SIZE (torchrun does) or pass local_rank= and local_world=",
        "local rank {pos} is not in a host of {size} ranks",
    )
