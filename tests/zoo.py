"""The model zoo: small eager PyTorch models that kiln's tracer must capture exactly.

Plain torch, no downloads: every model gets random weights from a fixed seed. Each entry of
``ZOO`` is a factory returning ``(model in eval mode, example inputs, dynamic spec)``, where the
inputs are a tuple (positional) or a dict (by argument name) and the dynamic spec is what
``kiln.trace(..., dynamic=...)`` takes (``{"x": {0: "batch"}}``). The factories take sizes as
keyword arguments so the benchmarks can build the full-size models (``resnet50(width=64,
image=224)``, ``transformer_encoder(d_model=768, ...)``) from the same code the tests check.

Used by tests/frontend/test_zoo.py and bench/trace_bench.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

SEED = 0
Dynamic = dict[str, dict[int, str]]
Example = tuple[nn.Module, Any, Dynamic]


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    """Build a module with weights from the fixed seed; BN statistics made non-trivial so
    folding them is really exercised."""
    torch.manual_seed(SEED)
    model = build()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model.eval()


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(SEED + 1))


def _randint(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(SEED + 1))


# ---------------------------------------------------------------------------- MLP
class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (16, 32, 32, 10), p: float = 0.1):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers += [nn.ReLU(), nn.Dropout(p)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def mlp(batch: int = 2) -> Example:
    return _seeded(MLP), (_randn(batch, 4, 4),), {"x": {0: "batch"}}


# ---------------------------------------------------------------------------- ResNets
def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(cin, width, 3, stride)
        self.conv2, self.bn2 = _conv_bn(width, cout, 3)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.downsample(x)
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(cin, width, 1)
        self.conv2, self.bn2 = _conv_bn(width, width, 3, stride)
        self.conv3, self.bn3 = _conv_bn(width, cout, 1)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(cin, cout, 1, stride))


class ResNet(nn.Module):
    """torchvision's ResNet layout (stem conv 7x7/2 + BN + ReLU + maxpool 3x3/2, four stages,
    adaptive average pool, fully connected) with a configurable base width."""

    def __init__(self, block: type, layers: tuple[int, ...], width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        stages = []
        for i, n in enumerate(layers):
            blocks = []
            for j in range(n):
                blocks.append(block(cin, width * 2 ** i, 2 if j == 0 and i > 0 else 1))
                cin = width * 2 ** i * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet18(batch: int = 1, width: int = 8, image: int = 64, num_classes: int = 10) -> Example:
    model = _seeded(lambda: ResNet(BasicBlock, (2, 2, 2, 2), width, num_classes))
    return model, (_randn(batch, 3, image, image),), {"x": {0: "batch"}}


def resnet50(batch: int = 1, width: int = 8, image: int = 64, num_classes: int = 10) -> Example:
    model = _seeded(lambda: ResNet(Bottleneck, (3, 4, 6, 3), width, num_classes))
    return model, (_randn(batch, 3, image, image),), {"x": {0: "batch"}}


# ---------------------------------------------------------------------------- MobileNetV3
class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x):
        s = self.fc2(F.relu(self.fc1(self.avgpool(x))))
        return x * F.hardsigmoid(s)


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, expand: int, cout: int, k: int, stride: int, se: bool, hswish: bool):
        super().__init__()
        act = nn.Hardswish if hswish else nn.ReLU
        layers: list[nn.Module] = []
        if expand != cin:
            layers += [*_conv_bn(cin, expand, 1), act()]
        layers += [*_conv_bn(expand, expand, k, stride, groups=expand), act()]  # depthwise
        if se:
            layers.append(SqueezeExcite(expand, max(8, expand // 4)))
        layers += _conv_bn(expand, cout, 1)
        self.block = nn.Sequential(*layers)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x):
        out = self.block(x)
        return out + x if self.use_residual else out


class MobileNetV3(nn.Module):
    # (kernel, expanded, out, squeeze-excite, hardswish, stride): a shortened MobileNetV3-Small.
    CONFIG = ((3, 16, 16, True, False, 2), (3, 32, 24, False, False, 2), (3, 48, 24, False, False, 1),
              (5, 64, 40, True, True, 2), (5, 96, 40, True, True, 1))

    def __init__(self, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [*_conv_bn(3, 16, 3, 2), nn.Hardswish()]
        cin = 16
        for k, exp, cout, se, hs, stride in self.CONFIG:
            layers.append(InvertedResidual(cin, exp, cout, k, stride, se, hs))
            cin = cout
        layers += [*_conv_bn(cin, 6 * cin, 1), nn.Hardswish()]
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(6 * cin, 64), nn.Hardswish(), nn.Dropout(0.2),
                                        nn.Linear(64, num_classes))

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(x.flatten(1))


def mobilenet_v3(batch: int = 1, image: int = 64) -> Example:
    return _seeded(MobileNetV3), (_randn(batch, 3, image, image),), {"x": {0: "batch"}}


# ---------------------------------------------------------------------------- transformers
class Encoder(nn.Module):
    """A stack of ``nn.TransformerEncoderLayer`` (batch first, GELU, post-norm: BERT's layout)."""

    def __init__(self, d_model: int, nhead: int, dim_ff: int, layers: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout=0.1, activation="gelu",
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        # TransformerEncoder deep-copies one layer: give each its own weights, as a trained model
        # has (identical layers would let an exporter store one copy and flatter its timings).
        for m in self.encoder.layers.modules():
            if isinstance(m, nn.MultiheadAttention):
                m._reset_parameters()
            elif isinstance(m, nn.Linear) and not isinstance(m.weight, nn.UninitializedParameter):
                m.reset_parameters()
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x):
        return self.norm(self.encoder(x))


def transformer_encoder(batch: int = 2, seq: int = 8, d_model: int = 32, nhead: int = 4, dim_ff: int = 64,
                        layers: int = 2) -> Example:
    model = _seeded(lambda: Encoder(d_model, nhead, dim_ff, layers))
    return model, (_randn(batch, seq, d_model),), {"x": {0: "batch", 1: "seq"}}


class CausalSelfAttention(nn.Module):
    """Multi-head attention written out by hand, as in GPT-2 / nanoGPT."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.size()
        q, k, v = self.qkv(x).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        att = att.masked_fill(mask, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.proj(y)


class DecoderBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d),
                                 nn.Dropout(0.1))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm decoder blocks, output head tied to the token embedding."""

    def __init__(self, vocab: int = 64, max_seq: int = 16, d: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList(DecoderBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt(batch: int = 2, seq: int = 8, vocab: int = 64) -> Example:
    model = _seeded(lambda: GPT(vocab=vocab))
    return model, (_randint(vocab, batch, seq),), {"idx": {0: "batch", 1: "seq"}}


class SDPAttention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``; keyword inputs."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def _split(self, x):
        b, t, d = x.shape
        return x.reshape(b, t, self.heads, d // self.heads).permute(0, 2, 1, 3)

    def forward(self, x, memory_scale):
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v * memory_scale, is_causal=True)
        b, h, t, hd = y.shape
        return self.out(y.permute(0, 2, 1, 3).reshape(b, t, h * hd))


def sdpa(batch: int = 2, seq: int = 8, d: int = 32) -> Example:
    inputs = {"x": _randn(batch, seq, d), "memory_scale": _randn(1, 1, 1, 1).abs() + 0.5}
    return _seeded(SDPAttention), inputs, {"x": {0: "batch", 1: "seq"}}


# ---------------------------------------------------------------------------- dict outputs
class TwoHeads(nn.Module):
    """A shared trunk with two heads, returned by name."""

    def __init__(self, d: int = 12, classes: int = 5):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, 24), nn.Tanh(), nn.LayerNorm(24))
        self.cls = nn.Linear(24, classes)
        self.reg = nn.Linear(24, 2)

    def forward(self, features):
        h = self.trunk(features)
        logits = self.cls(h)
        return {"logits": logits, "probs": logits.softmax(-1), "box": torch.sigmoid(self.reg(h))}


def dict_outputs(batch: int = 3) -> Example:
    return _seeded(TwoHeads), (_randn(batch, 12),), {"features": {0: "batch"}}


# ---------------------------------------------------------------------------- Hugging Face (optional)
def hf_bert(batch: int = 2, seq: int = 8) -> Example:
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)
    model = _seeded(lambda: transformers.BertModel(config))
    inputs = {"input_ids": _randint(64, batch, seq)}
    return model, inputs, {"input_ids": {0: "batch", 1: "seq"}}


