"""kiln.script in the hybrid mode and recursively (issue 9): submodules of a scripted model are
scripted too; a module class, module or function marked with kiln.script (no example inputs)
keeps its data-dependent control flow when kiln.trace traces the whole model, and still runs
its original Python eagerly. Plus the RNN acceptance case end to end through kiln.script."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import kiln  # noqa: E402
from kiln.frontend.script import is_marked  # noqa: E402


def ops(graph) -> dict[str, int]:
    return graph.op_counts()  # subgraphs included


def run(graph_or_path, *xs):
    return kiln.load(graph_or_path).run([np.asarray(x) for x in xs], as_list=True)


# ---------------------------------------------------------------------------- the early-exit head
@kiln.script
class EarlyExitHead(nn.Module):
    """Classify; stop when confident, else refine with a second stage."""

    def __init__(self, features: int = 16, classes: int = 4, threshold: float = 0.9):
        super().__init__()
        self.first = nn.Linear(features, classes)
        self.second = nn.Sequential(nn.Linear(features + classes, 32), nn.ReLU(), nn.Linear(32, classes))
        self.threshold = threshold

    def forward(self, h):
        probs = torch.softmax(self.first(h), -1)
        if probs.max() > self.threshold:
            return probs
        return torch.softmax(self.second(torch.cat([h, probs], -1)), -1)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.proj = nn.Linear(32, 16)

    def forward(self, x):
        return self.proj(self.conv(x).flatten(1))


class Classifier(nn.Module):
    """Traced backbone + scripted head."""

    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.head = EarlyExitHead()

    def forward(self, x):
        return self.head(self.backbone(x))


def _classifier():
    torch.manual_seed(0)
    model = Classifier().eval()
    with torch.no_grad():  # a confident first stage for large inputs, an unsure one near zero
        model.head.first.weight.mul_(20)
    return model


def _both_paths(model):
    """An input taking the early exit and one running the second stage."""
    confident, unsure = None, None
    gen = torch.Generator().manual_seed(1)
    for scale in (10.0, 5.0, 3.0, 1.0, 0.1, 0.01, 0.001):
        x = torch.randn(1, 1, 6, 6, generator=gen) * scale
        with torch.no_grad():
            p = torch.softmax(model.head.first(model.backbone(x)), -1)
        if p.max() > 0.9 and confident is None:
            confident = x
        if p.max() <= 0.9 and unsure is None:
            unsure = x
    assert confident is not None and unsure is not None
    return confident, unsure


def test_marked_class_keeps_its_branch_inside_a_traced_model(tmp_path):
    model = _classifier()
    assert is_marked(EarlyExitHead) and is_marked(model.head) and not is_marked(model.backbone)
    confident, unsure = _both_paths(model)
    graph = kiln.trace(model, confident)  # traced on the early-exit path; the check also runs the other
    counts = ops(graph)
    assert counts.get("If") == 1 and counts.get("Conv", 0) >= 1
    program = kiln.load(kiln.save(graph, tmp_path / "hybrid.kiln"))
    outs = []
    for x in (confident, unsure):
        with torch.no_grad():
            want = model(x).numpy()
        got = program.run([x.numpy()], as_list=True)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        outs.append(want)
    # the two paths really differ: the second stage is not the first stage's answer
    with torch.no_grad():
        first = torch.softmax(model.head.first(model.backbone(unsure)), -1).numpy()
    assert not np.allclose(outs[1], first, atol=1e-3)


def test_plain_trace_of_an_unmarked_head_is_wrong_for_the_other_path():
    """Why marking matters: without it the trace keeps only the example's path."""

    class PlainHead(nn.Module):
        def __init__(self, marked):
            super().__init__()
            self.inner = marked

        def forward(self, h):
            return EarlyExitHead.forward.__kiln_script_original__(self.inner, h)

    model = _classifier()
    confident, unsure = _both_paths(model)
    plain = nn.Sequential(model.backbone, PlainHead(model.head)).eval()
    with pytest.warns(kiln.TraceWarning):
        graph = kiln.trace(plain, confident, check=False)
    assert "If" not in ops(graph) and "kiln.Guard" in ops(graph)
    # The graph refuses the other path (a kiln.Guard on the head's condition) ...
    with pytest.raises(kiln.ExecutionError, match=r"kiln.Guard failed at .*test_script_hybrid.py:\d+"):
        run(graph, unsure.numpy())
    # ... and answers wrong there with the guards off.
    with pytest.warns(kiln.TraceWarning):
        unguarded = kiln.trace(plain, confident, check=False, guards=False)
    with torch.no_grad():
        want = plain(unsure).numpy()
    assert not np.allclose(run(unguarded, unsure.numpy())[0], want, atol=1e-3)


