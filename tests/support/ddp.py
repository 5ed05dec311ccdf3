"""DDP test helpers: a world of one in this process, and a data plane that records.

A one-rank gloo group on a ``HashStore`` is enough for DDP to call communication hooks
(buckets, the rebuild after the first backward, ``is_last``), and a one-rank data plane
completes at once. :class:`RecordingPlane` wraps a real plane (``state.plane = RecordingPlane(
state.plane)``) to see what the hook hands it: the buffer of each bucket (for a GPU bucket, the
hook's pinned staging buffer) and, on request, copies of the data and the result.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from gradlane.integrations.ddp import GradlaneState, HookConfig
from gradlane.integrations.rendezvous import StoreRendezvous
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import CollectiveReport
from gradlane.transport.drivers.futures import CollectiveResult
from gradlane.transport.drivers.plane import Plane, PlaneWrapper
from torch import nn

__all__ = ["RecordingPlane", "Submitted", "hook_state", "one_rank_group", "tiny_model"]


@contextlib.contextmanager
def one_rank_group() -> Iterator[dist.Store]:
    """A one-rank gloo process group on a ``HashStore``, destroyed on exit; yields the store."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def tiny_model() -> nn.Module:
    """Three linear layers, 8 -> 32 -> 32 -> 4, initialised from seed 0 (equal every call)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def hook_state(store: dist.Store, **kw: Any) -> GradlaneState:
    """A gradlane hook state meeting its peers through ``store`` (64 KB chunks, stats logged
    every step); ``kw`` goes to :class:`GradlaneState`."""
    return GradlaneState(
        TransportConfig(chunk_bytes=65000),
        HookConfig(log_every=1),
        rendezvous=StoreRendezvous(store),
        **kw,
    )


@dataclass
class Submitted:
    """One collective a :class:`RecordingPlane` passed on."""

    step: int
    bucket: int
    view: np.ndarray
    """The array the hook submitted (the bucket's buffer, or its pinned staging buffer)."""
    data: np.ndarray | None = None
    """With ``keep``: a copy of ``view`` as submitted (this rank's contribution)."""
    result: np.ndarray | None = None
    """With ``keep``: a copy of the result, taken before the hook sees it."""
    report: CollectiveReport | None = None
    error: BaseException | None = None

    @property
    def address(self) -> int:
        """Where the submitted buffer lives."""
        return int(self.view.ctypes.data)


class RecordingPlane(PlaneWrapper):
    """A real data plane, wrapped to record every collective the hook submits.

    Its completion callback runs before the caller's (:class:`PlaneWrapper`), so it sees the
    result before the hook writes it back. ``keep`` copies the submitted data and the result
    (memory: twice the buckets per step); without it only the buffers' identities are kept.
    """

    def __init__(self, plane: Plane, *, keep: bool = False) -> None:
        super().__init__(plane)
        self.keep = keep
        self.records: list[Submitted] = []
        self._lock = threading.Lock()

    def watch(
        self, step: int, bucket: int, data: np.ndarray
    ) -> Callable[[concurrent.futures.Future[CollectiveResult]], None]:
        """Record the submission; its result is recorded when it completes."""
        rec = Submitted(step, bucket, data, data.copy() if self.keep else None)
        with self._lock:
            self.records.append(rec)
        return lambda f: self._done(rec, f)

    def _done(self, rec: Submitted, f: concurrent.futures.Future[CollectiveResult]) -> None:
        try:
            result, report = f.result()
        except BaseException as e:
            rec.error = e
            return
        rec.report = report
        if self.keep:
            rec.result = np.array(result, copy=True)

    def of_step(self, step: int) -> list[Submitted]:
        """The step's collectives in bucket order."""
        with self._lock:
            return sorted((r for r in self.records if r.step == step), key=lambda r: r.bucket)
