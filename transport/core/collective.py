"""Sans-I/O transpose all-reduce (ARCHITECTURE §4): reduce-scatter by direct all-to-all, then
all-gather of the reduced shards. A loss harms one pair in one phase, never a chain.

Theory of operation
-------------------
Rank i owns shard i (an even split of the bucket). ``start`` packs every other shard toward its
owner (REDUCE phase) and expects the other ranks' pieces of shard i; the rank's own piece is
already in the accumulator. When the reduce transfer completes, the shard is filled without
bias — each chunk is scaled by world / contributors, so a chunk that missed a sender is the
mean of those that arrived times the world size — and sent to every other rank (GATHER phase),
which places it into its result. A gathered chunk that never came keeps the rank's own value
scaled by the world size (the same unbiased-sum convention). The result is the SUM over ranks;
the DDP hook asks for the mean with ``scale=1/world``.

With a lossy precision policy (``TransportConfig.precision``), a float32 bucket's chunks may
travel in fewer bits, in both phases: each rank's contribution carries its error-feedback
residual, and an owner keeps exactly the rounded sums it gathers to the others, so every
replica holds the same result (:mod:`~gradlane.transport.core.wire_precision`).

With ``rotate``, float32 buckets are rotated by a seeded randomized Hadamard transform before
sharding and rotated back after the gather: the transform is linear, so it commutes with the
sum, and a lost chunk becomes small noise spread over its block.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gradlane.transport import kernels
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.endpoint import Endpoint
from gradlane.transport.core.events import (
    AllReduceComplete,
    AllReduceFailed,
    CollectiveReport,
    Datagram,
    DatagramRun,
    Event,
    LossReport,
    PeerTimedOut,
    TransferComplete,
)
from gradlane.transport.core.incoming import InKey
from gradlane.transport.core.sender import OutKey
from gradlane.transport.core.wire_precision import WirePrecision
from gradlane.transport.wire.header import DType, Phase, TransferSpec, chunk_counts

#: Staging buffers of ordered reduces kept for reuse (the largest), per rank.
_STAGES_KEPT = 4

__all__ = [
    "TransposeAllReduce",
    "check_servers",
    "from_f32",
    "shard_bounds",
    "to_f32",
    "wire_view",
]


def shard_bounds(n_elems: int, world: int, servers: Sequence[int] | None = None) -> np.ndarray:
    """Start offsets of each rank's shard plus the end: shard i = [b[i], b[i+1]).

    Without ``servers`` every rank owns an equal shard (the transpose all-reduce). With them, the
    bucket is split evenly over the server ranks only (in rank order) and every other rank's
    shard is empty: a parameter server (one server) or a sharded one (several).
    """
    if servers is None:
        return (np.arange(world + 1, dtype=np.int64) * n_elems) // world
    owners = sorted(set(servers))
    splits = (np.arange(len(owners) + 1, dtype=np.int64) * n_elems) // len(owners)
    size = np.zeros(world, dtype=np.int64)
    size[owners] = np.diff(splits)
    return np.concatenate(([0], np.cumsum(size)))


def _out_words(out: np.ndarray, data: np.ndarray, wire_in: np.ndarray) -> np.ndarray:
    """The caller's result buffer as wire words; it must match ``data`` exactly."""
    if (
        not isinstance(out, np.ndarray)
        or out.shape != data.shape
        or out.dtype != data.dtype
        or not out.flags["C_CONTIGUOUS"]
        or not out.flags["WRITEABLE"]
    ):
        raise ValueError(
            f"out must be a writable contiguous array like the bucket ({data.dtype}{data.shape}), "
            f"got {getattr(out, 'dtype', type(out).__name__)}{getattr(out, 'shape', '')}"
        )
    return out.view(wire_in.dtype)


