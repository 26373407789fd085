"""Guards: every Python value a trace reads from input-dependent tensor data is checked at run time.

A traced graph either answers right or refuses with kiln.ExecutionError naming the source line,
the value at export and the value now (kiln/ir/ops/guard.py). These tests pin each read the
tracer guards, reads that need no guard, the passes that decide or merge guards, every runtime
that runs them (the reference evaluator, the CPU program through a saved file, the mobile stub;
the CUDA program in tests/runtime/test_cuda_guards.py), `kiln inspect`, the ONNX export, and
`guards=False`.
"""
from __future__ import annotations

import logging
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import kiln  # noqa: E402
from kiln.checks import GuardFailed  # noqa: E402
from kiln.ir import evaluate  # noqa: E402
from kiln.ir.passes import optimize  # noqa: E402


def _trace(fn, inputs, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kiln.TraceWarning)
        return kiln.trace(fn, inputs, check=False, **kw)


def _guards(graph) -> list:
    return [n for n in graph.walk() if n.domain == "kiln" and n.op == "Guard"]


def _run(graph, *xs):
    return evaluate(graph, [np.asarray(x) for x in xs])


# ---------------------------------------------------------------------------- each read is guarded
def _bool_read(x):
    return x * 2 if bool(x.sum() > 0) else -x


def _item_int(ids):
    return ids * ids.max().item()


def _item_float(x):
    return x / x.abs().max().item()


def _int_read(n):
    return torch.zeros(int(n.sum())) + 1


def _float_read(x):
    return x * float(x.mean())


def _tolist_read(x):
    a, b = x.tolist()
    return torch.tensor([a + b])


def _numpy_read(x):
    return torch.from_numpy(x.numpy() * 3)


def _index_read(x, i):
    return x[[0, 1, 2][i]]


def _contains_read(x):
    return x + 1 if 3 in x else x - 1


def _equal_read(a, b):
    return a if torch.equal(a, b) else b


def _allclose_read(a, b):
    return a + b if torch.allclose(a, b, atol=0.1) else a - b


READS = {
    # name: (fn, example, a passing input, a refused input, what the message names)
    "bool": (_bool_read, (torch.ones(3),), (torch.full((3,), 2.0),), (-torch.ones(3),), "bool(tensor)"),
    "item int": (_item_int, (torch.tensor([1, 4, 2]),), (torch.tensor([0, 4, 4]),), (torch.tensor([1, 5, 2]),),
                 "tensor.item()"),
    "item float": (_item_float, (torch.tensor([1.0, -2.0]),), (torch.tensor([2.0, 1.0]),),
                   (torch.tensor([1.0, 3.0]),), "tensor.item()"),
    "int": (_int_read, (torch.tensor([1, 2]),), (torch.tensor([0, 3]),), (torch.tensor([2, 2]),), "int(tensor)"),
    "float": (_float_read, (torch.tensor([1.0, 3.0]),), (torch.tensor([3.0, 1.0]),), (torch.tensor([1.0, 1.0]),),
              "float(tensor)"),
    "tolist": (_tolist_read, (torch.tensor([1.0, 2.0]),), (torch.tensor([1.0, 2.0]),), (torch.tensor([2.0, 2.0]),),
               "tensor.tolist()"),
    "numpy": (_numpy_read, (torch.tensor([1.0, 2.0]),), (torch.tensor([1.0, 2.0]),), (torch.tensor([0.0, 2.0]),),
              "tensor.numpy()"),
    "index": (_index_read, (torch.randn(3, 2), torch.tensor(1)), (torch.randn(3, 2), torch.tensor(1)),
              (torch.randn(3, 2), torch.tensor(2)), "a tensor used as an index"),
    "contains": (_contains_read, (torch.tensor([1, 3]),), (torch.tensor([3, 5]),), (torch.tensor([1, 2]),),
                 "'element in tensor'"),
    "equal": (_equal_read, (torch.ones(2), torch.ones(2)), (torch.zeros(2), torch.zeros(2)),
              (torch.ones(2), torch.zeros(2)), "torch.equal"),
    "allclose": (_allclose_read, (torch.ones(2), torch.ones(2)), (torch.ones(2), torch.ones(2) + 0.05),
                 (torch.ones(2), torch.zeros(2)), "allclose"),
}


