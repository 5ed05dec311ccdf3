"""The gradlane DDP hook in real torch.distributed processes (gloo over loopback, spawn).

Each test spawns its ranks (``tests.multiproc.ddp_workers``), reads every result from a queue
with a timeout, releases ranks that wait, and joins or kills every process in a ``finally``;
each test also has a pytest timeout. Comparisons are against DDP's default hook in the same
processes; nothing asserts on timing except that a failure arrives before the queue timeout
(a hang would be a failure, not a stuck run).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from gradlane.integrations.timeline import STEPS_TID, merge_timelines, read_timeline

from tests.multiproc import ddp_workers
from tests.support.procs import RankProcs, free_port, owned


class Group(RankProcs):
    """``world`` spawned ranks running one scenario; results by rank."""

    def start(self, scenario: str, world: int, args: dict) -> None:
        port = free_port()
        for rank in range(world):
            self.spawn(
                ddp_workers.rank_main,
                (scenario, rank, world, port, args, self.up, self.down(rank)),
                f"gl-ddp-{scenario}-r{rank}",
            )

    def results(self, n: int | None = None, wait_s: float = ddp_workers.WAIT_S) -> dict:
        """The payloads of ``n`` ranks (default: all); a rank's error fails the test."""
        return super().results(wait_s, n)

    def release(self) -> None:
        for down in self.downs.values():
            down.put("go")


@pytest.fixture
def group() -> Iterator[Group]:
    yield from owned(Group(), "go")


#: Largest gap between the two hooks' gradients, relative to the largest gradient: float32 sums
#: differ only in summation order; 16-bit sums round once here (the sum is taken in float32)
#: and per addition in gloo.
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_reliable_hook_equals_default_hook(group: Group, world: int):
    cases = [(m, "float32", static) for m in ("mlp", "cnn") for static in (False, True)]
    if world == 2:
        cases += [("mlp", "float16", False), ("mlp", "bfloat16", False)]
    steps = 5
    group.start("equality", world, {"cases": cases, "steps": steps, "seed": 3})
    for rank, per_case in sorted(group.results().items()):
        assert [c["case"] for c in per_case] == [tuple(c) for c in cases]
        for c in per_case:
            name, dtype, static = c["case"]
            where = f"rank {rank} {name} {dtype} static_graph={static}"
            assert len(c["gaps"]) == steps and c["steps"] == steps, where
            assert max(c["gaps"]) <= TOLERANCE[dtype], f"{where}: gaps {c['gaps']}"
            assert c["failed"] == 0, where
            # Across the rebuild: one whole-model bucket first, several afterwards, and the
            # hook saw the new layout (a new generation).
            assert c["buckets"][0] == 1, f"{where}: buckets per step {c['buckets']}"
            assert max(c["buckets"]) > 1, f"{where}: buckets per step {c['buckets']}"
            assert c["generation"] >= 1, where


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_silent_rank_makes_backward_raise_naming_it(group: Group, world: int):
    silent, good, hard = world - 1, 3, 2.0
    args = {"silent": silent, "good_steps": good, "hard_deadline_s": hard, "seed": 5}
    group.start("silent_rank", world, args)
    results = group.results(world - 1)  # the silent rank reports after its release
    group.release()
    results.update(group.results(1))
    assert results[silent] == {"silent": True}
    for rank in range(world - 1):
        r = results[rank]
        assert r["raised"], f"rank {rank}: backward() returned although rank {silent} was silent"
        text = r["message"]
        # The error itself, not DDP failing to cast a failed Future's value to a Tensor.
        assert "Unable to cast" not in text, text
        assert f"HookError: gradlane hook on rank {rank}" in text, text
        assert f"rank(s) {silent}" in text or f", {silent}" in text, text
        assert f"did not deliver step {good} bucket" in text, text
        assert "PeerTimeout" in text, text
        # It failed at the hard deadline, not at the queue timeout.
        assert hard <= r["elapsed"] < ddp_workers.WAIT_S / 4, r["elapsed"]


