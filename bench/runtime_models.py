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


class TinyViT(nn.Module):
    """A ViT-Tiny-style model (issue 21's "small ViT"): 16x16 patches of a 3x64x64 image, a class token,
    learned positions, 4 pre-norm encoder layers (hidden 192, 3 heads, feed-forward 768, GELU), a head."""

    def __init__(self, image: int = 64, patch: int = 16, dim: int = 192, heads: int = 3, layers: int = 4,
                 classes: int = 1000):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch(x).flatten(2).transpose(1, 2)
        p = torch.cat([self.cls.expand(p.shape[0], -1, -1), p], dim=1) + self.pos
        return self.head(self.norm(self.encoder(p))[:, 0])


def _vit() -> nn.Module:
    return zoo._seeded(TinyViT)


class GeluMLP(nn.Module):
    """Issue 24's GELU-tanh row: 2 GPT-2-style MLP blocks (768 -> 3072 -> 768, residual, LayerNorm) whose GELU is
    written out as transformers' NewGELUActivation writes it, ``x ** 3`` (torch.pow) inside the tanh."""

    def __init__(self, dim: int = 768, hidden: int = 3072, layers: int = 2):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(dim, hidden) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(hidden, dim) for _ in range(layers))
        self.norm = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))

    @staticmethod
    def gelu(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down, norm in zip(self.up, self.down, self.norm):
            x = norm(x + down(self.gelu(up(x))))
        return x


def _gelu_mlp() -> nn.Module:
    return zoo._seeded(GeluMLP)


def _mobilenet() -> nn.Module:
    return zoo._seeded(lambda: zoo.MobileNetV3(num_classes=1000))


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


MODELS: dict[str, RefModel] = {m.key: m for m in (
    RefModel("mlp", "MLP 784-512-512-10", _mlp, lambda b: _randn(b, 784)),
    RefModel("resnet18", "ResNet-18, 3x224x224", _resnet18, lambda b: _randn(b, 3, 224, 224)),
    RefModel("bert2", "BERT-style 2 layers, hidden 128, seq 128", _encoder(128, 2, 512, 2),
             lambda b: _randn(b, SEQ, 128)),
    RefModel("bert4", "BERT-style 4 layers, hidden 768, seq 128", _encoder(768, 12, 3072, 4),
             lambda b: _randn(b, SEQ, 768)),
    RefModel("vit", "ViT-Tiny-style, 4 layers, hidden 192, 3x64x64", _vit, lambda b: _randn(b, 3, 64, 64)),
    RefModel("gelu_mlp", "GELU-tanh MLP (x ** 3 written out), 2 blocks 768-3072, seq 128", _gelu_mlp,
             lambda b: _randn(b, SEQ, 768)),
    RefModel("mobilenet", "MobileNetV3-Small-style (depthwise convs), 3x224x224", _mobilenet,
             lambda b: _randn(b, 3, 224, 224)),
)}


def resnet50() -> tuple[nn.Module, torch.Tensor]:
    """Full-size ResNet-50 at 1x3x224x224, for the memory measurement."""
    model, inputs, _ = zoo.resnet50(batch=1, width=64, image=224, num_classes=1000)
    return model, inputs[0]
