"""dtypes, TensorType and symbolic broadcasting."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kiln import KilnError
from kiln.ir import DType, TensorType, dtype
from kiln.ir.types import broadcast_shapes


def test_dtype_round_trip_numpy():
    for d in DType:
        if d is DType.BFLOAT16:
            pytest.importorskip("ml_dtypes")
        assert dtype(d.numpy) is d
        assert dtype(d.short) is d
        assert d.itemsize == np.dtype(d.numpy).itemsize


def test_dtype_values_are_onnx_codes():
    assert DType.FLOAT32.value == 1 and DType.INT64.value == 7 and DType.BFLOAT16.value == 16


def test_unsupported_dtype_is_named():
    with pytest.raises(KilnError, match="unsupported dtype complex64"):
        dtype(np.complex64)


def test_tensor_type_str_and_static():
    t = TensorType("float32", ("batch", 3, None))
    assert str(t) == "float32[batch,3,?]"
    assert not t.is_static and t.rank == 3
    assert TensorType("int64", (2, 3)).numel() == 6
    assert str(TensorType("bool")) == "bool[*]"
    with pytest.raises(ValueError):
        TensorType("float32", (-1,))


def test_matches_binds_symbols_consistently():
    t = TensorType("float32", ("batch", 4))
    b = {}
    assert t.matches(np.zeros((3, 4), np.float32), b) and b == {"batch": 3}
    assert not t.matches(np.zeros((5, 4), np.float32), b)
    assert not t.matches(np.zeros((3, 4), np.float64))


def test_symbolic_broadcast():
    assert broadcast_shapes(("batch", 1, 4), (3, 1)) == ("batch", 3, 4)
    assert broadcast_shapes(("batch", 4), ("batch", 4)) == ("batch", 4)
    assert broadcast_shapes(("a",), ("b",)) == (None,)
    assert broadcast_shapes(("a",), (5,)) == (5,)
    assert broadcast_shapes((2, 3), None) is None
    with pytest.raises(ValueError, match="do not broadcast"):
        broadcast_shapes((2, 3), (4, 3))


@given(st.lists(st.integers(1, 4), min_size=0, max_size=4), st.lists(st.integers(1, 4), min_size=0, max_size=4))
def test_static_broadcast_matches_numpy(a, b):
    try:
        want = np.broadcast_shapes(tuple(a), tuple(b))
    except ValueError:
        with pytest.raises(ValueError):
            broadcast_shapes(tuple(a), tuple(b))
        return
    assert broadcast_shapes(tuple(a), tuple(b)) == want