def hf_gpt2(batch: int = 2, seq: int = 8) -> Example:
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, use_cache=False)
    model = _seeded(lambda: transformers.GPT2Model(config))
    inputs = {"input_ids": _randint(64, batch, seq)}
    return model, inputs, {"input_ids": {0: "batch", 1: "seq"}}


# ---------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Entry:
    name: str
    factory: Callable[..., Example]
    cnn: bool = False  # after optimize: no BatchNormalization / Identity / Dropout left
    needs: Optional[str] = None  # an optional package the model needs
    # Two other sizes per symbol (batch, seq) at which the dynamic graph must also run.
    other_sizes: tuple[Mapping[str, int], ...] = ({"batch": 1, "seq": 5}, {"batch": 3, "seq": 12})


ZOO: tuple[Entry, ...] = (
    Entry("mlp", mlp),
    Entry("resnet18", resnet18, cnn=True),
    Entry("resnet50", resnet50, cnn=True),
    Entry("mobilenet_v3", mobilenet_v3, cnn=True),
    Entry("transformer_encoder", transformer_encoder),
    Entry("gpt", gpt),
    Entry("dict_outputs", dict_outputs),
    Entry("sdpa", sdpa),
    Entry("hf_bert", hf_bert, needs="transformers"),
    Entry("hf_gpt2", hf_gpt2, needs="transformers"),
)


