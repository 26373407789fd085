"""ONNX Scan (Scan-9 and later), which kiln imports as a Loop (serializer/onnx_scan.py): scan axes and directions
on inputs and outputs, states, outer values, nested scans, names shared with the graph, zero-length scans, against
Scan's definition in numpy and onnxruntime; the imported Loop exported back to ONNX; Scan-8 and malformed nodes
refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import FormatError, UnsupportedOpError
from kiln.ir import evaluate
from kiln.runtime import load

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from kiln.serializer.onnx_import import import_onnx  # noqa: E402


F32 = TensorProto.FLOAT


def make_model(graph, opset_imports):
    """A model of the oldest IR version that carries its opset (onnxruntime releases lag onnx's newest IR)."""
    ir_version = helper.find_min_ir_version_for(opset_imports)
    return helper.make_model(graph, opset_imports=opset_imports, ir_version=ir_version)


def vi(name: str, shape=None, elem=F32):
    return helper.make_tensor_value_info(name, elem, shape)


def scan_body(n_in: int = 1, reads_outer: bool = True):
    """(s, x_0..) -> (s + sum_j x_j * w, (s + sum_j x_j * w) * 2, x_0 - s): one state, n_in scan inputs, two scan
    outputs; w is an outer value the body reads by name."""
    nodes, acc = [], "s"
    for j in range(n_in):
        scaled = f"xw{j}"
        nodes.append(helper.make_node("Mul", [f"x{j}", "w" if reads_outer else f"x{j}"], [scaled]))
        nodes.append(helper.make_node("Add", [acc, scaled], [f"acc{j}"]))
        acc = f"acc{j}"
    nodes += [helper.make_node("Identity", [acc], ["s_out"]),
              helper.make_node("Add", [acc, acc], ["twice"]),
              helper.make_node("Sub", ["x0", "s"], ["diff"])]
    return helper.make_graph(nodes, "body", [vi("s", [3])] + [vi(f"x{j}", [3]) for j in range(n_in)],
                             [vi("s_out", [3]), vi("twice", [3]), vi("diff", [3])])


def scan_model(xs_shapes, attrs: dict, opset: int = 16, n_in: int = 1, body=None):
    """Model (s0 [3], w [3], x0.. ) -> Scan -> (s_final, twice_stacked, diff_stacked)."""
    body = body or scan_body(n_in)
    node = helper.make_node("Scan", ["s0"] + [f"in{j}" for j in range(n_in)], ["s_final", "ys", "ds"], body=body,
                            num_scan_inputs=n_in, **attrs)
    ident = helper.make_node("Identity", ["w_in"], ["w"])
    g = helper.make_graph([ident, node], "scan_graph",
                          [vi("s0", [3]), vi("w_in", [3])] + [vi(f"in{j}", s) for j, s in enumerate(xs_shapes)],
                          [vi("s_final"), vi("ys"), vi("ds")])
    return make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def scan_oracle(s0, w, xs, in_axes, in_dirs, out_axes, out_dirs):
    """Scan by its definition, in numpy (the body of scan_body)."""
    steps = xs[0].shape[in_axes[0]]
    s, outs = s0, [[], []]
    for t in range(steps):
        elems = [np.take(x, steps - 1 - t if d else t, axis=a) for x, a, d in zip(xs, in_axes, in_dirs)]
        new = s + sum(e * w for e in elems)
        outs[0].append(new * 2)
        outs[1].append(elems[0] - s)
        s = new
    stacked = []
    for k, seq in enumerate(outs):
        y = np.stack(seq[::-1] if out_dirs[k] else seq)
        stacked.append(np.moveaxis(y, 0, out_axes[k] % y.ndim))
    return [s] + stacked


def run_both(model, feeds: dict) -> list:
    """kiln's answer (imported, optimized, run) and the graph's reference evaluation must agree; returns kiln's."""
    g = import_onnx(model)
    assert not any(n.op == "Scan" for n in g.walk())
    args = [feeds[v.name] for v in g.inputs]
    got = load(g).run(args, as_list=True)
    for a, b in zip(got, evaluate(g, args)):
        np.testing.assert_array_equal(a, b)
    return got


@pytest.mark.parametrize("in_axis,in_dir,out_axes,out_dirs", [
    (0, 0, (0, 0), (0, 0)), (1, 0, (1, 0), (0, 1)), (-1, 1, (-1, 1), (1, 0)), (1, 1, (-2, 1), (1, 1))])
@pytest.mark.parametrize("opset", [9, 11, 16, 25])
def test_scan_axes_and_directions_match_definition_and_onnxruntime(rng, in_axis, in_dir, out_axes, out_dirs, opset):
    """Scan-9+ with scan_input_axes/directions and scan_output_axes/directions, a state and an outer value read
    by the body; the oracle is the definition, and onnxruntime where installed."""
    if opset < 11 and min(in_axis, *out_axes) < 0:
        pytest.skip("negative axes arrive with Scan-11")
    shape = [5, 3] if in_axis == 0 else [3, 5]
    attrs = dict(scan_input_axes=[in_axis], scan_input_directions=[in_dir], scan_output_axes=list(out_axes),
                 scan_output_directions=list(out_dirs))
    model = scan_model([shape], attrs, opset)
    feeds = {"s0": rng.standard_normal(3).astype(np.float32), "w_in": rng.standard_normal(3).astype(np.float32),
             "in0": rng.standard_normal(shape).astype(np.float32)}
    got = run_both(model, feeds)
    want = scan_oracle(feeds["s0"], feeds["w_in"], [feeds["in0"]], [in_axis % 2], [in_dir], out_axes, out_dirs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for a, b in zip(got, sess.run(None, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_scan_bidirectional_over_one_tensor(rng):
    """The same tensor scanned forwards and backwards at once (zip): ONNX's recipe for a bidirectional scan."""
    model = scan_model([[4, 3], [4, 3]], dict(scan_input_directions=[0, 1]), n_in=2)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    feeds = {"s0": np.zeros(3, np.float32), "w_in": np.ones(3, np.float32), "in0": x, "in1": x}
    got = run_both(model, feeds)
    want = scan_oracle(feeds["s0"], feeds["w_in"], [x, x], [0, 0], [0, 1], (0, 0), (0, 0))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[0], 2 * x.sum(0), rtol=1e-5, atol=1e-6)


def test_scan_onnx_node_tests_and_names_the_body_shares_with_the_graph(rng):
    """test_scan9_sum's body, with its names reused: the body's state input is called like the outer scan input,
    and a scan input element like the graph's input (body names shadow outer ones in ONNX)."""
    body = helper.make_graph([helper.make_node("Add", ["x", "initial"], ["sum_out"]),
                              helper.make_node("Identity", ["sum_out"], ["scan_out"])], "body",
                             [vi("x", [2]), vi("initial", [2])], [vi("sum_out", [2]), vi("scan_out", [2])])
    node = helper.make_node("Scan", ["initial", "x"], ["y", "z"], body=body, num_scan_inputs=1)
    model = make_model(helper.make_graph([node], "g", [vi("initial", [2]), vi("x", [3, 2])],
                                                [vi("y", [2]), vi("z", [3, 2])]),
                              opset_imports=[helper.make_opsetid("", 9)])
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    y, z = run_both(model, {"initial": np.array([1, 2], np.float32), "x": x})
    np.testing.assert_array_equal(y, [7, 11])
    np.testing.assert_array_equal(z, [[1, 3], [3, 6], [7, 11]])


def test_scan_nested_in_scan_and_without_state(rng):
    """A Scan whose body holds a Scan (each row's running sum), no state at the outer level; and a scan of length 0
    returns the initial state."""
    inner_body = helper.make_graph([helper.make_node("Add", ["acc", "v"], ["acc_out"]),
                                    helper.make_node("Identity", ["acc_out"], ["seen"])], "inner",
                                   [vi("acc", []), vi("v", [])], [vi("acc_out", []), vi("seen", [])])
    zero = helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", F32, [], [0.0]))
    inner = helper.make_node("Scan", ["zero", "row"], ["total", "running"], body=inner_body, num_scan_inputs=1)
    outer_body = helper.make_graph([zero, inner], "outer", [vi("row", [4])], [vi("running", [4])])
    node = helper.make_node("Scan", ["m"], ["sums"], body=outer_body, num_scan_inputs=1)
    model = make_model(helper.make_graph([node], "g", [vi("m", [3, 4])], [vi("sums", [3, 4])]),
                              opset_imports=[helper.make_opsetid("", 16)])
    m = rng.standard_normal((3, 4)).astype(np.float32)
    [sums] = run_both(model, {"m": m})
    np.testing.assert_allclose(sums, np.cumsum(m, axis=1), rtol=1e-5, atol=1e-6)

    model = scan_model([["t", 3]], {})
    s0 = np.arange(3, dtype=np.float32)
    got = run_both(model, {"s0": s0, "w_in": np.ones(3, np.float32), "in0": np.zeros((0, 3), np.float32)})
    np.testing.assert_array_equal(got[0], s0)
    assert got[1].shape == got[2].shape == (0, 3)


def test_scan_imported_loop_exports_and_runs_in_onnxruntime(rng):
    """The Loop a Scan becomes is plain ONNX again on export."""
    ort = pytest.importorskip("onnxruntime")
    from kiln.serializer.onnx import to_onnx_model
    attrs = dict(scan_input_axes=[1], scan_input_directions=[1], scan_output_axes=[1, 0], scan_output_directions=[0, 1])
    g = import_onnx(scan_model([[3, 6]], attrs))
    feeds = [rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32),
             rng.standard_normal((3, 6)).astype(np.float32)]
    proto = to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    assert "Scan" not in {n.op_type for n in proto.graph.node} and "Loop" in {n.op_type for n in proto.graph.node}
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for a, b in zip(sess.run(None, {v.name: f for v, f in zip(g.inputs, feeds)}), evaluate(g, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_scan_8_is_refused_by_name():
    body = helper.make_graph([helper.make_node("Add", ["s", "x"], ["s2"]), helper.make_node("Identity", ["s2"], ["o"])],
                             "body", [vi("s", [2]), vi("x", [2])], [vi("s2", [2]), vi("o", [2])])
    node = helper.make_node("Scan", ["", "s0", "x"], ["y", "z"], body=body, num_scan_inputs=1)
    model = make_model(helper.make_graph([node], "g", [vi("s0", [1, 2]), vi("x", [1, 3, 2])], [vi("y"), vi("z")]),
                              opset_imports=[helper.make_opsetid("", 8)])
    with pytest.raises(UnsupportedOpError, match=r"\(Scan-8, opset 8\): Scan-8's batch axis, sequence_lens and "
                                                 r"directions are not supported; kiln imports Scan-9 and later"):
        import_onnx(model)


@pytest.mark.parametrize("change,error,match", [
    (dict(num_scan_inputs=0), FormatError, "num_scan_inputs is 0"),
    (dict(num_scan_inputs=3), FormatError, "num_scan_inputs is 3, the node has 2 inputs"),
    (dict(scan_input_axes=[0, 1]), FormatError, "scan_input_axes has 2 entries, the node has 1"),
    (dict(scan_input_directions=[2]), FormatError, r"scan_input_directions \[2\] must hold 0 \(forward\) or 1"),
    (dict(scan_input_axes=[2]), FormatError, r"scan_input_axes\[0\] 2 is out of range for rank 2"),
    (dict(scan_output_axes=[0, 2]), FormatError, r"scan_output_axes\[1\] 2 is out of range for rank 2"),
    (dict(sequence_lens=[1]), UnsupportedOpError, "attribute 'sequence_lens' is not part of Scan-9"),
])
def test_scan_bad_attributes_fail_by_name(change, error, match):
    attrs = {"num_scan_inputs": 1, **change}
    n_in = attrs.pop("num_scan_inputs")
    model = scan_model([[5, 3]], attrs)
    next(a for a in model.graph.node[1].attribute if a.name == "num_scan_inputs").i = n_in
    with pytest.raises(error, match=rf"\(Scan\).*{match}"):
        import_onnx(model)


def test_scan_inputs_of_different_lengths_fail():
    with pytest.raises(FormatError, match=r"\(Scan\): the scan inputs have lengths \[4, 5\]"):
        import_onnx(scan_model([[4, 3], [5, 3]], {}, n_in=2))


def test_scan_output_axis_needs_a_known_rank(rng):
    """A scan output element of unknown rank (a Reshape to an outer shape of unknown length) stacks on axis 0 as
    well; moving it to another axis is a Transpose kiln cannot write without the rank: refused by name."""
    body = helper.make_graph([helper.make_node("Add", ["s", "x"], ["s_out"]),
                              helper.make_node("Reshape", ["s_out", "shp"], ["elem"])], "body",
                             [vi("s", [3]), vi("x", [3])], [vi("s_out", [3]), vi("elem")])

    def model(out_axis):
        node = helper.make_node("Scan", ["s0", "xs"], ["s_final", "ys"], body=body, num_scan_inputs=1,
                                scan_output_axes=[out_axis])
        return make_model(helper.make_graph(
            [node], "g", [vi("s0", [3]), vi("xs", [4, 3]), vi("shp", ["k"], TensorProto.INT64)],
            [vi("s_final"), vi("ys")]), opset_imports=[helper.make_opsetid("", 16)])

    xs = rng.standard_normal((4, 3)).astype(np.float32)
    s_final, ys = run_both(model(0), {"s0": np.zeros(3, np.float32), "xs": xs, "shp": np.array([3, 1])})
    np.testing.assert_allclose(ys[..., 0], np.cumsum(xs, axis=0), rtol=1e-6, atol=1e-6)
    with pytest.raises(UnsupportedOpError, match=r"\(Scan\): scan output 0 goes to axis 1, and its rank is not "
                                                 r"known at import"):
        import_onnx(model(1))
