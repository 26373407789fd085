"""The tracer's core: inputs/outputs/names, parameters as initializers, scopes, symbolic sizes,
warnings for data-dependent Python values, checks, and unsupported ops."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
from kiln import TraceCheckError, TraceWarning, UnsupportedOpError  # noqa: E402
from kiln.ir import evaluate, verify  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.drop(self.fc1(x)).relu()
        return self.fc2(h.view(h.size(0), -1))


def test_names_params_and_scopes():
    g = kiln.trace(MLP().eval(), torch.randn(2, 4), optimize=False)
    verify(g)
    assert [v.name for v in g.inputs] == ["x"] and [v.name for v in g.outputs] == ["output"]
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} <= set(g.initializers)
    scopes = {n.meta.get("scope") for n in g.nodes}
    assert {"fc1", "fc2"} <= scopes
    assert all(n.meta.get("source") for n in g.nodes)


def test_dynamic_batch_runs_at_other_sizes():
    m = MLP().eval()
    g = kiln.trace(m, torch.randn(2, 4), dynamic_batch=True)
    assert g.inputs[0].type.shape == ("batch", 4)
    for b in (1, 5):
        x = torch.randn(b, 4)
        (got,) = evaluate(g, {"x": x.numpy()})
        np.testing.assert_allclose(got, m(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_dict_and_tuple_outputs_keep_names():
    class Two(torch.nn.Module):
        def forward(self, x, y):
            return {"sum": x + y, "prod": x * y}

    g = kiln.trace(Two(), (torch.randn(3), torch.randn(3)))
    assert [v.name for v in g.inputs] == ["x", "y"] and [v.name for v in g.outputs] == ["sum", "prod"]

    def pair(a):
        return a + 1, a * 2

    g = kiln.trace(pair, torch.randn(3))
    assert [v.name for v in g.outputs] == ["output_0", "output_1"]


def test_training_mode_warns_and_traces_in_eval():
    m = MLP()
    with pytest.warns(TraceWarning, match="training mode"):
        kiln.trace(m, torch.randn(2, 4))
    assert not m.training


def test_data_dependent_branch_warns_and_check_catches_it():
    def branchy(x):
        if x.sum() > 0:
            return x * 2
        return -x

    x = torch.ones(4)
    # With guards (the default) the graph refuses the inputs that take the other branch ...
    with pytest.warns(TraceWarning, match=r"Tensor.__bool__' reads a Python value"):
        with pytest.raises(TraceCheckError, match=r"refuses .*kiln.Guard failed at .*test_tracer_core.py:\d+ "
                                                  r"`if x.sum\(\) > 0:`.*gave True while the model was traced; this input gives False"):
            kiln.trace(branchy, x)
    # ... without them it answers wrong for them, which the check finds by comparing outputs.
    with pytest.warns(TraceWarning, match="guards are off"):
        with pytest.raises(TraceCheckError, match="disagrees with the model"):
            kiln.trace(branchy, x, guards=False)


def test_unsupported_op_names_op_scope_and_line():
    class Odd(torch.nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x)

    with pytest.raises(UnsupportedOpError, match=r"<model> \(.*test_tracer_core.py:\d+\): op 'torch.*bessel_j0' "
                                                 r"is not supported.*kiln/frontend/torch_ops/"):
        kiln.trace(Odd(), torch.randn(3))


def test_bad_example_inputs_are_explained():
    with pytest.raises(kiln.KilnError, match="not parameters of"):
        kiln.trace(MLP(), {"y": torch.randn(2, 4)})
    with pytest.raises(kiln.KilnError, match="must be a torch.Tensor"):
        kiln.trace(MLP(), (3,))
    with pytest.raises(kiln.KilnError, match="not an input"):
        kiln.trace(MLP(), torch.randn(2, 4), dynamic={"z": {0: "batch"}})


def test_in_place_write_through_an_indexed_view_reaches_its_base():
    def through_view(x):
        y = x * 1
        row = y[0]
        row.add_(1)  # writes into y's memory too
        return y

    g = kiln.trace(through_view, torch.randn(3, 4))
    x = np.random.rand(3, 4).astype(np.float32)
    (got,) = evaluate(g, {"x": x})
    np.testing.assert_allclose(got, through_view(torch.from_numpy(x)).numpy())


def test_in_place_write_through_other_views_is_refused_not_wrong():
    def through_view(x):
        y = x * 1
        row = y.narrow(0, 0, 1)  # a view kiln does not follow back to its base
        row.add_(1)
        return y

    with pytest.raises(UnsupportedOpError, match="written in place by 'Tensor.add_'"):
        kiln.trace(through_view, torch.randn(3, 4))


def test_in_place_on_a_fresh_tensor_is_fine():
    def fresh(x):
        y = x * 2
        y += 1
        return torch.relu_(y)

    g = kiln.trace(fresh, torch.randn(3, 4))
    (got,) = evaluate(g, {"x": np.ones((3, 4), np.float32)})
    np.testing.assert_allclose(got, np.full((3, 4), 3.0))


def test_python_composites_trace_without_the_public_redispatch_function(monkeypatch):
    # Some releases have only the C hook behind torch.overrides.redispatch_function, older ones
    # neither: the tracer then passes the function's own has_torch_function guard (frontend/compat.py;
    # tests/frontend/test_torch_versions.py runs every model there both ways).
    monkeypatch.delattr(torch.overrides, "redispatch_function", raising=False)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = layer(x).numpy()
    graph = kiln.trace(layer, (x,))
    np.testing.assert_allclose(kiln.evaluate(graph, [x.numpy()])[0], want, rtol=1e-5, atol=1e-5)
    monkeypatch.delattr(torch._C, "_skip_one_hop_torch_function", raising=False)
    graph = kiln.trace(layer, (x,))
    np.testing.assert_allclose(kiln.evaluate(graph, [x.numpy()])[0], want, rtol=1e-5, atol=1e-5)


def test_dict_inputs_that_skip_a_parameter_bind_by_name():
    """transformers' GPT-2: forward(input_ids, past_key_values=None, attention_mask=None, ...)."""
    class Skips(torch.nn.Module):
        def forward(self, input_ids, past=None, attention_mask=None):
            assert past is None
            return input_ids * attention_mask

    g = kiln.trace(Skips(), {"input_ids": torch.randn(2, 3), "attention_mask": torch.randn(2, 3)})
    assert [v.name for v in g.inputs] == ["input_ids", "attention_mask"]
    a, b = np.random.rand(2, 3).astype(np.float32), np.random.rand(2, 3).astype(np.float32)
    (got,) = evaluate(g, {"input_ids": a, "attention_mask": b})
    np.testing.assert_allclose(got, a * b, rtol=1e-6)


