"""The daemon's Prometheus metrics: their definitions, and the HTTP endpoint that serves them.

prometheus_client keeps the values (thread-safe: the daemon's loop thread updates them while
the HTTP thread reads), renders the text exposition and provides the WSGI app. What is ours is
the list of families, in a registry per daemon (never the process-wide default: one process
may run several daemons, as the tests do), how a :class:`CollectiveReport` and the engine's
statistics map onto them, and an endpoint the daemon can stop: prometheus_client's app on a
wsgiref server whose :meth:`MetricsServer.close` frees the port.
"""

from __future__ import annotations

import math
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from gradlane.transport.core.events import CollectiveReport
from gradlane.transport.errors import ConfigError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

__all__ = ["LATENCY_BUCKETS_S", "DaemonMetrics", "MetricsServer"]

#: Step-latency histogram bounds (seconds): 1 ms to 10 s, roughly x2.5 apart.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DaemonMetrics:
    """The daemon's metric families, in their own :attr:`registry`.

    Unlabelled families are exposed from the start: ``gradlane_delivered_fraction`` is NaN (no
    reading) until the first all-reduce, ``gradlane_delivered_fraction_min`` starts at 1.
    """

    def __init__(self, generation: int) -> None:
        self.registry = r = CollectorRegistry()
        self.step_latency = Histogram(
            "gradlane_step_latency_seconds",
            "first local submission to the all-reduced result, per (step, bucket)",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.collectives = Counter(
            "gradlane_collectives_total", "all-reduces by outcome", ["outcome"], registry=r
        )
        self.delivered_fraction = Gauge(
            "gradlane_delivered_fraction", "delivered fraction of the last all-reduce", registry=r
        )
        self.delivered_fraction_min = Gauge(
            "gradlane_delivered_fraction_min", "smallest delivered fraction so far", registry=r
        )
        self.drops = Counter(
            "gradlane_drops_total",
            "chunks dropped, by priority class and reason",
            ["class", "reason"],
            registry=r,
        )
        self.retransmits = Counter(
            "gradlane_retransmits_total",
            "chunks retransmitted, by priority class",
            ["class"],
            registry=r,
        )
        self.path_bytes = Counter(
            "gradlane_path_bytes_total", "bytes sent per path", ["path"], registry=r
        )
        self.path_rate = Gauge(
            "gradlane_path_rate_bytes_per_second",
            "estimated rate per peer and path",
            ["peer", "path"],
            registry=r,
        )
        self.path_loss = Gauge(
            "gradlane_path_loss_ratio", "loss EWMA per peer and path", ["peer", "path"], registry=r
        )
        self.packets_rejected = Gauge(
            "gradlane_packets_rejected",
            "datagrams rejected, by reason (engine)",
            ["reason"],
            registry=r,
        )
        self.ipc_rejected = Counter(
            "gradlane_ipc_rejected_total",
            "IPC messages rejected, by reason",
            ["reason"],
            registry=r,
        )
        self.slot_timeouts = Counter(
            "gradlane_slot_timeouts_total", "slots freed at their deadline", registry=r
        )
        self.local_ranks = Gauge("gradlane_local_ranks", "trainers connected", registry=r)
        self.in_flight = Gauge(
            "gradlane_collectives_in_flight", "inter-host all-reduces running", registry=r
        )
        self.generation = Gauge("gradlane_generation", "this daemon's generation", registry=r)
        self.generation.set(generation)
        self.delivered_fraction.set(math.nan)
        self.delivered_fraction_min.set(1.0)
        self._fraction_min = 1.0

    def drop(self, reason: str, cls: str, n: float = 1.0) -> None:
        """Count ``n`` chunks or elements dropped for ``reason`` in priority class ``cls``."""
        self.drops.labels(cls, reason).inc(float(n))

    def collective(self, report: CollectiveReport, latency_s: float) -> None:
        """One finished all-reduce: its latency, outcome, delivered fraction, drops,
        retransmissions and bytes per path."""
        self.step_latency.observe(latency_s)
        self.collectives.labels("degraded" if report.degraded else "ok").inc()
        frac = report.delivered_fraction
        self.delivered_fraction.set(frac)
        if frac < self._fraction_min:  # only the loop thread writes: no race on the minimum
            self._fraction_min = frac
            self.delivered_fraction_min.set(frac)
        s = report.sender
        for c, n in enumerate(s.dropped):
            if n:
                self.drop("skipped_within_bound", str(c), n)
        for c, n in enumerate(s.retransmitted):
            if n:
                self.retransmits.labels(str(c)).inc(float(n))
        for p, n in enumerate(s.per_path_bytes):
            if n:
                self.path_bytes.labels(str(p)).inc(float(n))
        missing = report.reduce.missing_elems + sum(g.missing_elems for g in report.gather)
        if missing:
            self.drop("missing_elements", "all", missing)

    def engine(self, stats: dict[str, Any]) -> None:
        """The engine's reject counters and per-path rate and loss, from its ``stats()``."""
        for reason, n in stats.get("rejected", {}).items():
            self.packets_rejected.labels(reason).set(n)
        for peer, snap in stats.get("paths", {}).items():
            for p, (rate, loss) in enumerate(zip(snap["rate_Bps"], snap["loss"], strict=True)):
                self.path_rate.labels(str(peer), str(p)).set(rate or 0.0)
                self.path_loss.labels(str(peer), str(p)).set(loss or 0.0)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when it has none yet): for logs and tests."""
        return self.registry.get_sample_value(name, labels) or 0.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes are not worth a log line each


class MetricsServer:
    """``GET /metrics`` of ``registry`` on ``(host, port)`` (port 0: any free one), in a thread."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        try:
            self._server = make_server(
                host, port, make_wsgi_app(registry), ThreadingWSGIServer, _QuietHandler
            )
        except OSError as e:
            raise ConfigError(f"metrics endpoint {host}:{port}: {e.strerror}") from None
        #: The bound address: the actual port when 0 was asked.
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="gradlane-metrics",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """Where the metrics are served."""
        return f"http://{self.address[0]}:{self.address[1]}/metrics"

    def close(self) -> None:
        """Stop serving, free the port and join the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
