"""The collectives a data plane was asked for, and the Futures of those it has started.

:class:`CollectiveRequest` is one ``submit`` call's arguments, as the planes pass them between
threads. Every driver of a sans-I/O
:class:`~gradlane.transport.core.collective.TransposeAllReduce` (the UDP plane, the ZeroMQ
plane) needs the same three steps at its edge (STYLE rule 6: futures only at the edge): start a
collective for a caller's Future, resolve Futures from the core's events, and fail what is left
when the driver stops or breaks. :class:`PendingCollectives` is that one implementation, so the
drivers cannot drift apart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
from gradlane.scheduling.priority import PriorityPolicy
from gradlane.transport.core.collective import TransposeAllReduce
from gradlane.transport.core.events import AllReduceComplete, AllReduceFailed, CollectiveReport
from gradlane.transport.errors import GradlaneError, TransferFailed

__all__ = ["CollectiveRequest", "CollectiveResult", "PendingCollectives", "urgency"]

CollectiveResult = tuple[np.ndarray, CollectiveReport]
"""What a collective's Future resolves to: the result (the sum over ranks) and its report."""


@dataclass(frozen=True, slots=True)
class CollectiveRequest:
    """One all-reduce a caller asked a data plane for: the arguments of
    :meth:`gradlane.transport.drivers.plane.Plane.submit`, as they travel to the plane's thread.

    ``data`` is read (never written) until the collective ends; ``out`` receives the result
    (it may be ``data``); ``servers`` makes it a parameter-server exchange; ``scale``
    multiplies the result; ``pinned`` protects every chunk (see
    :meth:`~gradlane.transport.core.collective.TransposeAllReduce.start`).
    """

    step: int
    bucket: int
    data: np.ndarray
    layer_position: float = 0.5
    dtype: int | None = None
    servers: tuple[int, ...] | None = None
    out: np.ndarray | None = None
    scale: float = 1.0
    pinned: bool = False


def urgency(req: CollectiveRequest, policy: PriorityPolicy) -> tuple[bool, float]:
    """Sort key of requests that wait to start together, most urgent first: pinned buckets,
    then by the policy's send position (the front layers, which the next forward pass needs
    first; ``flat``: none). A plane that finds several requests queued starts them in this
    order (a stable sort keeps arrival order among equals), so a protected bucket submitted
    last does not wait behind the start of every bucket submitted before it."""
    return (not req.pinned, policy.send_position(req.layer_position))


class PendingCollectives:
    """(step, bucket) → Future of ``(result, CollectiveReport)``.

    ``start`` and ``deliver`` run on the driver's loop thread; ``fail_all`` may also run on the
    thread that closes the driver after its loop has stopped, hence the lock.
    """

    def __init__(self) -> None:
        self._futures: dict[tuple[int, int], Future[CollectiveResult]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._futures)

    def keys(self) -> set[tuple[int, int]]:
        """The (step, bucket) of every tracked collective."""
        with self._lock:
            return set(self._futures)

    def start(
        self,
        core: TransposeAllReduce,
        fut: Future[CollectiveResult],
        req: CollectiveRequest,
        now: float,
    ) -> bool:
        """Start ``req`` on ``core`` for ``fut``; a bad request fails its own Future, never the
        loop. Returns True when the collective is running (its events will resolve ``fut``).
        """
        if not fut.set_running_or_notify_cancel():
            return False  # the caller cancelled it before the loop got to it
        key = (req.step, req.bucket)
        with self._lock:
            if key in self._futures:
                fut.set_exception(
                    TransferFailed(
                        f"step {req.step} bucket {req.bucket} is already being all-reduced"
                    )
                )
                return False
            self._futures[key] = fut
        try:
            core.start(
                req.step,
                req.bucket,
                req.data,
                req.layer_position,
                now,
                dtype=req.dtype,
                pinned=req.pinned,
                servers=req.servers,
                out=req.out,
                scale=req.scale,
            )
        except (ValueError, TypeError, GradlaneError) as exc:
            with self._lock:
                self._futures.pop(key, None)
            fut.set_exception(exc)
            return False
        return True

    def add(self, step: int, bucket: int, fut: Future[CollectiveResult]) -> None:
        """Track a Future that was queued but not started (so ``fail_all`` reaches it)."""
        with self._lock:
            self._futures.setdefault((step, bucket), fut)

    def deliver(self, core: TransposeAllReduce) -> tuple[int, int]:
        """Resolve Futures from the core's pending events; returns (completed, failed)."""
        completed = failed = 0
        while (ev := core.next_event()) is not None:
            if isinstance(ev, AllReduceComplete):
                fut = self._pop(ev.step, ev.bucket)
                completed += 1
                if fut is not None and not fut.done():
                    fut.set_result((ev.result, ev.report))
            elif isinstance(ev, AllReduceFailed):
                fut = self._pop(ev.step, ev.bucket)
                failed += 1
                if fut is not None and not fut.done():
                    fut.set_exception(ev.error)
        return completed, failed

    def fail_all(self, make_error: Callable[[int, int], BaseException]) -> None:
        """Fail every tracked Future with ``make_error(step, bucket)``."""
        with self._lock:
            pending, self._futures = self._futures, {}
        for (step, bucket), fut in pending.items():
            if not fut.done():
                fut.set_exception(make_error(step, bucket))

    def _pop(self, step: int, bucket: int) -> Future[Any] | None:
        with self._lock:
            return self._futures.pop((step, bucket), None)