def check_servers(servers: Sequence[int] | None, world: int) -> tuple[int, ...] | None:
    """Validate a parameter-server rank list (non-empty, ranks in range, no repeats)."""
    if servers is None:
        return None
    out = tuple(int(r) for r in servers)
    if not out or len(set(out)) != len(out) or not all(0 <= r < world for r in out):
        raise ValueError(
            f"servers={list(servers)}: give distinct ranks in [0, {world}), at least one"
        )
    return out


def wire_view(data: np.ndarray, dtype: int | None) -> tuple[np.ndarray, int]:
    """The bucket as its wire representation (float32, or raw uint16 for f16/bf16) and dtype."""
    if data.ndim != 1 or not data.flags["C_CONTIGUOUS"]:
        raise ValueError("a bucket must be a contiguous 1-D array")
    if data.dtype == np.float32:
        return data, DType.F32
    if data.dtype == np.float16:
        return data.view(np.uint16), DType.F16
    if data.dtype in (np.uint16, np.int16) and dtype in (DType.F16, DType.BF16):
        return data.view(np.uint16), int(dtype)
    raise ValueError(
        f"unsupported bucket dtype {data.dtype}: use float32, float16, or raw 16-bit words "
        "with dtype=DType.BF16 / DType.F16"
    )


def to_f32(wire: np.ndarray, dtype: int) -> np.ndarray:
    """Wire words to float32 (a copy)."""
    if dtype == DType.F32:
        return wire.astype(np.float32, copy=True)
    if dtype == DType.F16:
        return wire.view(np.float16).astype(np.float32)
    return (wire.astype(np.uint32) << np.uint32(16)).view(np.float32)


