"""optimize(): levels, the named pass list, the report, verify_each, and the acceptance block."""
import numpy as np
import pytest

from kiln import VerifyError
from kiln.ir import Graph, evaluate, verify
from kiln.ir.passes import dce, optimize, pipeline


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.walk()]


def bn(g: Graph, h, c: int, rng, name: str):
    stats = {"weight": rng.uniform(0.5, 2.0, c), "bias": rng.normal(size=c),
             "running_mean": rng.normal(size=c), "running_var": rng.uniform(0.2, 3.0, c)}
    args = [g.add_initializer(f"{name}.{k}", a.astype(np.float32)) for k, a in stats.items()]
    return g.op("BatchNormalization", h, *args, name=name)


def resnet_block(rng) -> Graph:
    """Conv-BN-Relu-Conv-BN + identity skip, Relu; with an Identity, a Dropout and a dead branch."""
    g = Graph("block")
    x = g.add_input("x", "float32", ("batch", 8, 16, 16))
    w1 = g.add_initializer("conv1.weight", (rng.normal(size=(8, 8, 3, 3)) * 0.2).astype(np.float32))
    w2 = g.add_initializer("conv2.weight", (rng.normal(size=(8, 8, 3, 3)) * 0.2).astype(np.float32))
    h = g.op("Conv", x, w1, pads=[1, 1, 1, 1], name="conv1")
    h = g.op("Relu", bn(g, h, 8, rng, "bn1"), name="relu1")
    h = g.op("Identity", h)
    h = g.op("Conv", h, w2, pads=[1, 1, 1, 1], name="conv2")
    h = g.op("Dropout", bn(g, h, 8, rng, "bn2"))
    # A dead branch, with a weight only it reads.
    g.op("ReduceMean", g.op("Mul", h, g.add_initializer("unused.scale", np.full(1, 3.0, np.float32))))
    g.outputs = [g.op("Relu", g.op("Add", h, x, name="skip"), name="out")]
    return g


