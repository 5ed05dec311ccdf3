"""The trace format as the tests hold it (``gradlane.integrations.trace``, docs/testbed.md)."""

from __future__ import annotations

#: The fields of every bucket record of a trace, recorded or synthetic.
BUCKET_FIELDS = frozenset({
    "kind", "rank", "step", "bucket", "bytes", "numel", "dtype", "params", "layer_span",
    "ready_s", "gap_s", "comm_s", "last", "ok",
})  # fmt: skip
