"""RotaryEmbedding (ai.onnx opset 23)."""
from __future__ import annotations