def test_acceptance_resnet_block(rng):
    g = resnet_block(rng)
    verify(g)
    original = g.copy()
    report = optimize(g, level=2, verify_each=True)
    verify(g)
    assert ops(g) == ["Conv", "Relu", "Conv", "Add", "Relu"]
    assert [v.name for v in g.outputs] == ["out"] and g.inputs[0].shape == ("batch", 8, 16, 16)
    assert not any(k.startswith(("bn", "unused")) for k in g.initializers)
    assert len(g.initializers) == 4
    assert report.converged and report.nodes_before == 11 and report.nodes_after == 5
    assert report.passes["fold_batchnorm"].nodes_removed == 2
    for batch in (1, 3):
        x = rng.normal(size=(batch, 8, 16, 16)).astype(np.float32)
        want = evaluate(original, {"x": x})[0]
        got = evaluate(g, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_levels(rng):
    level0 = resnet_block(rng)
    for n in level0.nodes:
        for v in n.outputs:
            v.type = None
    report = optimize(level0, level=0)
    assert len(level0.nodes) == 11 and all(v.type is not None for n in level0.nodes for v in n.outputs)
    assert list(report.passes) == ["infer_shapes"]
    level1 = resnet_block(rng)
    optimize(level1, level=1)
    assert ops(level1).count("BatchNormalization") == 2 and "Identity" not in ops(level1)
    assert [name for name, _ in pipeline(1)] == ["fold_constants", "inline_constant_branches", "simplify", "cse",
                                                 "dce"]
    assert [name for name, _ in pipeline(2)] == ["fold_constants", "inline_constant_branches", "simplify",
                                                 "fold_batchnorm", "cse", "dce"]
    with pytest.raises(ValueError, match="optimization level"):
        optimize(level1, level=7)


def test_report_table(rng):
    g = resnet_block(rng)
    report = optimize(g)
    text = str(report)
    for name in ("infer_shapes", "fold_constants", "simplify", "fold_batchnorm", "cse", "dce"):
        assert name in text
    assert "nodes 11 -> 5" in text and "fixed point" in text
    stats = report.passes["dce"]
    assert stats.runs == report.iterations and stats.changed >= 1 and stats.seconds >= 0


def test_custom_passes_by_name_or_pair(rng):
    g = resnet_block(rng)
    report = optimize(g, passes=["dce", ("prune", lambda graph: dce(graph, prune_inputs=True))])
    assert "BatchNormalization" in ops(g) and "ReduceMean" not in ops(g)
    assert list(report.passes) == ["infer_shapes", "dce", "prune"]
    with pytest.raises(ValueError, match="unknown pass 'nope'"):
        optimize(g, passes=["nope"])


def test_stops_after_max_iterations(rng):
    g = resnet_block(rng)
    report = optimize(g, max_iterations=1)
    assert report.iterations == 1 and not report.converged
    assert "stopped before a fixed point" in str(report)


def test_verify_each_names_the_pass(rng):
    def scramble(graph: Graph) -> bool:
        graph.nodes.reverse()
        return True

    with pytest.raises(VerifyError, match="after pass 'scramble'"):
        optimize(resnet_block(rng), passes=["dce", ("scramble", scramble)], verify_each=True)


def test_bodies_of_if_and_loop_are_optimized(rng):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3))
    cond = g.add_input("cond", "bool", ())
    c = g.add_initializer("c", rng.normal(size=3).astype(np.float32))
    ones = g.add_initializer("ones", np.ones(3, np.float32))
    body = g.subgraph("body")
    body.add_input("i", "int64", ())
    keep_going = body.add_input("cond_in", "bool", ())
    acc = body.add_input("acc", "float32", (2, 3))
    body.op("Neg", acc)  # dead
    step = body.op("Identity", body.op("Mul", body.op("Add", c, c), ones))  # constant
    body.outputs = [body.op("Identity", keep_going), body.op("Add", body.op("Mul", acc, ones), step)]
    looped = g.op("Loop", g.add_initializer("trips", np.array(3, np.int64)), None, x, body=body, outputs=1)
    then = g.subgraph("then")
    then.outputs = [then.op("Dropout", then.op("Relu", looped))]
    other = g.subgraph("else")
    other.outputs = [other.op("Neg", other.op("Identity", looped))]
    g.outputs = [g.op("If", cond, then_branch=then, else_branch=other, outputs=1)]
    verify(g)
    original = g.copy()
    optimize(g, verify_each=True)
    assert ops(g) == ["Loop", "If", "Identity", "Add", "Neg", "Relu"]  # else_branch walks first
    # The body's step is one folded constant; its cond output stays (bound by position).
    assert body.nodes[-1].inputs[1].const is not None
    for flag in (True, False):
        feeds = {"x": rng.normal(size=(2, 3)).astype(np.float32), "cond": np.array(flag)}
        np.testing.assert_allclose(evaluate(g, feeds)[0], evaluate(original, feeds)[0], rtol=1e-6)


def test_a_graph_the_pipeline_converged_on_is_not_optimized_again(rng, tmp_path, monkeypatch):
    """optimize() marks the graph it converged on (level, kiln version, a structural fingerprint, kept
    through save/load); optimizing it again, or kiln.load of the saved file, runs no pass. Any edit since
    clears the mark's match, so the passes run again."""
    import importlib

    import kiln
    pl = importlib.import_module("kiln.ir.passes.pipeline")  # the module (kiln.ir.passes.pipeline is also a function)
    g = resnet_block(rng)
    first = optimize(g)
    assert first.converged and first.iterations >= 1 and pl.is_optimized(g)
    again = optimize(g)
    assert again.converged and again.iterations == 0 and not pl.is_optimized(g, level=1)
    path = kiln.save(g, tmp_path / "m.kiln")
    loaded = kiln.load_graph(path)
    assert pl.is_optimized(loaded)
    ran = []
    monkeypatch.setattr(pl, "infer_shapes", lambda graph: ran.append(graph) or False)
    x = rng.standard_normal((1, 8, 16, 16)).astype(np.float32)
    want = evaluate(loaded, [x])
    got = kiln.load(path).run([x], as_list=True)
    assert not ran  # the load ran no pass
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    out = loaded.outputs[0]
    loaded.outputs = [loaded.op("Relu", out)]  # an edit: the mark no longer matches
    assert not pl.is_optimized(loaded) and optimize(loaded).iterations >= 1
