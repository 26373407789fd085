"""``BitCast`` (ai.onnx 26): the bits of each element read as another element type of the same bit width,
without any value conversion (Cast converts values). The shape is kept, so the two types must have the same width,
as ONNX requires (``to`` of another width is an inference error); bytes are little endian, as on every machine kiln
runs on. kiln covers every pair of its dtypes of one width: 2 bits (int2, uint2), 4 (int4, uint4, float4e2m1),
8 (int8, uint8, bool, the float8 types, float8e8m0), 16 (int16, uint16, float16, bfloat16), 32 (int32, uint32,
float32) and 64 (int64, uint64, float64). The 4- and 2-bit types are held one element per byte (kiln.ir.dtypes):
their low bits are what is read. ONNX's complex and float6 types are not kiln dtypes: a model using them is refused
at import by element type.

A bool holds 0 or 1. ONNX leaves a byte other than 0 and 1 read as bool undefined; kiln reads any nonzero byte as
True (what a C++ ``bool`` test of it gives), so a bool tensor never holds another byte.

BitCast is newer than the ONNX opsets kiln writes (18..22): the exporter writes it where an older op means exactly
the same (a cast to the same type is Identity; bool to or from int8/uint8 is Cast, 0/1 either way with a nonzero
byte becoming True) and refuses the rest by name (serializer/onnx.py).
"""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import ANY_TYPES, DType
from kiln.ir.registry import REQUIRED, Attr, AttrKind, In, InferContext, op
from kiln.ir.types import TensorType


def _infer_bitcast(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    code = ctx.attrs["to"]
    try:
        target = DType(code)
    except ValueError:
        ctx.fail(f"to={code} is not a dtype kiln supports; known codes: "
                 f"{', '.join(f'{d.value} ({d})' for d in DType)}")
    if target.bits != x.dtype.bits:
        ctx.fail(f"BitCast keeps the bits of each element, so 'to' must have the input's width: {x.dtype} is "
                 f"{x.dtype.bits} bits, {target} is {target.bits}")
    return TensorType(target, x.shape)


@op("BitCast", inputs=[In("input", ANY_TYPES)], outputs=["output"], attrs=[Attr("to", AttrKind.INT, REQUIRED)],
    infer=_infer_bitcast)
def bitcast(x, to=REQUIRED):
    """The elements' bits read as dtype code ``to`` (a view, no copy, from 8 bits up); to bool: any nonzero byte
    is True; to a 4- or 2-bit type: the low bits of each byte."""
    target = DType(to)
    if target is DType.BOOL:
        return x.view(np.uint8) != 0
    if target.bits < 8:
        return (x.view(np.uint8) & np.uint8((1 << target.bits) - 1)).view(target.numpy)
    return x.view(target.numpy)
