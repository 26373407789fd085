"""The reference models of the CPU runtime benchmark (issue 5), in plain torch, random weights.

Built from tests/zoo.py's factories (the code the tracer's acceptance tests check) at the sizes
the issue names:
- mlp: MLP 784-512-512-10 (Linear + ReLU + Dropout), input [batch, 784];
- resnet18: torchvision's ResNet-18 layout (width 64, 1000 classes), input [batch, 3, 224, 224];
- bert2: a BERT-style encoder, 2 layers, hidden 128, 2 heads, feed-forward 512, input [batch, 128, 128];
- bert4: a BERT-style encoder, 4 layers, hidden 768, 12 heads, feed-forward 3072, input [batch, 128, 768].

The encoders are ``nn.TransformerEncoderLayer`` stacks (batch first, GELU, post-norm) + a final
LayerNorm; each layer has its own weights. Used by bench/runtime_bench.py.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # noqa: E402

SEQ = 128


@dataclass(frozen=True)
class RefModel:
    key: str
    label: str
    build: Callable[[], nn.Module]          # the model in eval mode, weights from a fixed seed
    example: Callable[[int], torch.Tensor]  # an input at a batch size


def _mlp() -> nn.Module:
    return zoo._seeded(lambda: zoo.MLP((784, 512, 512, 10)))


def _resnet18() -> nn.Module:
    return zoo.resnet18(batch=1, width=64, image=224, num_classes=1000)[0]


def _encoder(d_model: int, nhead: int, dim_ff: int, layers: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return zoo.transformer_encoder(batch=1, seq=SEQ, d_model=d_model, nhead=nhead, dim_ff=dim_ff,
                                       layers=layers)[0]
    return build


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


MODELS: dict[str, RefModel] = {m.key: m for m in (
    RefModel("mlp", "MLP 784-512-512-10", _mlp, lambda b: _randn(b, 784)),
    RefModel("resnet18", "ResNet-18, 3x224x224", _resnet18, lambda b: _randn(b, 3, 224, 224)),
    RefModel("bert2", "BERT-style 2 layers, hidden 128, seq 128", _encoder(128, 2, 512, 2),
             lambda b: _randn(b, SEQ, 128)),
    RefModel("bert4", "BERT-style 4 layers, hidden 768, seq 128", _encoder(768, 12, 3072, 4),
             lambda b: _randn(b, SEQ, 768)),
)}


def resnet50() -> tuple[nn.Module, torch.Tensor]:
    """Full-size ResNet-50 at 1x3x224x224, for the memory measurement."""
    model, inputs, _ = zoo.resnet50(batch=1, width=64, image=224, num_classes=1000)
    return model, inputs[0]
