"""The PyTorch DDP communication hook over gradlane (ARCHITECTURE §7).

Usage::

    state = GradlaneState.from_env(model=ddp.module)   # after init_process_group
    ddp.register_comm_hook(state, gradlane_hook)
    ...                                                 # train as usual
    state.close()

Theory of operation
-------------------
DDP calls the hook on its autograd thread, once per gradient bucket, in ``bucket.index()``
order, and waits on every returned Future at the end of ``backward()`` — forever: it has no
timeout. So the hook only *enqueues*: it hands a zero-copy NumPy view of the bucket to the
data plane (a :class:`~gradlane.transport.drivers.plane.Plane`: the UDP
:class:`~gradlane.transport.drivers.udp.plane.UdpPlane` or the ZeroMQ plane) with
``scale=1/world`` — the plane scales only its own shard as the sum completes, so the mean
costs no pass over the bucket (DDP's own hook divides it first) — and returns a
``torch.futures.Future``. The plane's thread completes it: it checks the result's dtype and size
(DDP would silently accept a wrong one), copies it into ``bucket.buffer()`` and sets the Future.
Nothing in the hook blocks and nothing raises: any error — a late peer (``PeerTimeout``), a
closed plane, an unsupported dtype — fails the Future with a :class:`HookError` naming this
rank, the step and the bucket, and because the hook returns ``fut.then(lambda f: f.wait())``
the message reaches the ``RuntimeError`` that ``backward()`` raises (a bare failed Future would
lose it).

Transfers are keyed by (generation, step, bucket index). ``step`` counts the synchronised
backward passes of this state (it advances on ``bucket.is_last()``; ``no_sync()`` passes never
reach the hook, so every rank counts the same) and never goes back, so it alone names the
transfer on the wire. ``generation`` counts bucket layouts: DDP starts with one whole-model
bucket and rebuilds its buckets after the first backward (the second with ``static_graph``),
in reverse order and with new storage; the hook notices a bucket index whose size, dtype or
parameters changed, starts a new generation and recomputes what it caches per bucket (layer
position, whether it holds a pinned layer, staging buffer). Under ``join()`` ranks that ran
out of data call the hook with zero buckets, so they keep counting the same steps as the
others.

GPU buckets go through a pinned host buffer per bucket (allocated once per bucket layout and
reused every step): a non-blocking device-to-host copy and a CUDA event on the current stream
(the one that wrote the bucket's gradients), a staging thread that waits for the event (never
the autograd thread; a blocking-sync event, so it sleeps rather than spins a core through the
backward pass) and submits, and, on completion, a non-blocking host-to-device copy on a side
stream. The Future is created with the bucket's device and completed on that side stream, so
its event covers the copy and DDP's wait orders its stream after it. The next step reuses the
pinned buffer only after DDP has waited on this Future: its device-to-host copy is queued
behind that wait. The staging and plane threads select the bucket's device before any CUDA
call (a thread starts on device 0, and a rank on another device must not open a context
there).

In daemon mode (``mode="daemon"`` or ``GRADLANE_MODE=daemon``) the data plane is a
:class:`~gradlane.transport.daemon.client.DaemonPlane`: the host's ``gradlane daemon`` sums the
host's ranks and runs the inter-host all-reduce; the hook itself is the same.

One state serves one DDP instance. Per-step statistics (:class:`StepStats`) are kept by the
state (:meth:`GradlaneState.stats`) and logged every ``log_every`` steps. With
``HookConfig.timeline`` set, a :class:`~gradlane.integrations.timeline.Timeline` records every
bucket and the state writes it at ``close()``; unset, the hook only checks that it is unset.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from gradlane.integrations.buckets import BucketLayout, ParamOrder, numpy_view
from gradlane.integrations.rendezvous import (
    DEFAULT_TIMEOUT_S,
    StoreRendezvous,
    is_loopback,
    local_hosts,
    local_rank_and_world,
    rank_and_world,
    with_job_secret,
)
from gradlane.integrations.steps import StepLedger, StepStats
from gradlane.integrations.timeline import DEFAULT_MAX_EVENTS, Timeline, rank_path
from gradlane.scheduling.errors import ConfigError, GradlaneError
from gradlane.transport.config import (
    TransportConfig,
    check_types,
    env_settings,
    loopback_config,
)
from gradlane.transport.core.events import CollectiveReport
from gradlane.transport.daemon.client import DaemonPlane
from gradlane.transport.daemon.config import check_ipc_path, default_socket
from gradlane.transport.drivers.peers import Rendezvous, check_host
from gradlane.transport.drivers.plane import Plane
from gradlane.transport.drivers.udp.plane import InjectedLoss, UdpPlane
from gradlane.transport.drivers.zmq.plane import ZmqPlane, zmq_config
from gradlane.transport.wire.tag import TagKey

__all__ = [
    "HOOK_ENV_PREFIX",
    "GradlaneState",
    "HookConfig",
    "HookError",
    "StepStats",
    "gradlane_hook",
]

log = logging.getLogger(__name__)

#: Environment variables of :class:`HookConfig` (``GRADLANE_HOOK__TRANSPORT=zmq``); every other
#: ``GRADLANE_*`` variable is a :class:`~gradlane.transport.config.TransportConfig` setting.
HOOK_ENV_PREFIX = "GRADLANE_HOOK__"
_TRANSPORTS = ("udp", "zmq")
_MODES = ("embedded", "daemon")


class HookError(GradlaneError):
    """A bucket was not all-reduced; the message names the rank, step and bucket."""


@dataclass(frozen=True)
class HookConfig:
    """Knobs of the DDP hook itself (the transport's are in ``TransportConfig``).

    Environment: ``GRADLANE_HOOK__<FIELD>``, e.g. ``GRADLANE_HOOK__TRANSPORT=zmq``,
    ``GRADLANE_HOOK__HOSTS=10.0.0.1,10.0.1.1``, ``GRADLANE_HOOK__LOG_EVERY=50``.
    """

    transport: str = "udp"
    """``udp``: the UDP plane (priorities, bounded loss, multipath); ``zmq``: the reliable
    ZeroMQ data plane (TCP)."""
    hosts: tuple[str, ...] = ()
    """This rank's local address per path; empty: 127.0.0.1, 127.0.0.2, ... on loopback, else
    the address that routes to ``MASTER_ADDR`` (one path)."""
    log_every: int = 100
    """Log one line of statistics every this many steps (INFO, logger
    ``gradlane.integrations.ddp``); 0 = never."""
    history: int = 10_000
    """Per-step statistics kept (the oldest are dropped; totals keep counting)."""
    rendezvous_timeout_s: float = DEFAULT_TIMEOUT_S
    """How long to wait for the store and for every peer's addresses."""
    name: str = "default"
    """Names this job's gradlane states in the rendezvous store (with a per-process serial)."""
    mode: str = "embedded"
    """``embedded``: this process runs its own data plane; ``daemon``: buckets go to the host's
    ``gradlane daemon`` over IPC (``GRADLANE_MODE=daemon`` works too)."""
    daemon_socket: str = ""
    """Daemon mode: the daemon's IPC socket ('' = /tmp/gradlane-<job>.sock)."""
    connect_timeout_s: float = 60.0
    """Daemon mode: how long to wait for the daemon at start (it may start after the trainers)."""
    inject_loss: float = 0.0
    """Tests and demos only: the UDP plane drops this fraction of the datagrams it receives, at
    random, before the protocol sees them (an
    :class:`~gradlane.transport.drivers.udp.plane.InjectedLoss` seeded by the transport's
    ``seed`` and the rank), so that loss shows on a loopback that never loses. Always 0 on a
    real network; UDP only (ZeroMQ is reliable)."""
    timeline: str = ""
    """Record a timeline of every bucket and write it to this path at ``close()``, as Chrome
    trace-event JSON for https://ui.perfetto.dev (docs/ddp-hook.md); ``{rank}`` in it is
    replaced by the rank, else ``.rank<r>`` goes before the suffix. '' = off."""
    timeline_events: int = DEFAULT_MAX_EVENTS
    """Timeline events kept in memory (a few hundred bytes each); later ones are counted as
    dropped, not kept."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.transport not in _TRANSPORTS:
            raise ConfigError(
                f"transport={self.transport!r}: one of {', '.join(_TRANSPORTS)} "
                "(GRADLANE_HOOK__TRANSPORT)"
            )
        for i, host in enumerate(self.hosts):
            if not isinstance(host, str) or not host or any(c in host for c in " ,/[]"):
                bad = True
            elif ":" in host:  # only an IPv6 literal has colons: 'host:port' is not a host
                try:
                    ipaddress.ip_address(host)
                    bad = False
                except ValueError:
                    bad = True
            else:
                bad = False
            if bad:
                raise ConfigError(
                    f"hosts[{i}] (GRADLANE_HOOK__HOSTS): {host!r} is not a host; give one "
                    "IP address or host name per path, without a port"
                )
        if self.log_every < 0 or self.history < 1:
            raise ConfigError("log_every must be >= 0 (0 = never) and history >= 1")
        if self.rendezvous_timeout_s <= 0:
            raise ConfigError(f"rendezvous_timeout_s={self.rendezvous_timeout_s}: must be > 0")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name={self.name!r}: a non-empty name without '/'")
        if self.mode not in _MODES:
            raise ConfigError(f"mode={self.mode!r}: one of {', '.join(_MODES)} (GRADLANE_MODE)")
        if self.daemon_socket:
            check_ipc_path(self.daemon_socket, "daemon_socket (GRADLANE_HOOK__DAEMON_SOCKET)")
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"connect_timeout_s={self.connect_timeout_s}: must be > 0")
        if not 0.0 <= self.inject_loss < 1.0:
            raise ConfigError(
                f"inject_loss={self.inject_loss}: a fraction of datagrams in [0, 1) (0 = off)"
            )
        if self.inject_loss and self.transport == "zmq":
            raise ConfigError("inject_loss applies to the UDP plane only (ZeroMQ is reliable)")
        if "\0" in self.timeline:
            raise ConfigError(f"timeline={self.timeline!r}: a file path (GRADLANE_HOOK__TIMELINE)")
        if self.timeline_events < 1:
            raise ConfigError(f"timeline_events={self.timeline_events}: must be >= 1")

    def resolved_hosts(self) -> tuple[str, ...]:
        """``hosts`` as numeric addresses: IP literals as given, names resolved (IPv4); a
        ``ConfigError`` names a host that is neither. Checked when a plane is built from them,
        not at construction, so that a config can be written for another machine."""
        return tuple(
            check_host(h, f"hosts[{i}] (GRADLANE_HOOK__HOSTS)") for i, h in enumerate(self.hosts)
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HookConfig:
        """Build from ``GRADLANE_HOOK__*`` variables (names matched case-insensitively, values
        parsed by each field's type; ``hosts`` comma-separated) and ``GRADLANE_MODE``; unknown
        ones are an error naming them."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        if env.get("GRADLANE_MODE"):
            kwargs["mode"] = env["GRADLANE_MODE"].strip()
        kwargs.update(env_settings(cls, env, HOOK_ENV_PREFIX))
        return cls(**kwargs)


@dataclass(frozen=True)
class _Key:
    generation: int
    step: int
    bucket: int

    def __str__(self) -> str:
        return f"step {self.step} bucket {self.bucket} (layout generation {self.generation})"


_serials: dict[str, itertools.count[int]] = {}
_serials_lock = threading.Lock()


def _next_serial(name: str) -> int:
    with _serials_lock:
        return next(_serials.setdefault(name, itertools.count()))


class GradlaneState:
    """State of :func:`gradlane_hook`: configuration, the data plane, steps, statistics.

    Creating it starts the data plane and exchanges addresses with every other rank (all
    ranks create their states together, in the same order). ``transport`` defaults to
    ``loopback_config()`` when every path address is on loopback, else ``TransportConfig()``
    (``zmq_config()`` for ``transport="zmq"``); ``rank``/``world``
    default to the process group's; ``rendezvous`` defaults to the job's TCPStore
    (:meth:`StoreRendezvous.from_env`); ``model`` (the module DDP wraps) gives the exact layer
    order, which is otherwise learned from the first bucket. ``plane`` injects a started data
    plane instead (tests). :meth:`from_env` builds everything from ``GRADLANE_*`` variables.
    Without a ``transport.secret`` its packets are keyed with one shared through the store
    (:func:`~gradlane.integrations.rendezvous.with_job_secret`; :attr:`secret_source`).
    """

    def __init__(
        self,
        transport: TransportConfig | None = None,
        config: HookConfig | None = None,
        *,
        rank: int | None = None,
        world: int | None = None,
        rendezvous: Rendezvous | None = None,
        model: torch.nn.Module | None = None,
        plane: Plane | None = None,
        mode: str | None = None,
        local_rank: int | None = None,
        local_world: int | None = None,
    ) -> None:
        # -- who and how
        hook = config or HookConfig()
        if mode is not None and mode != hook.mode:
            hook = dataclasses.replace(hook, mode=mode)
        self.config = hook
        self.rank, self.world = rank_and_world(rank, world)
        self._scale = 1.0 / self.world  # DDP wants the mean; the plane scales as it reduces
        self._local = (local_rank, local_world)
        if transport is None:
            transport = _default_transport(hook, os.environ.get("MASTER_ADDR"))
        self.transport = transport
        # -- transfer keys: (generation, step, bucket index); see the module docstring
        self.generation = 0
        self.step = 0
        self._order = ParamOrder(model.parameters() if model is not None else None)
        self._layouts: dict[int, BucketLayout] = {}
        # -- statistics, written from the plane's thread
        self.ledger = StepLedger(self.rank, hook.history, hook.log_every)
        self._lock = self.ledger.lock
        # -- the timeline: None = off, and the hook's only cost is checking that
        self.timeline: Timeline | None = None
        if hook.timeline:  # checked before the plane starts: a bad path fails now, not at close
            self.timeline = Timeline(
                self.rank, self.world, path=rank_path(hook.timeline, self.rank),
                max_events=hook.timeline_events, what="timeline (GRADLANE_HOOK__TIMELINE)",
            )  # fmt: skip
        # -- GPU staging (created on the first CUDA bucket)
        self._stager: concurrent.futures.ThreadPoolExecutor | None = None
        self._h2d_streams: dict[torch.device, Any] = {}
        # -- the data plane
        self._closed = False
        self.secret_source = with_job_secret(transport, None)[1]  # the plane may change it
        self.plane: Plane = plane if plane is not None else self._start_plane(rendezvous)

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        rank: int | None = None,
        world: int | None = None,
        rendezvous: Rendezvous | None = None,
        model: torch.nn.Module | None = None,
        plane: Plane | None = None,
        **transport_overrides: Any,
    ) -> GradlaneState:
        """Configuration from ``GRADLANE_*`` variables (``GRADLANE_HOOK__*`` for the hook's
        own, the rest for the transport, e.g. ``GRADLANE_LOSS__LOSS_BOUND=0.02``);
        ``transport_overrides`` win over the environment."""
        env = dict(os.environ if environ is None else environ)
        hook = HookConfig.from_env(env)
        if hook.hosts and hook.mode == "embedded":  # a bad address is named now, not at a timeout
            hook = dataclasses.replace(hook, hosts=hook.resolved_hosts())
        tenv = {k: v for k, v in env.items() if not k.startswith(HOOK_ENV_PREFIX)}
        master = env.get("MASTER_ADDR")
        # The environment's settings on top of the defaults for this plane and network.
        transport = _overlay(
            _default_transport(hook, master),
            TransportConfig.from_env(tenv, **transport_overrides),
            TransportConfig(),
        )
        embedded = hook.mode == "embedded"
        if not hook.hosts and embedded:  # resolved here, so that ``environ`` is the only source
            hosts = local_hosts(transport.n_paths, master)
            hook = dataclasses.replace(hook, hosts=tuple(hosts))
        rank, world = rank_and_world(rank, world, env)
        if rendezvous is None and plane is None and embedded:
            rendezvous = StoreRendezvous.from_env(environ=env, timeout_s=hook.rendezvous_timeout_s)
        local_rank = local_world = None
        if not embedded:  # torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, read from ``environ``
            local_rank, local_world = local_rank_and_world(None, None, env)
        return cls(
            transport,
            hook,
            rank=rank,
            world=world,
            rendezvous=rendezvous,
            model=model,
            plane=plane,
            local_rank=local_rank,
            local_world=local_world,
        )

    # -- lifecycle -------------------------------------------------------------------------------
    def _start_plane(self, rendezvous: Rendezvous | None) -> Plane:
        hook, cfg = self.config, self.transport
        if hook.mode == "daemon":  # keyed, or not, by the daemon's own config
            self.secret_source = "daemon"
            return self._connect_daemon()
        hosts = list(hook.resolved_hosts()) or local_hosts(
            cfg.n_paths, os.environ.get("MASTER_ADDR")
        )
        if len(hosts) != cfg.n_paths:
            raise ConfigError(f"{len(hosts)} host(s) {hosts} for n_paths={cfg.n_paths}")
        rdv = rendezvous
        if rdv is None:
            rdv = StoreRendezvous.from_env(timeout_s=hook.rendezvous_timeout_s)
        if isinstance(rdv, StoreRendezvous):
            rdv = rdv.channel(f"{hook.name}.{_next_serial(hook.name)}.{hook.transport}")
        self.transport, self.secret_source = with_job_secret(cfg, rdv)  # before any packet
        cfg = self.transport
        if hook.transport == "udp":
            tap = InjectedLoss(hook.inject_loss, seed=cfg.seed) if hook.inject_loss else None
            udp = UdpPlane(
                self.rank, self.world, cfg, rendezvous=rdv, local_addrs=hosts, rx_tap=tap
            )
            udp.start()  # publishes, then looks every peer up (bounded by the timeout)
            return udp
        mine = [(h, _free_tcp_port(h)) for h in hosts]
        rdv.publish(self.rank, mine)
        endpoints = [[_tcp(h, p) for h, p in rdv.addresses(r)] for r in range(self.world)]
        return ZmqPlane(self.rank, self.world, cfg, endpoints).start()

    def _connect_daemon(self) -> Plane:
        """Daemon mode: the host's daemon is the data plane (waits for it, bounded)."""
        hook, cfg = self.config, self.transport
        local_rank, local_world = local_rank_and_world(*self._local)
        loss = cfg.loss
        client = DaemonPlane(
            hook.daemon_socket or default_socket(cfg.job),
            job=cfg.job,
            rank=self.rank,
            world=self.world,
            local_rank=local_rank,
            local_world=local_world,
            connect_timeout_s=hook.connect_timeout_s,
            # The daemon answers within its slot timeout plus its UDP plane's hard deadline; this
            # bound only catches a daemon that hangs without closing its socket.
            request_timeout_s=2 * loss.hard_deadline_s + 10.0,
        )
        return client.start()

    @property
    def tag_key(self) -> TagKey:
        """The key of this state's packet tags (``tag_key.keyed``: authenticated); in daemon
        mode the daemon's own ``secret`` decides instead."""
        return self.transport.tag_key

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Wait up to ``timeout_s`` until the peers have acknowledged what this rank sent them
        (:meth:`gradlane.transport.drivers.plane.Plane.drain`); True when nothing is owed.

        The end of a job, on every rank: ``state.drain()``, ``dist.barrier()``,
        ``state.close()``. A rank finishes its last step once it has received everything,
        while a peer may still miss a datagram of it (or an ACK of its own was lost): closing
        right away would leave that peer resending into silence for ``close``'s 2 s drain, and
        a warning. The barrier keeps every plane answering until all have drained.
        """
        if self._closed:
            return True
        return self.plane.drain(timeout_s)

    def close(self) -> None:
        """Stop the data plane (in-flight buckets fail); later buckets fail with a clear error.
        Then write the timeline, if one is recorded (a failure to write it is logged, not
        raised: ``close()`` often runs while another error is on its way)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.plane.close()
        finally:
            if self._stager is not None:
                self._stager.shutdown(wait=True)
            if self.timeline is not None:
                try:
                    self.timeline.write()
                except GradlaneError as e:
                    log.error("rank %d: %s", self.rank, e)

    def write_timeline(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the timeline recorded so far to ``path`` (``{rank}`` replaced by the rank;
        default: ``HookConfig.timeline``'s file for this rank) and return where. A
        ``HookError`` when no timeline is recorded; a ``TimelineError`` when it cannot be
        written."""
        if self.timeline is None:
            raise HookError(
                f"rank {self.rank} records no timeline: set HookConfig.timeline "
                "(GRADLANE_HOOK__TIMELINE) to a path"
            )
        if path is not None:
            path = os.fspath(path).replace("{rank}", str(self.rank))
        return self.timeline.write(path)

    def __enter__(self) -> GradlaneState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the hook --------------------------------------------------------------------------------
    def all_reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Enqueue one bucket; the Future resolves to ``bucket.buffer()`` holding the mean."""
        ready = time.monotonic()
        buf = bucket.buffer()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[buf.device] if buf.is_cuda else None
        )
        key = _Key(self.generation, self.step, -1)
        try:
            index, last, nbytes = bucket.index(), bucket.is_last(), buf.numel() * buf.element_size()
            key = _Key(self.generation, self.step, index)
            if last:
                self.step += 1  # before anything can fail: every rank keeps counting the same
            self.ledger.note_start(key.step, key.generation, nbytes, ready, last)
            if self.timeline is not None:
                self.timeline.bucket_ready(key.step, index, nbytes, ready, last)
            try:
                layout = self._layout(index, buf, bucket.parameters())
                key = _Key(self.generation, key.step, index)
                if self._closed:
                    raise HookError(
                        f"the gradlane {self.config.transport} data plane of rank {self.rank} "
                        "is closed (GradlaneState.close() was called): create a new "
                        "GradlaneState and register it to keep training"
                    )
                # The mean, not the sum: the plane scales its own shard by 1 / world as it
                # completes, and the gather brings the scaled values (no pass over the bucket).
                if buf.is_cuda:
                    self._submit_cuda(key, layout, buf, fut)
                else:
                    self._submit_cpu(key, layout, buf, fut)
            except Exception as e:
                self._complete(key, fut, error=e)
        except Exception as e:  # never raise into DDP: that would break it for good
            if not fut.done():
                _fail(fut, self._error(key, e))
        return fut.then(_wait)

    def _layout(self, index: int, buf: torch.Tensor, params: list[torch.Tensor]) -> BucketLayout:
        lay = self._layouts.get(index)
        if lay is not None and lay.matches(buf, params):
            return lay
        if lay is not None:  # this index now holds other parameters: DDP rebuilt its buckets
            self.generation += 1
            self._layouts.clear()
            log.debug("rank %d: bucket layout generation %d", self.rank, self.generation)
        lay = BucketLayout.of(index, buf, params, self._order, self.transport.priority)
        self._layouts[index] = lay
        return lay

    def _submit_cpu(
        self,
        key: _Key,
        layout: BucketLayout,
        buf: torch.Tensor,
        fut: torch.futures.Future[torch.Tensor],
    ) -> None:
        data = numpy_view(buf)  # the plane reads it on its thread; DDP waits before touching it
        # In place (out=data), as dist.all_reduce works: no result array, no copy back.
        cf = self.plane.submit(
            key.step, key.bucket, data, layout.position, layout.wire, out=data,
            scale=self._scale, pinned=layout.pinned,
        )  # fmt: skip
        cf.add_done_callback(lambda cf: self._on_result(cf, key, data, buf, fut, None))

    def _submit_cuda(
        self,
        key: _Key,
        layout: BucketLayout,
        buf: torch.Tensor,
        fut: torch.futures.Future[torch.Tensor],
    ) -> None:
        if layout.staging is None:
            layout.staging = torch.empty(layout.numel, dtype=layout.dtype, pin_memory=True)
        host = layout.staging
        # Both on the current stream of the bucket's device: the one the gradients were written
        # on, so the copy follows them and the event follows the copy.
        host.copy_(buf, non_blocking=True)
        copied = torch.cuda.Event(blocking=True)
        copied.record(torch.cuda.current_stream(buf.device))
        if self._stager is None:
            self._stager = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"gradlane-stage-r{self.rank}"
            )
        data = numpy_view(host)
        device = buf.device

        def stage() -> None:  # staging thread: the autograd thread never waits on the GPU
            try:
                with torch.cuda.device(device):
                    copied.synchronize()
                    cf = self.plane.submit(
                        key.step, key.bucket, data, layout.position, layout.wire, out=data,
                        scale=self._scale, pinned=layout.pinned,
                    )  # fmt: skip
                    cf.add_done_callback(lambda cf: self._on_result(cf, key, data, buf, fut, host))
            except Exception as e:
                self._complete(key, fut, error=e)

        self._stager.submit(stage)

    def _on_result(
        self,
        cf: concurrent.futures.Future[tuple[np.ndarray, CollectiveReport]],
        key: _Key,
        data: np.ndarray,
        buf: torch.Tensor,
        fut: torch.futures.Future[torch.Tensor],
        host: torch.Tensor | None,
    ) -> None:
        """On the plane's thread: check the result, write it into the bucket, set the Future."""
        try:
            result, report = cf.result()
            if result.dtype != data.dtype or result.shape != data.shape:
                raise HookError(
                    f"the data plane returned {result.dtype}[{result.size}] for a "
                    f"{data.dtype}[{data.size}] bucket"
                )
            if result is not data:  # a plane that returned a new array
                np.copyto(data, result)
            if host is not None:
                # Completed on the side stream: the Future's event then covers the copy.
                stream = self._h2d_stream(buf.device)
                with torch.cuda.device(buf.device), torch.cuda.stream(stream):
                    buf.copy_(host, non_blocking=True)
                    self._complete(key, fut, report=report, value=buf)
                return
        except Exception as e:
            self._complete(key, fut, error=e)
            return
        self._complete(key, fut, report=report, value=buf)

    def _h2d_stream(self, device: torch.device) -> Any:
        stream = self._h2d_streams.get(device)
        if stream is None:
            stream = self._h2d_streams[device] = torch.cuda.Stream(device)
        return stream

    def _complete(
        self,
        key: _Key,
        fut: torch.futures.Future[torch.Tensor],
        *,
        report: CollectiveReport | None = None,
        value: torch.Tensor | None = None,
        error: BaseException | None = None,
    ) -> None:
        self.ledger.note_done(key.step, key.generation, report, failed=error is not None)
        if self.timeline is not None:
            self.timeline.bucket_done(key.step, key.bucket, time.monotonic(), report=report,
                                      error=error, generation=key.generation)  # fmt: skip
        if fut.done():
            return
        if error is None:
            assert value is not None
            fut.set_result(value)
        else:
            _fail(fut, self._error(key, error))

    def _error(self, key: _Key, e: BaseException) -> HookError:
        if isinstance(e, HookError):
            text = str(e)
        else:
            text = f"{type(e).__name__}: {e}"
        err = HookError(f"gradlane hook on rank {self.rank}: {key} was not all-reduced: {text}")
        err.__cause__ = e
        return err

    # -- statistics ------------------------------------------------------------------------------
    def step_stats(self) -> list[StepStats]:
        """The kept per-step statistics, oldest first (completed steps only)."""
        return self.ledger.history()

    def stats(self, *, plane: bool = False) -> dict[str, Any]:
        """Totals and summaries of the completed steps; with ``plane``, the plane's counters too
        (never call that from a Future callback: it waits for the plane's thread)."""
        out: dict[str, Any] = {
            "rank": self.rank,
            "world": self.world,
            "transport": "daemon" if self.config.mode == "daemon" else self.config.transport,
            "generation": self.generation,
            "next_step": self.step,
            "keyed": self.tag_key.keyed,
            "secret_source": self.secret_source,
            **self.ledger.summary(),
        }
        if self.timeline is not None:
            out["timeline"] = {"events": self.timeline.events, "dropped": self.timeline.dropped}
        if plane:
            out["plane"] = self.plane.stats()
        return out


def gradlane_hook(
    state: GradlaneState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce ``bucket`` over gradlane (mean over ranks).

    Register with ``ddp.register_comm_hook(state, gradlane_hook)``. Never blocks, never raises;
    errors reach ``backward()`` naming the rank, step and bucket.
    """
    return state.all_reduce(bucket)


# DDP compares the hook's annotations with the real objects, and this module's are strings
# (``from __future__ import annotations``).
gradlane_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


def _fail(fut: torch.futures.Future[torch.Tensor], error: BaseException) -> None:
    fut.set_exception(error)  # type: ignore[arg-type]  # torch's annotation says T


def _wait(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    # Returned through ``then`` so that a failure's message survives into backward()'s error.
    return fut.wait()


def _default_transport(hook: HookConfig, master_addr: str | None) -> TransportConfig:
    """``zmq_config()`` for ZeroMQ; ``loopback_config()`` when every path is on loopback (the
    given hosts, or no hosts and a loopback ``MASTER_ADDR``); else ``TransportConfig()``."""
    if hook.transport == "zmq":
        return zmq_config()
    if hook.hosts:
        if all(is_loopback(h) for h in hook.hosts):
            return loopback_config(n_paths=len(hook.hosts))
        return TransportConfig(n_paths=len(hook.hosts))
    if not master_addr or is_loopback(master_addr):
        return loopback_config()
    return TransportConfig()


def _overlay(base: Any, changed: Any, default: Any) -> Any:
    """``base`` with every field where ``changed`` differs from ``default`` (nested per field)."""
    updates: dict[str, Any] = {}
    for f in dataclasses.fields(base):
        new, old = getattr(changed, f.name), getattr(default, f.name)
        if new == old:
            continue
        if dataclasses.is_dataclass(new):
            updates[f.name] = _overlay(getattr(base, f.name), new, old)
        else:
            updates[f.name] = new
    return dataclasses.replace(base, **updates) if updates else base


def _free_tcp_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
