"""kiln.Guard's meaning (kiln/ir/ops/guard.py, kiln/checks.py): each read, its tolerance, shapes."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.checks import GuardFailed, holds, read_value
from kiln.ir import Graph, evaluate, verify
from kiln.ir.registry import get_schema


def guarded(dtype: str, shape, **attrs) -> Graph:
    g = Graph("guard")
    x = g.add_input("x", dtype, shape)
    g.add_node("Guard", [x], attrs, domain="kiln", num_outputs=0)
    g.outputs = [g.op("Identity", x)]
    verify(g)
    return g


CASES = [
    # read, dtype, expected, passing values, failing values
    ("bool", "float32", np.array(True), [np.float32(2), np.float32(-0.5)], [np.float32(0)]),
    ("bool", "bool", np.array(False), [np.array(False)], [np.array(True)]),
    ("int", "float32", np.array(3, np.int64), [np.float32(3.7), np.float32(3)], [np.float32(-3.2), np.float32(4)]),
    ("float", "float32", np.array(0.1), [np.float32(0.1)], [np.float32(0.1001)]),
    ("item", "int64", np.array(7, np.int64), [np.int64(7)], [np.int64(8)]),
    ("value", "int32", np.array([1, 2], np.int32), [np.array([1, 2], np.int32)], [np.array([2, 1], np.int32)]),
]


@pytest.mark.parametrize("read,dtype,expected,good,bad", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_reads(read, dtype, expected, good, bad):
    shape = list(np.shape(good[0]))
    rtol = 1e-5 if expected.dtype.kind == "f" else 0.0
    g = guarded(dtype, shape, expected=expected, read=read, rtol=rtol, what="w", location="f.py:1", code="c")
    for x in good:
        evaluate(g, [np.asarray(x, dtype)])
    for x in bad:
        with pytest.raises(GuardFailed, match=r"kiln.Guard failed at f.py:1 `c`: w gave"):
            evaluate(g, [np.asarray(x, dtype)])


def test_scalar_read_of_a_tensor_with_several_elements_fails():
    g = guarded("float32", [2], expected=np.array(True), read="bool")
    with pytest.raises(GuardFailed, match="a tensor of 2 elements"):
        evaluate(g, [np.ones(2, np.float32)])


def test_value_read_of_another_shape_fails():
    g = guarded("int64", ["n"], expected=np.array([1, 2]), read="value")
    evaluate(g, [np.array([1, 2])])
    with pytest.raises(GuardFailed, match=r"shape \[3\]"):
        evaluate(g, [np.array([1, 2, 3])])


def test_float_tolerance_is_relative_and_nan_equals_nan():
    assert holds(np.array(1.0 + 1e-7), np.array(1.0), 1e-5)
    assert not holds(np.array(1.0 + 1e-4), np.array(1.0), 1e-5)
    assert holds(np.array(np.nan), np.array(np.nan), 0.0)
    assert not holds(np.array(0.0), np.array(1e-30), 1e-5)
    assert read_value(np.ones(3), "bool") is None


def test_schema_has_a_side_effect_and_a_bad_read_is_refused():
    assert get_schema("Guard", "kiln").side_effect
    with pytest.raises(Exception, match="read must be one of"):
        guarded("float32", [], expected=np.array(True), read="sometimes")
