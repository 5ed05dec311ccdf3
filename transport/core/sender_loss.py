"""Loss handling of the sender: NACKs, retransmission timeouts and their probes, and what a
loss does to the transfer, its paths and its pacers.

:class:`LossHandling` is a part of :class:`~gradlane.transport.core.sender.SenderCore` (its
base): the methods below run on the sender's state, which the sender owns and documents. Loss
detection itself happens in three places — RACK in the ACK kernel (``SenderCore.on_ack``), the
timeout round (:meth:`LossHandling._on_timeout`) and the receiver's NACKs
(:meth:`LossHandling.on_nack`) — and every detected loss goes through
:meth:`LossHandling._declare_lost`: tolerated within the loss budget, else resent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from gradlane.transport.core.outgoing import ABANDONED, INFLIGHT, LOST, OutKey, OutTransfer

if TYPE_CHECKING:
    from gradlane.scheduling.pacing import Pacer
    from gradlane.scheduling.paths import PathSet
    from gradlane.transport.config import TransportConfig
    from gradlane.transport.core.send_pass import PaceGate

__all__ = ["LossHandling"]

_NO_CHUNKS = np.empty(0, dtype=np.int64)


class LossHandling:
    """What the sender does when chunks are reported or found lost (a base of ``SenderCore``)."""

    if TYPE_CHECKING:  # the sender's state and helpers these methods use
        config: TransportConfig
        paths: dict[int, PathSet]
        pacers: dict[tuple[int, int], Pacer]
        _gate: PaceGate
        _tos: list[int]
        _n_paths: int
        _sendable: set[OutKey]
        _probes: list[tuple[OutKey, int, int, int]]

        def _bitmap_span(
            self, key: OutKey, base: int, bits: np.ndarray
        ) -> tuple[OutTransfer, int] | None: ...
        def _wake(self, now: float) -> None: ...
        def _release(self, t: OutTransfer, idx: np.ndarray) -> None: ...
        def _stats(self, step: int, bucket: int, seq: int = 0) -> Any: ...
        def _maybe_fin(self, t: OutTransfer, now: float, rto: float | None = None) -> None: ...

    def on_nack(
        self, key: OutKey, base: int, bits: np.ndarray, now: float, newest: int = -1
    ) -> None:
        """The receiver needs these chunks now: queue them for retransmission, even abandoned.

        ``newest`` is the newest chunk that had reached the receiver when it asked (-1: the
        receiver did not say: nothing came yet, or its sockets were not read to the end since).
        A chunk this sender last sent before that chunk's last transmission in the same lane
        (path and class) should have arrived: it is lost. One sent after it there may still be
        on its way, if it left less than the path's smallest RTT (at least the reorder window)
        ago; one on another lane, if it left less than its path's RTT bound ago (smoothed RTT
        plus four deviations: a deeper or growing queue there is no loss — the receiver's pass
        end may come over a fast path while a congested one still queues the chunks before it:
        :meth:`OutTransfer.on_way_for`), or its smoothed RTT when nothing else of ours is in
        flight on that path (no queue of ours can grow there). Without ``newest`` every chunk
        waits so. A chunk asked for while on its way is not forgotten: it is resent when its
        wait ends without an ACK (:meth:`OutTransfer.ask_later`), not at the next NACK, which
        a receiver whose NACKs bring nothing sends ever later.
        """
        span = self._bitmap_span(key, base, bits)
        if span is None:
            return
        t, end = span
        self._wake(now)
        idx = bits[: end - base].nonzero()[0] + base
        ps = self.paths[key.dst]
        evidence = 0 <= newest < t.n_chunks
        floor = np.maximum(ps.min_rtts(), self.config.reorder_window_s)
        floor[~np.isfinite(floor)] = self.config.reorder_window_s
        # A path that carries nothing of ours toward this peer but the chunks asked for adds
        # no queue of our own for them to wait behind: the smoothed RTT covers what queue is
        # left there (others' traffic). On a busy path our own data may be queueing up, and
        # the average lags a queue that grows: the RTT bound then.
        flying = t.state[idx] == INFLIGHT
        asked = idx[flying]
        own = np.bincount(t.path[asked], weights=t.lengths[asked], minlength=self._n_paths)
        quiet = ps.outstanding <= own + 0.5
        bound = np.where(quiet, ps.rtt_bounds(0.0), ps.rtt_bounds())
        wait = t.on_way_for(idx, newest if evidence else -1, floor, bound, len(self._tos))
        young = flying & (now < t.sent_at[idx] + wait)
        if young.any():
            t.ask_later(idx[young], wait[young])
        self._requeue(t, idx[~young], now, lost=evidence)

    def _requeue(self, t: OutTransfer, idx: np.ndarray, now: float, lost: bool) -> None:
        """Chunks ``idx`` of ``t`` the receiver needs (in flight or abandoned): queued for
        retransmission, whatever the loss budget would let go. In-flight ones leave their
        paths as losses (``lost``: the receiver's evidence or a wait that ran out) or merely
        released (queued again without evidence)."""
        st = t.state[idx]
        want = idx[(st == INFLIGHT) | (st == ABANDONED)]
        flying = idx[st == INFLIGHT]
        t.n_inflight -= int(flying.size)
        if flying.size and lost:
            # Overtaken by what arrived (or long gone): lost on their paths, like RACK's.
            self._note_loss(t, flying, now)
        elif flying.size:  # queued again: no longer outstanding where they were sent
            self._release(t, flying)
        t.abandoned_elems -= int(t.counts[idx[st == ABANDONED]].sum())
        t.state[want] = LOST
        t.n_lost += int(want.size)
        if want.size:
            self._sendable.add(t.key)

    def _on_timeout(self, t: OutTransfer, late: np.ndarray, now: float) -> None:
        """Chunks ``late`` of ``t`` passed their retransmission timeout.

        The first timeout of a round declares lost what the loss bound lets go and what a later
        chunk overtook (the peer acknowledged it), and only probes for the rest (F-RTO, RFC
        5682, with RACK-TLP's probe, RFC 8985): one more copy of the newest such chunk of each
        path, on that path so that it queues behind the others; the transfer's timer restarts,
        backed off. On a loaded host a timeout mostly means a receiver that has not read its
        socket yet: resending everything late to it would double the queue it is behind on
        (tens of 64 KB chunks per timeout). The ACKs that follow tell
        (:meth:`OutTransfer.probe_answered`): originals still arriving end the round (a spurious
        timeout); a probe arriving alone means what was sent before it on its path is lost.
        When neither shows by the next timeout, the late chunks are declared lost; a dead path
        is left then, as resends take healthy paths.
        """
        if t.probe_at == np.inf:
            # Lost at once: what the loss bound lets go (nothing to resend), and
            # what a chunk sent later overtook in its lane (its ACK came: the peer reads).
            gone = np.union1d(t.tolerable(late), t.overtaken(late, len(self._tos)))
            if gone.size:
                self._declare_lost(t, gone, now)
                late = np.setdiff1d(late, gone, assume_unique=True)
                if not late.size:
                    return
            t.probe_at = t.rto_since = now
            t.rto_backoff = min(t.rto_backoff * 2.0, 64.0)
            # The newest late chunk of each path: a socket's queue is in order, another's not.
            newest_first = late[np.argsort(t.tx_seq[late])[::-1]]
            t.probes = newest_first[np.unique(t.path[newest_first], return_index=True)[1]]
            st = self._stats(t.key.step, t.key.bucket)
            for p in t.probes.tolist():
                q, cls, nbytes = int(t.path[p]), int(t.prio[p]), int(t.lengths[p])
                # The copy leaves the chunk as it is (in flight, its send time and sequence,
                # so an ACK of either copy is RACK's evidence at the original's place); its
                # count only keeps Karn's rule off its RTT.
                t.tx[p] = min(int(t.tx[p]) + 1, 255)
                st.sent[cls] += 1
                st.retransmitted[cls] += 1
                st.bytes_sent += nbytes
                if q < st.path_bytes.shape[0]:
                    st.path_bytes[q] += nbytes
                self.pacers[(t.key.dst, q)].consume(nbytes, now)
                self._probes.append((t.key, p, q, self._tos[cls]))
            return
        t.probe_at, t.probes = np.inf, _NO_CHUNKS
        # Exponential backoff for consecutive timeouts (RFC 6298); any acknowledgement resets it.
        t.rto_backoff = min(t.rto_backoff * 2.0, 64.0)
        self._declare_lost(t, late, now)

    def _resend_asked(self, t: OutTransfer, now: float) -> None:
        """Chunks a NACK asked for while they were on their way, still unacknowledged when their
        wait ended (:meth:`OutTransfer.asked_lost`): lost, and resent as the NACK's own."""
        self._requeue(t, t.asked_lost(now), now, lost=True)

    def _declare_lost(self, t: OutTransfer, idx: np.ndarray, now: float) -> None:
        """In-flight chunks presumed lost: tolerate what the budget allows (never protected),
        else resend."""
        t.n_inflight -= int(idx.size)
        self._note_loss(t, idx, now)
        resend = idx
        if t.budget_elems > 0:
            tolerate = t.tolerable(idx)
            if tolerate.size:
                t.state[tolerate] = ABANDONED
                t.abandoned_elems += int(t.counts[tolerate].sum())
                self._stats(t.key.step, t.key.bucket).dropped += np.bincount(
                    t.prio[tolerate], minlength=len(self._tos)
                )[: len(self._tos)]
                resend = np.setdiff1d(idx, tolerate, assume_unique=True)
        t.state[resend] = LOST
        t.n_lost += int(resend.size)
        if resend.size:
            self._sendable.add(t.key)
        else:
            self._maybe_fin(t, now)

    def _note_loss(self, t: OutTransfer, idx: np.ndarray, now: float) -> None:
        """In-flight chunks ``idx`` are lost: off their paths' outstanding bytes, into their
        loss rates, and a congestion signal to their pacers."""
        peer = t.key.dst
        paths = t.path[idx].astype(np.int64)
        sizes = t.lengths[idx].astype(np.int64)
        self.paths[peer].on_lost(paths, sizes, now)
        self._gate.on_loss(now, int(idx.size))
        for q in np.unique(paths):
            sel = paths == q
            # A reliable transfer must deliver every chunk: any loss of it is congestion.
            prot = t.budget_elems == 0 or bool(t.protected[idx[sel]].any())
            self.pacers[(peer, int(q))].controller.on_loss(
                now=now, lost_bytes=int(sizes[sel].sum()), protected=prot
            )
