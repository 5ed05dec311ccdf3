"""What a DDP ``GradBucket`` holds: its layer span, its wire dtype, a NumPy view of its buffer.

Shared by the gradlane hook (:mod:`gradlane.integrations.ddp`) and the trace recorder
(:mod:`gradlane.integrations.trace`).

Layer position: 0 is the model's first parameter (the front layer, needed first by the next
forward), 1 its last. :class:`ParamOrder` knows each parameter's index either from the model
(``model.parameters()`` order) or, without a model, learns it from the buckets it sees: DDP's
first iteration has one whole-model bucket whose ``parameters()`` come in model order (torch
2.13), so the order is complete after the first backward. A bucket's *span* is the (min, max)
position of its parameters; its priority position is the min — the front-most layer it holds,
which is when the next forward first needs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.wire.header import DType

__all__ = ["BucketLayout", "ParamOrder", "numpy_view", "wire_dtype"]

#: torch dtype -> (numpy dtype of the view handed to the transport, wire dtype or None = implied)
_WIRE: dict[torch.dtype, tuple[np.dtype, int | None]] = {
    torch.float32: (np.dtype(np.float32), None),
    torch.float16: (np.dtype(np.float16), None),
    torch.bfloat16: (np.dtype(np.uint16), int(DType.BF16)),
}


def wire_dtype(dtype: torch.dtype) -> tuple[np.dtype, int | None]:
    """The NumPy dtype a bucket of ``dtype`` travels as, and the ``dtype=`` to pass to submit.

    Raises ``TypeError`` naming the supported dtypes for anything else.
    """
    try:
        return _WIRE[dtype]
    except KeyError:
        raise TypeError(
            f"gradlane all-reduces float32, float16 and bfloat16 buckets, not {dtype}: "
            "train in one of those (or cast the bucket in a wrapping hook)"
        ) from None


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A zero-copy NumPy view of a contiguous 1-D CPU tensor (bf16 as raw uint16 words)."""
    if t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"need a contiguous 1-D CPU tensor, got {t.device} shape {tuple(t.shape)}")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class ParamOrder:
    """Index of every parameter in model order; positions in [0, 1]."""

    def __init__(self, params: Iterable[torch.Tensor] | None = None) -> None:
        self._index: dict[int, int] = {}
        self._fixed = params is not None
        # Keep the tensors alive: ids are only unique among live objects.
        self._keep: list[torch.Tensor] = []
        if params is not None:
            self._learn(params)

    def __len__(self) -> int:
        return len(self._index)

    def _learn(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            if id(p) not in self._index:
                self._index[id(p)] = len(self._index)
                self._keep.append(p)

    def indices(self, params: list[torch.Tensor]) -> list[int]:
        """Model-order index of each of ``params``; unknown parameters are learned first
        (unless the order came from a model, where they count as the last layer)."""
        if not self._fixed:
            self._learn(params)
        last = max(1, len(self._index) - 1)
        return [self._index.get(id(p), last) for p in params]

    def span(self, params: list[torch.Tensor]) -> tuple[float, float]:
        """(min, max) layer position of ``params`` (see :meth:`indices`)."""
        if not params:
            return (0.0, 0.0)
        idx = self.indices(params)
        last = max(1, len(self._index) - 1)
        return (min(idx) / last, max(idx) / last)


@dataclass
class BucketLayout:
    """One bucket of one DDP layout: what the hook caches per ``bucket.index()``."""

    index: int
    numel: int
    dtype: torch.dtype
    device: torch.device
    n_params: int
    first_param: int
    last_param: int
    span: tuple[float, float]
    np_dtype: np.dtype
    wire: int | None
    pinned: bool = False
    """The bucket holds a pinned layer (``PriorityConfig.pinned_layers``): all of it is
    protected and sent in class 0."""
    staging: torch.Tensor | None = None
    """Pinned host copy of a GPU bucket (allocated on first use)."""

    @property
    def position(self) -> float:
        """The bucket's priority position: its front-most layer."""
        return self.span[0]

    @property
    def nbytes(self) -> int:
        """Bytes of gradients in the bucket."""
        return self.numel * self.np_dtype.itemsize

    @classmethod
    def of(
        cls,
        index: int,
        buf: torch.Tensor,
        params: list[torch.Tensor],
        order: ParamOrder,
        priority: PriorityConfig | None = None,
    ) -> BucketLayout:
        """The layout of a bucket with buffer ``buf`` holding ``params``; it is pinned when
        ``priority`` pins one of their model-order indices (:meth:`PriorityConfig.pins`)."""
        np_dtype, wire = wire_dtype(buf.dtype)
        return cls(
            index=index,
            numel=buf.numel(),
            dtype=buf.dtype,
            device=buf.device,
            n_params=len(params),
            first_param=id(params[0]) if params else 0,
            last_param=id(params[-1]) if params else 0,
            span=order.span(params),
            np_dtype=np_dtype,
            wire=wire,
            pinned=priority is not None and priority.pins(order.indices(params)),
        )

    def matches(self, buf: torch.Tensor, params: list[torch.Tensor]) -> bool:
        """True when ``buf`` and ``params`` are still this layout's bucket."""
        return (
            buf.numel() == self.numel
            and buf.dtype == self.dtype
            and buf.device == self.device
            and len(params) == self.n_params
            and (not params or id(params[0]) == self.first_param)
            and (not params or id(params[-1]) == self.last_param)
        )
