"""Synthetic traces: DDP's buckets and a compute model, from a model's parameter list.

Usage::

    python -m gradlane.bench.replay.synth --model big_mlp:512x4 --steps 40 --out t4m.jsonl
    python -m gradlane.bench.replay.synth --params-json params.json --bucket-cap-mb 25 --out t.jsonl

The output is the ``gradlane-trace`` v1 format the recorder writes (docs/testbed.md,
``integrations/trace.py``), so :mod:`gradlane.bench.replay.run` reads both alike. What is
synthesised:

* **buckets** — DDP's rule after its bucket rebuild (``Reducer::rebuild_buckets``, which calls
  ``compute_bucket_assignment_by_size`` with the gradient-ready order): the parameters in reverse
  model order (a sequential model's backward produces the last layer's gradient first), packed
  greedily; a bucket closes once its bytes reach the current cap; the first bucket's cap is DDP's
  ``_DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB, so the first all-reduce starts early) when
  ``bucket_cap_mb`` is DDP's default 25, else ``bucket_cap_mb`` like every later one (DDP's own
  rule; ``--first-bucket-mb`` overrides it). Bucket 0 therefore holds the last layers;
  ``layer_span`` gives the positions (0 = the model's first parameter), as the recorder does.
* **timing** — a FLOP model of dense layers: a forward pass costs 2 FLOPs per parameter and
  sample, a backward 4 (input and weight gradients), at ``--flops`` FLOP/s; or given rates
  (``--grad-rate-mbps``: MB of gradients the backward produces per second, ``--forward-ms``).
  A bucket is ready once the backward has produced all of its parameters' gradients. Every gap is
  scaled by a seeded log-normal jitter (``--jitter``: its sigma), per (rank, step, bucket).

``comm_s`` is ``null`` (nothing was communicated); the meta record says ``"synthetic": true``.
A parameter list in JSON: ``[["name", [shape...]], ...]`` or ``[{"name": .., "shape": [..]}]``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gradlane.integrations.trace import TRACE_FORMAT, TRACE_VERSION

__all__ = [
    "FIRST_BUCKET_BYTES",
    "SynthSpec",
    "assign_buckets",
    "first_cap_bytes",
    "load_params",
    "model_params",
    "synth_records",
    "write_trace",
]

#: DDP's first-bucket cap (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``).
FIRST_BUCKET_BYTES = 1 << 20
MB = 1 << 20
#: DDP's default ``bucket_cap_mb``.
DDP_DEFAULT_CAP_MB = 25.0
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

Param = tuple[str, int]  # (name, number of elements)


@dataclass(frozen=True)
class SynthSpec:
    """What to synthesise: bucketing, timing model, size of the trace."""

    world: int = 2
    steps: int = 20
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 0.0
    """Cap of bucket 0; 0 = DDP's rule: 1 MiB with the default 25 MB cap, else the cap."""
    dtype: str = "float32"
    batch: int = 32
    """Samples per rank and step (FLOP model)."""
    flops: float = 20e9
    """FLOP/s of one rank (FLOP model); ignored when ``grad_rate_mbps`` is set."""
    grad_rate_mbps: float = 0.0
    """Given rate: MB of gradients the backward produces per second (0 = use the FLOP model)."""
    forward_ms: float = 0.0
    """Given rate mode: the forward pass's duration."""
    jitter: float = 0.05
    """Sigma of the log-normal factor on every compute gap (0 = exact)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.world < 1 or self.steps < 1 or self.batch < 1:
            raise ValueError("world, steps and batch must be >= 1")
        if self.bucket_cap_mb <= 0 or self.first_bucket_mb < 0:
            raise ValueError("bucket_cap_mb must be > 0 and first_bucket_mb >= 0")
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"dtype {self.dtype!r}: one of {sorted(_ITEMSIZE)}")
        if self.flops <= 0 or self.grad_rate_mbps < 0 or self.forward_ms < 0 or self.jitter < 0:
            raise ValueError("flops must be > 0; grad_rate_mbps, forward_ms, jitter >= 0")


def assign_buckets(
    numels: Sequence[int], itemsize: int, cap_bytes: int, first_cap_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """DDP's rebuilt buckets: parameter indices (model order) per bucket, bucket 0 first.

    Parameters are taken last to first; a bucket closes as soon as its bytes reach the current
    cap (``first_cap_bytes`` for bucket 0, ``cap_bytes`` after), as ``compute_bucket_assignment_
    by_size`` does; the remainder forms the last bucket.
    """
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        cur.append(i)
        size += numels[i] * itemsize
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def first_cap_bytes(bucket_cap_mb: float, first_bucket_mb: float = 0.0) -> int:
    """Bucket 0's cap: ``first_bucket_mb`` when given, else DDP's rule (``DistributedDataParallel``
    uses ``_DEFAULT_FIRST_BUCKET_BYTES`` only when ``bucket_cap_mb`` is left at its default 25)."""
    if first_bucket_mb > 0:
        return int(first_bucket_mb * MB)
    return FIRST_BUCKET_BYTES if bucket_cap_mb == DDP_DEFAULT_CAP_MB else int(bucket_cap_mb * MB)


def synth_records(
    params: Sequence[Param], spec: SynthSpec, meta: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The trace's records (meta first) for ``params`` in model order."""
    if not params:
        raise ValueError("the model has no parameters")
    numels = [n for _, n in params]
    if any(n <= 0 for n in numels):
        raise ValueError("every parameter needs at least one element")
    item = _ITEMSIZE[spec.dtype]
    cap = int(spec.bucket_cap_mb * MB)
    buckets = assign_buckets(
        numels, item, cap, first_cap_bytes(spec.bucket_cap_mb, spec.first_bucket_mb)
    )
    total = sum(numels)
    last = max(1, len(numels) - 1)
    if spec.grad_rate_mbps > 0:
        forward_s = spec.forward_ms / 1e3
        per_elem_bwd = item / (spec.grad_rate_mbps * 1e6)
    else:
        forward_s = 2.0 * spec.batch * total / spec.flops
        per_elem_bwd = 4.0 * spec.batch / spec.flops
    out: list[dict[str, Any]] = [
        {
            "kind": "meta",
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "world": spec.world,
            "ranks": list(range(spec.world)),
            "steps": spec.steps,
            "hook": "synthetic",
            "synthetic": True,
            "params": total,
            "grad_bytes": total * item,
            "n_buckets": len(buckets),
            "bucket_cap_mb": spec.bucket_cap_mb,
            "first_bucket_bytes": first_cap_bytes(spec.bucket_cap_mb, spec.first_bucket_mb),
            "batch_per_rank": [spec.batch],
            "synth": asdict(spec),
            **(meta or {}),
        }
    ]
    for step in range(spec.steps):
        for rank in range(spec.world):
            rng = np.random.default_rng([spec.seed, rank, step])
            factors = (
                rng.lognormal(0.0, spec.jitter, size=len(buckets) + 1) if spec.jitter else None
            )
            t = forward_s * (factors[0] if factors is not None else 1.0)
            for b, idx in enumerate(buckets):
                n = sum(numels[i] for i in idx)
                dt = n * per_elem_bwd * (factors[b + 1] if factors is not None else 1.0)
                # The forward pass precedes the first bucket's backward: its gap holds both.
                gap = dt + t if b == 0 else dt
                t += dt
                out.append(
                    {
                        "kind": "bucket",
                        "rank": rank,
                        "step": step,
                        "bucket": b,
                        "bytes": n * item,
                        "numel": n,
                        "dtype": spec.dtype,
                        "params": len(idx),
                        "layer_span": [min(idx) / last, max(idx) / last],
                        "ready_s": round(t, 9),
                        "gap_s": round(gap, 9),
                        "comm_s": None,
                        "last": b == len(buckets) - 1,
                        "ok": True,
                    }
                )
    return out


