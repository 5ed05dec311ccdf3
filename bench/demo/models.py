"""Models and data of the DDP demo, benchmark, trace recorder and tests (torch.nn only).

The data is scikit-learn's bundled handwritten digits (1,797 8×8 images, shipped inside the
package: nothing is downloaded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "MODELS",
    "BertShapedEncoder",
    "Digits",
    "big_mlp",
    "build",
    "digits_cnn",
    "digits_mlp",
    "load_digits",
    "wide_mlp",
]


@dataclass(frozen=True)
class Digits:
    """Train and test splits, float32 features in [0, 1] and int64 labels."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Digits:
    """scikit-learn's digits, split stratified with ``seed`` (1,437 train / 360 test)."""
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    x, y = sk_load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )

    def f(a: object) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.float32) / 16.0

    def i(a: object) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.int64)

    return Digits(f(x_tr), i(y_tr), f(x_te), i(y_te))


def digits_mlp(hidden: int = 256) -> nn.Module:
    """64 → hidden → hidden → 10 (85,002 parameters at hidden=256)."""
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def digits_cnn() -> nn.Module:
    """A small CNN on the 8×8 images (flat 64-feature input, reshaped inside)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def big_mlp(width: int = 1024, depth: int = 6, inputs: int = 64) -> nn.Module:
    """An MLP with ``depth`` square hidden layers: 6 × 1024² weights ≈ 25.5 MB of float32
    gradients (6,374,410 parameters)."""
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


class BertShapedEncoder(nn.Module):
    """BERT-base's shape built from torch.nn: 30,522-token, 512-position and 2-type embeddings
    of width 768, LayerNorm, 12 post-norm encoder layers (12 heads, FFN 3072, GELU), a tanh
    pooler and a 2-class head: 109.5 M parameters (BERT-base: 109.5 M)."""

    def __init__(
        self,
        layers: int = 12,
        width: int = 768,
        heads: int = 12,
        ffn: int = 3072,
        vocab: int = 30522,
        positions: int = 512,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(positions, width)
        self.types = nn.Embedding(2, width)
        self.norm = nn.LayerNorm(width, eps=1e-12)
        layer = nn.TransformerEncoderLayer(
            width, heads, ffn, dropout=0.1, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler = nn.Linear(width, width)
        self.head = nn.Linear(width, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: (batch, sequence) token ids → (batch, 2) logits."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.tokens(ids) + self.positions(pos)[None] + self.types(torch.zeros_like(ids))
        h = self.encoder(self.norm(h))
        return self.head(torch.tanh(self.pooler(h[:, 0])))


def wide_mlp(hidden: int = 1024) -> nn.Module:
    """The digits MLP at ``hidden`` = 1024: 64 → 1024 → 1024 → 10, 1,126,410 parameters, 4.5 MB
    of float32 gradients: enough that at a few hundred Mbit/s the network, not the CPU, sets
    the step time."""
    return digits_mlp(hidden)


MODELS = {"mlp": digits_mlp, "cnn": digits_cnn, "wide": wide_mlp}


def build(name: str, seed: int) -> nn.Module:
    """A digits model by name (``mlp`` or ``cnn``), initialised from ``seed``."""
    try:
        make = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}") from None
    torch.manual_seed(seed)
    return make()
