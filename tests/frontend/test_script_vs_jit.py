"""kiln.script next to torch.jit.script (issue 9): the same small models through both, recording
which each accepts. The table is the actual behaviour of torch 2.13 and of kiln.script today; a
change on either side fails here and should update docs/SCRIPT.md. Where both accept, the
kiln graph is also checked against eager PyTorch.

Also here: size comparisons in scripted code (frontend/symbolic.py) become If/Loop conditions,
while a traced model keeps plain-int comparisons."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import kiln  # noqa: E402
from kiln.errors import ScriptError  # noqa: E402
from kiln.ir import evaluate  # noqa: E402

END = 7


class Sign(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x * -1

class Greedy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)
    def forward(self, ids):
        n = 0
        while n < 6:
            nxt = self.out(self.emb(ids).mean(1)).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            n = n + 1
            if (nxt == END).all():
                break
        return ids

class RNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.RNNCell(4, 6)
    def forward(self, x):
        h = torch.zeros(x.size(0), 6)
        for t in range(x.size(1)):
            h = self.cell(x[:, t], h)
        return h

class EarlyExit(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.deep = nn.Linear(8, 8)
    def forward(self, h):
        p = self.head(h).softmax(-1)
        if p.max() > 0.6:
            return p
        return self.head(torch.relu(self.deep(h))).softmax(-1)

def scale(x, k):
    return x * k

class Helper(nn.Module):
    def forward(self, x):
        return scale(x, 2.0) + 1

class Unpack(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, -1)
        lo, hi = (a, b) if True else (b, a)
        return lo * hi

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

class TryExcept(nn.Module):
    def forward(self, x):
        try:
            y = x * 2
        except RuntimeError:
            y = x
        return y

class ListAppend(nn.Module):
    def forward(self, x):
        outs = []
        for t in range(x.size(1)):
            outs.append(x[:, t] * t)
        return torch.stack(outs, 1)

class VarArgs(nn.Module):
    def forward(self, *xs):
        return xs[0] + xs[1]

class DictState(nn.Module):
    def forward(self, x):
        d = {"a": x, "b": x * 2}
        return d["a"] + d["b"]

class WhileSize(nn.Module):
    def forward(self, ids):
        while ids.size(1) < 8:
            ids = torch.cat([ids, ids[:, -1:] + 1], 1)
        return ids

class LinearRNN(nn.Module):
    """The RNN cell written out (kiln has no mapping for nn.RNNCell's fused op)."""

    def __init__(self):
        super().__init__()
        self.ih = nn.Linear(4, 6)
        self.hh = nn.Linear(6, 6)

    def forward(self, x):
        h = torch.zeros(x.size(0), 6)
        for t in range(x.size(1)):
            h = torch.tanh(self.ih(x[:, t]) + self.hh(h))
        return h


# name -> (model class, example inputs, dynamic dims, torch.jit.script accepts, kiln.script outcome).
# kiln outcome: a set of control-flow ops the graph must contain, or the exception it raises.
CASES = {
    "sign_if": (Sign, (torch.randn(3),), None, True, {"If"}),
    # END is a module global int: TorchScript cannot close over it.
    "greedy_while_break": (Greedy, (torch.tensor([[1, 2]]),), {"ids": {1: "s"}}, False, {"Loop", "If"}),
    "rnn_cell_over_range": (RNN, (torch.randn(2, 5, 4),), {"x": {1: "t"}}, True, {"Loop"}),
    "rnn_linear_over_range": (LinearRNN, (torch.randn(2, 5, 4),), {"x": {1: "t"}}, True, {"Loop"}),
    "early_exit_head": (EarlyExit, (torch.randn(1, 8),), None, True, {"If"}),
    # An unannotated helper: TorchScript types k as Tensor and rejects the call with a float.
    "helper_without_annotations": (Helper, (torch.randn(3),), None, False, set()),
    "tuple_unpacking": (Unpack, (torch.randn(2, 4),), None, True, set()),
    "for_over_modulelist": (Stack, (torch.randn(2, 4),), None, True, set()),
    "try_except": (TryExcept, (torch.randn(3),), None, False, ScriptError),
    # A Python list grown in a data-dependent loop: the trace freezes the example's length and
    # kiln.script's trace check catches it (not yet a ScriptError naming the line).
    "list_append_in_loop": (ListAppend, (torch.randn(2, 5),), {"x": {1: "t"}}, True, kiln.TraceCheckError),
    "varargs_forward": (VarArgs, (torch.randn(3), torch.randn(3)), None, False, set()),
    "dict_of_tensors": (DictState, (torch.randn(3),), None, True, set()),
    "while_on_growing_size": (WhileSize, (torch.zeros(1, 3, dtype=torch.long),), {"ids": {1: "n"}}, True, {"Loop"}),
}


def _jit_accepts(model: nn.Module) -> bool:
    try:
        torch.jit.script(model)
    except Exception:  # noqa: BLE001 - TorchScript raises several unrelated types
        return False
    return True


@pytest.mark.parametrize("name", list(CASES))
def test_torch_jit_script(name):
    cls, _, _, jit_ok, _ = CASES[name]
    torch.manual_seed(0)
    assert _jit_accepts(cls().eval()) is jit_ok


@pytest.mark.parametrize("name", list(CASES))
def test_kiln_script(name):
    cls, example, dynamic, _, outcome = CASES[name]
    torch.manual_seed(0)
    model = cls().eval()
    if isinstance(outcome, type):
        with pytest.raises(outcome), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kiln.script(model, example, dynamic=dynamic)
        return
    graph = kiln.script(model, example, dynamic=dynamic)
    assert {n.op for n in graph.nodes} & {"If", "Loop"} == outcome
    with torch.no_grad():
        want = model(*example)
    got = evaluate(graph, [x.numpy() for x in example])[0]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- comparisons of sizes
class SizeIf(nn.Module):
    def forward(self, x):
        if x.size(1) > 4:
            y = x * 2
        else:
            y = x - 1
        return y


def test_scripted_if_on_a_dynamic_size_is_an_if_node_right_at_both_lengths():
    graph = kiln.script(SizeIf(), (torch.randn(2, 6),), dynamic={"x": {1: "seq"}})
    assert "If" in {n.op for n in graph.nodes}
    for length in (3, 6):
        x = torch.randn(2, length)
        np.testing.assert_allclose(evaluate(graph, [x.numpy()])[0], SizeIf()(x).numpy(), rtol=1e-6)


def test_scripted_while_on_a_growing_size_runs_to_the_bound_from_any_length():
    graph = kiln.script(WhileSize(), (torch.zeros(1, 3, dtype=torch.long),), dynamic={"ids": {1: "n"}})
    for length in (1, 5, 8, 9):
        ids = torch.arange(length)[None]
        got = evaluate(graph, [ids.numpy()])[0]
        np.testing.assert_array_equal(got, WhileSize()(ids).numpy())
        assert got.shape[1] == max(length, 8)


def test_traced_model_guards_plain_int_size_comparisons():
    # kiln.trace (not script): the size comparison stays a Python bool and the graph is
    # specialized to the example's branch, with a TraceWarning and a guard that refuses sizes
    # taking the other branch.
    with pytest.warns(kiln.TraceWarning, match="a symbolic size compared with '>'"):
        graph = kiln.trace(SizeIf(), (torch.randn(2, 6),), dynamic={"x": {1: "seq"}}, check=False)
    ops = {n.op for n in graph.walk()}
    assert "If" not in ops and "Mul" in ops and "Guard" in ops
    x = torch.randn(2, 7)
    np.testing.assert_allclose(evaluate(graph, [x.numpy()])[0], SizeIf()(x).numpy(), rtol=1e-6)
    with pytest.raises(kiln.ExecutionError, match="kiln.Guard failed"):
        evaluate(graph, [torch.randn(2, 2).numpy()])
