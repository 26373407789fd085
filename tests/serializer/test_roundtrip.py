"""save -> load gives back the same graph: printed IR, constants bit for bit, metadata, meta;
the bytes are deterministic and constants are zero-copy read-only views into the file."""
from __future__ import annotations

import os

import numpy as np
import pytest
from sample_graphs import feature_graph, random_graph
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln
from kiln.ir import Graph, evaluate, verify


def constants(g: Graph) -> dict:
    out = {}
    for sub in g.all_graphs():
        for v in sub.initializers.values():
            out[v.name] = v.const
        for n in sub.nodes:
            for k, a in n.attrs.items():
                if isinstance(a, np.ndarray):
                    out[f"{n.name}.{k}"] = a
    return out


def assert_same(a: Graph, b: Graph) -> None:
    assert str(a) == str(b)
    assert a.metadata == b.metadata
    assert [n.meta for n in a.walk()] == [n.meta for n in b.walk()]
    ca, cb = constants(a), constants(b)
    assert ca.keys() == cb.keys()
    for k in ca:
        assert ca[k].dtype == cb[k].dtype and ca[k].shape == cb[k].shape, k
        assert ca[k].tobytes() == cb[k].tobytes(), k


def test_feature_graph_round_trip(tmp_path):
    pytest.importorskip("ml_dtypes")
    g = feature_graph()
    verify(g)
    path = kiln.save(g, tmp_path / "m.kiln")
    back = kiln.load_graph(path)
    verify(back)
    assert_same(g, back)
    feed = {"x": np.ones((2, 3, 4), np.float32), "y": np.ones((5, 4), np.float32),
            "z": np.ones((2, 2), np.float32)}
    for want, got in zip(evaluate(g, feed), evaluate(back, feed)):
        np.testing.assert_array_equal(want, got)


def test_same_graph_same_bytes(tmp_path):
    pytest.importorskip("ml_dtypes")
    a = kiln.save(feature_graph(), tmp_path / "a.kiln").read_bytes()
    b = kiln.save(feature_graph(), tmp_path / "b.kiln").read_bytes()
    c = kiln.save(kiln.load_graph(tmp_path / "a.kiln"), tmp_path / "c.kiln").read_bytes()
    assert a == b == c


def test_constants_are_aligned_read_only_views(tmp_path):
    pytest.importorskip("ml_dtypes")
    path = kiln.save(feature_graph(), tmp_path / "m.kiln")
    g = kiln.load_graph(path)
    for name, arr in constants(g).items():
        assert not arr.flags.writeable, name
        assert arr.size == 0 or arr.ctypes.data % 64 == 0, name
        with pytest.raises(ValueError):
            arr[...] = 0
    # Two initializers sharing one array are stored once and come back sharing memory.
    a, b = g.initializers["shared.a"].const, g.initializers["shared.b"].const
    assert a.ctypes.data == b.ctypes.data


def test_layout_alignment(tmp_path):
    pytest.importorskip("ml_dtypes")
    from kiln.serializer.format import parse_header
    data = kiln.save(feature_graph(), tmp_path / "m.kiln").read_bytes()
    h = parse_header(data, len(data))
    assert h.data_offset % 4096 == 0 and h.flatbuffer_offset == 64
    assert h.data_offset + h.data_size == len(data)
    assert data[h.flatbuffer_offset + 4:h.flatbuffer_offset + 8] == b"KILN"


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_graphs_round_trip(data):
    pytest.importorskip("ml_dtypes")
    g = random_graph(data)
    verify(g)
    back = kiln.load_graph_from_bytes(_save_bytes(g))
    verify(back)
    assert_same(g, back)


def _save_bytes(g: Graph) -> bytes:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        return kiln.save(g, os.path.join(d, "m.kiln")).read_bytes()


def test_negative_zero_float_attribute_keeps_its_sign(tmp_path):
    # -0.0 equals the FlatBuffer field's default (0.0): the builder would drop it unless forced.
    import math

    import kiln
    from kiln.ir import Graph

    g = Graph("g")
    x = g.add_input("x", "float32", (2,))
    g.outputs = [g.op("LeakyRelu", x, alpha=-0.0)]
    back = kiln.load_graph(kiln.save(g, tmp_path / "z.kiln"))
    alpha = back.nodes[0].attrs["alpha"]
    assert alpha == 0.0 and math.copysign(1.0, alpha) == -1.0