@pytest.mark.timeout(300)
def test_no_sync_accumulates_without_calling_the_hook(group: Group):
    steps = 3
    group.start("no_sync", 2, {"steps": steps, "seed": 7})
    for rank, r in group.results().items():
        assert max(r["gaps"]) <= 1e-6, f"rank {rank}: {r['gaps']}"
        # Only the synchronised passes count as steps: every rank keeps the same numbering.
        assert r["steps"] == steps and r["next_step"] == steps, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_join_with_uneven_inputs_matches_the_default_hook(group: Group, world: int):
    base = 3
    group.start("join", world, {"base": base, "seed": 9})
    for rank, r in group.results().items():
        assert r["gap"] <= 1e-5 * max(r["scale"], 1.0), f"rank {rank}: {r}"
        # A rank that ran out of data keeps calling the hook (with zero buckets) until the
        # last rank is done, so every rank counts the same steps.
        assert r["steps"] == base + world - 1, r


@pytest.mark.timeout(300)
def test_timeline_has_a_row_per_rank_and_a_span_per_bucket_and_step(group: Group):
    steps, world = 4, 2
    with tempfile.TemporaryDirectory(prefix="gradlane-timeline-") as d:
        folder = Path(d)
        group.start("timeline", world, {"path": str(folder / "t.json"), "steps": steps, "seed": 11})
        results = group.results()
        paths = [Path(results[r]["path"]) for r in range(world)]
        assert paths == [folder / f"t.rank{r}.json" for r in range(world)]
        for rank, path in enumerate(paths):
            events = read_timeline(path)["traceEvents"]
            procs = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
            assert [(e["pid"], e["args"]["name"]) for e in procs] == [(rank + 1, f"rank {rank}")]
            assert {e["pid"] for e in events} == {rank + 1}
            spans = Counter(
                (e["args"]["step"], e["args"]["bucket"]) for e in events if e.get("cat") == "bucket"
            )
            per_step = results[rank]["buckets"]
            assert len(per_step) == steps and max(per_step) > 1, per_step  # DDP rebuilt its buckets
            assert set(spans.values()) == {1}, spans  # one span per bucket and step
            assert [sum(s == step for s, _ in spans) for step in range(steps)] == per_step
            phases = Counter(e["name"] for e in events if e.get("cat") == "phase")
            assert phases == {"reduce": sum(per_step), "gather": sum(per_step)}
            step_spans = [e for e in events if e.get("cat") == "step"]
            assert len(step_spans) == steps and {e["tid"] for e in step_spans} == {STEPS_TID}
        merged = read_timeline(merge_timelines(paths, folder / "all.json"))
        names = sorted(
            e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"
        )
        assert names == ["rank 0", "rank 1"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "policy", "level"), [(2, "e4m3", 0.0), (3, "adaptive", 2.0)])
def test_lossy_wire_precision_keeps_replicas_identical_and_trains(
    group: Group, world: int, policy: str, level: float
):
    steps = 12
    group.start("lossy", world, {"policy": policy, "level": level, "steps": steps, "seed": 7})
    for rank, r in sorted(group.results().items()):
        where = f"rank {rank} {policy}"
        # Owners keep what they gather: every replica the same, bit for bit.
        assert r["divergence"] == 0.0, where
        assert len(r["share"]) == steps, where
        # After DDP's bucket rebuild (step 1), most elements travel in fewer bits, with a
        # small relative error, and E4M3 bytes on the wire.
        assert min(r["share"][2:]) > 0.5, f"{where}: shares {r['share']}"
        assert 0 < max(r["error"][2:]) < 0.1, f"{where}: errors {r['error']}"
        assert all(fb[2] > 0 for fb in r["format_bytes"][2:]), where
        # It trains like the default hook: the losses stay close (same batches, same start).
        gaps = [abs(a - b) / max(a, 1e-9) for a, b in r["losses"]]
        assert max(gaps) < 0.05, f"{where}: loss gaps {gaps}"
