"""``gradlane daemon``: run this host's transport daemon until SIGTERM (ARCHITECTURE §6).

One daemon per host; the host's trainers run with ``GRADLANE_MODE=daemon``. Configuration:
``--config FILE`` (TOML, see :mod:`gradlane.transport.daemon.config`), ``GRADLANE_DAEMON__*``
variables, then the flags below. With ``--rendezvous store`` the daemons find each other through a
TCPStore at ``--store HOST:PORT`` that host 0's daemon serves. The line ``gradlane daemon: ready
...`` on stdout says it serves; SIGTERM or SIGINT drains and removes its socket and shared memory.
The exit code is 0 after a clean stop, 1 when the daemon stopped on an error, 2 when it could not
start.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import signal
import sys
import time
from typing import Any

from gradlane.integrations.cli.command import emit
from gradlane.integrations.rendezvous import RendezvousError, StoreRendezvous
from gradlane.scheduling.errors import GradlaneError
from gradlane.transport.daemon.config import DaemonConfig, load, parse_address
from gradlane.transport.daemon.server import Daemon

__all__ = ["JsonFormatter", "add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The daemon's flags (each overrides the TOML file and the environment)."""
    p.add_argument("--config", metavar="FILE", help="TOML file with [daemon] and [transport]")
    p.add_argument("--job", type=int, help="job token (trainers must use the same, GRADLANE_JOB)")
    p.add_argument("--secret", help="shared secret of the job's daemons (keyed packet tags)")
    p.add_argument("--host-rank", type=int, help="this host's rank among the daemons")
    p.add_argument("--hosts", type=int, help="number of hosts (daemons)")
    p.add_argument("--socket", metavar="PATH", help="IPC socket (default /tmp/gradlane-<job>.sock)")
    p.add_argument(
        "--path",
        action="append",
        metavar="ADDR[:PORT]",
        dest="paths",
        help="local address per inter-host path (repeat for several paths)",
    )
    p.add_argument(
        "--peers",
        metavar="H:P,H:P;H:P,H:P",
        help="static peer list: hosts separated by ';', paths by ','",
    )
    p.add_argument("--rendezvous", choices=("static", "store"))
    p.add_argument(
        "--store", metavar="HOST:PORT", help="TCPStore of the rendezvous (host 0 serves)"
    )
    p.add_argument("--local-world", type=int, help="trainer ranks on this host (0: learn)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="Prometheus endpoint ('' = off)")
    p.add_argument("--loss-bound", type=float, help="loss bound of the inter-host all-reduce")
    p.add_argument("--hard-deadline", type=float, help="hard deadline of a collective (s)")
    p.add_argument("--on-hard-deadline", choices=("raise", "degrade"))
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("--log-level", default="INFO")


class JsonFormatter(logging.Formatter):
    """One JSON object per log record (time, level, logger, message, and any ``extra``)."""

    _SKIP = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(
                record.created, datetime.timezone.utc
            ).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in self._SKIP})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _config(args: argparse.Namespace) -> DaemonConfig:
    flags = {
        "job": args.job,
        "secret": args.secret,
        "host_rank": args.host_rank,
        "hosts": args.hosts,
        "socket": args.socket,
        "rendezvous": args.rendezvous,
        "store": args.store,
        "local_world": args.local_world,
        "metrics": args.metrics,
        "paths": tuple(args.paths) if args.paths else None,
        "peers": tuple(tuple(a for a in h.split(",") if a) for h in args.peers.split(";"))
        if args.peers
        else None,
    }
    loss = {
        "loss_bound": args.loss_bound,
        "hard_deadline_s": args.hard_deadline,
        "on_hard_deadline": args.on_hard_deadline,
    }
    loss = {k: v for k, v in loss.items() if v is not None}
    return load(args.config, flags, {"loss": loss} if loss else None)


def _store_rendezvous(cfg: DaemonConfig) -> StoreRendezvous | None:
    if cfg.hosts == 1 or cfg.rendezvous != "store":
        return None
    import torch.distributed as dist  # noqa: PLC0415 (only this mode needs torch)

    host, port = parse_address(cfg.store)
    timeout = datetime.timedelta(seconds=cfg.rendezvous_timeout_s)
    try:
        store = dist.TCPStore(
            host, port, cfg.hosts, cfg.host_rank == 0, timeout=timeout, wait_for_workers=False
        )
    except (RuntimeError, OSError) as e:
        raise RendezvousError(f"daemon rendezvous store {host}:{port}: {e}") from e
    return StoreRendezvous(
        store,
        f"gradlane-daemon/{cfg.job}/",
        timeout_s=cfg.rendezvous_timeout_s,
        where=f"the daemons' TCPStore at {host}:{port}",
    )


def run(args: argparse.Namespace) -> int:
    """Start the daemon, serve until SIGTERM/SIGINT, drain and clean up. Exit code 0: stopped
    cleanly; 1: its loop stopped on an error (logged with its traceback); 2: it did not start."""
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
    try:
        cfg = _config(args)
        daemon = Daemon(cfg, rendezvous=_store_rendezvous(cfg)).start()
    except GradlaneError as e:
        emit(f"gradlane daemon: {e}", err=True)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    emit(
        f"gradlane daemon: ready host {cfg.host_rank}/{cfg.hosts} ipc://{cfg.socket_path} "
        f"generation {daemon.generation:x} paths {daemon.bound} metrics {daemon.metrics_url}"
    )
    t0 = time.monotonic()
    while not daemon.wait(0.5):  # short waits so the signal handlers run promptly
        pass
    if daemon.error is not None:
        emit(
            f"gradlane daemon: failed after {time.monotonic() - t0:.1f}s: "
            f"{type(daemon.error).__name__}: {daemon.error}",
            err=True,
        )
        return 1
    emit(f"gradlane daemon: stopped after {time.monotonic() - t0:.1f}s")
    return 0
