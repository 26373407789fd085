"""Tensor types: an element type and a shape whose dims are ints, symbols or unknown.

A dim is an ``int`` (static), a ``str`` (a named symbol such as ``"batch"``: every dim with the
same name has the same size at run time) or ``None`` (unknown). A shape of ``None`` means
even the rank is unknown.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

import numpy as np

from kiln.ir.dtypes import DType, dtype as as_dtype

Dim = Union[int, str, None]
Shape = Optional[tuple]


def _check_dim(d: object) -> Dim:
    if d is None or isinstance(d, str):
        return d
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0:
        return int(d)
    raise ValueError(f"a dim must be a non-negative int, a symbol name or None, not {d!r}")


@dataclass(frozen=True)
class TensorType:
    """The static type of a value: dtype plus (possibly symbolic) shape."""

    dtype: DType
    shape: Shape = None

    def __init__(self, dtype: "DType | str | np.dtype", shape: Optional[Iterable[Dim]] = None):
        object.__setattr__(self, "dtype", as_dtype(dtype))
        object.__setattr__(self, "shape", None if shape is None else tuple(_check_dim(d) for d in shape))

    @property
    def rank(self) -> Optional[int]:
        return None if self.shape is None else len(self.shape)

    @property
    def is_static(self) -> bool:
        """True when every dim is a known int."""
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    def numel(self) -> Optional[int]:
        """Number of elements, or None when a dim is not a known int."""
        if not self.is_static:
            return None
        return int(np.prod(self.shape, dtype=np.int64))

    def with_shape(self, shape: Optional[Iterable[Dim]]) -> "TensorType":
        return TensorType(self.dtype, shape)

    def with_dtype(self, dt: "DType | str") -> "TensorType":
        return TensorType(dt, self.shape)

    def matches(self, array: np.ndarray, bindings: Optional[dict] = None) -> bool:
        """Whether ``array`` has this dtype and shape; symbols bind consistently in ``bindings``."""
        if as_dtype(array.dtype) is not self.dtype:
            return False
        if self.shape is None:
            return True
        if array.ndim != len(self.shape):
            return False
        bindings = {} if bindings is None else bindings
        for want, got in zip(self.shape, array.shape):
            if isinstance(want, int) and want != got:
                return False
            if isinstance(want, str) and bindings.setdefault(want, got) != got:
                return False
        return True

    @classmethod
    def of(cls, array: np.ndarray) -> "TensorType":
        return cls(array.dtype, array.shape)

    def __str__(self) -> str:
        if self.shape is None:
            return f"{self.dtype}[*]"
        dims = ",".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"


def format_shape(shape: Shape) -> str:
    if shape is None:
        return "[*]"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def merge_dim(a: Dim, b: Dim) -> Dim:
    """The more precise of two dims known to be equal (int beats symbol beats unknown)."""
    if isinstance(a, int):
        return a
    if isinstance(b, int):
        return b
    return a if a is not None else b


def dims_compatible(a: Dim, b: Dim) -> bool:
    """Whether two dims can be the same size at run time."""
    return not (isinstance(a, int) and isinstance(b, int) and a != b)


def broadcast_dim(a: Dim, b: Dim) -> Dim:
    """Numpy broadcasting of two dims, symbols included.

    Raises ValueError when two known ints cannot broadcast. A symbol against 1 stays the
    symbol; a symbol against an int n > 1 becomes n (the only size that can broadcast);
    two different symbols give unknown.
    """
    if a == 1:
        return b
    if b == 1:
        return a
    if isinstance(a, int) and isinstance(b, int):
        if a != b:
            raise ValueError(f"dims {a} and {b} do not broadcast")
        return a
    if isinstance(a, int):
        return a
    if isinstance(b, int):
        return b
    if a == b:
        return a
    return None


def broadcast_shapes(*shapes: Shape) -> Shape:
    """Multidirectional (numpy) broadcast of several shapes; None if any rank is unknown."""
    if any(s is None for s in shapes):
        return None
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = [1] * rank
    for s in shapes:
        padded = (1,) * (rank - len(s)) + tuple(s)
        out = [broadcast_dim(x, y) for x, y in zip(out, padded)]
    return tuple(out)


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """Map a possibly negative axis into [0, rank); ValueError if out of range."""
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"{what} {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis
