"""Elementwise arithmetic and math ops (ONNX semantics, numpy broadcasting)."""
from __future__ import annotations

import numpy as np

from kiln.ir.ops._common import NUMERIC, infer_broadcast
from kiln.ir.registry import In, op


@op("Add", inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast)
def add(a, b):
    return np.add(a, b)


@op("Sub", inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast)
def sub(a, b):
    return np.subtract(a, b)


@op("Mul", inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast)
def mul(a, b):
    return np.multiply(a, b)