def by_name(name: str) -> Entry:
    return next(e for e in ZOO if e.name == name)


def params(entries=ZOO, *extra: Any) -> list:
    """``pytest.param``s of zoo entries (each combined with every value of ``extra``, if given),
    skipped with a reason where an entry needs a package that is not installed."""
    import importlib.util
    import itertools

    import pytest

    out = []
    for e in entries:
        missing = e.needs is not None and importlib.util.find_spec(e.needs) is None
        marks = pytest.mark.skip(reason=f"{e.needs} is not installed") if missing else ()
        for combo in itertools.product(*extra) if extra else [()]:
            ident = "-".join([e.name, *map(str, combo)])
            out.append(pytest.param(e, *combo, id=ident, marks=marks))
    return out


# ---------------------------------------------------------------------------- inputs
def input_list(model: nn.Module, inputs: Any) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of example inputs given as a tuple (named by forward's parameters) or dict."""
    import inspect

    if isinstance(inputs, Mapping):
        return list(inputs), list(inputs.values())
    params = list(inspect.signature(model.forward).parameters)
    return params[:len(inputs)], list(inputs)


def fresh_inputs(model: nn.Module, inputs: Any, dynamic: Dynamic, sizes: Mapping[str, int],
                 seed: int) -> tuple[list[str], list[torch.Tensor]]:
    """New random inputs like the examples, with each symbolic dim set to ``sizes[symbol]``.
    Integer inputs (token ids) are drawn from the examples' range."""
    gen = torch.Generator().manual_seed(seed)
    names, examples = input_list(model, inputs)
    fresh = []
    for name, ex in zip(names, examples):
        shape = list(ex.shape)
        for dim, sym in dynamic.get(name, {}).items():
            shape[dim] = sizes.get(sym, shape[dim])
        if ex.dtype.is_floating_point:
            fresh.append(torch.randn(shape, generator=gen, dtype=ex.dtype))
        else:
            fresh.append(torch.randint(0, int(ex.max()) + 1, shape, generator=gen, dtype=ex.dtype))
    return names, fresh
