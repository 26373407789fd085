"""Element types of kiln tensors and their numpy equivalents.

bfloat16 comes from ``ml_dtypes`` (the numpy extension types JAX and ONNX use); it is
imported only when a bfloat16 tensor is actually touched, so the core install needs only numpy.

*Storage types* (issue 22): the float8 formats, float4e2m1, float8e8m0 and the 4- and 2-bit integers, as
quantized models store weights and scales. kiln holds them one element per byte as ml_dtypes does (ONNX packs
the sub-byte integers in its files; the importer unpacks them). They are neither ``is_float`` nor ``is_int``:
only ops that convert or move values (Cast, CastLike, Quantize/DequantizeLinear, the shape-only ops) take them,
so no arithmetic kernel ever sees one; ``ALL_TYPES`` excludes them, ``ANY_TYPES`` includes them.
"""
from __future__ import annotations

import enum
from functools import cache

import numpy as np

from kiln.errors import KilnError


class DType(enum.Enum):
    """A tensor element type. The value is the ONNX ``TensorProto.DataType`` code."""

    FLOAT32 = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    BOOL = 9
    FLOAT16 = 10
    FLOAT64 = 11
    UINT32 = 12
    UINT64 = 13
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20
    UINT4 = 21
    INT4 = 22
    FLOAT4E2M1 = 23
    FLOAT8E8M0 = 24
    UINT2 = 25
    INT2 = 26

    @property
    def short(self) -> str:
        """The numpy-style name: ``float32``, ``bool``..."""
        return _SHORT[self]

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype (bfloat16 through ml_dtypes)."""
        d = _NUMPY.get(self)
        if d is None:  # once per dtype: np.dtype("float32") was a few % of loading a node-heavy graph
            d = _NUMPY[self] = _numpy_dtype(self)
        return d

    @property
    def itemsize(self) -> int:
        """Bytes per element as kiln holds it (storage types: one byte, as ml_dtypes)."""
        if self is DType.BFLOAT16:
            return 2
        return 1 if self in STORAGE_TYPES else self.numpy.itemsize

    @property
    def bits(self) -> int:
        """Bits per element in an ONNX file (4 and 2 for the sub-byte integers and float4, which ONNX packs)."""
        return _PACKED_BITS.get(self, 8 * self.itemsize)

    @property
    def is_storage(self) -> bool:
        """A storage type (float8, float4, float8e8m0, 4/2-bit integers): converted or moved, never computed on."""
        return self in STORAGE_TYPES

    @property
    def is_float(self) -> bool:
        return self in FLOAT_TYPES

    @property
    def is_int(self) -> bool:
        return self in INT_TYPES

    @property
    def is_signed(self) -> bool:
        return self in _SIGNED

    def __str__(self) -> str:
        return self.short

    # Members are singletons compared by identity: hash them so too (Enum's default hashes the name in
    # Python code, a few % of loading a node-heavy graph, where every TensorType hash hashes its dtype).
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"DType.{self.name}"


_SHORT = {d: d.name.lower() for d in DType}
_BY_SHORT = {v: k for k, v in _SHORT.items()}
_BY_SHORT.update({"float": DType.FLOAT32, "double": DType.FLOAT64, "half": DType.FLOAT16,
                  "long": DType.INT64, "int": DType.INT32, "bool_": DType.BOOL})

# The storage types and their ml_dtypes names (numpy's name for the dtype).
_ML_DTYPES = {DType.BFLOAT16: "bfloat16", DType.FLOAT8E4M3FN: "float8_e4m3fn", DType.FLOAT8E4M3FNUZ: "float8_e4m3fnuz",
              DType.FLOAT8E5M2: "float8_e5m2", DType.FLOAT8E5M2FNUZ: "float8_e5m2fnuz", DType.UINT4: "uint4",
              DType.INT4: "int4", DType.FLOAT4E2M1: "float4_e2m1fn", DType.FLOAT8E8M0: "float8_e8m0fnu",
              DType.UINT2: "uint2", DType.INT2: "int2"}
_BY_SHORT.update({v: k for k, v in _ML_DTYPES.items()})
_PACKED_BITS = {DType.UINT4: 4, DType.INT4: 4, DType.FLOAT4E2M1: 4, DType.UINT2: 2, DType.INT2: 2}

FLOAT8_TYPES = frozenset({DType.FLOAT8E4M3FN, DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2, DType.FLOAT8E5M2FNUZ})
STORAGE_TYPES = FLOAT8_TYPES | frozenset({DType.FLOAT4E2M1, DType.FLOAT8E8M0, DType.UINT4, DType.INT4,
                                          DType.UINT2, DType.INT2})
FLOAT_TYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
INT_TYPES = frozenset({DType.INT8, DType.INT16, DType.INT32, DType.INT64,
                       DType.UINT8, DType.UINT16, DType.UINT32, DType.UINT64})
NUMERIC_TYPES = FLOAT_TYPES | INT_TYPES
_SIGNED = FLOAT_TYPES | FLOAT8_TYPES | frozenset({DType.INT8, DType.INT16, DType.INT32, DType.INT64, DType.INT4,
                                                  DType.INT2, DType.FLOAT4E2M1})
ALL_TYPES = frozenset(DType) - STORAGE_TYPES  # what "all types" means for an op that computes
ANY_TYPES = frozenset(DType)  # ... and for one that only converts or moves values


@cache
def _ml_dtype(name: str) -> np.dtype:
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise KilnError(f"{name} tensors need the 'ml_dtypes' package: pip install ml_dtypes") from e
    t = getattr(ml_dtypes, name, None)
    if t is None:  # pragma: no cover - an ml_dtypes older than 0.5
        raise KilnError(f"{name} tensors need ml_dtypes >= 0.5 (this is {ml_dtypes.__version__}): "
                        "pip install -U ml_dtypes")
    return np.dtype(t)


def _numpy_dtype(d: DType) -> np.dtype:
    ml = _ML_DTYPES.get(d)
    if ml is not None:
        return _ml_dtype(ml)
    return np.dtype(_SHORT[d])


_NUMPY: dict = {}  # DType -> numpy dtype, filled on first use (bfloat16 imports ml_dtypes then)

# numpy dtype -> DType, filled as dtypes are seen (a hot path when loading and checking graphs).
_BY_NUMPY: dict = {}


def dtype(x: "DType | str | np.dtype | type") -> DType:
    """Coerce a DType, a name (``"float32"``), a numpy dtype or a numpy scalar type to DType."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in _BY_SHORT:
        return _BY_SHORT[x]
    if isinstance(x, np.dtype) and x in _BY_NUMPY:
        return _BY_NUMPY[x]
    try:
        npd = np.dtype(x)
    except TypeError:
        raise KilnError(f"unknown dtype {x!r}; kiln supports {', '.join(sorted(_SHORT.values()))}") from None
    name = npd.name
    if name not in _BY_SHORT:
        raise KilnError(f"unsupported dtype {npd}; kiln supports {', '.join(sorted(_SHORT.values()))}")
    result = _BY_SHORT[name]
    if isinstance(x, np.dtype):
        _BY_NUMPY[x] = result
    return result
