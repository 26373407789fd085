"""Example PyTorch models for ``kiln export`` (random weights, no downloads).

    kiln export examples/models.py:MLP -o mlp.kiln --input "x:1x64" --dynamic-batch
    kiln export examples/models.py:SmallCNN -o cnn.kiln --input "x:1x3x32x32" --dynamic-batch
    kiln export examples/models.py:tiny_transformer -o lm.kiln --input "ids:1x16:int64:0:1000" \\
        --dynamic-batch --dynamic ids:1:seq

``MODULE:ATTR`` names an nn.Module class (built with no arguments, as ``MLP`` and ``SmallCNN``
here), a factory function returning a module (``tiny_transformer``), or a module instance.
Every model draws its random weights from a fixed seed, so each run exports the same file.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def seeded(seed: int = 0):
    """Weights from ``seed`` without disturbing the caller's random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MLP(nn.Module):
    """A classifier on flat features: 64 -> 128 -> 128 -> 10."""

    def __init__(self, features: int = 64, hidden: int = 128, classes: int = 10):
        super().__init__()
        with seeded():
            self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.1),
                                     nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU stages with max pooling, a global average pool and a linear classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()

        def stage(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True), nn.MaxPool2d(2))

        with seeded():
            self.features = nn.Sequential(stage(3, 16), stage(16, 32), stage(32, 64))
            self.classifier = nn.Linear(64, classes)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        x = self.pool(self.features(x))
        return self.classifier(x.view(x.size(0), -1))


class TinyTransformer(nn.Module):
    """A small language model: token + position embeddings, a causal ``nn.TransformerEncoder``,
    and an output head tied to the token embedding."""

    def __init__(self, vocab: int = 1000, d_model: int = 64, heads: int = 4, layers: int = 2, max_seq: int = 128):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(max_seq, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids):
        seq = ids.size(1)
        x = self.tokens(ids) + self.positions(torch.arange(seq, device=ids.device))
        mask = torch.triu(torch.full((seq, seq), float("-inf"), device=ids.device), diagonal=1)
        # is_causal=True says what the mask is; without it torch compares the mask with a causal
        # one and reads the answer as a Python bool (a TraceWarning).
        return self.head(self.norm(self.encoder(x, mask=mask, is_causal=True)))


def tiny_transformer() -> TinyTransformer:
    """A factory: the TinyTransformer with weights from a fixed seed, in eval mode."""
    with seeded():
        return TinyTransformer().eval()
