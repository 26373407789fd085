"""The GPU runtime and the storage types (issue 22): CuPy has no float8/int4/... arrays, so a model holding one
is refused at load by name, pointing to the CPU runtime; unsigned integers run on the GPU as on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.ir.dtypes import DType
from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()


def test_a_float8_value_is_refused_at_load_by_name():
    g = Graph("f8")
    x = g.add_input("x", "float32", [4])
    q = g.op("Cast", x, to=DType.FLOAT8E4M3FN.value)
    g.outputs = [g.op("Cast", q, to=DType.FLOAT32.value)]
    with pytest.raises(KilnError, match=r"is float8e4m3fn, which the GPU runtime does not take yet .*device='cpu'"):
        kiln.load(g, device="cuda")


@pytest.mark.parametrize("dt", [np.uint16, np.uint32, np.uint64])
def test_unsigned_integers_match_the_cpu(dt):
    g = Graph("u")
    a = g.add_input("a", np.dtype(dt).name, [6])
    b = g.add_input("b", np.dtype(dt).name, [6])
    s = g.op("Add", a, b)
    g.outputs = [s, g.op("Div", s, b), g.op("Less", a, b), g.op("Max", s, b), g.op("BitwiseXor", a, b)]
    hi = np.iinfo(dt).max
    av = np.array([0, 1, hi // 2, hi - 3, 7, hi // 3], dt)
    bv = np.array([1, 2, 3, 2, hi // 2, 5], dt)
    want = kiln.load(g).run({"a": av, "b": bv}, as_list=True)
    got = kiln.load(g, device="cuda", output="numpy").run({"a": av, "b": bv}, as_list=True)
    for w, o in zip(want, got):
        assert o.dtype == w.dtype
        np.testing.assert_array_equal(o, w)
