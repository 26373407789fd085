"""Static ONNX sequences lowered to tensors at import (serializer/onnx_sequences.py): the list ops with constant
positions, Split/ConcatFromSequence, Loops carrying a sequence unrolled; answers equal onnxruntime's; everything
not static refused by name."""
from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.errors import UnsupportedOpError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

from kiln.serializer import onnx_sequences  # noqa: E402
from kiln.serializer.onnx_import import import_onnx  # noqa: E402

RNG = np.random.default_rng(7)


def _const(name: str, value) -> "onnx.NodeProto":
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _model(nodes, inputs, outputs, opset=18):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _same_as_ort(model, feeds: dict) -> list:
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    g = import_onnx(model)
    got = kiln.load(g).run(feeds, as_list=True)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    return got


def _mvit_like(trips: int, cond_out: str = "c_true"):
    """torchvision MViT's pattern as the TorchScript exporter writes it: SequenceEmpty, a Loop of constant trip
    count whose body appends x[:, i:i+1] (the iteration number declared [1], as that exporter does, so the
    Gathers give 1-D starts/ends), one more insert after, then SequenceAt."""
    body = helper.make_graph(
        [helper.make_node("Gather", ["starts", "i"], ["s"]),
         _const("one", np.int64(1)),
         helper.make_node("Add", ["i", "one"], ["i1"]),
         helper.make_node("Gather", ["starts", "i1"], ["e"]),
         helper.make_node("Slice", ["x", "s", "e", "ax"], ["piece"]),
         helper.make_node("SequenceInsert", ["seq_in", "piece"], ["seq_out"]),
         helper.make_node("Identity", [cond_out], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", T.INT64, [1]), helper.make_tensor_value_info("cond", T.BOOL, []),
         helper.make_tensor_sequence_value_info("seq_in", T.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []),
         helper.make_tensor_sequence_value_info("seq_out", T.FLOAT, None)])
    nodes = [_const("starts", np.arange(trips + 1, dtype=np.int64)), _const("ax", np.array([1], np.int64)),
             _const("trips", np.int64(trips)), _const("c_true", np.bool_(True)),
             helper.make_node("SequenceEmpty", [], ["empty"], dtype=T.FLOAT),
             helper.make_node("Loop", ["trips", "c_true", "empty"], ["looped"], body=body),
             helper.make_node("SequenceInsert", ["looped", "x"], ["seq"]),
             _const("p0", np.int64(0)), _const("plast", np.int64(-1)),
             helper.make_node("SequenceAt", ["seq", "p0"], ["first"]),
             helper.make_node("SequenceAt", ["seq", "plast"], ["last"]),
             helper.make_node("SequenceLength", ["seq"], ["n"])]
    extra = [helper.make_tensor_value_info("go", T.BOOL, [])] if cond_out == "go" else []
    return _model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, ["b", 4]), *extra],
                  [helper.make_tensor_value_info(o, t, None) for o, t in
                   [("first", T.FLOAT), ("last", T.FLOAT), ("n", T.INT64)]])


@pytest.mark.parametrize("trips", [1, 3])
def test_a_loop_filling_a_sequence_is_unrolled_and_matches_onnxruntime(trips):
    got = _same_as_ort(_mvit_like(trips), {"x": RNG.standard_normal((2, 4)).astype(np.float32)})
    assert got[2] == trips + 1
    g = import_onnx(_mvit_like(trips))
    assert not any(n.op == "Loop" for n in g.walk())  # unrolled


