"""Kernel throughput against NumPy's own copy and add on the same bytes, in the same run.

``python -m gradlane.bench.perf.kernels --json out.json [--quick]``

Each kernel runs interleaved with its NumPy baseline (``np.copyto`` of the same payload bytes into
a preallocated buffer for send/place; ``dst += src`` on float32 arrays of the same element count
for reduce), single-threaded, after a warm-up; the figures are medians. Throughput counts payload
bytes (the shard), so the headers a kernel writes or reads on top are its own overhead.

"send" is what a sender runs per shard: :func:`kernels.chunk_stats` (one read: norms and tag
sums, fast or keyed) and :func:`kernels.write_headers` (a 48-byte header per chunk from those
sums). The payload itself is never copied: the kernel's ``sendmmsg`` gathers it.

The lossy wire formats' rows come with their *floors*, measured in the same run: the least any
kernel doing the job could cost here. ``pack_*_floor`` reads the float32 input and writes a
payload of the format's width (each element's top bits, no rounding), and with error feedback a
float32 residual per element too, with no tag, energy or header; ``reduce_*_floor`` decodes one
contiguous payload and adds it, with no tag or header per row (``reduce_*_tagged_floor``: the
same with the tag's sums, which every receive must compute). A kernel's ratio can only
approach its floor's, so a target above the floor cannot be met on this machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from gradlane.bench.host import HostWatch
from gradlane.transport import kernels
from gradlane.transport.kernels._codec import add_bf16, add_e4m3
from gradlane.transport.kernels._common import EXACT, fast_sums64
from gradlane.transport.kernels.encoding import encode_shard, fill_headers_as
from gradlane.transport.wire.header import (
    HEADER_SIZE,
    N_REASONS,
    DType,
    Header,
    SessionSpec,
    TransferSpec,
)
from gradlane.transport.wire.tag import TagKey
from numba import njit

MB = 1_000_000
SIZES_MB = (25, 100)
PAYLOADS = (8192, 1408)
SECRET = "bench-secret"


@njit(**EXACT)
def _floor_pack(bits: np.ndarray, shift: int, out: np.ndarray, res: np.ndarray) -> None:
    """The floor of packing float32 ``bits`` to a narrower format: each element's top bits
    (``bits >> shift``, u16 or u8 ``out``), and with a residual buffer (``res`` non-empty) a
    float32 written per element too; no rounding, tag or energy."""
    f = bits.view(np.float32)
    s = np.uint32(shift)
    if res.shape[0]:
        for j in range(bits.shape[0]):
            out[j] = bits[j] >> s
            res[j] = f[j]
    else:
        for j in range(bits.shape[0]):
            out[j] = bits[j] >> s


@njit(**EXACT)
def _floor_add_bf16_tagged(words: np.ndarray, acc: np.ndarray, chunk: int) -> np.uint64:
    """The floor of a checked bfloat16 receive: ``acc +=`` the items of u32 ``words`` (two
    each) while the fast tag's sums run over the same words, per ``chunk`` items, as one
    contiguous payload (no headers, no per-row bookkeeping, nothing saved for an undo)."""
    h = np.uint64(0)
    half = chunk // 2
    lo32 = np.uint64(0xFFFFFFFF)
    for c in range(words.shape[0] // half):
        base = c * half
        a = np.uint64(0)
        b = np.uint64(0)
        for i in range(half):
            w = words[base + i]
            wu = np.uint64(w)
            a += wu
            b += (np.uint64(i) & lo32) * wu
            acc[2 * (base + i)] += np.uint32(w << np.uint32(16)).view(np.float32)
            acc[2 * (base + i) + 1] += np.uint32(w & np.uint32(0xFFFF0000)).view(np.float32)
        h += a ^ b
    return h


@njit(**EXACT)
def _floor_add_e4m3_tagged(codes: np.ndarray, acc: np.ndarray, chunk: int) -> np.uint64:
    """The floor of a checked E4M3 receive: per ``chunk`` codes of one contiguous payload, the
    fast tag's sums (one vectorised pass over the chunk's bytes, from L1 after it), then the
    decode-add; no headers, no per-row bookkeeping, nothing saved for an undo. (One fused loop
    is slower: four codes a tag word do not vectorise with the sums.)"""
    h = np.uint64(0)
    words = codes.view(np.uint64)
    for c in range(codes.shape[0] // chunk):
        a, b = fast_sums64(words[c * chunk // 8 :], chunk)
        h += a ^ b
        add_e4m3(acc[c * chunk : (c + 1) * chunk], codes[c * chunk : (c + 1) * chunk],
                 np.float32(0.01))  # fmt: skip
    return h


def _interleaved(
    kernel: Callable[[], object],
    baseline: Callable[[], object],
    reps: int,
    setup: Callable[[], object] | None = None,
) -> tuple[float, float, float]:
    """Median seconds of ``kernel`` and ``baseline`` run back to back, and the median of the
    per-round throughput ratios (baseline time / kernel time), after one warm-up round.

    The ratio of each adjacent pair is what the summary reports: on a shared machine the load
    changes between rounds, and a pair run back to back sees the same load.
    """
    tk: list[float] = []
    tb: list[float] = []
    ratios: list[float] = []
    for i in range(reps + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        kernel()
        t1 = time.perf_counter()
        baseline()
        t2 = time.perf_counter()
        if i:  # the first round is the warm-up
            tk.append(t1 - t0)
            tb.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(tk), statistics.median(tb), statistics.median(ratios)


def _solo(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None) -> float:
    ts: list[float] = []
    for i in range(reps + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _arena_for(n_elems: int, chunk_elems: int, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    n_chunks = -(-n_elems // chunk_elems)
    width = 48 + chunk_elems * itemsize
    width += (-width) % 8
    return np.zeros((n_chunks, width), dtype=np.uint8), np.zeros(n_chunks, dtype=np.int64)


def _row(results: list[dict[str, Any]], **fields: Any) -> None:
    results.append(fields)
    ratio = fields.get("ratio")
    base = fields.get("baseline_GBps")
    print(
        f"{fields['kernel']:<22} {fields['size_MB']:>5} MB {fields.get('payload_B', '-'):>6} B "
        f"{fields['GBps']:>8.2f} GB/s"
        + (f"   {fields['baseline']:<10} {base:>8.2f} GB/s   x{ratio:.3f}" if ratio else "")
    )


def _pack_reduce_place(
    src: np.ndarray,
    other: np.ndarray,
    size_mb: int,
    payload: int,
    reps: int,
    results: list[dict[str, Any]],
    summary: dict[str, float],
) -> None:
    """send / reduce_into / place_into (and at 25 MB the keyed and 16-bit sends) for one size."""
    nbytes = src.nbytes
    n = src.shape[0]
    ce = payload // 4
    tag = "" if payload == 8192 else f"_{payload}B"
    copy_dst = np.empty_like(src)
    iadd_dst = np.zeros_like(src)
    arena, lengths = _arena_for(n, ce, 4)
    header = Header(job=1, step=5, bucket=0, shard=0, src=1, dst=0)
    fast, keyed = TagKey(), TagKey.from_secret(SECRET)

    def do_send(key: TagKey = fast, data: np.ndarray = src, dtype: DType = DType.F32) -> int:
        elems = payload // data.itemsize
        stats = kernels.chunk_stats(data, dtype=dtype, chunk_elems=elems, key=key)
        hdr = np.empty((stats.norms.shape[0], HEADER_SIZE), dtype=np.uint8)
        zero = np.zeros(stats.norms.shape[0], dtype=np.uint8)
        return kernels.write_headers(
            hdr, data, stats, dtype=dtype, header=header, chunk_elems=elems, key=key,
            prio=zero, flags=zero,
        )  # fmt: skip

    def do_copy() -> None:
        np.copyto(copy_dst, src)

    tk, tb, ratio = _interleaved(do_send, do_copy, reps)
    _row(results, kernel="send", size_MB=size_mb, payload_B=payload, GBps=nbytes / tk / 1e9,
         baseline="np.copyto", baseline_GBps=nbytes / tb / 1e9, ratio=ratio)  # fmt: skip
    summary[f"send_vs_copy_{size_mb}MB{tag}"] = round(ratio, 3)

    session = SessionSpec(job=1, me=0, world=2)
    transfer = TransferSpec(
        step=5, bucket=0, shard=0, phase=0, dtype=DType.F32, n_elems=n, chunk_elems=ce,
        src_lo=0, src_hi=2,
    )  # fmt: skip
    # The packets the receive kernels take, as the wire carries them (untimed).
    kernels.pack(src, arena, lengths, dtype=DType.F32, header=header, chunk_elems=ce, key=fast)
    accum = np.zeros(n, dtype=np.float32)
    out = np.empty(n, dtype=np.float32)
    contrib = np.zeros(transfer.n_chunks, dtype=np.uint16)
    received = np.zeros((2, transfer.n_chunks), dtype=np.uint8)
    counters = np.zeros(N_REASONS, dtype=np.int64)

    def reset() -> None:
        received[:] = 0
        contrib[:] = 0

    def do_iadd() -> None:
        iadd_dst.__iadd__(other)

    def do_place() -> int:
        return kernels.place_into(
            arena, lengths, out, received, session=session, transfer=transfer, counters=counters
        )

    def time_reduce(kernel: str, key: str, sess: SessionSpec) -> None:
        """``reduce_into`` of the arena's packets under ``sess`` against ``dst += src``."""

        def do_reduce() -> int:
            return kernels.reduce_into(
                arena, lengths, accum, contrib, received,
                session=sess, transfer=transfer, counters=counters,
            )  # fmt: skip

        counters[:] = 0
        tk, tb, ratio = _interleaved(do_reduce, do_iadd, reps, setup=reset)
        if counters[0] != (reps + 1) * transfer.n_chunks:
            raise RuntimeError(f"{kernel} rejected packets: {counters.tolist()}")
        _row(results, kernel=kernel, size_MB=size_mb, payload_B=payload,
             GBps=nbytes / tk / 1e9, baseline="dst += src", baseline_GBps=nbytes / tb / 1e9,
             ratio=ratio)  # fmt: skip
        summary[f"{key}_{size_mb}MB{tag}"] = round(ratio, 3)

    time_reduce("reduce_into", "reduce_vs_iadd", session)

    tk, tb, ratio = _interleaved(do_place, do_copy, reps, setup=reset)
    _row(results, kernel="place_into", size_MB=size_mb, payload_B=payload,
         GBps=nbytes / tk / 1e9, baseline="np.copyto", baseline_GBps=nbytes / tb / 1e9,
         ratio=ratio)  # fmt: skip
    summary[f"place_vs_copy_{size_mb}MB{tag}"] = round(ratio, 3)
    if size_mb != 25:
        return

    tk, tb, ratio = _interleaved(lambda: do_send(keyed), do_copy, reps)
    _row(results, kernel="send_keyed", size_MB=size_mb, payload_B=payload,
         GBps=nbytes / tk / 1e9, baseline="np.copyto", baseline_GBps=nbytes / tb / 1e9,
         ratio=ratio)  # fmt: skip
    summary[f"send_keyed_GBps_{size_mb}MB{tag}"] = round(nbytes / tk / 1e9, 2)

    # The keyed receive: the same packets under the job key, checked and added.
    kernels.pack(src, arena, lengths, dtype=DType.F32, header=header, chunk_elems=ce, key=keyed)
    time_reduce(
        "reduce_keyed", "reduce_keyed_vs_iadd", SessionSpec(job=1, me=0, world=2, key=keyed)
    )

    if payload == PAYLOADS[0]:
        _lossy(src, size_mb, ce, reps, results, summary, (do_copy, do_iadd, reset))

    half = src.astype(np.float16).view(np.uint16)
    for name, wire in (("send_bf16", DType.BF16), ("send_f16", DType.F16)):
        t = _solo(functools.partial(do_send, fast, half, wire), reps)
        _row(results, kernel=name, size_MB=size_mb, payload_B=payload,
             GBps=half.nbytes / t / 1e9)  # fmt: skip
        summary[f"{name}_GBps_{size_mb}MB{tag}"] = round(half.nbytes / t / 1e9, 2)


