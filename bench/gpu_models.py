"""The models of the GPU benchmark (bench/gpu_bench.py, issue 8), in plain torch, random weights.

- ResNet-50: tests/zoo.py's ``resnet50(width=64, image=224, num_classes=1000)`` (torchvision's
  layout), input [batch, 3, 224, 224].
- BERT-base encoder: written out here rather than as ``nn.TransformerEncoderLayer`` (tests/zoo.py
  ``transformer_encoder``), because that module's attention runs through the Python function
  ``F.multi_head_attention_forward``, which kiln's tracer cannot enter on torch 2.11 (the device
  machine's torch). BERT's layer as Hugging Face writes it: a QKV projection, multi-head attention
  through ``F.scaled_dot_product_attention`` (no mask), output projection, residual + LayerNorm,
  feed-forward 768 -> 3072 -> 768 with exact GELU, residual + LayerNorm (post-norm); the
  embeddings' LayerNorm first. 12 layers, hidden 768, 12 heads; input [batch, 128, 768] hidden
  states (no token embeddings). Every layer has its own weights.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # noqa: E402

SEQ = 128


class BertLayer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d, eps=1e-12)
        self.up = nn.Linear(d, ff)
        self.down = nn.Linear(ff, d)
        self.ln2 = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q = q.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        y = y.transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.out(y))
        return self.ln2(x + self.down(F.gelu(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, d: int = 768, heads: int = 12, ff: int = 3072, layers: int = 12):
        super().__init__()
        self.ln = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(d, heads, ff) for _ in range(layers))

    def forward(self, x):
        x = self.ln(x)
        for layer in self.layers:
            x = layer(x)
        return x


def bert(batch: int = 1, seq: int = SEQ, d: int = 768, heads: int = 12, ff: int = 3072, layers: int = 12):
    """(model in eval mode, example inputs, dynamic spec) like tests/zoo.py's factories."""
    model = zoo._seeded(lambda: BertEncoder(d, heads, ff, layers))
    return model, (zoo._randn(batch, seq, d),), {"x": {0: "batch"}}


def resnet50(batch: int = 1, width: int = 64, image: int = 224, num_classes: int = 1000):
    return zoo.resnet50(batch=batch, width=width, image=image, num_classes=num_classes)