def test_split_concat_construct_erase():
    nodes = [helper.make_node("SplitToSequence", ["x"], ["parts"], axis=1, keepdims=0),
             helper.make_node("ConcatFromSequence", ["parts"], ["stacked"], axis=-1, new_axis=1),
             _const("sizes", np.array([1, 2], np.int64)),
             helper.make_node("SplitToSequence", ["x", "sizes"], ["two"], axis=1),
             _const("p", np.int64(0)),
             helper.make_node("SequenceErase", ["two", "p"], ["rest"]),
             helper.make_node("SequenceConstruct", ["x", "x"], ["pair"]),
             helper.make_node("SequenceInsert", ["pair", "x", "p"], ["three"]),
             helper.make_node("ConcatFromSequence", ["three"], ["cat"], axis=0),
             helper.make_node("ConcatFromSequence", ["rest"], ["tail"], axis=1),
             _const("chunk", np.int64(2)),
             helper.make_node("SplitToSequence", ["x", "chunk"], ["chunks"], axis=1),
             helper.make_node("SequenceLength", ["chunks"], ["nchunks"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info(o, t, None) for o, t in
                    [("stacked", T.FLOAT), ("cat", T.FLOAT), ("tail", T.FLOAT), ("nchunks", T.INT64)]])
    got = _same_as_ort(model, {"x": RNG.standard_normal((2, 3)).astype(np.float32)})
    assert got[0].shape == (2, 3) and got[1].shape == (6, 3) and got[2].shape == (2, 2) and got[3] == 2


def test_a_sequence_at_the_graph_interface_is_refused_by_name():
    model = _model([helper.make_node("SequenceConstruct", ["x"], ["s"])],
                   [helper.make_tensor_value_info("x", T.FLOAT, [2])],
                   [helper.make_tensor_sequence_value_info("s", T.FLOAT, None)])
    with pytest.raises(UnsupportedOpError, match="output 's' of graph 'g' is of ONNX type sequence; kiln supports tensors only"):
        import_onnx(model)


def test_a_position_computed_at_run_time_is_refused():
    model = _model([helper.make_node("SequenceConstruct", ["x", "x"], ["s"]),
                    helper.make_node("SequenceAt", ["s", "k"], ["y"])],
                   [helper.make_tensor_value_info("x", T.FLOAT, [2]), helper.make_tensor_value_info("k", T.INT64, [])],
                   [helper.make_tensor_value_info("y", T.FLOAT, None)])
    with pytest.raises(UnsupportedOpError, match="the position is computed at run time"):
        import_onnx(model)


def test_loops_that_cannot_be_unrolled_are_refused(monkeypatch):
    with pytest.raises(UnsupportedOpError, match="body's condition is not the constant True"):
        import_onnx(_mvit_like(2, cond_out="go"))  # the body's condition is an input of the model
    monkeypatch.setattr(onnx_sequences, "MAX_UNROLLED_NODES", 10)
    with pytest.raises(UnsupportedOpError, match="unrolling 3 iterations of a 7-node body passes 10 nodes"):
        import_onnx(_mvit_like(3))


def test_another_op_reading_a_sequence_is_refused_by_name():
    model = _model([helper.make_node("SequenceConstruct", ["x"], ["s"]),
                    helper.make_node("Relu", ["s"], ["y"])],
                   [helper.make_tensor_value_info("x", T.FLOAT, [2])],
                   [helper.make_tensor_value_info("y", T.FLOAT, None)])
    with pytest.raises(UnsupportedOpError, match=r"\(Relu\) reads 's', a sequence"):
        import_onnx(model)


def test_optional_values_are_known_at_import():
    """Optional(x) holds x, Optional() is empty: OptionalHasElement is a constant, OptionalGetElement the value."""
    opt_empty = helper.make_node("Optional", [], ["none"], type=helper.make_tensor_type_proto(T.FLOAT, [2]))
    nodes = [helper.make_node("Optional", ["x"], ["some"]), opt_empty,
             helper.make_node("OptionalHasElement", ["some"], ["has_some"]),
             helper.make_node("OptionalHasElement", ["none"], ["has_none"]),
             helper.make_node("OptionalHasElement", ["x"], ["has_x"]),
             helper.make_node("OptionalGetElement", ["some"], ["got"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [2])],
                   [helper.make_tensor_value_info(o, t, None) for o, t in
                    [("has_some", T.BOOL), ("has_none", T.BOOL), ("has_x", T.BOOL), ("got", T.FLOAT)]])
    got = _same_as_ort(model, {"x": np.array([1.5, -2.0], np.float32)})
    assert [bool(got[0]), bool(got[1]), bool(got[2])] == [True, False, True]
    bad = _model([opt_empty, helper.make_node("OptionalGetElement", ["none"], ["y"])], [],
                 [helper.make_tensor_value_info("y", T.FLOAT, None)])
    with pytest.raises(UnsupportedOpError, match="reads an empty optional value"):
        import_onnx(bad)
