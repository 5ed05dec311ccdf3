"""``gradlane stats``: print a daemon's Prometheus metrics as a readable table."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from gradlane.integrations.cli.main import emit
from gradlane.scheduling.errors import GradlaneError
from gradlane.transport.daemon.metrics import fetch, parse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--url`` (or ``--metrics HOST:PORT``) of the daemon's endpoint, ``--json``."""
    p.add_argument("--url", help="metrics URL (default http://127.0.0.1:9464/metrics)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="the daemon's --metrics address")
    p.add_argument("--json", action="store_true", help="print the samples as JSON")


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
        samples = parse(fetch(url))
    except GradlaneError as e:
        emit(f"gradlane stats: {e}", err=True)
        return 1
    if args.json:
        emit(json.dumps([{"name": n, "labels": lb, "value": v} for n, lb, v in samples], indent=1))
        return 0
    hist: dict[str, list[tuple[float, float]]] = defaultdict(list)
    emit(f"gradlane daemon metrics ({url})")
    for name, labels, value in samples:
        if name.endswith("_bucket") and "le" in labels:
            hist[name[: -len("_bucket")]].append((float(labels["le"]), value))
            continue
        shown = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        emit(f"  {name}{'{' + shown + '}' if shown else ''}".ljust(72) + f"{value:g}")
    for name, buckets in hist.items():
        p50, p99 = _quantile(buckets, 0.5), _quantile(buckets, 0.99)
        emit(f"  {name}: p50 <= {p50}s, p99 <= {p99}s over {buckets[-1][1]:g} observations")
    return 0
