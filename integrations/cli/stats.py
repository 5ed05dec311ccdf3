"""``gradlane stats``: print a daemon's Prometheus metrics as a readable table."""

from __future__ import annotations

import argparse
import json
import math
import urllib.request
from collections import defaultdict

from gradlane.integrations.cli.command import emit
from gradlane.scheduling.errors import GradlaneError
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["add_arguments", "fetch", "run", "samples"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--url`` (or ``--metrics HOST:PORT``) of the daemon's endpoint, ``--json``."""
    p.add_argument("--url", help="metrics URL (default http://127.0.0.1:9464/metrics)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="the daemon's --metrics address")
    p.add_argument("--json", action="store_true", help="print the samples as JSON")


def fetch(url: str, timeout_s: float = 5.0) -> str:
    """The text served at ``url``; a :class:`GradlaneError` saying where when it cannot."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return str(r.read().decode())
    except OSError as e:
        raise GradlaneError(f"no gradlane metrics at {url}: {e}") from None


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples ``(name, labels, value)`` of a Prometheus text exposition.

    Left out: the ``*_created`` series prometheus_client adds beside each counter and histogram
    (when the series started, not a reading)."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise GradlaneError(f"not a Prometheus text exposition: {e}") from None
    return [
        (s.name, dict(s.labels), float(s.value))
        for f in families
        if not f.name.endswith("_created")
        for s in f.samples
    ]


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Upper bound of the histogram bucket that holds quantile ``q`` (None when empty)."""
    total = buckets[-1][1] if buckets else 0.0
    for le, cum in buckets:
        if total and cum >= q * total:
            return le
    return None


def run(args: argparse.Namespace) -> int:
    """Fetch and print; exit 1 when no daemon answers."""
    url = args.url or f"http://{args.metrics or '127.0.0.1:9464'}/metrics"
    try:
        got = samples(fetch(url))
    except GradlaneError as e:
        emit(f"gradlane stats: {e}", err=True)
        return 1
    if args.json:  # NaN (a gauge with no reading yet) is not JSON: null
        rows = [
            {"name": n, "labels": lb, "value": v if math.isfinite(v) else None} for n, lb, v in got
        ]
        emit(json.dumps(rows, indent=1))
        return 0
    hist: dict[str, list[tuple[float, float]]] = defaultdict(list)
    emit(f"gradlane daemon metrics ({url})")
    for name, labels, value in got:
        if name.endswith("_bucket") and "le" in labels:
            hist[name[: -len("_bucket")]].append((float(labels["le"]), value))
            continue
        shown = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        emit(f"  {name}{'{' + shown + '}' if shown else ''}".ljust(72) + f"{value:g}")
    for name, buckets in hist.items():
        if not buckets[-1][1]:
            emit(f"  {name}: no observations yet")
            continue
        p50, p99 = _quantile(buckets, 0.5), _quantile(buckets, 0.99)
        emit(f"  {name}: p50 <= {p50}s, p99 <= {p99}s over {buckets[-1][1]:g} observations")
    return 0
