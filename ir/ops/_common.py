"""Shared pieces for op registrations: dtype sets and the common inference rules."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from kiln.ir.dtypes import ALL_TYPES, FLOAT_TYPES, INT_TYPES, NUMERIC_TYPES, DType
from kiln.ir.registry import InferContext
from kiln.ir.types import TensorType, broadcast_shapes

if TYPE_CHECKING:
    import numpy as np

FLOAT = FLOAT_TYPES
INT = INT_TYPES
NUMERIC = NUMERIC_TYPES
ALL = ALL_TYPES
BOOL = frozenset({DType.BOOL})
INDEX = frozenset({DType.INT32, DType.INT64})
SIGNED_NUMERIC = frozenset(t for t in NUMERIC_TYPES if t.is_signed)


def infer_same(ctx: InferContext) -> TensorType:
    """Output has the type of input 0 (unary elementwise ops)."""
    return ctx.input(0)


def _broadcast(ctx: InferContext, dtype: Optional[DType] = None) -> TensorType:
    present = [ctx.input(i) for i in range(len(ctx.inputs)) if ctx.has_input(i)]
    first = present[0].dtype
    for t in present[1:]:
        if t.dtype is not first:
            ctx.fail(f"inputs have different dtypes: {', '.join(str(p.dtype) for p in present)}")
    return TensorType(dtype or first, broadcast_shapes(*(t.shape for t in present)))


def infer_broadcast(ctx: InferContext) -> TensorType:
    """Same dtype in, same dtype out, numpy broadcasting of all (present) inputs."""
    return _broadcast(ctx)


def infer_broadcast_bool(ctx: InferContext) -> TensorType:
    """Comparisons: inputs of one dtype broadcast to a bool output."""
    return _broadcast(ctx, DType.BOOL)


def same_shape(ctx: InferContext, dtype: DType) -> TensorType:
    return TensorType(dtype, ctx.input(0).shape)


def compute_dtype(dt: "np.dtype") -> "np.dtype":
    """The numpy dtype a float reference computes in: float64 stays float64, narrower floats
    (float16, bfloat16, float32) widen to float32 so the result rounds once, on the cast back.
    Integer dtypes are returned unchanged."""
    import numpy as np

    dt = np.dtype(dt)
    if dt == np.float64 or dt.kind in "iub":
        return dt
    return np.dtype(np.float32)
