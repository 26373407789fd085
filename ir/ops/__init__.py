"""The registered op set, one module per family.

Importing this package registers the common families. The rest (``EXTRA``: op sets few models use) are
imported on the registry's first lookup of an op it does not have yet, or before it lists every op
(``kiln.ir.registry.load_all_ops``): a process that loads and runs a ResNet or a BERT does not pay for
parsing and registering DFT, NonMaxSuppression or LSTM (about a quarter of the op set's import time).
"""
import importlib

from kiln.ir.ops import (  # noqa: F401
    activation, control, elementwise, indexing, layout, linalg, logic, nn, normalization, pool, reduce, shape,
    tensor)
from kiln.ir.ops import fused  # noqa: F401,E402  (kiln.FusedElementwise: the fusion pass's op)
from kiln.ir.ops import assertion  # noqa: F401,E402  (kiln.Assert: run-time checks from scripted `assert`)
from kiln.ir.ops import guard  # noqa: F401,E402  (kiln.Guard: what a trace leaves where the model read tensor data)

EXTRA = (
    "quant",             # DequantizeLinear and friends (int8 weights of packed mobile files)
    "resize",            # Resize (ONNX Resize-19)
    "attention",         # Attention (ai.onnx's Attention-23..25)
    "loss",              # SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss
    "rotary",            # RotaryEmbedding-23
    "grid_sample",       # GridSample-20/22
    "rnn",               # LSTM, GRU, RNN
    "linear_attention",  # LinearAttention-27, TensorScatter-24
    "causal_conv",       # CausalConvWithState-27
    "detection",         # NonMaxSuppression, RoiAlign, DeformConv
    "image",             # AffineGrid, Col2Im, CenterCropPad, MaxUnpool
    "signal",            # DFT, STFT, window functions, MelWeightMatrix
    "text",              # TfIdfVectorizer
    "unique",            # Unique
    "bitcast",           # BitCast-26
)


def load_extra() -> None:
    """Import (register) the EXTRA op families."""
    for name in EXTRA:
        importlib.import_module(f"kiln.ir.ops.{name}")