@pytest.mark.parametrize("name", list(READS))
def test_each_read_is_guarded_and_refuses_other_values(name):
    fn, example, same, other, what = READS[name]
    with pytest.warns(kiln.TraceWarning, match="reads a Python value from tensor data.*kiln.Guard"):
        graph = kiln.trace(fn, example, check=False)
    assert _guards(graph), "no guard was emitted"
    # An input that reads the same value runs and matches torch.
    got = _run(graph, *[x.numpy() for x in same])
    want = fn(*same)
    np.testing.assert_allclose(got[0], want.numpy(), rtol=1e-6)
    # One that reads another value is refused, naming the line, the construct and both values.
    with pytest.raises(kiln.ExecutionError, match=rf"kiln.Guard failed at .*test_guards.py:\d+ .*{re.escape(what)}") as err:
        _run(graph, *[x.numpy() for x in other])
    assert isinstance(err.value, GuardFailed)
    assert "while the model was traced" in str(err.value) and "this input gives" in str(err.value)


def test_guard_message_gives_values_and_advice():
    graph = _trace(_item_int, (torch.tensor([1, 4, 2]),))
    with pytest.raises(GuardFailed) as err:
        _run(graph, np.array([1, 9, 2]))
    msg = str(err.value)
    assert "`return ids * ids.max().item()`" in msg
    assert "gave 4 while the model was traced; this input gives 9" in msg
    for advice in ("representative", "@kiln.script", "--input NAME:SHAPE:DTYPE:LOW:HIGH"):
        assert advice in msg or advice.replace("representative", "represent") in msg


def test_float_reads_tolerate_rounding_but_not_other_values():
    graph = _trace(_float_read, (torch.tensor([1.0, 3.0]),))
    # The same mean computed in another order is accepted; a different mean is not.
    _run(graph, np.array([3.0, 1.0], np.float32))
    with pytest.raises(GuardFailed):
        _run(graph, np.array([1.0, 3.001], np.float32))


# ---------------------------------------------------------------------------- reads that need no guard
def test_reads_of_constants_and_static_shapes_are_not_guarded():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if self.lin.weight.sum() > -100:      # a parameter: the same on every run
                x = self.lin(x)
            if x.size(1) == 4:                    # a static dim
                x = x * 2
            return x + len(x)                     # a static dim 0

    with warnings.catch_warnings():
        warnings.simplefilter("error", kiln.TraceWarning)
        graph = kiln.trace(M().eval(), (torch.randn(2, 4),))
    assert not _guards(graph)


def test_symbolic_size_compared_in_python_is_guarded():
    def fn(x):
        return x * 2 if x.size(0) > 2 else x - 1

    with pytest.warns(kiln.TraceWarning, match="a symbolic size compared with '>'"):
        graph = kiln.trace(fn, (torch.randn(4, 3),), dynamic_batch=True, check=False)
    np.testing.assert_allclose(_run(graph, np.ones((5, 3), np.float32))[0], 2 * np.ones((5, 3)))
    with pytest.raises(GuardFailed, match=r"symbolic size compared with '>' gave True while the model was traced; this input gives False"):
        _run(graph, np.ones((2, 3), np.float32))


def test_len_of_symbolic_dim_is_guarded():
    def fn(x):
        return x * len(x)

    graph = _trace(fn, (torch.randn(3, 2),), dynamic_batch=True)
    _run(graph, np.ones((3, 2), np.float32))
    with pytest.raises(GuardFailed, match=r"len\(tensor\)"):
        _run(graph, np.ones((4, 2), np.float32))