def _lossy(
    src: np.ndarray,
    size_mb: int,
    ce: int,
    reps: int,
    results: list[dict[str, Any]],
    summary: dict[str, float],
    baselines: tuple[Callable[[], None], Callable[[], None], Callable[[], None]],
) -> None:
    """The lossy wire formats: packing (:func:`encoding.encode_shard`, error feedback on: one
    pass converting, summing the tag and keeping the residual; and off, without the residual)
    against ``np.copyto`` of the float32 input, and reducing such packets (``reduce_into``)
    against ``dst += src``."""
    do_copy, do_iadd, _ = baselines
    nbytes = src.nbytes
    n = src.shape[0]
    n_chunks = -(-n // ce)
    fast = TagKey()
    residual = np.empty_like(src)
    header = Header(job=1, step=5, bucket=0, shard=0, src=1, dst=0)
    session = SessionSpec(job=1, me=0, world=2)
    transfer = TransferSpec(
        step=5, bucket=0, shard=0, phase=0, dtype=DType.F32, n_elems=n, chunk_elems=ce,
        src_lo=0, src_hi=2,
    )  # fmt: skip
    accum = np.zeros(n, dtype=np.float32)
    contrib = np.zeros(n_chunks, dtype=np.uint16)
    received = np.zeros((2, n_chunks), dtype=np.uint8)
    counters = np.zeros(N_REASONS, dtype=np.int64)

    def reset() -> None:
        received[:] = 0
        contrib[:] = 0

    for name, wire in (("bf16", DType.BF16), ("fp8", DType.E4M3)):
        formats = np.full(n_chunks, int(wire), dtype=np.uint8)

        def do_pack(formats: np.ndarray = formats) -> int:
            enc = encode_shard(src, formats, chunk_elems=ce, key=fast, residual=residual)
            return enc.payload_bytes

        tk, tb, ratio = _interleaved(do_pack, do_copy, reps)
        _row(results, kernel=f"pack_{name}", size_MB=size_mb, payload_B=ce * 4,
             GBps=nbytes / tk / 1e9, baseline="np.copyto", baseline_GBps=nbytes / tb / 1e9,
             ratio=ratio)  # fmt: skip
        summary[f"pack_{name}_vs_copy"] = round(ratio, 3)

        def do_pack_plain(formats: np.ndarray = formats) -> int:  # error feedback off
            return encode_shard(src, formats, chunk_elems=ce, key=fast).payload_bytes

        tk, tb, ratio = _interleaved(do_pack_plain, do_copy, reps)
        _row(results, kernel=f"pack_{name}_nofb", size_MB=size_mb, payload_B=ce * 4,
             GBps=nbytes / tk / 1e9, baseline="np.copyto", baseline_GBps=nbytes / tb / 1e9,
             ratio=ratio)  # fmt: skip
        summary[f"pack_{name}_no_feedback_vs_copy"] = round(ratio, 3)

        # The floors (see the module docstring), with and without the residual.
        narrow = np.empty(n, dtype=np.uint16 if wire == DType.BF16 else np.uint8)
        shift = 16 if wire == DType.BF16 else 24
        for suffix, res in (("", residual), ("_no_feedback", residual[:0])):

            def do_floor(narrow: np.ndarray = narrow, shift: int = shift,
                         res: np.ndarray = res) -> None:  # fmt: skip
                _floor_pack(src.view(np.uint32), shift, narrow, res)

            tk, tb, ratio = _interleaved(do_floor, do_copy, reps)
            _row(results, kernel=f"pack_{name}{'_nofb' if suffix else ''}_floor", size_MB=size_mb,
                 GBps=nbytes / tk / 1e9, baseline="np.copyto", baseline_GBps=nbytes / tb / 1e9,
                 ratio=ratio)  # fmt: skip
            summary[f"pack_{name}{suffix}_floor_vs_copy"] = round(ratio, 3)

        def do_add(narrow: np.ndarray = narrow, wire: DType = wire) -> None:
            if wire == DType.BF16:
                add_bf16(accum, narrow)
            else:
                add_e4m3(accum, narrow, np.float32(0.01))

        tk, tb, ratio = _interleaved(do_add, do_iadd, reps)
        _row(results, kernel=f"reduce_{name}_floor", size_MB=size_mb, GBps=nbytes / tk / 1e9,
             baseline="dst += src", baseline_GBps=nbytes / tb / 1e9, ratio=ratio)  # fmt: skip
        summary[f"reduce_{name}_floor_vs_iadd"] = round(ratio, 3)
        # The same with the tag's sums, which every receive computes.
        whole = narrow[: n - n % ce]

        def do_tagged(whole: np.ndarray = whole, wire: DType = wire) -> None:
            if wire == DType.BF16:
                _floor_add_bf16_tagged(whole.view(np.uint32), accum, ce)
            else:
                _floor_add_e4m3_tagged(whole, accum, ce)

        tk, tb, ratio = _interleaved(do_tagged, do_iadd, reps)
        _row(results, kernel=f"reduce_{name}_tag_floor", size_MB=size_mb,
             GBps=nbytes / tk / 1e9, baseline="dst += src", baseline_GBps=nbytes / tb / 1e9,
             ratio=ratio)  # fmt: skip
        summary[f"reduce_{name}_tagged_floor_vs_iadd"] = round(ratio, 3)

        arena, lengths = lossy_packets(src, formats, ce, header, fast)

        def do_reduce(arena: np.ndarray = arena, lengths: np.ndarray = lengths) -> int:
            return kernels.reduce_into(
                arena, lengths, accum, contrib, received,
                session=session, transfer=transfer, counters=counters,
            )  # fmt: skip

        counters[:] = 0
        tk, tb, ratio = _interleaved(do_reduce, do_iadd, reps, setup=reset)
        if counters[0] != (reps + 1) * n_chunks:
            raise RuntimeError(f"reduce_{name} rejected packets: {counters.tolist()}")
        _row(results, kernel=f"reduce_{name}", size_MB=size_mb, payload_B=ce * 4,
             GBps=nbytes / tk / 1e9, baseline="dst += src", baseline_GBps=nbytes / tb / 1e9,
             ratio=ratio)  # fmt: skip
        summary[f"reduce_{name}_vs_iadd"] = round(ratio, 3)


def lossy_packets(
    src: np.ndarray, formats: np.ndarray, ce: int, header: Header, key: TagKey
) -> tuple[np.ndarray, np.ndarray]:
    """Whole DATA packets of float32 ``src`` with chunk ``c`` in ``formats[c]``, as the wire
    carries them: an arena of rows (header, then payload) and their lengths."""
    enc = encode_shard(src, formats, chunk_elems=ce, key=key)
    n_chunks = formats.shape[0]
    hdr = np.empty((n_chunks, HEADER_SIZE), dtype=np.uint8)
    fill_headers_as(
        hdr, enc, np.zeros(n_chunks, dtype=np.float32), n_elems=src.shape[0], chunk_elems=ce,
        words=kernels.header_words(header), key=key, prio=np.zeros(n_chunks, dtype=np.uint8),
        flags=np.zeros(n_chunks, dtype=np.uint8),
    )  # fmt: skip
    arena, lengths = _arena_for(src.shape[0], ce, 4)
    for c in range(n_chunks):
        nb = int(enc.lengths[c]) - HEADER_SIZE
        arena[c, :HEADER_SIZE] = hdr[c]
        arena[c, HEADER_SIZE : HEADER_SIZE + nb] = enc.payload[c * enc.stride : c * enc.stride + nb]
        lengths[c] = enc.lengths[c]
    return arena, lengths


def _hadamard(
    src: np.ndarray,
    size_mb: int,
    reps: int,
    results: list[dict[str, Any]],
    summary: dict[str, float],
) -> None:
    nbytes = src.nbytes
    work = src.copy()
    t = _solo(lambda: kernels.hadamard_forward(work, seed=7, block=1024), reps)
    _row(results, kernel="hadamard_fwd", size_MB=size_mb, GBps=nbytes / t / 1e9)
    summary[f"hadamard_GBps_{size_mb}MB"] = round(nbytes / t / 1e9, 2)
    t = _solo(lambda: kernels.hadamard_inverse(work, seed=7, block=1024), reps)
    _row(results, kernel="hadamard_inv", size_MB=size_mb, GBps=nbytes / t / 1e9)
    summary[f"hadamard_inv_GBps_{size_mb}MB"] = round(nbytes / t / 1e9, 2)


def run(quick: bool) -> dict[str, Any]:
    """Run every benchmark; returns the JSON document (also printed as a table)."""
    reps = 7 if quick else 21
    rng = np.random.default_rng(0)
    results: list[dict[str, Any]] = []
    summary: dict[str, float] = {}
    print(f"{'kernel':<22} {'size':>8} {'payload':>8} {'throughput':>13}   baseline")
    for size_mb in SIZES_MB[:1] if quick else SIZES_MB:
        n = size_mb * MB // 4
        src = rng.standard_normal(n).astype(np.float32)
        other = rng.standard_normal(n).astype(np.float32)
        for payload in PAYLOADS:
            _pack_reduce_place(src, other, size_mb, payload, reps, results, summary)
        _hadamard(src, size_mb, reps, results, summary)
    return {
        "bench": "kernels",
        "units": "GB/s = 1e9 payload bytes per second; ratio = median over rounds of "
        "baseline time / kernel time, each round running the two back to back",
        "machine": {
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "platform": platform.platform(),
        },
        "config": {"fastmath": kernels.CONFIG.fastmath, "reps": reps, "quick": quick},
        "results": results,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="25 MB only, fewer repetitions")
    args = parser.parse_args(argv)
    host = HostWatch()
    doc = run(args.quick)
    doc["host"] = host.record()
    print(json.dumps(doc["summary"], indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