def test_hybrid_model_exports_to_onnx_and_matches_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    model = _classifier()
    confident, unsure = _both_paths(model)
    graph = kiln.trace(model, unsure, dynamic_batch=False)
    path = kiln.export_onnx(graph, tmp_path / "hybrid.onnx")
    onnx.checker.check_model(str(path), full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for x in (confident, unsure):
        with torch.no_grad():
            want = model(x).numpy()
        got = session.run(None, {graph.inputs[0].name: x.numpy()})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_marked_parts_run_their_original_python_eagerly():
    calls = []

    class Probe(nn.Module):
        def forward(self, x):
            calls.append("eager")
            if x.sum() > 0:
                return x + 1
            return x - 1

    m = kiln.script(Probe())
    assert is_marked(m) and not is_marked(Probe) and isinstance(m, Probe)
    x = torch.ones(3)
    assert torch.equal(m(x), x + 1) and torch.equal(m(-x), -x - 1)
    assert calls == ["eager", "eager"]
    assert kiln.script(m) is m  # marking twice changes nothing
    assert set(m.state_dict()) == set(Probe().state_dict())


# ---------------------------------------------------------------------------- marked instance and function
@kiln.script
def clamp_sign(x):
    """A marked function: its branch survives kiln.trace of the caller."""
    if x.mean() > 0:
        y = x.clamp(max=1.0)
    else:
        y = -x
    return y


class UsesFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return clamp_sign(self.lin(x)) * 2


class Gate(nn.Module):
    def forward(self, x):
        n = 0
        while x.abs().max() > 1:  # halve until small: a data-dependent loop
            x = x / 2
            n = n + 1
        return x


class WithGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.lin(x))


def test_marked_function_inside_traced_model():
    torch.manual_seed(0)
    model = UsesFunction().eval()
    assert clamp_sign.__name__ == "clamp_sign" and is_marked(clamp_sign)
    graph = kiln.trace(model, torch.randn(2, 4))
    assert ops(graph).get("If") == 1
    for x in (torch.full((2, 4), 3.0), torch.full((2, 4), -3.0), torch.randn(2, 4)):
        with torch.no_grad():
            want = model(x).numpy()
        np.testing.assert_allclose(run(graph, x.numpy())[0], want, rtol=1e-5, atol=1e-6)


def test_marking_one_submodule_instance_keeps_its_loop():
    torch.manual_seed(0)
    model = WithGate().eval()
    kiln.script(model.gate)  # this instance only
    assert is_marked(model.gate) and not is_marked(Gate) and not is_marked(Gate())
    graph = kiln.trace(model, torch.randn(2, 4))
    assert ops(graph).get("Loop") == 1
    for scale in (0.1, 10.0, 1000.0):
        x = torch.randn(2, 4) * scale
        with torch.no_grad():
            want = model(x).numpy()
        np.testing.assert_allclose(run(graph, x.numpy())[0], want, rtol=1e-5, atol=1e-6)


def test_marking_torch_modules_or_other_objects_is_an_error():
    with pytest.raises(kiln.ScriptError, match="torch.nn module"):
        kiln.script(nn.Linear(2, 2))
    with pytest.raises(kiln.ScriptError, match="torch.nn module"):
        kiln.script(nn.ReLU)
    with pytest.raises(kiln.ScriptError, match="got int"):
        kiln.script(3)
    with pytest.raises(kiln.ScriptError, match="marks"):
        kiln.script(Gate(), dynamic_batch=True)


# ---------------------------------------------------------------------------- recursive scripting
class Block(nn.Module):
    """A user submodule with data-dependent control flow of its own."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            y = torch.relu(y)
        else:
            y = -y
        return y


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), nn.Tanh(), Block())  # user blocks inside a torch container
        self.shared = self.blocks[0]

    def forward(self, x):
        return self.blocks(x) + self.shared(x)


def test_submodules_are_scripted_recursively_and_the_model_is_unchanged():
    torch.manual_seed(0)
    model = Stack().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph = kiln.script(model, torch.randn(2, 4))
    assert ops(graph).get("If") == 3  # two blocks in the Sequential, and the shared one called again
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        x = torch.randn(2, 4, generator=gen) * 3
        with torch.no_grad():
            want = model(x).numpy()
        np.testing.assert_allclose(run(graph, x.numpy())[0], want, rtol=1e-5, atol=1e-6)
    # the user's model is untouched: same submodule objects, no instance attributes added
    assert type(model.blocks[0]) is Block and model.shared is model.blocks[0]
    assert "forward" not in model.blocks[0].__dict__ and "forward" not in model.__dict__
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_scripting_a_model_with_a_marked_submodule():
    torch.manual_seed(0)
    model = _classifier()
    confident, unsure = _both_paths(model)
    graph = kiln.script(model, confident)
    assert ops(graph).get("If") == 1
    for x in (confident, unsure):
        with torch.no_grad():
            want = model(x).numpy()
        np.testing.assert_allclose(run(graph, x.numpy())[0], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- RNN acceptance
class ElmanRNN(nn.Module):
    """An RNN cell unrolled over the sequence: the length is known only at run time."""

    def __init__(self):
        super().__init__()
        self.wx = nn.Linear(3, 5)
        self.wh = nn.Linear(5, 5)

    def forward(self, x):
        h = torch.zeros(x.size(0), 5)
        for t in range(x.size(1)):
            h = torch.tanh(self.wx(x[:, t]) + self.wh(h))
        return h


def test_rnn_over_a_dynamic_sequence_scripted_end_to_end(tmp_path):
    torch.manual_seed(0)
    model = ElmanRNN().eval()
    graph = kiln.script(model, torch.randn(2, 4, 3), dynamic={"x": {1: "seq"}})
    assert ops(graph).get("Loop") == 1
    program = kiln.load(kiln.save(graph, tmp_path / "rnn.kiln"))
    for length in (3, 9):
        x = torch.randn(2, length, 3)
        with torch.no_grad():
            want = model(x).numpy()
        np.testing.assert_allclose(program.run([x.numpy()], as_list=True)[0], want, rtol=1e-5, atol=1e-6)
    # tracing the same model unrolls the example's length instead
    traced = kiln.trace(model, torch.randn(2, 4, 3), dynamic={"x": {1: "seq"}}, check=False)
    assert "Loop" not in ops(traced)
