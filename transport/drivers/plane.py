"""What every data plane offers: the one interface the DDP hook, the daemon and the bench use.

A *data plane* all-reduces buckets between the ranks of a job on threads of its own. There are
three, interchangeable behind :class:`Plane`:

* :class:`~gradlane.transport.drivers.udp.plane.UdpPlane`: the protocol core over UDP sockets
  (priorities, bounded loss, multipath);
* :class:`~gradlane.transport.drivers.zmq.plane.ZmqPlane`: the same core over ZeroMQ (TCP or
  IPC: reliable, exact);
* :class:`~gradlane.transport.daemon.client.DaemonPlane`: hands buckets to the host's
  ``gradlane daemon``, which sums the host's ranks and runs the inter-host all-reduce.

Each is started by its own constructor and ``start()`` (their addresses and rendezvous differ);
from then on a caller only needs what :class:`Plane` lists. The protocol is
``runtime_checkable``, so ``isinstance(obj, Plane)`` checks that the methods are there (not their
signatures: mypy checks those wherever a plane is used as a ``Plane``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from gradlane.transport.drivers.futures import CollectiveResult

__all__ = ["Plane", "PlaneWrapper"]


@runtime_checkable
class Plane(Protocol):
    """A started data plane: submit collectives and get Futures, read stats, drain, close.

    Every method is thread-safe. A collective's Future resolves on the plane's thread, to
    ``(result, CollectiveReport)`` (:data:`~gradlane.transport.drivers.futures.CollectiveResult`),
    or fails with the transport's error: :class:`~gradlane.transport.errors.PeerTimeout` naming
    the late ranks, :class:`~gradlane.transport.errors.TransferFailed` when the plane closes
    first or a request is refused.
    """

    def submit(
        self,
        step: int,
        bucket: int,
        data: np.ndarray,
        layer_position: float = 0.5,
        dtype: int | None = None,
        servers: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        *,
        scale: float = 1.0,
        pinned: bool = False,
    ) -> concurrent.futures.Future[CollectiveResult]:
        """All-reduce ``data`` (1-D float32/float16, or raw 16-bit words with ``dtype``): the
        sum over ranks, times ``scale``, into ``out`` when given (it may be ``data``: in place).

        ``(step, bucket)`` names the collective on every rank; ``layer_position`` is 0 for the
        front layer (needed first next step), 1 for the last; ``servers`` (ranks, the same on
        every rank) makes it a parameter-server push/pull where the plane offers one;
        ``pinned``: every chunk protected, in class 0. ``data`` is read until the Future is
        done: do not modify it before.
        """
        ...

    def stats(self) -> dict[str, Any]:
        """The plane's counters (JSON-friendly; the keys depend on the plane)."""
        ...

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Wait, at most ``timeout_s``, until peers have what this rank sent them; True when
        nothing is owed. At the end of a job: ``drain()`` on every rank, a barrier, then
        ``close()``."""
        ...

    def close(self) -> None:
        """Fail in-flight work and release sockets and threads (idempotent)."""
        ...


#: What :meth:`PlaneWrapper.watch` may return: a callback for the collective's Future.
DoneCallback = Callable[[concurrent.futures.Future[CollectiveResult]], None]


class PlaneWrapper:
    """A :class:`Plane` around another one, for tools that watch what a hook submits (a
    benchmark timing its collectives, a test recording them): every call goes to ``plane``.

    Subclasses override :meth:`watch`, called with each submission before it goes on; the
    callback it returns is added to the collective's Future before the caller's, so it sees
    the result before the hook writes it back.
    """

    def __init__(self, plane: Plane) -> None:
        self.plane = plane

    def watch(self, step: int, bucket: int, data: np.ndarray) -> DoneCallback | None:
        """Called for each submission; the callback to run when it completes, if any."""
        return None

    def submit(
        self,
        step: int,
        bucket: int,
        data: np.ndarray,
        layer_position: float = 0.5,
        dtype: int | None = None,
        servers: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        *,
        scale: float = 1.0,
        pinned: bool = False,
    ) -> concurrent.futures.Future[CollectiveResult]:
        """:meth:`watch`, then the wrapped plane's :meth:`Plane.submit`."""
        done = self.watch(step, bucket, data)
        cf = self.plane.submit(
            step, bucket, data, layer_position, dtype, servers, out, scale=scale, pinned=pinned
        )
        if done is not None:
            cf.add_done_callback(done)
        return cf

    def stats(self) -> dict[str, Any]:
        """The wrapped plane's counters."""
        return self.plane.stats()

    def drain(self, timeout_s: float = 2.0) -> bool:
        """The wrapped plane's drain."""
        return self.plane.drain(timeout_s)

    def close(self) -> None:
        """Close the wrapped plane."""
        self.plane.close()