def model_params(model: Any) -> list[Param]:
    """(name, numel) of a torch module's trainable parameters, in ``parameters()`` order."""
    return [(n, int(p.numel())) for n, p in model.named_parameters() if p.requires_grad]


def load_params(path: str | Path) -> list[Param]:
    """A parameter list from JSON: ``[[name, shape], ...]`` or ``[{"name", "shape"}, ...]``."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of parameters")
    out: list[Param] = []
    for k, item in enumerate(data):
        if isinstance(item, dict):
            name, shape = item.get("name", f"p{k}"), item.get("shape")
        elif isinstance(item, list) and len(item) == 2:
            name, shape = item
        else:
            raise ValueError(f"{path}: entry {k} is neither [name, shape] nor {{name, shape}}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ValueError(f"{path}: entry {k} ({name}): shape must be a list of positive ints")
        out.append((str(name), math.prod(shape)))
    return out


def _named_model(name: str) -> Any:
    """A torch module by name: ``mlp``, ``cnn``, ``bert`` or ``big_mlp:WIDTHxDEPTH``."""
    from gradlane.bench.demo.models import BertShapedEncoder, big_mlp, build

    if name.startswith("big_mlp"):
        width, depth = 1024, 6
        if ":" in name:
            try:
                w, d = name.split(":", 1)[1].lower().split("x")
                width, depth = int(w), int(d)
            except ValueError:
                raise ValueError(
                    f"{name!r}: write big_mlp:WIDTHxDEPTH, e.g. big_mlp:512x4"
                ) from None
        return big_mlp(width=width, depth=depth)
    if name == "bert":
        return BertShapedEncoder()
    return build(name, 0)


def write_trace(records: Iterable[dict[str, Any]], path: str | Path) -> None:
    """Write records as JSON Lines (compact, one per line)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(
        prog="python -m gradlane.bench.replay.synth", description=__doc__.split("\n")[0]
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="mlp, cnn, bert or big_mlp:WIDTHxDEPTH (torch.nn modules)")
    src.add_argument("--params-json", help="a JSON parameter list")
    ap.add_argument("--out", required=True, help="trace file to write (.jsonl)")
    for f in SynthSpec.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        ap.add_argument(flag, type=type(f.default), default=f.default, help=f"default {f.default}")
    ns = ap.parse_args(argv)
    try:
        spec = SynthSpec(**{k: getattr(ns, k) for k in SynthSpec.__dataclass_fields__})
        params = (
            load_params(ns.params_json) if ns.params_json else model_params(_named_model(ns.model))
        )
        command = "python -m gradlane.bench.replay.synth " + shlex.join(
            sys.argv[1:] if argv is None else argv
        )
        meta = {"model": ns.model or Path(ns.params_json).stem, "command": command}
        records = synth_records(params, spec, meta)
    except (ValueError, OSError) as e:
        print(f"synth_trace: {e}", file=sys.stderr)
        return 2
    write_trace(records, ns.out)
    m = records[0]
    print(
        f"{ns.out}: {m['params']:,} parameters, {m['grad_bytes'] / 1e6:.2f} MB in "
        f"{m['n_buckets']} buckets, {spec.steps} steps x {spec.world} ranks"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
