"""Element types of kiln tensors and their numpy equivalents.

bfloat16 comes from ``ml_dtypes`` (the numpy extension types JAX and ONNX use); it is
imported only when a bfloat16 tensor is actually touched, so the core install needs only numpy.
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
        return 2 if self is DType.BFLOAT16 else self.numpy.itemsize

    @property
    def is_float(self) -> bool:
        return self in FLOAT_TYPES

    @property
    def is_int(self) -> bool:
        return self in INT_TYPES

    @property
    def is_signed(self) -> bool:
        return self in FLOAT_TYPES or self in (DType.INT8, DType.INT16, DType.INT32, DType.INT64)

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

FLOAT_TYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
INT_TYPES = frozenset({DType.INT8, DType.INT16, DType.INT32, DType.INT64,
                       DType.UINT8, DType.UINT16, DType.UINT32, DType.UINT64})
NUMERIC_TYPES = FLOAT_TYPES | INT_TYPES
ALL_TYPES = frozenset(DType)


@cache
def _bfloat16() -> np.dtype:
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise KilnError("bfloat16 tensors need the 'ml_dtypes' package: pip install ml_dtypes") from e
    return np.dtype(ml_dtypes.bfloat16)


def _numpy_dtype(d: DType) -> np.dtype:
    if d is DType.BFLOAT16:
        return _bfloat16()
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
    name = "bfloat16" if npd.name == "bfloat16" else npd.name
    if name not in _BY_SHORT:
        raise KilnError(f"unsupported dtype {npd}; kiln supports {', '.join(sorted(_SHORT.values()))}")
    result = _BY_SHORT[name]
    if isinstance(x, np.dtype):
        _BY_NUMPY[x] = result
    return result