def test_torch_internal_size_checks_are_guarded_silently():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", kiln.TraceWarning)
        graph = kiln.trace(layer, (torch.randn(2, 5, 8),), dynamic={"src": {0: "batch", 1: "seq"}})
    x = torch.randn(3, 7, 8)
    np.testing.assert_allclose(_run(graph, x.numpy())[0], layer(x).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_iterating_a_tensor_is_traced_not_read():
    def fn(x):
        return sum(row * i for i, row in enumerate(x))

    graph = _trace(fn, (torch.randn(3, 2),))
    assert not _guards(graph)
    x = torch.randn(3, 2)
    np.testing.assert_allclose(_run(graph, x.numpy())[0], fn(x).numpy(), rtol=1e-6)


# ---------------------------------------------------------------------------- options and passes
def test_guards_off_gives_the_old_silent_graph():
    with pytest.warns(kiln.TraceWarning, match="guards are off"):
        graph = kiln.trace(_bool_read, (torch.ones(3),), check=False, guards=False)
    assert not _guards(graph)
    np.testing.assert_allclose(_run(graph, -np.ones(3, np.float32))[0], -2 * np.ones(3))  # wrong, by request


def test_repeated_reads_share_one_guard_and_constant_guards_go():
    def fn(x):
        a = x * 2 if x.sum() > 0 else x
        b = a + 1 if x.sum() > 0 else a  # the same read again
        return b

    graph = _trace(fn, (torch.ones(3),))
    optimize(graph)
    kiln.verify(graph)
    assert len(_guards(graph)) == 1
    # A guard whose input became a constant (the read was of something foldable) is decided at
    # optimize time: it held when traced, so it goes.
    from kiln.ir import Graph
    g = Graph("c")
    x = g.add_input("x", "float32", (2,))
    c = g.add_constant(np.array(True))
    g.add_node("Guard", [c], {"expected": np.array(True), "read": "bool"}, domain="kiln", num_outputs=0)
    g.outputs = [g.op("Relu", x)]
    optimize(g)
    assert not _guards(g)


def test_guard_survives_save_and_load_and_is_listed_by_inspect(tmp_path, capsys):
    graph = _trace(_bool_read, (torch.ones(3),))
    path = tmp_path / "m.kiln"
    kiln.save(graph, path)
    program = kiln.load(path)
    np.testing.assert_allclose(program.run([np.full(3, 2.0, np.float32)], as_list=True)[0], np.full(3, 4.0))
    with pytest.raises(kiln.ExecutionError, match="kiln.Guard failed at .*test_guards.py"):
        program.run([-np.ones(3, np.float32)])
    from kiln.serializer.inspect import format_summary, read_summary
    s = read_summary(path)
    assert len(s["guards"]) == 1
    g = s["guards"][0]
    assert "test_guards.py" in g["location"] and g["what"] == "bool(tensor)" and g["expected"] == "True"
    assert "bool(x.sum() > 0)" in g["code"]
    text = format_summary(s)
    assert "guards (1:" in text and "bool(tensor) must be True" in text


def test_onnx_export_drops_guards_with_a_warning(tmp_path, caplog):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    graph = _trace(_bool_read, (torch.ones(3),))
    with caplog.at_level(logging.WARNING):
        kiln.export_onnx(graph, tmp_path / "m.onnx")
    assert any("dropping the guard" in r.message and "test_guards.py" in r.message for r in caplog.records)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"))
    out = sess.run(None, {sess.get_inputs()[0].name: np.full(3, 2.0, np.float32)})[0]
    np.testing.assert_allclose(out, np.full(3, 4.0))


def test_mobile_stub_runs_guards(tmp_path):
    from kiln.mobile_stub.pack import pack_file
    from kiln.mobile_stub.runtime import load as load_stub

    def scale_by_first(x):  # ops the mobile op set has (Gather, Mul, Relu)
        return torch.relu(x) * float(x[0] * 2)

    graph = _trace(scale_by_first, (torch.tensor([2.0, 1.0, 3.0]),))
    src, dst = tmp_path / "m.kiln", tmp_path / "m.mobile.kiln"
    kiln.save(graph, src)
    pack_file(src, dst)
    stub = load_stub(str(dst))
    np.testing.assert_allclose(stub.run(np.array([2.0, -1.0, 1.0], np.float32))[0], [8.0, 0.0, 4.0])
    with pytest.raises(kiln.ExecutionError, match="kiln.Guard failed at .*test_guards.py.*gave 4.0 while the model was traced; this input gives 6.0"):
        stub.run(np.array([3.0, 1.0, 1.0], np.float32))


def test_cli_export_no_guards_and_summary(tmp_path):
    from cli_helpers import run_cli  # kiln's CLI in this process (no torch import a call)

    src = tmp_path / "m.py"
    src.write_text("import torch\n"
                   "class M(torch.nn.Module):\n"
                   "    def forward(self, x, mask):\n"
                   "        if mask.all():\n"
                   "            return x * 2\n"
                   "        return x * mask\n")
    base = ["export", f"{src}:M", "--input", "x:2x4", "--input", "mask:2x4:int64:1:2"]
    # The user range keeps the check on all-ones masks: the export passes, and says which guard
    # the file carries.
    out = run_cli(*base, "-o", tmp_path / "a.kiln")
    assert out.returncode == 0, out.stderr
    assert "guards      1:" in out.stdout and "m.py:4" in out.stdout
    out = run_cli(*base, "-o", tmp_path / "b.kiln", "--no-guards")
    assert out.returncode == 0, out.stderr
    assert "guards are off" in out.stderr and "guards      " not in out.stdout
    # Without the range the check draws 0/1 masks and refuses at export.
    out = run_cli("export", f"{src}:M", "--input", "x:2x4", "--input", "mask:2x4:int64:0:2", "-o",
                  tmp_path / "c.kiln")
    assert out.returncode == 0, out.stderr  # a random 0/1 example takes the mask path: nothing is read


# ---------------------------------------------------------------------------- the cases 1 and 2
class _MaskShortcut(nn.Module):
    """What transformers' masking_utils did for SDPA: an all-ones padding mask is dropped."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        if attention_mask.all():
            return h.mean(1)
        m = attention_mask[..., None].to(h.dtype)
        return (h * m).sum(1) / m.sum(1)


def test_case1_all_ones_mask_is_caught_at_export():
    ids = torch.randint(0, 50, (2, 6))
    ones = torch.ones(2, 6, dtype=torch.int64)
    with pytest.raises(kiln.TraceCheckError, match=r"refuses .*attention_mask.all\(\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kiln.TraceWarning)
            kiln.trace(_MaskShortcut().eval(), (ids, ones))
    # Traced without the check, the graph refuses a padded mask instead of ignoring it.
    graph = _trace(_MaskShortcut().eval(), (ids, ones))
    padded = ones.clone()
    padded[0, 4:] = 0
    with pytest.raises(GuardFailed):
        _run(graph, ids.numpy(), padded.numpy())


def test_case1_transformers_bert_keeps_the_mask():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 100, (1, 16))
    ones = torch.ones(1, 16, dtype=torch.int64)

    class Wrap(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    wrapped = Wrap(model).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = kiln.trace(wrapped, (ids, ones))
    padded = ones.clone()
    padded[0, 10:] = 0
    want = wrapped(ids, padded).detach().numpy()
    try:
        got = _run(graph, ids.numpy(), padded.numpy())[0]
    except GuardFailed:
        return  # refusing is fine; answering wrong is not
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, f"the graph ignores the padding mask (relative error {err:.2g})"


class _Collatz(nn.Module):
    def forward(self, n):
        steps = torch.zeros((), dtype=torch.int64)
        while bool(n > 1):
            if int(n) % 2 == 0:
                n = n // 2
            else:
                n = 3 * n + 1
            steps = steps + 1
        return steps


def test_case2_script_keeps_bool_int_float_item_conditions_as_control_flow():
    graph = kiln.script(_Collatz(), (torch.tensor(6),))
    assert {"Loop", "If"} <= {n.op for n in graph.walk()}
    assert not _guards(graph)
    for n in (1, 6, 7, 27):
        assert int(_run(graph, np.array(n))[0]) == int(_Collatz()(torch.tensor(n)))

    class FloatItem(nn.Module):
        def forward(self, x):
            while float(x.abs().max()) > 1.0:
                x = x / 2
            if x.sum().item() > 0:
                x = x + 1
            for _ in range(int(x.numel() * x.abs().max() > 0.25)):
                x = x * 3
            return x

    graph = kiln.script(FloatItem(), (torch.tensor([3.0, -1.0]),))
    assert not _guards(graph)
    for x in ([3.0, -1.0], [0.1, 0.1], [-9.0, 2.0], [0.2, -0.3]):
        t = torch.tensor(x)
        np.testing.assert_allclose(_run(graph, t.numpy())[0], FloatItem()(t).numpy(), rtol=1e-6)


def test_case2_trace_of_the_loop_is_refused_at_export():
    with pytest.raises(kiln.TraceCheckError, match=r"refuses .*int\(n\) % 2 == 0|refuses .*bool\(n > 1\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kiln.TraceWarning)
            kiln.trace(_Collatz(), (torch.tensor(6),))


def test_torch_jit_is_tracing_answers_true_while_kiln_traces():
    seen = []

    def fn(x):
        seen.append(torch.jit.is_tracing())
        return x + 1

    _trace(fn, (torch.ones(2),))
    assert seen == [True] and not torch.jit.is_tracing()


def test_sizes_compared_with_the_same_symbol_need_no_guard():
    # torch's RNN checks the zeros it makes for hx against the input's batch: the same symbol.
    lstm = nn.LSTM(4, 8, batch_first=True).eval()
    graph = _trace(lstm, (torch.randn(2, 5, 4),), dynamic={"input": {0: "b", 1: "t"}})
    assert not _guards(graph)


def test_a_comparison_of_a_value_with_itself_is_decided():
    from kiln.ir import Graph
    g = Graph("self")
    x = g.add_input("x", "float32", ["n"])
    n = g.op("Squeeze", g.op("Shape", x), g.add_constant(np.array([0], np.int64)))
    same = g.op("Equal", n, n)
    g.add_node("Guard", [same], {"expected": np.array(True), "read": "bool"}, domain="kiln", num_outputs=0)
    g.outputs = [g.op("Relu", x)]
    optimize(g)
    assert not _guards(g) and "Equal" not in {m.op for m in g.walk()}


def test_size_guard_the_check_flips_goes_when_the_traced_path_serves_that_size():
    def expand_rows(x, pos):  # transformers' masking_utils: expand position ids unless batch == 1
        if x.size(0) != pos.size(0):
            pos = pos.expand(x.size(0), -1)
        return x + pos

    x, pos = torch.randn(2, 5), torch.randn(1, 5)
    with pytest.warns(kiln.TraceWarning, match=r"the check dropped the guard at .*test_guards.py:\d+ .*batch 1"):
        graph = kiln.trace(expand_rows, (x, pos), dynamic={"x": {0: "batch"}})
    assert not _guards(graph)
    for b in (1, 2, 4):
        xb = torch.randn(b, 5)
        np.testing.assert_allclose(_run(graph, xb.numpy(), pos.numpy())[0], expand_rows(xb, pos).numpy(), rtol=1e-6)


def test_size_guard_stays_and_the_check_fails_where_the_path_matters():
    def first_or_mean(x):
        if x.size(0) > 1:
            return x.mean(0)
        return x[0] * 2

    with pytest.raises(kiln.TraceCheckError, match=r"refuses fresh random inputs #2 \(batch 1\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kiln.TraceWarning)
            kiln.trace(first_or_mean, (torch.randn(2, 3),), dynamic_batch=True)
