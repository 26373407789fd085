"""Shape ops (Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Concat, Split, Shape, Size,
Expand, Tile) against torch and hand-computed values, and symbolic shape propagation."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from op_harness import build_single, check_op, i64, inferred

from kiln.errors import ShapeInferenceError
from kiln.ir import Graph, evaluate, verify
from kiln.ir.passes import infer_shapes

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.float32, np.float16, np.int64, BF16, np.bool_]




def arange(shape, dtype=np.float32) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n) % 7).reshape(shape).astype(dtype)






# --------------------------------------------------------------------------- Reshape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src, target, want", [
    ((2, 3, 4), (0, -1), (2, 12)),
    ((2, 3, 4), (-1,), (24,)),
    ((2, 3, 4), (4, 0, 2), (4, 3, 2)),
    ((6,), (2, 1, 3), (2, 1, 3)),
    ((2, 0, 3), (0, 3, -1), (2, 3, 0)),
])
def test_reshape(torch, dtype, src, target, want):
    x = arange(src, dtype)
    expected = torch.from_numpy(x.view(np.uint16) if dtype == BF16 else x).reshape(want).numpy()
    expected = expected.view(BF16) if dtype == BF16 else expected
    check_op("Reshape", [x, i64(*target)], expected, const_inputs=[1])


def test_reshape_symbolic_dims():
    x = arange((2, 4, 6))
    assert inferred("Reshape", [x, i64(0, -1)], const_inputs=[1]) == [("batch", 24)]
    assert inferred("Reshape", [x, i64(0, 4, -1)], const_inputs=[1]) == [("batch", 4, 6)]
    assert inferred("Reshape", [x, i64(-1, 6)], const_inputs=[1]) == [(None, 6)]
    assert inferred("Reshape", [x, i64(0, 2, 2, 6)], const_inputs=[1]) == [("batch", 2, 2, 6)]
    check_op("Reshape", [x, i64(0, 2, -1)], x.reshape(2, 2, 12), const_inputs=[1], symbolic_batch=True)


def test_reshape_allowzero():
    x = np.zeros((0, 3), np.float32)
    check_op("Reshape", [x, i64(3, 0)], np.zeros((3, 0), np.float32), {"allowzero": 1}, const_inputs=[1])
    assert inferred("Reshape", [x, i64(3, 0)], {"allowzero": 1}, const_inputs=[1], symbolic_batch=False) == [(3, 0)]


def test_reshape_unknown_target_keeps_rank():
    x = arange((2, 12))
    outs = check_op("Reshape", [x, i64(4, 6)], x.reshape(4, 6))
    assert outs[0].shape == (4, 6)
    assert inferred("Reshape", [x, i64(4, 6)]) == [(None, None)]


@pytest.mark.parametrize("target, msg", [
    ((5, -1), "do not divide"), ((5, 5), "element counts differ"), ((-1, -1), "more than one -1"),
    ((2, -2), "only -1 may be negative"), ((0, 0, 0, 0), "copies an input dim"),
])
def test_reshape_errors(target, msg):
    with pytest.raises(ShapeInferenceError, match=f"node 'reshape' \\(Reshape\\).*{msg}"):
        build_single("Reshape", [arange((2, 12)), i64(*target)], const_inputs=[1])


def test_reshape_allowzero_with_minus_one_fails():
    with pytest.raises(ShapeInferenceError, match="allowzero"):
        build_single("Reshape", [arange((2, 12)), i64(0, -1)], {"allowzero": 1}, const_inputs=[1])


# --------------------------------------------------------------------------- Flatten / Transpose


@pytest.mark.parametrize("axis, want", [(0, (1, 60)), (1, (3, 20)), (2, (12, 5)), (3, (60, 1)), (-1, (12, 5))])
def test_flatten(torch, axis, want):
    x = arange((3, 4, 5), np.float16)
    check_op("Flatten", [x], torch.from_numpy(x).reshape(want).numpy(), {"axis": axis})


def test_flatten_symbolic():
    x = arange((3, 4, 5))
    assert inferred("Flatten", [x], {"axis": 1}) == [("batch", 20)]
    assert inferred("Flatten", [x], {"axis": 2}) == [(None, 5)]
    assert inferred("Flatten", [x], {"axis": 0}) == [(1, None)]
    with pytest.raises(ShapeInferenceError, match="axis 4 is out of range"):
        build_single("Flatten", [x], {"axis": 4})


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
@pytest.mark.parametrize("perm", [None, (0, 2, 1), (2, 0, 1), (1, 0, 2)])
def test_transpose(torch, dtype, perm):
    x = arange((2, 3, 4), dtype)
    t = torch.from_numpy(x)
    expected = t.permute(*(perm or (2, 1, 0))).numpy()
    check_op("Transpose", [x], expected, {"perm": perm}, symbolic_batch=True)


def test_transpose_symbolic_and_errors():
    x = arange((2, 3, 4))
    assert inferred("Transpose", [x], {"perm": (1, 0, 2)}) == [(3, "batch", 4)]
    assert inferred("Transpose", [x]) == [(4, 3, "batch")]
    with pytest.raises(ShapeInferenceError, match="not a permutation"):
        build_single("Transpose", [x], {"perm": (0, 0, 1)})


# --------------------------------------------------------------------------- Squeeze / Unsqueeze


@pytest.mark.parametrize("axes, dims", [((1,), (1,)), ((-1, 1), (1, 3)), (None, None)])
def test_squeeze(torch, axes, dims):
    x = arange((2, 1, 3, 1), np.int64)
    t = torch.from_numpy(x)
    expected = t.squeeze() if dims is None else t.squeeze(dims)
    inputs = [x] if axes is None else [x, i64(*axes)]
    check_op("Squeeze", inputs, expected.numpy(), const_inputs=[1])


def test_squeeze_inference():
    x = arange((2, 1, 3))
    assert inferred("Squeeze", [x, i64(1)], const_inputs=[1]) == [("batch", 3)]
    # Without axes a symbolic dim might be 1: the rank is unknown.
    assert inferred("Squeeze", [x]) == [None]
    assert inferred("Squeeze", [x], symbolic_batch=False) == [(2, 3)]
    with pytest.raises(ShapeInferenceError, match="cannot squeeze axis 2 of size 3"):
        build_single("Squeeze", [x, i64(2)], const_inputs=[1])


@pytest.mark.parametrize("axes, want", [((0,), (1, 2, 3)), ((2,), (2, 3, 1)), ((-1,), (2, 3, 1)),
                                        ((0, 3), (1, 2, 3, 1)), ((1, 0), (1, 1, 2, 3))])
def test_unsqueeze(torch, axes, want):
    x = arange((2, 3), np.float64)
    check_op("Unsqueeze", [x, i64(*axes)], torch.from_numpy(x).reshape(want).numpy(), const_inputs=[1])


def test_unsqueeze_inference():
    x = arange((2, 3))
    assert inferred("Unsqueeze", [x, i64(1, -1)], const_inputs=[1]) == [("batch", 1, 3, 1)]
    with pytest.raises(ShapeInferenceError, match="name an axis twice"):
        build_single("Unsqueeze", [x, i64(1, 1)], const_inputs=[1])
    with pytest.raises(ShapeInferenceError, match="out of range"):
        build_single("Unsqueeze", [x, i64(3)], const_inputs=[1])


# --------------------------------------------------------------------------- Concat / Split


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.bool_])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(torch, dtype, axis):
    x = arange((2, 3, 4), dtype)
    parts = [x, np.ascontiguousarray(x[::-1, ::-1]), np.ascontiguousarray(x[:, :, ::-1])]
    expected = torch.cat([torch.from_numpy(p) for p in parts], dim=axis).numpy()
    check_op("Concat", parts, expected, {"axis": axis}, symbolic_batch=axis != 0)


def test_concat_inference():
    a, b = arange((2, 3)), arange((2, 5))
    assert inferred("Concat", [a, b], {"axis": 1}) == [("batch", 8)]
    assert inferred("Concat", [a, arange((4, 3))], {"axis": 0}) == [(None, 3)]
    with pytest.raises(ShapeInferenceError, match="differ in dim 1"):
        build_single("Concat", [a, b], {"axis": 0})
    with pytest.raises(ShapeInferenceError, match="one rank"):
        build_single("Concat", [a, arange((2, 3, 1))], {"axis": 0})
    with pytest.raises(ShapeInferenceError, match="different dtypes"):
        build_single("Concat", [a, arange((2, 3), np.int64)], {"axis": 0})


@pytest.mark.parametrize("sizes, axis", [((2, 4), 1), ((1, 1, 4), 1), ((3, 0, 3), 1), ((2, 1), 0)])
def test_split_sizes(torch, sizes, axis):
    x = arange((3, 6), np.float32)
    expected = [t.numpy() for t in torch.split(torch.from_numpy(x), list(sizes), dim=axis)]
    check_op("Split", [x, i64(*sizes)], expected, {"axis": axis}, const_inputs=[1], num_outputs=len(sizes))


@pytest.mark.parametrize("dim, n, chunks", [(6, 3, (2, 2, 2)), (7, 3, (3, 3, 1)), (5, 2, (3, 2)), (4, 4, (1, 1, 1, 1))])
def test_split_num_outputs(torch, dim, n, chunks):
    x = arange((2, dim), np.int32)
    expected = [t.numpy() for t in torch.split(torch.from_numpy(x), list(chunks), dim=1)]
    check_op("Split", [x], expected, {"axis": -1, "num_outputs": n}, num_outputs=n, symbolic_batch=True)


def test_split_inference():
    x = arange((4, 6))
    assert inferred("Split", [x, i64(1, 5)], {"axis": 1}, const_inputs=[1], num_outputs=2) == \
        [("batch", 1), ("batch", 5)]
    assert inferred("Split", [x], {"num_outputs": 2}, num_outputs=2) == [(None, 6), (None, 6)]
    with pytest.raises(ShapeInferenceError, match="sums to 5"):
        build_single("Split", [x, i64(1, 4)], {"axis": 1}, const_inputs=[1], num_outputs=2)
    with pytest.raises(ShapeInferenceError, match="exactly one of"):
        build_single("Split", [x], {"axis": 1}, num_outputs=2)
    with pytest.raises(ShapeInferenceError, match="num_outputs=3 but the node has 2"):
        build_single("Split", [x], {"axis": 1, "num_outputs": 3}, num_outputs=2)
    # 5 into 4 chunks of ceil(5/4) = 2 overruns the axis: the chunks past its end are clipped (2, 2, 1, 0), as
    # ONNX's reference evaluator and onnxruntime compute it (AffineGrid's function body relies on it).
    x5 = arange((2, 5))
    check_op("Split", [x5], [x5[:, 0:2], x5[:, 2:4], x5[:, 4:5], x5[:, 5:5]], {"axis": 1, "num_outputs": 4},
             num_outputs=4)


# --------------------------------------------------------------------------- Shape / Size


@pytest.mark.parametrize("start, end, want", [(0, None, (2, 3, 4, 5)), (1, None, (3, 4, 5)), (-2, None, (4, 5)),
                                              (1, 3, (3, 4)), (0, -1, (2, 3, 4)), (-9, 9, (2, 3, 4, 5)),
                                              (3, 1, ())])
def test_shape(start, end, want):
    x = np.zeros((2, 3, 4, 5), np.float16)
    attrs = {"start": start} if end is None else {"start": start, "end": end}
    check_op("Shape", [x], np.array(want, np.int64), attrs, symbolic_batch=True)


def test_size():
    check_op("Size", [np.zeros((2, 3, 4), np.bool_)], np.array(24, np.int64), symbolic_batch=True)
    check_op("Size", [np.zeros((), np.float32)], np.array(1, np.int64))


# --------------------------------------------------------------------------- Expand / Tile


@pytest.mark.parametrize("src, target", [((3, 1), (2, 1, 6)), ((3, 1), (3, 4)), ((1,), (2, 2)),
                                         ((2, 3), (1, 1)), ((4, 1, 2), (4, 3, 2))])
@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_expand(torch, src, target, dtype):
    x = arange(src, dtype)
    # torch.broadcast_tensors broadcasts both ways, as ONNX Expand does.
    expected, _ = torch.broadcast_tensors(torch.from_numpy(x), torch.empty(target))
    check_op("Expand", [x, i64(*target)], expected.numpy(), const_inputs=[1])


def test_expand_inference():
    x = arange((2, 1, 3))
    assert inferred("Expand", [x, i64(1, 4, 1)], const_inputs=[1]) == [("batch", 4, 3)]
    assert inferred("Expand", [x, i64(5, 1, 1, 1)], const_inputs=[1]) == [(5, "batch", 1, 3)]
    assert inferred("Expand", [x, i64(1, 4, 1)]) == [(None, None, None)]
    with pytest.raises(ShapeInferenceError, match="does not broadcast"):
        build_single("Expand", [x, i64(1, 1, 2)], const_inputs=[1])


@pytest.mark.parametrize("reps", [(1, 1), (2, 3), (3, 1), (1, 0)])
@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.bool_])
def test_tile(torch, reps, dtype):
    x = arange((2, 3), dtype)
    check_op("Tile", [x, i64(*reps)], torch.from_numpy(x).tile(reps).numpy(), const_inputs=[1])


def test_tile_inference():
    x = arange((2, 3))
    assert inferred("Tile", [x, i64(1, 2)], const_inputs=[1]) == [("batch", 6)]
    assert inferred("Tile", [x, i64(2, 2)], const_inputs=[1]) == [(None, 6)]
    with pytest.raises(ShapeInferenceError, match="one entry per input axis"):
        build_single("Tile", [x, i64(2)], const_inputs=[1])


# --------------------------------------------------------------------------- symbolic propagation


def _graph(shape, dtype="float32"):
    g = Graph("prop")
    return g, g.add_input("x", dtype, shape)


def test_transformer_reshape_keeps_batch():
    g, x = _graph(["batch", 128, 64])
    batch = g.op("Gather", g.op("Shape", x), g.add_initializer("zero", i64(0).reshape(())))
    lead = g.op("Unsqueeze", batch, g.add_initializer("ax0", i64(0)))
    target = g.op("Concat", lead, g.add_initializer("rest", i64(-1, 64)), axis=0)
    g.outputs = [g.op("Reshape", x, target)]
    infer_shapes(g)
    verify(g)
    assert g.outputs[0].type.shape == ("batch", 128, 64)
    feed = arange((3, 128, 64))
    np.testing.assert_array_equal(evaluate(g, [feed])[0], feed)


def test_heads_split_and_merge():
    # [batch, seq, 64] -> [batch, seq, 4, 16] -> transpose -> merge back to [batch, seq, 64].
    g, x = _graph(["batch", "seq", 64])
    shp = g.op("Shape", x)
    lead = g.op("Slice", shp, g.add_initializer("s0", i64(0)), g.add_initializer("e2", i64(2)))
    heads = g.op("Reshape", x, g.op("Concat", lead, g.add_initializer("hd", i64(4, 16)), axis=0))
    t = g.op("Transpose", heads, perm=(0, 2, 1, 3))
    back = g.op("Transpose", t, perm=(0, 2, 1, 3))
    merged = g.op("Reshape", back, g.op("Concat", g.op("Shape", x, end=2), g.add_initializer("m1", i64(-1)), axis=0))
    g.outputs = [heads, t, merged]
    infer_shapes(g)
    verify(g)
    assert [v.type.shape for v in g.outputs] == [("batch", "seq", 4, 16), ("batch", 4, "seq", 16),
                                                 ("batch", "seq", 64)]
    feed = arange((2, 5, 64))
    outs = evaluate(g, [feed])
    np.testing.assert_array_equal(outs[1], feed.reshape(2, 5, 4, 16).transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(outs[2], feed)


def test_shape_values_through_squeeze_identity_and_constant_of_shape():
    g, x = _graph(["batch", "seq", 8])
    seq = g.op("Squeeze", g.op("Shape", x, start=1, end=2), g.add_initializer("a0", i64(0)))
    seq_vec = g.op("Identity", g.op("Unsqueeze", seq, g.add_initializer("a0b", i64(0))))
    batch_vec = g.op("Shape", x, end=1)
    mask_shape = g.op("Concat", batch_vec, seq_vec, seq_vec, axis=0)
    mask = g.op("ConstantOfShape", mask_shape)
    tiled = g.op("Tile", x, g.op("Concat", g.add_initializer("one", i64(1)), seq_vec,
                                g.add_initializer("one_b", i64(1)), axis=0))
    widened = g.op("Expand", g.add_initializer("row", np.ones((1, 1, 8), np.float32)), g.op("Shape", x))
    g.outputs = [mask, tiled, widened]
    infer_shapes(g)
    verify(g)
    assert [v.type.shape for v in g.outputs] == [("batch", "seq", "seq"), ("batch", None, 8),
                                                 ("batch", "seq", 8)]
    outs = evaluate(g, [arange((2, 3, 8))])
    assert [o.shape for o in outs] == [(2, 3, 3), (2, 9, 8), (2, 3, 8)]
    np.testing.assert_array_equal(outs[1], np.tile(arange((2, 3, 8)), (1, 3, 1)))


def test_reshape_reads_symbolic_target_exactly():
    # A target whose values are symbols gives exactly those dims (the symbols are trusted).
    g, x = _graph(["batch", 24])
    y = g.add_input("y", "float32", ["batch", 2, 12])
    g.outputs = [g.op("Reshape", x, g.op("Shape", y))]
    infer_shapes(g)
    verify(g)
    assert g.outputs[0].type.shape == ("batch", 2, 12)
