"""`assert` on tensor data in scripted code is a run-time check: a kiln.Assert node that fails the
run with the assert's message and source line, survives the optimizer and .kiln files, and is
dropped (with a warning) by the ONNX exporter. Asserts on Python values stay plain asserts."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
from kiln.ir.ops.assertion import AssertionFailed  # noqa: E402


def needs_positive(x):
    y = x * 2
    assert x.sum() > 0, "need positive"
    return y + 1


def checks_in_a_branch(x):
    if x.sum() > 0:
        assert x.max() < 100, "too big"
        y = x * 2
    else:
        y = -x
    return y


def static_check(x):
    assert x.shape[0] == 3, "three rows"
    return x + 1


def asserts(graph):
    return [n for n in graph.walk() if n.domain == "kiln" and n.op == "Assert"]


def scripted_needs_positive():
    # The trace check also runs the negated example, which the eager function rejects with its
    # assert: the graph's Assert rejecting it too counts as agreement.
    return kiln.script(needs_positive, (torch.rand(4) + 0.1,))


def line_of(fn, text):
    import inspect
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, s in enumerate(lines) if text in s)


def test_the_graph_checks_every_run():
    g = scripted_needs_positive()
    (node,) = asserts(g)  # kept by the optimizer although nothing reads it
    p = kiln.load(g)
    x = torch.rand(4) + 0.1
    np.testing.assert_allclose(p.run([x.numpy()], as_list=True)[0], needs_positive(x).numpy(), rtol=1e-6)
    with pytest.raises(AssertionFailed) as info:
        p.run([-x.numpy()])
    msg = str(info.value)
    assert "need positive" in msg
    assert f"test_script_assert.py:{line_of(needs_positive, 'assert')}" in msg
    assert 'assert x.sum() > 0, "need positive"' in msg
    with pytest.raises(AssertionError, match="need positive"):  # what the eager function raises
        needs_positive(-x)


def test_save_load_keeps_the_check(tmp_path):
    path = str(tmp_path / "positive.kiln")
    kiln.save(scripted_needs_positive(), path)
    p = kiln.load(path)
    assert len(asserts(p.graph)) == 1
    p.run([np.ones(4, np.float32)])
    with pytest.raises(AssertionFailed, match="need positive"):
        p.run([-np.ones(4, np.float32)])


def test_onnx_export_is_valid_without_the_check(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    path = str(tmp_path / "positive.onnx")
    kiln.export_onnx(scripted_needs_positive(), path)
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert all(n.op_type != "Assert" for n in model.graph.node)
    x = -torch.ones(4)
    (got,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(got, (x * 2 + 1).numpy())


def test_an_example_that_fails_the_check_fails_scripting():
    with pytest.raises(AssertionError, match="need positive"):
        kiln.script(needs_positive, (-torch.rand(4) - 0.1,), check=False)


def test_a_check_in_a_branch_runs_only_when_the_branch_does():
    # Scripted on a negative example: the then branch (with its assert) is traced on values that
    # the eager function never checks there; scripting must not fail, and the trace check passes.
    g = kiln.script(checks_in_a_branch, (-torch.rand(3) - 1,))
    assert len(asserts(g)) == 1 and sum(n.op == "If" for n in g.nodes) == 1
    p = kiln.load(g)
    big_negative = torch.full((3,), -500.0)
    np.testing.assert_allclose(p.run([big_negative.numpy()], as_list=True)[0], 500.0)
    np.testing.assert_allclose(p.run([np.ones(3, np.float32)], as_list=True)[0], 2.0)
    with pytest.raises(AssertionFailed, match="too big"):
        p.run([np.full(3, 500, np.float32)])


def test_an_assert_on_a_static_shape_stays_a_python_assert():
    g = kiln.script(static_check, (torch.rand(3, 2),))
    assert asserts(g) == []
    with pytest.raises(AssertionError, match="three rows"):
        kiln.script(static_check, (torch.rand(2, 2),))
