"""Prometheus text exposition (format 0.0.4) for the daemon's counters, and its HTTP endpoint.

A :class:`Registry` holds counters, gauges and histograms, each with optional labels; every
update takes one lock (updates come from the daemon's loop and the engine's thread, reads from
the HTTP thread). :class:`MetricsServer` serves ``GET /metrics`` on a local address from a
stdlib ``ThreadingHTTPServer`` thread; :func:`fetch` and :func:`parse` are the client side that
``gradlane stats`` uses.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gradlane.transport.errors import ConfigError, GradlaneError

__all__ = ["LATENCY_BUCKETS_S", "MetricsServer", "Registry", "fetch", "parse"]

#: Step-latency histogram bounds (seconds): 1 ms to 10 s, roughly x2.5 apart.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
Labels = tuple[tuple[str, str], ...]
_INF = 'le="+Inf"'


def _key(labels: dict[str, str]) -> Labels:
    # A trailing underscore lets a label be named like a Python keyword: class_="0" -> class.
    return tuple(sorted((k.rstrip("_"), v) for k, v in labels.items()))


def _labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Family:
    def __init__(self, name: str, kind: str, help_text: str) -> None:
        if not _NAME.match(name):
            raise ConfigError(f"metric name {name!r} is not a Prometheus name")
        self.name, self.kind, self.help = name, kind, help_text
        self.values: dict[Labels, Any] = {}


class Registry:
    """Metric families by name; :meth:`render` gives the text exposition.

    Labels are keyword arguments; a trailing underscore is dropped (``class_="0"`` is the label
    ``class``)."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        self._lock = threading.Lock()

    def _family(self, name: str, kind: str, help_text: str) -> _Family:
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = _Family(name, kind, help_text)
        elif fam.kind != kind:
            raise ConfigError(f"metric {name} is a {fam.kind}, not a {kind}")
        return fam

    def declare(self, name: str, kind: str, help_text: str) -> None:
        """Declare a family so it is listed (with HELP/TYPE) before its first sample."""
        with self._lock:
            self._family(name, kind, help_text)

    def inc(self, name: str, value: float = 1.0, help_text: str = "", **labels: str) -> None:
        """Add ``value`` (>= 0) to the counter ``name{labels}``."""
        if value < 0:
            raise ValueError(f"counter {name} cannot go down ({value})")
        key = _key(labels)
        with self._lock:
            fam = self._family(name, "counter", help_text)
            fam.values[key] = fam.values.get(key, 0.0) + value

    def set(self, name: str, value: float, help_text: str = "", **labels: str) -> None:
        """Set the gauge ``name{labels}``."""
        key = _key(labels)
        with self._lock:
            self._family(name, "gauge", help_text).values[key] = float(value)

    def observe(
        self,
        name: str,
        value: float,
        help_text: str = "",
        buckets: Sequence[float] = LATENCY_BUCKETS_S,
        **labels: str,
    ) -> None:
        """Record one observation in the histogram ``name{labels}``."""
        key = _key(labels)
        with self._lock:
            fam = self._family(name, "histogram", help_text)
            h = fam.values.get(key)
            if h is None:
                h = fam.values[key] = {
                    "bounds": tuple(buckets),
                    "counts": [0] * len(buckets),
                    "sum": 0.0,
                    "count": 0,
                }
            i = bisect.bisect_left(h["bounds"], value)
            if i < len(h["counts"]):
                h["counts"][i] += 1
            h["sum"] += value
            h["count"] += 1

    def value(self, name: str, **labels: str) -> float:
        """A counter's or gauge's current value (0 when never set): for tests and logs."""
        with self._lock:
            fam = self._families.get(name)
            v = fam.values.get(_key(labels), 0.0) if fam else 0.0
        return float(v["count"] if isinstance(v, dict) else v)

    def render(self) -> str:
        """The Prometheus text exposition of every family."""
        out: list[str] = []
        with self._lock:
            for fam in self._families.values():
                out.append(f"# HELP {fam.name} {fam.help or fam.name}")
                out.append(f"# TYPE {fam.name} {fam.kind}")
                for key, v in sorted(fam.values.items()):
                    if fam.kind != "histogram":
                        out.append(f"{fam.name}{_labels(key)} {_num(v)}")
                        continue
                    cum = 0
                    for bound, n in zip(v["bounds"], v["counts"], strict=True):
                        cum += n
                        le = f'le="{_num(bound)}"'
                        out.append(f"{fam.name}_bucket{_labels(key, le)} {cum}")
                    out.append(f"{fam.name}_bucket{_labels(key, _INF)} {v['count']}")
                    out.append(f"{fam.name}_sum{_labels(key)} {_num(v['sum'])}")
                    out.append(f"{fam.name}_count{_labels(key)} {v['count']}")
        return "\n".join(out) + "\n"


class MetricsServer:
    """``GET /metrics`` of ``registry`` on ``(host, port)`` (port 0: any free one), in a thread."""

    def __init__(self, registry: Registry, host: str = "127.0.0.1", port: int = 0) -> None:
        reg = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics here")
                    return
                body = reg.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes are not worth a log line each

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise ConfigError(f"metrics endpoint {host}:{port}: {e.strerror}") from None
        self._server.daemon_threads = True
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
        """Stop serving and join the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def fetch(url: str, timeout_s: float = 5.0) -> str:
    """The text served at ``url``; a :class:`GradlaneError` saying where when it cannot."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return str(r.read().decode())
    except OSError as e:
        raise GradlaneError(f"no gradlane metrics at {url}: {e}") from None


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)\Z")


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples ``(name, labels, value)`` of a text exposition (comments skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise GradlaneError(f"not a Prometheus sample line: {line!r}")
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out