def test_jit_style_rounding_of_sizes():
    """transformers' MobileViT under is_tracing(): torch.ceil(size / patch) on Python numbers."""
    def f(x):
        if torch.jit.is_tracing():
            h = int(torch.ceil(x.shape[-1] / 4) * 4)
        else:
            h = int(math.ceil(x.shape[-1] / 4) * 4)
        return torch.nn.functional.pad(x, (0, h - x.shape[-1]))

    g = kiln.trace(f, torch.randn(2, 10))
    (got,) = evaluate(g, {"x": np.ones((2, 10), np.float32)})
    assert got.shape == (2, 12)
    assert torch.ceil(torch.tensor(2.5)).item() == 3.0 and not torch.jit.is_tracing()  # restored after


def test_library_frames_are_told_apart_by_path_components():
    """Issue 24: torchvision's files (.../site-packages/torchvision/...) share the string prefix of torch's folder
    (.../site-packages/torch); a prefix test skipped them as torch's, so errors named the caller's line instead of
    the torchvision line that failed. Folders are compared by path components now."""
    import os

    from kiln.frontend import tracer
    torch_dir = tracer._TORCH_DIR
    vision = os.path.join(os.path.dirname(torch_dir), os.path.basename(torch_dir) + "vision", "models", "resnet.py")
    assert not tracer.inside(vision, torch_dir)
    assert not tracer._library_frame(vision)
    assert tracer._library_frame(os.path.join(torch_dir, "nn", "functional.py"))
    assert tracer.inside(torch_dir, torch_dir)
    assert not tracer.inside(tracer._FRONTEND_DIR + "_helpers.py", tracer._FRONTEND_DIR)
    assert tracer._library_frame(os.path.join(tracer._FRONTEND_DIR, "tracer.py"))
