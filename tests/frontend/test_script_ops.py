"""The control-flow primitives behind kiln.script (frontend/script_ops.py), tested on hand-written
"rewritten" models: what the AST rewriter emits for `if`/`while`/`for`, traced with kiln.trace,
then run through the CPU runtime (and saved/loaded, exported to ONNX) against eager PyTorch."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
from kiln.errors import UnsupportedOpError  # noqa: E402
from kiln.frontend.script_ops import (UNDEFINED, ScriptError, kiln_and, kiln_assert,  # noqa: E402
                                      kiln_for_iter, kiln_for_range, kiln_if, kiln_not, kiln_while)


def run(graph, **inputs):
    out = kiln.load(graph).run({k: v.numpy() for k, v in inputs.items()})
    return list(out.values())


def ops(graph):
    return graph.op_counts()


# ---------------------------------------------------------------------------- if
class SignFlip(torch.nn.Module):
    """if x.sum() > 0: y = x * 2  else: y = x * -1"""

    def forward(self, x):
        (y,) = kiln_if(x.sum() > 0, lambda: (x * 2,), lambda: (x * -1,))
        return y


def test_if_on_tensor_data_keeps_both_branches():
    m = SignFlip()
    x = torch.rand(3, 4) + 0.1
    g = kiln.trace(m, (x,))  # the trace check runs -x too: it fails if only one branch is kept
    assert ops(g).get("If") == 1
    for inp in (x, -x, torch.randn(3, 4)):
        (got,) = run(g, x=inp)
        np.testing.assert_allclose(got, m(inp).numpy(), rtol=1e-6)


def test_if_eager_runs_python():
    x = torch.tensor([1.0, -3.0])
    assert torch.equal(SignFlip()(x), x * -1)
    assert kiln_if(True, lambda: ("a",), lambda: ("b",)) == ("a",)
    assert kiln_if(0, lambda: ("a",), lambda: ("b",)) == ("b",)


def test_if_on_python_or_constant_condition_records_no_if():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.flag = torch.nn.Parameter(torch.ones(()), requires_grad=False)

        def forward(self, x):
            (y,) = kiln_if(x.shape[0] == 3, lambda: (x + 1,), lambda: (x - 1,))
            (z,) = kiln_if(self.flag > 0, lambda: (y * 2,), lambda: (y * 3,))
            return z

    g = kiln.trace(M(), torch.randn(3, 2))
    assert "If" not in ops(g)
    x = torch.randn(3, 2)
    np.testing.assert_allclose(run(g, x=x)[0], ((x + 1) * 2).numpy(), rtol=1e-6)


def test_if_merges_unchanged_tensors_ints_and_bools():
    class M(torch.nn.Module):
        def forward(self, x):
            n, flag = 1, False
            y, n, flag, k = kiln_if(x.mean() > 0, lambda: (x + 1, n + 1, True, 7), lambda: (x, n, flag, 7))
            assert k == 7
            return y * n, x.new_ones(()) * kiln_not(flag)

    m = M()
    x = torch.rand(2, 3)
    g = kiln.trace(m, (x,), optimize=False)
    (node,) = [n for n in g.nodes if n.op == "If"]
    assert len(node.outputs) == 3  # y, n and flag; x and k are the same on both paths
    for inp in (x, -x):
        got = run(g, x=inp)
        want = m(inp)
        np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-6)
        assert bool(got[1]) == bool(want[1])


def test_if_with_nested_if_and_values_from_outside():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)

            def then():
                (z,) = kiln_if(h.max() > 1, lambda: (h * 10,), lambda: (h + x,))
                return (z,)

            (y,) = kiln_if(x.sum() > 0, then, lambda: (h - x,))
            return y

    m = M().eval()
    x = torch.rand(2, 4)
    g = kiln.trace(m, (x,))
    assert ops(g)["If"] == 2
    for inp in (x, -x, x * 0.01, x * 100):
        np.testing.assert_allclose(run(g, x=inp)[0], m(inp).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_if_branch_disagreements_are_script_errors():
    def trace(fn):
        class M(torch.nn.Module):
            def forward(self, x):
                return fn(x)[0]
        return kiln.trace(M(), torch.randn(3), check=False)

    with pytest.raises(ScriptError, match="dtypes must agree"):
        trace(lambda x: kiln_if(x.sum() > 0, lambda: (x,), lambda: (x.long(),)))
    with pytest.raises(ScriptError, match="make both tensors"):
        trace(lambda x: kiln_if(x.sum() > 0, lambda: (x + 1,), lambda: (2.0,)))
    with pytest.raises(ScriptError, match="differently shaped"):
        trace(lambda x: kiln_if(x.sum() > 0, lambda: (x, x), lambda: (x,)))
    with pytest.raises(ScriptError, match="same on both paths"):
        trace(lambda x: kiln_if(x.sum() > 0, lambda: (x, "a"), lambda: (x, "b")))


def test_if_name_assigned_in_one_branch_is_undefined_after():
    seen = []

    class M(torch.nn.Module):
        def forward(self, x):
            y, z = kiln_if(x.sum() > 0, lambda: (x + 1, x * 2), lambda: (x - 1, UNDEFINED))
            seen.append(z)
            return y

    kiln.trace(M(), torch.randn(3), check=False)
    assert seen == [UNDEFINED]  # traced: z is defined on one path only
    with pytest.raises(ScriptError, match="one branch only"):
        UNDEFINED + 1
    with pytest.raises(ScriptError, match="one branch only"):
        torch.add(torch.ones(1), UNDEFINED)


def test_in_place_write_to_outer_tensor_in_branch_is_refused():
    class M(torch.nn.Module):
        def forward(self, x):
            y = x * 1

            def then():
                y.add_(1)
                return (y,)

            (z,) = kiln_if(x.sum() > 0, then, lambda: (y,))
            return z

    with pytest.raises(UnsupportedOpError, match="written in place"):
        kiln.trace(M(), torch.rand(3), check=False)


# ---------------------------------------------------------------------------- for range
class TinyRNN(torch.nn.Module):
    """h = 0; for t in range(x.size(1)): h = tanh(Wx x[:, t] + Wh h)"""

    def __init__(self):
        super().__init__()
        self.wx = torch.nn.Linear(3, 5)
        self.wh = torch.nn.Linear(5, 5)

    def forward(self, x):
        h = torch.zeros(x.size(0), 5)
        (h,) = kiln_for_range(0, x.size(1), 1, lambda t, h: (torch.tanh(self.wx(x[:, t]) + self.wh(h)),), (h,))
        return h


def test_rnn_over_dynamic_sequence_is_one_loop():
    torch.manual_seed(0)
    m = TinyRNN().eval()
    g = kiln.trace(m, torch.randn(2, 4, 3), dynamic={"x": {1: "seq"}})
    assert ops(g)["Loop"] == 1 and ops(g).get("Tanh") == 1
    for length in (1, 2, 7):
        x = torch.randn(2, length, 3)
        np.testing.assert_allclose(run(g, x=x)[0], m(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_for_range_with_static_bounds_unrolls():
    m = TinyRNN().eval()
    g = kiln.trace(m, torch.randn(2, 3, 3))
    assert "Loop" not in ops(g) and ops(g)["Tanh"] == 3


def test_for_range_counter_compares_in_the_graph():
    """`if t % 2 == 0` style tests on the counter stay data dependent (TracedInt comparisons),
    with start/step other than 0/1 and an int carried along."""

    class M(torch.nn.Module):
        def forward(self, x):
            def body(t, acc, count):
                (acc,) = kiln_if(t >= 3, lambda: (acc + x[:, t],), lambda: (acc - x[:, t],))
                return acc, count + 1

            acc, count = kiln_for_range(1, x.size(1), 2, body, (torch.zeros(x.size(0)), 0))
            return acc * count

    m = M()
    g = kiln.trace(m, torch.randn(2, 6), dynamic={"x": {1: "n"}})
    assert ops(g)["Loop"] == 1 and ops(g)["If"] == 1
    for n in (1, 2, 3, 6, 9):
        x = torch.randn(2, n)
        np.testing.assert_allclose(run(g, x=x)[0], m(x).numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- while
class Halve(torch.nn.Module):
    """n = 0; while x.norm() >= 1: x = x / 2; n += 1"""

    def forward(self, x):
        x, n = kiln_while(lambda x, n: x.norm() >= 1, lambda x, n: (x / 2, n + 1), (x, 0))
        return x, x.new_zeros((), dtype=torch.int64) + n


def test_while_with_data_dependent_stop():
    m = Halve()
    g = kiln.trace(m, torch.randn(3, 4) * 10)
    assert ops(g)["Loop"] == 1
    for scale in (0.01, 3.0, 1000.0):
        x = torch.randn(3, 4) * scale
        got, want = run(g, x=x), m(x)
        np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-6)
        assert int(got[1]) == int(want[1])


def test_while_eager_and_python_condition_unrolls():
    x = torch.full((2,), 8.0)
    y, n = Halve()(x)
    assert n == 4 and float(y.norm()) < 1

    class Countdown(torch.nn.Module):
        def forward(self, x):
            x, i = kiln_while(lambda x, i: i > 0, lambda x, i: (x * 2, i - 1), (x, 3))
            return x

    g = kiln.trace(Countdown(), torch.randn(2))
    assert "Loop" not in ops(g)
    x = torch.randn(2)
    np.testing.assert_allclose(run(g, x=x)[0], (x * 8).numpy(), rtol=1e-6)


class Greedy(torch.nn.Module):
    """Greedy decoding: append the argmax token until `eos` or `max_new` tokens."""

    def __init__(self, eos=-1, max_new=6):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.out = torch.nn.Linear(8, 10)
        self.eos, self.max_new = eos, max_new

    def forward(self, ids):
        def cond(ids, done, i):
            return kiln_and(kiln_not(done), lambda: i < self.max_new)

        def body(ids, done, i):
            nxt = self.out(self.emb(ids).mean(1)).argmax(-1, keepdim=True)
            return torch.cat([ids, nxt], 1), (nxt == self.eos).all(), i + 1

        ids, done, i = kiln_while(cond, body, (ids, torch.tensor(False), 0))
        return ids


def test_greedy_decoding_with_growing_ids_and_early_stop():
    torch.manual_seed(1)
    m = Greedy().eval()
    prompts = [torch.randint(0, 10, (1, n), generator=torch.Generator().manual_seed(n)) for n in (1, 2, 3, 5)]
    m.eos = int(m(prompts[0])[0, 2])  # the 2nd generated token of one prompt: that one stops early
    g = kiln.trace(m, prompts[1], dynamic={"ids": {1: "n"}})
    assert ops(g)["Loop"] == 1
    lengths = set()
    for p in prompts:
        (got,) = run(g, ids=p)
        want = m(p).numpy()
        assert got.shape == want.shape and (got == want).all()
        lengths.add(want.shape[1] - p.shape[1])
    assert min(lengths) < m.max_new  # some prompt stopped at the end token


def test_loop_variable_changing_dtype_is_a_script_error():
    class M(torch.nn.Module):
        def forward(self, x):
            (x,) = kiln_while(lambda x: x.sum() > 1, lambda x: ((x / 2).long(),), (x,))
            return x

    with pytest.raises(ScriptError, match="keeps its dtype and rank"):
        kiln.trace(M(), torch.ones(3) * 4, check=False)


# ---------------------------------------------------------------------------- for iter, assert
def test_for_iter_over_modules_and_dynamic_tensor():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(2)])

        def forward(self, x):
            (x,) = kiln_for_iter(self.layers, lambda layer, x: (torch.relu(layer(x)),), (x,))
            (s,) = kiln_for_iter(x, lambda row, s: (s + row * row,), (torch.zeros(3),))
            return s

    m = M().eval()
    g = kiln.trace(m, torch.randn(4, 3), dynamic={"x": {0: "rows"}})
    assert ops(g)["Loop"] == 1 and ops(g)["Relu"] == 2
    for n in (1, 6):
        x = torch.randn(n, 3)
        np.testing.assert_allclose(run(g, x=x)[0], m(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_assert():
    kiln_assert(True, "fine")
    with pytest.raises(AssertionError, match="positive"):
        kiln_assert(torch.tensor(-1.0) > 0, "positive")

    class M(torch.nn.Module):
        def forward(self, x):
            kiln_assert(x.sum() > 0, "needs a positive sum")
            return x * 2

    with pytest.raises(AssertionError, match="positive sum"):
        kiln.trace(M(), -torch.rand(3), check=False)


def test_kiln_and_or_not_on_python_values_short_circuit():
    assert kiln_and(False, lambda: 1 / 0) is False
    assert kiln_and(True, lambda: 5) == 5
    assert kiln_not(0) is True
    t = torch.tensor(True)
    assert kiln_and(t, lambda: False) is False and bool(kiln_and(t, lambda: True))


# ---------------------------------------------------------------------------- formats
def test_save_load_round_trip(tmp_path):
    g = kiln.trace(TinyRNN().eval(), torch.randn(2, 4, 3), dynamic={"x": {1: "seq"}})
    kiln.save(g, tmp_path / "rnn.kiln")
    prog = kiln.load(tmp_path / "rnn.kiln")
    x = torch.randn(2, 5, 3)
    np.testing.assert_allclose(list(prog.run({"x": x.numpy()}).values())[0], run(g, x=x)[0], rtol=1e-6)

    g = kiln.trace(SignFlip(), torch.rand(3))
    kiln.save(g, tmp_path / "if.kiln")
    prog = kiln.load(tmp_path / "if.kiln")
    for x in (torch.rand(3), -torch.rand(3)):
        np.testing.assert_allclose(list(prog.run({"x": x.numpy()}).values())[0], SignFlip()(x).numpy())


@pytest.mark.parametrize("case", ["if", "rnn", "while"])
def test_onnx_export_runs_in_onnxruntime(tmp_path, case):
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    if case == "if":
        m, example, dyn, inputs = SignFlip(), torch.rand(3, 4), None, [torch.rand(3, 4), -torch.rand(3, 4)]
    elif case == "rnn":
        m, example, dyn = TinyRNN().eval(), torch.randn(2, 4, 3), {"x": {1: "seq"}}
        inputs = [torch.randn(2, 2, 3), torch.randn(2, 6, 3)]
    else:
        m, example, dyn, inputs = Halve(), torch.randn(3, 4) * 10, None, [torch.randn(3, 4) * s for s in (0.1, 50)]
    g = kiln.trace(m, example, dynamic=dyn)
    path = kiln.export_onnx(g, tmp_path / "m.onnx")
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for x in inputs:
        got = sess.run(None, {"x": x.numpy()})
        want = m(x)
        want = want if isinstance(want, tuple) else (want,)
        for gt, w in zip(got, want):
            np.testing.assert_allclose(gt, w.detach().numpy(), rtol=1e-5, atol=1e-6)