def from_f32(values: np.ndarray, dtype: int, out: np.ndarray) -> None:
    """Write float32 ``values`` into wire words ``out`` (bf16 rounds to nearest even)."""
    if dtype == DType.F32:
        out[:] = values
    elif dtype == DType.F16:
        out.view(np.float16)[:] = values
    else:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        words = (rounded >> np.uint32(16)).astype(np.uint16)
        nan = np.isnan(values)
        words[nan] = (bits[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x40)
        out[:] = words


@dataclass
class _Collective:
    step: int
    bucket: int
    dtype: int
    layer_position: float
    pinned: bool
    started: float
    original: np.ndarray  # the caller's dtype view of the result
    result: np.ndarray  # wire words
    src: np.ndarray  # this rank's contribution in wire words: the caller's array, or its rotation
    bounds: np.ndarray
    accum: np.ndarray  # float32 sums of this rank's shard (a view of ``result`` for float32)
    contrib: np.ndarray
    rotated: bool
    # Per-chunk statistics of this rank's finished sums, written by the reduce kernel as each
    # chunk's last contribution lands (float32 only; None otherwise): what the gather sends.
    stats: kernels.ChunkStats | None = None
    scale: float = 1.0  # the result's multiplier (applied to this rank's shard only)
    reduce_report: LossReport | None = None
    gather_reports: dict[int, LossReport] = field(default_factory=dict)
    gather_received: dict[int, np.ndarray] = field(default_factory=dict)
    nonfinite: int = 0  # chunks of this rank's finished shard holding NaN/inf (from their norms)
    stage: np.ndarray | None = None  # the ordered reduce's staging buffer, while it runs
    gather_at: float = 0.0  # when this rank's gather phase started (its reduce complete)
    residual: np.ndarray | None = None  # the bucket's error-feedback buffer (lossy formats)
    lossy: bool = False  # chunks may travel in a lossy wire format
    precision_level: float = 0.0  # the adaptive level at the start
    # While waiting for the peers' last acknowledgements: the wait's end, or None until the
    # driver next passes in a time (see TransposeAllReduce._conclude).
    finish_by: float | None = 0.0


class TransposeAllReduce:
    """Per-rank transpose all-reduce over an :class:`Endpoint`, behind the same driver API
    (:class:`~gradlane.transport.core.events.SansIOCore`, plus the endpoint's receive arena).

    ``start(step, bucket, data, layer_position, now)`` begins one collective; the driver gets an
    :class:`AllReduceComplete` (result + :class:`CollectiveReport`) or :class:`AllReduceFailed`
    from ``next_event()``. Drivers use only the public methods and properties here.
    """

    def __init__(
        self,
        me: int,
        world: int,
        config: TransportConfig | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.endpoint = Endpoint(me, world, config, rng)
        self.me = me
        self.world = world
        self.config = self.endpoint.config
        self.precision = WirePrecision(self.config)
        self._running: dict[tuple[int, int], _Collective] = {}
        # Complete collectives waiting (up to ack_wait_s) for their outgoing data to be acked.
        self._waiting: dict[tuple[int, int], _Collective] = {}
        self._events: deque[Event] = deque()
        # Staging buffers of ordered reduces (deterministic_sum), kept for reuse: a fresh one
        # would take a page fault on every page a contribution waits in.
        self._stages: list[np.ndarray] = []

    # -- collective API ------------------------------------------------------------------------
    def start(
        self,
        step: int,
        bucket: int,
        data: np.ndarray,
        layer_position: float,
        now: float,
        *,
        dtype: int | None = None,
        pinned: bool = False,
        servers: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        scale: float = 1.0,
    ) -> None:
        """Begin all-reducing ``data`` (1-D float32/float16, or raw 16-bit words with ``dtype``).

        ``scale`` multiplies the result (``1 / world``: the mean, as DDP wants it). Only this
        rank's shard is scaled — as its sum completes, chunk by chunk in the reduce kernel for
        float32 — and the gather brings everyone the scaled values: no pass over the whole
        buffer, where dividing the input first costs one.

        ``servers`` makes it a parameter-server exchange: every rank *pushes* its bucket to the
        server ranks (each server owns an equal slice), the servers sum, and every rank *pulls*
        the sum back; same loss policy, priorities, fill rules and report. Every rank must pass
        the same ``servers`` for a (step, bucket). ``None``: the transpose all-reduce (every rank
        serves one shard), which spreads the load evenly and is the faster choice on a uniform
        network; one server fits when a single host has the bandwidth (or must own the result).

        ``out`` (same shape and dtype as ``data``) receives the result instead of a new array;
        it may be ``data`` itself (in place, as ``torch.distributed.all_reduce`` works): peers'
        shards are only overwritten by the gather phase, which cannot start before those peers
        have everything they need from this rank. Reusing buffers saves the page faults of a
        fresh result every call.

        ``layer_position`` is 0 for the front layer (needed first next step), 1 for the last.
        ``data`` is never written, but it is read until the collective ends (peers' shards are
        sent straight from it, never copied): do not modify it before the completion event.
        The result (a new array) comes with that event.
        """
        wire_in, wdt = wire_view(data, dtype)
        servers = check_servers(servers, self.world)
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number, got {scale}")
        if (step, bucket) in self._running:
            raise ValueError(f"step {step} bucket {bucket} is already being all-reduced")
        ep = self.endpoint
        ep.note_step(step)
        ep.note_time(now)
        n = wire_in.shape[0]
        world, me = self.world, self.me
        rotated = self.config.rotate and wdt == DType.F32 and n > 0
        lossy = self.precision.applies(wdt, rotated, self.world)
        residual = None
        if lossy:
            # Plus last time's residual (error feedback): a new array, or the caller's.
            src, residual = self.precision.contribution(step, bucket, wire_in)
        elif rotated:
            src = wire_in.copy()
            kernels.hadamard_forward(
                src, seed=self._seed(step, bucket), block=self.config.rotate_block
            )
        else:
            # The caller's words are only read (peers' shards are sent straight from them), so
            # nothing is copied but this rank's own shard: one memory pass fewer per collective.
            src = wire_in
        bounds = shard_bounds(n, world, servers)
        lo, hi = int(bounds[me]), int(bounds[me + 1])
        chunk_elems = self.config.chunk_elems(wdt)
        if out is None:
            result = np.empty_like(src)  # every other shard is written by the gather phase
        else:
            result = _out_words(out, data, wire_in)
        result[lo:hi] = src[lo:hi]
        # float32 sums in place in the result's own shard; 16-bit words need a float32 copy.
        accum = result[lo:hi] if wdt == DType.F32 else to_f32(src[lo:hi], wdt)
        n_mine = -(-(hi - lo) // chunk_elems)
        contrib = np.ones(n_mine, dtype=np.uint16)
        if out is not None:
            original = out
        else:
            original = result.view(data.dtype) if data.dtype != result.dtype else result
        c = _Collective(
            step,
            bucket,
            wdt,
            layer_position,
            pinned,
            now,
            original,
            result,
            src,
            bounds,
            accum,
            contrib,
            rotated,
            scale=scale,
            residual=residual,
            lossy=lossy,
            precision_level=self.precision.level,
        )
        if wdt == DType.F32:
            c.stats = kernels.ChunkStats(
                np.empty(n_mine, dtype=np.float32),
                np.empty(n_mine, dtype=np.uint64),
                np.empty(n_mine, dtype=np.uint64),
            )
        self._running[(step, bucket)] = c
        self.precision.on_start(step, now)
        if world == 1:
            if scale != 1.0:
                mine = result[lo:hi]
                from_f32(to_f32(mine, wdt) * np.float32(scale), wdt, mine)
            self._finish(c, now)
            return
        received = np.zeros((world, n_mine), dtype=np.uint8)
        received[me] = 1
        spec = TransferSpec(step, bucket, me, Phase.REDUCE, wdt, hi - lo, chunk_elems, 0, world)
        senders = tuple(r for r in range(world) if r != me)
        order = None
        if self.config.deterministic_sum and len(senders) > 1:  # two addends commute exactly
            c.stage = self._take_stage(world * (hi - lo))
            order = kernels.sum_order(senders, world, hi - lo, n_mine, c.stage)
        # The reduce transfer is expected first: every transfer of this collective shares one
        # hard deadline, and the receiver checks them in insertion order, so when a peer never
        # sends, the failure names it (reduce phase) rather than a neighbour whose gather is
        # only late because it waits for that peer too.
        ep.receiver.expect(
            InKey(step, bucket, me, Phase.REDUCE),
            spec,
            senders,
            accum,
            contrib,
            received,
            now,
            ep.session,
            stats=c.stats,
            final=world,
            scale=scale if c.stats is not None else 1.0,  # 16-bit: scaled at the gather's start
            order=order,
        )
        for j in range(world):
            if j == me:
                continue
            jl, jh = int(bounds[j]), int(bounds[j + 1])
            gspec = TransferSpec(step, bucket, j, Phase.GATHER, wdt, jh - jl, chunk_elems, j, j + 1)
            grecv = np.zeros((1, gspec.n_chunks), dtype=np.uint8)
            c.gather_received[j] = grecv
            ep.receiver.expect(
                InKey(step, bucket, j, Phase.GATHER),
                gspec,
                (j,),
                result[jl:jh],
                np.zeros(gspec.n_chunks, dtype=np.uint16),
                grecv,
                now,
                ep.session,
            )
        for j in range(world):
            if j != me:
                jl, jh = int(bounds[j]), int(bounds[j + 1])
                ep.sender.start(
                    OutKey(step, bucket, j, Phase.REDUCE, j),
                    src[jl:jh],
                    wdt,
                    layer_position,
                    now,
                    pinned,
                    precision=self.precision.policy if lossy else None,
                    residual=residual[jl:jh] if residual is not None else None,
                )
        # Only what the start itself produced (transfers complete from early data): a batch of
        # received datagrams waits until this collective's first datagrams are out.
        self._pump(now, flush=False)

    @property
    def in_flight(self) -> int:
        """Collectives started here and not yet completed or failed."""
        return len(self._running)

    def owed(self) -> set[tuple[int, int]]:
        """The (step, bucket) of every outgoing transfer not yet acknowledged or stopped (see
        :meth:`Endpoint.owed`; safe off the driver's thread)."""
        return self.endpoint.owed()

    def stats(self) -> dict[str, object]:
        """The endpoint's reject counters and totals (see :meth:`Endpoint.stats`)."""
        return self.endpoint.stats()

    def path_stats(self) -> dict[int, dict[str, Any]]:
        """Per peer, per path statistics (see :meth:`Endpoint.path_stats`)."""
        return self.endpoint.path_stats()

    # -- driver API (delegates to the endpoint, then advances collectives) -----------------------
    @property
    def rx_arena(self) -> np.ndarray:
        """The receive arena drivers fill (see :attr:`Endpoint.rx_arena`)."""
        return self.endpoint.rx_arena

    @property
    def rx_free(self) -> int:
        """The arena's first free row (see :attr:`Endpoint.rx_free`)."""
        return self.endpoint.rx_free

    def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
        """Commit the datagrams just written into the arena's free rows: the way a batch of
        received datagrams goes in (see :meth:`Endpoint.commit_datagrams`)."""
        self.endpoint.commit_datagrams(lengths, path, now)

    def receive_rows(self, rows: np.ndarray, lengths: np.ndarray, path: int, now: float) -> None:
        """Process datagrams that lie one per row in the driver's own buffer, in place (see
        :meth:`Endpoint.receive_rows`)."""
        self.endpoint.receive_rows(rows, lengths, path, now)

    def receive_datagram(self, data: bytes | memoryview, path: int, now: float) -> None:
        """Feed one datagram given as bytes (see :meth:`Endpoint.receive_datagram`)."""
        self.endpoint.receive_datagram(data, path, now)

    def note_drained(self, now: float) -> None:
        """Every receive socket was just read empty (see :meth:`Endpoint.note_drained`)."""
        self.endpoint.note_drained(now)

    def datagrams_to_send(
        self, now: float, *, process_input: bool = True
    ) -> list[Datagram | DatagramRun]:
        """Datagrams to send now (see :meth:`Endpoint.datagrams_to_send`)."""
        self._start_waits(now)
        self._pump(now, flush=process_input)
        return self.endpoint.datagrams_to_send(now, process_input=process_input)

    @property
    def batches(self) -> int:
        """Received batches processed so far (see :attr:`Endpoint.batches`)."""
        return self.endpoint.batches

    def input_held(self, now: float) -> bool:
        """Received datagrams wait out their coalescing window (see
        :meth:`Endpoint.input_held`)."""
        return self.endpoint.input_held(now)

    def get_timer(self) -> float | None:
        """Next time ``handle_timer`` must run (at once while an ACK wait has not started)."""
        when = self.endpoint.get_timer()
        if self._waiting:
            now = self.endpoint.now
            by = min(now if c.finish_by is None else c.finish_by for c in self._waiting.values())
            when = by if when is None else min(when, by)
        return when

    def handle_timer(self, now: float) -> None:
        """Time-driven work of the endpoint, then of the collectives."""
        self._start_waits(now)
        self.endpoint.handle_timer(now)
        self._pump(now)

    def next_event(self) -> Event | None:
        """Pop the next collective event."""
        self._pump(self.endpoint.now)
        return self._events.popleft() if self._events else None

    # -- internals --------------------------------------------------------------------------------
    def _seed(self, step: int, bucket: int) -> int:
        return (self.config.job * 0x9E3779B1 + step * 65537 + bucket) & 0x7FFFFFFFFFFFFFFF

    def _start_waits(self, now: float) -> None:
        """Start the clock of every ACK wait that has none at ``now``: called first thing by
        the driver calls, before any processing has aged the time the driver read."""
        for c in self._waiting.values():
            if c.finish_by is None:
                c.finish_by = now + self.config.ack_wait_s

    def _pump(self, now: float, flush: bool = True) -> None:
        """Advance collectives on the endpoint's events (without ``flush``: only the events
        already produced, leaving received datagrams for later)."""
        ep = self.endpoint
        nxt = ep.next_event if flush else ep.pop_event
        while (ev := nxt()) is not None:
            if isinstance(ev, TransferComplete):
                self._on_transfer(ev.report, now)
            elif isinstance(ev, PeerTimedOut):
                self._fail(ev, now)
        if self._waiting:
            sender = self.endpoint.sender
            for key, c in list(self._waiting.items()):
                if not sender.owes(c.step, c.bucket) or (
                    c.finish_by is not None and now >= c.finish_by
                ):
                    del self._waiting[key]
                    self._finish(c, now)

    def _on_transfer(self, rep: LossReport, now: float) -> None:
        c = self._running.get((rep.step, rep.bucket))
        if c is None:
            return
        if rep.phase == Phase.REDUCE:
            c.reduce_report = rep
            self._start_gather(c, now)
        else:
            c.gather_reports[rep.shard] = rep
        if c.reduce_report is not None and len(c.gather_reports) == self.world - 1:
            self._conclude(c, now)

    def _conclude(self, c: _Collective, now: float) -> None:
        """Every shard is in. Finish now, or once the peers have acknowledged all this rank
        sent (within ``ack_wait_s``): the buffers then go back without copying anything out."""
        wait = self.config.ack_wait_s
        if wait > 0 and self.endpoint.sender.owes(c.step, c.bucket):
            # The wait starts at the next time the driver passes in (get_timer asks for one at
            # once), not at ``now``: ``now`` is when this call began, and processing the batch
            # that completed the result can take longer than the whole wait (a pass of 128
            # datagrams of 64 KB takes milliseconds). Counted from ``now``, the wait would
            # nearly always have run out already, and the collective would copy its whole
            # gather shard out of the caller's buffer at almost every completion.
            c.finish_by = None
            self._waiting[(c.step, c.bucket)] = c
        else:
            self._finish(c, now)

    def _take_stage(self, n: int) -> np.ndarray:
        """A float32 staging buffer of at least ``n`` elements, from the pool if one fits."""
        fits = [i for i, b in enumerate(self._stages) if b.shape[0] >= n]
        if fits:
            return self._stages.pop(min(fits, key=lambda i: self._stages[i].shape[0]))
        return np.empty(n, dtype=np.float32)

    def _give_stage(self, c: _Collective) -> None:
        """Return ``c``'s staging buffer (its reduce is over) to the pool, which keeps the
        largest few."""
        if c.stage is not None:
            self._stages.append(c.stage)
            self._stages.sort(key=lambda b: -b.shape[0])
            del self._stages[_STAGES_KEPT:]
            c.stage = None

    def _start_gather(self, c: _Collective, now: float) -> None:
        self._give_stage(c)  # the reduce transfer is complete: nothing is staged any more
        c.gather_at = now
        me, world = self.me, self.world
        lo, hi = int(c.bounds[me]), int(c.bounds[me + 1])
        chunk_elems = self.config.chunk_elems(c.dtype)
        counts = chunk_counts(hi - lo, chunk_elems)
        # Unbiased fill: every chunk is the mean of the contributions that arrived × world
        # (nothing to do when every rank contributed to every chunk, the reliable case).
        # The result's scale too: the float32 reduce kernel applied it to every chunk that got
        # all contributions (with their statistics); the rest are scaled here.
        stats = c.stats
        complete = c.contrib == world
        if not complete.all() or (stats is None and c.scale != 1.0):
            factor = world / np.maximum(c.contrib, 1).astype(np.float32) * np.float32(c.scale)
            if stats is not None:
                factor[complete] = 1.0  # finished in the kernel already
            np.multiply(c.accum, np.repeat(factor, counts), out=c.accum)
            stats = None  # some sums changed after the kernel took their statistics
        if c.dtype != DType.F32:
            from_f32(c.accum, c.dtype, c.result[lo:hi])
        # The gather phase starts now (the peers' reduce phases end about when this one does).
        for j in c.gather_received:
            self.endpoint.receiver.restart_clock(InKey(c.step, c.bucket, j, Phase.GATHER), now)
        # One shard to every peer: its norms and tag sums serve them all. Every chunk got its
        # world-th contribution, so the reduce kernel took them from the finished sums (float32);
        # otherwise the shard is read once for them here.
        mine = c.result[lo:hi]
        if stats is None:
            stats = kernels.chunk_stats(
                mine, dtype=DType(c.dtype), chunk_elems=chunk_elems, key=self.endpoint.key
            )
        # A chunk's norm is NaN or infinite when its values are: the report flags them for free.
        c.nonfinite = int(np.count_nonzero(~np.isfinite(stats.norms)))
        res = c.residual[lo:hi] if c.residual is not None else None
        first = None
        for j in range(world):
            if j != me:
                # Lossy: the first transfer encodes the shard (and ``mine`` becomes what the
                # peers decode), the others send its payload.
                t = self.endpoint.sender.start(
                    OutKey(c.step, c.bucket, me, Phase.GATHER, j),
                    mine,
                    c.dtype,
                    c.layer_position,
                    now,
                    c.pinned,
                    stats=stats,
                    precision=self.precision.policy if c.lossy and first is None else None,
                    residual=res if first is None else None,
                    decoded=mine if c.lossy and first is None else None,
                    encoded=first.encoded if first is not None else None,
                    count_error=first is None,
                )
                if first is None:
                    first = t
        if res is not None:
            self.precision.owner_units(res, c.scale)

    def _finish(self, c: _Collective, now: float) -> None:
        world, chunk_elems = self.world, self.config.chunk_elems(c.dtype)
        for j, grecv in c.gather_received.items():
            missing = (grecv[0] == 0).nonzero()[0]
            jl = int(c.bounds[j])
            for ch in missing.tolist():  # rare: only chunks lost for good
                a = jl + ch * chunk_elems
                b = min(a + chunk_elems, int(c.bounds[j + 1]))
                fill = to_f32(c.src[a:b], c.dtype) * np.float32(world * c.scale)
                from_f32(fill, c.dtype, c.result[a:b])
        # The result goes back to the caller (and is un-rotated in place below), and so does the
        # input: outgoing transfers still sending must stop reading them.
        self.endpoint.sender.detach(c.step, c.bucket)
        if c.rotated:
            kernels.hadamard_inverse(
                c.result, seed=self._seed(c.step, c.bucket), block=self.config.rotate_block
            )
        del self._running[(c.step, c.bucket)]
        empty = LossReport(c.step, c.bucket, self.me, Phase.REDUCE, 0, 0, {}, 0.0, False)
        report = CollectiveReport(
            step=c.step,
            bucket=c.bucket,
            duration=now - c.started,
            reduce=dataclasses.replace(c.reduce_report or empty, nonfinite_chunks=c.nonfinite),
            gather=tuple(c.gather_reports[j] for j in sorted(c.gather_reports)),
            sender=self.endpoint.sender.report(c.step, c.bucket),
            reduce_s=max(c.gather_at - c.started, 0.0),
            precision_level=c.precision_level,
        )
        self.precision.on_end(c.step, now, report.sender)
        self.endpoint.sender.forget_stats(c.step, c.bucket)
        self._events.append(AllReduceComplete(c.step, c.bucket, c.original, report))

    def _fail(self, ev: PeerTimedOut, now: float) -> None:
        c = self._running.pop((ev.step, ev.bucket), None)
        self._waiting.pop((ev.step, ev.bucket), None)
        if c is None:
            return
        self.endpoint.sender.detach(c.step, c.bucket)
        for j in range(self.world):
            for phase in (Phase.REDUCE, Phase.GATHER):
                self.endpoint.receiver.abort(InKey(c.step, c.bucket, j, phase))
        self._give_stage(c)  # after the aborts: no kernel writes into it any more
        self.precision.on_end(c.step, now, None)
        self._events.append(AllReduceFailed(ev.step, ev.bucket, ev.error))
