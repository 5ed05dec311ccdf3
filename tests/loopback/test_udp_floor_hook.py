"""``gradlane.bench.perf.udp_floor.FloorHook`` (the protocol-free DDP hook of
``gradlane.bench.perf.ddp_step --transports udp,floor``) refuses what it cannot reduce through the
Future, and its worker thread ends on close."""

from __future__ import annotations

import pytest
import torch
from gradlane.bench.perf.udp_floor import FloorHook


@pytest.mark.timeout(60)
def test_the_floor_hook_fails_a_bucket_it_cannot_reduce_with_a_clear_error():
    hook = FloorHook(0, 2)
    try:
        hook.start([hook.port, hook.port])
        fut = hook.submit(torch.zeros(8, dtype=torch.float16))
        with pytest.raises(TypeError, match="flat contiguous float32"):
            fut.wait()  # set by the worker at once: the dtype is checked first
    finally:
        hook.close()
    assert not hook._thread.is_alive()
    assert hook.sock.fileno() == -1
