"""Recurrent layers (issue 15): nn.LSTM/GRU/RNN and their cells traced against torch eager.

Each sequence model is traced at T=7, batch 2, with the sequence length and the batch symbolic,
then run at other lengths and batches (T=1/3/20) three ways: kiln's IR evaluator, the CPU
runtime (kiln.save -> kiln.load(...).run) and, where onnxruntime is installed, onnxruntime on
kiln.export_onnx's file. Every combination of layers x directions x batch_first x bias x
initial states given is covered for each kind, plus LSTM projections and unbatched inputs.
"""
from __future__ import annotations

import functools
import itertools
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence  # noqa: E402

import kiln  # noqa: E402
from kiln import UnsupportedOpError  # noqa: E402
from kiln.frontend.tracer import to_numpy  # noqa: E402

RTOL = ATOL = 1e-5
INPUT, HIDDEN, PROJ = 3, 5, 2
TRACE_T, TRACE_B = 7, 2
RUNS = [(1, 1), (3, 4), (20, 2)]  # (sequence length, batch) at run time
KINDS = ["lstm", "gru", "rnn_tanh", "rnn_relu"]


@pytest.fixture(autouse=True)
def _torch_on_one_thread():
    """torch's eager calls on one thread: on a loaded 2-core machine its thread pool's barrier
    turned the tiny RNN calls of this file from under 1 ms into 0.1-0.3 s each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Seq(nn.Module):
    """An nn.LSTM/GRU/RNN whose initial states, when given, are model inputs (kiln.trace takes
    tensors, not the (h0, c0) tuple)."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, h0=None, c0=None):
        if h0 is None:
            out, state = self.rnn(x)
        else:
            out, state = self.rnn(x, h0 if c0 is None else (h0, c0))
        return (out, *state) if isinstance(state, tuple) else (out, state)


def _rnn(kind: str, layers: int, bidirectional: bool, batch_first: bool, bias: bool, proj: int = 0) -> nn.Module:
    kw = dict(num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias)
    if kind == "lstm":
        return nn.LSTM(INPUT, HIDDEN, proj_size=proj, **kw)
    if kind == "gru":
        return nn.GRU(INPUT, HIDDEN, **kw)
    return nn.RNN(INPUT, HIDDEN, nonlinearity=kind[4:], **kw)


@functools.lru_cache(maxsize=None)
def _traced(kind, layers, bidirectional, batch_first, bias, states, proj=0, unbatched=False, seed=0):
    """(model, graph, make_inputs(T, B)) for one configuration, traced once per session."""
    torch.manual_seed(seed)
    model = Seq(_rnn(kind, layers, bidirectional, batch_first, bias, proj)).eval()
    dirs = 2 if bidirectional else 1
    hidden = proj or HIDDEN

    def make(T: int, B: int) -> tuple:
        x = torch.randn(T, INPUT) if unbatched else torch.randn(*((B, T) if batch_first else (T, B)), INPUT)
        if not states:
            return (x,)
        lead = (layers * dirs,) if unbatched else (layers * dirs, B)
        h0 = torch.randn(*lead, hidden)
        return (x, h0, torch.randn(*lead, HIDDEN)) if kind == "lstm" else (x, h0)

    example = make(TRACE_T, TRACE_B)
    if unbatched:
        dynamic = {"x": {0: "seq"}}
    else:
        dynamic = {"x": {1: "seq", 0: "batch"} if batch_first else {0: "seq", 1: "batch"}}
        dynamic.update({n: {1: "batch"} for n in ("h0", "c0")[:len(example) - 1]})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "LSTM with projections", UserWarning)
        graph = kiln.trace(model, example, dynamic=dynamic, check=False)
    return model, graph, make


def _want(model, inputs) -> list[np.ndarray]:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "LSTM with projections", UserWarning)
        return [to_numpy(t) for t in model(*inputs)]


def _close(got, want, label: str) -> None:
    assert len(got) == len(want), label
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.asarray(g).shape == w.shape, f"{label} output {i}: {np.asarray(g).shape} vs {w.shape}"
        np.testing.assert_allclose(np.asarray(g), w, rtol=RTOL, atol=ATOL, err_msg=f"{label} output {i}")


def _check_everywhere(config: tuple, tmp_path, runs=RUNS) -> None:
    model, graph, make = _traced(*config)
    program = kiln.load(kiln.save(graph, tmp_path / "rnn.kiln"))
    for T, B in runs:
        inputs = make(T, B)
        want = _want(model, inputs)
        arrays = [to_numpy(x) for x in inputs]
        _close(kiln.evaluate(graph, arrays), want, f"evaluator T={T} B={B}")
        _close(program.run(arrays, as_list=True), want, f"runtime T={T} B={B}")


# layers x bidirectional x batch_first x bias x initial states given, for every kind
MATRIX = [(kind, *combo) for kind in KINDS for combo in itertools.product((1, 2), (False, True), (False, True),
                                                                          (True, False), (False, True))]
EXTRA = [  # LSTM projections; unbatched 2-D inputs
    ("lstm", 1, False, False, True, False, PROJ), ("lstm", 2, True, True, True, True, PROJ),
    ("lstm", 2, True, False, False, False, PROJ), ("lstm", 1, False, False, False, True, PROJ),
    ("lstm", 2, True, False, True, True, PROJ, True), ("lstm", 1, False, False, True, False, 0, True),
    ("gru", 2, True, False, True, True, 0, True), ("gru", 1, False, False, False, False, 0, True),
    ("rnn_tanh", 2, False, False, True, True, 0, True), ("rnn_relu", 1, True, False, True, False, 0, True),
]
CONFIGS = MATRIX + EXTRA


def _id(config: tuple) -> str:
    kind, layers, bidir, bf, bias, states, *rest = config
    parts = [kind, f"L{layers}", "bi" if bidir else "uni", "bf" if bf else "tm", "bias" if bias else "nobias",
             "h0" if states else "zeros"]
    if rest and rest[0]:
        parts.append(f"proj{rest[0]}")
    if len(rest) > 1 and rest[1]:
        parts.append("unbatched")
    return "-".join(parts)


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_sequence_matches_torch_at_runtime_lengths(config, tmp_path):
    _check_everywhere(config, tmp_path)


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_onnx_export_matches_torch_in_onnxruntime(config, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model, graph, make = _traced(*config)
    path = tmp_path / "rnn.onnx"
    kiln.export_onnx(graph, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for T, B in RUNS:
        inputs = make(T, B)
        got = session.run(None, {n: to_numpy(x) for n, x in zip(names, inputs)})
        _close(got, _want(model, inputs), f"onnxruntime T={T} B={B}")


def test_graph_shape_one_loop_per_layer_projection_outside():
    """The input projection is one MatMul per direction outside the loop; the body does only the
    recurrent product; both directions share one Loop; the scan keeps the symbolic length."""
    _, graph, _ = _traced("lstm", 2, True, False, True, False)
    loops = [n for n in graph.nodes if n.op == "Loop"]
    assert len(loops) == 2
    body = loops[0].attrs["body"]
    assert [n.op for n in body.nodes].count("MatMul") == 1
    assert not any(n.op == "Loop" for n in body.nodes)
    assert [n.op for n in graph.nodes].count("MatMul") == 4  # 2 layers x 2 directions, whole sequence each
    assert graph.outputs[0].type.shape == ("seq", "batch", 2 * HIDDEN)
    assert graph.outputs[1].type.shape == (4, "batch", HIDDEN)


def test_static_length_still_loops_and_refuses_other_lengths(tmp_path):
    """Without a symbolic length the graph is specialised to the example's (the runtime says so)."""
    model = Seq(nn.GRU(INPUT, HIDDEN)).eval()
    x = torch.randn(6, 2, INPUT)
    graph = kiln.trace(model, (x,))
    program = kiln.load(kiln.save(graph, tmp_path / "gru.kiln"))
    _close(program.run([x.numpy()], as_list=True), _want(model, (x,)), "static")
    with pytest.raises(kiln.InputError):
        program.run([torch.randn(5, 2, INPUT).numpy()])


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_trace_check_passes_with_symbolic_length(kind):
    """kiln.trace's own check (other lengths and batches, negated example) on a 2-layer bidirectional model."""
    model = Seq(_rnn(kind, 2, True, True, True)).eval()
    kiln.trace(model, (torch.randn(2, 7, INPUT),), dynamic={"x": {0: "batch", 1: "seq"}})


def test_dropout_is_ignored_a_model_in_training_mode_is_traced_in_eval_mode():
    model = Seq(nn.LSTM(INPUT, HIDDEN, num_layers=3, dropout=0.5))
    x = torch.randn(7, 2, INPUT)
    graph = kiln.trace(model, (x,), dynamic={"x": {0: "seq", 1: "batch"}})
    assert not model.training
    x2 = torch.randn(11, 3, INPUT)
    _close(kiln.evaluate(graph, [x2.numpy()]), _want(model.eval(), (x2,)), "eval")


def test_functional_dropout_in_training_mode_is_refused():
    rnn = nn.GRU(INPUT, HIDDEN, num_layers=2)

    def f(x):
        return torch.gru(x, torch.zeros(2, x.shape[1], HIDDEN), rnn._flat_weights, True, 2, 0.5, True, False,
                         False)[0]

    with pytest.raises(UnsupportedOpError, match="dropout between layers in training mode"):
        kiln.trace(f, (torch.randn(4, 2, INPUT),), check=False)


def test_packed_sequences_are_refused_with_what_to_do():
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(INPUT, HIDDEN)

        def forward(self, x):
            _, (h, _) = self.rnn(pack_padded_sequence(x, [4, 2]))
            return h

    with pytest.raises(UnsupportedOpError, match="packed sequences .* run the RNN on the padded"):
        kiln.trace(Packed().eval(), (torch.randn(4, 2, INPUT),))


# ---------------------------------------------------------------------------- cells
class Cell(nn.Module):
    def __init__(self, cell: nn.Module):
        super().__init__()
        self.cell = cell

    def forward(self, x, h=None, c=None):
        if h is None:
            out = self.cell(x)
        else:
            out = self.cell(x, h if c is None else (h, c))
        return out if isinstance(out, tuple) else (out,)


def _cell(kind: str, bias: bool) -> nn.Module:
    if kind == "lstm":
        return nn.LSTMCell(INPUT, HIDDEN, bias=bias)
    if kind == "gru":
        return nn.GRUCell(INPUT, HIDDEN, bias=bias)
    return nn.RNNCell(INPUT, HIDDEN, bias=bias, nonlinearity=kind[4:])


@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("states", [False, True], ids=["zeros", "hx"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", KINDS)
def test_cell_matches_torch(kind, bias, states, unbatched, tmp_path):
    torch.manual_seed(1)
    model = Cell(_cell(kind, bias)).eval()

    def make(B: int) -> tuple:
        lead = () if unbatched else (B,)
        x = torch.randn(*lead, INPUT)
        if not states:
            return (x,)
        return (x, torch.randn(*lead, HIDDEN)) + ((torch.randn(*lead, HIDDEN),) if kind == "lstm" else ())

    example = make(2)
    dynamic = {} if unbatched else {n: {0: "batch"} for n in ("x", "h", "c")[:len(example)]}
    graph = kiln.trace(model, example, dynamic=dynamic)
    assert "Loop" not in [n.op for n in graph.nodes]
    program = kiln.load(kiln.save(graph, tmp_path / "cell.kiln"))
    for B in ((2,) if unbatched else (1, 2, 5)):
        inputs = make(B)
        arrays = [to_numpy(x) for x in inputs]
        want = _want(model, inputs)
        _close(kiln.evaluate(graph, arrays), want, f"evaluator B={B}")
        _close(program.run(arrays, as_list=True), want, f"runtime B={B}")


def test_cell_in_a_python_loop_unrolls_and_matches():
    """A decoder-style loop of GRUCell steps over a static length (the tracer unrolls Python loops)."""
    cell = nn.GRUCell(INPUT, HIDDEN).eval()

    def f(x):
        h = torch.zeros(x.shape[1], HIDDEN)
        for t in range(x.shape[0]):
            h = cell(x[t], h)
        return h

    x = torch.randn(4, 2, INPUT)
    graph = kiln.trace(f, (x,), dynamic_batch=False)
    _close(kiln.evaluate(graph, [x.numpy()]), [to_numpy(f(x))], "unrolled")


# ---------------------------------------------------------------------------- kiln.script
def test_script_of_a_model_holding_an_lstm():
    """kiln.script goes through the same tracer: the LSTM's Loop nests with the script's If."""

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(INPUT, HIDDEN, num_layers=2, batch_first=True, bidirectional=True)
            self.head = nn.Linear(2 * HIDDEN, 3)

        def forward(self, x):
            out, (h, _) = self.rnn(x)
            if x.mean() > 0:
                y = self.head(out[:, -1])
            else:
                y = -self.head(out[:, 0])
            return y, h

    torch.manual_seed(2)
    model = Tagger().eval()
    graph = kiln.script(model, (torch.randn(2, 6, INPUT),), dynamic={"x": {0: "batch", 1: "seq"}})
    ops = [n.op for n in graph.nodes]
    assert "If" in ops and ops.count("Loop") == 2
    for T, B in ((1, 1), (4, 3), (15, 2)):
        for sign in (1.0, -1.0):
            x = torch.randn(B, T, INPUT) + sign  # the mean's sign picks the branch
            with torch.no_grad():
                want = [to_numpy(t) for t in model(x)]
            _close(kiln.evaluate(graph, [x.numpy()]), want, f"script T={T} B={B}")


def test_script_of_a_cell_stepped_over_a_runtime_length():
    """A GRUCell stepped by a scripted `for` over the run-time length: the script's Loop holds the cell."""

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.GRUCell(INPUT, HIDDEN)

        def forward(self, x):
            h = torch.zeros(x.size(0), HIDDEN)
            for t in range(x.size(1)):
                h = self.cell(x[:, t], h)
            return h

    torch.manual_seed(3)
    model = Decoder().eval()
    graph = kiln.script(model, (torch.randn(2, 5, INPUT),), dynamic={"x": {0: "batch", 1: "seq"}})
    assert "Loop" in [n.op for n in graph.nodes]
    for T, B in ((1, 1), (3, 4), (12, 2)):
        x = torch.randn(B, T, INPUT)
        with torch.no_grad():
            want = [to_numpy(model(x))]
        _close(kiln.evaluate(graph, [x.numpy()]), want, f"script T={T} B={B}")


def test_script_with_rnns_inside_the_branches_of_an_if(tmp_path):
    """A Loop recorded inside a scripted If branch (the tracer's current graph is the branch)."""

    class Switch(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(INPUT, HIDDEN, bidirectional=True)
            self.lstm = nn.LSTM(INPUT, 2 * HIDDEN)

        def forward(self, x):
            if x.mean() > 0:
                y, _ = self.gru(x)
            else:
                y, _ = self.lstm(x)
            return y

    torch.manual_seed(4)
    model = Switch().eval()
    graph = kiln.script(model, (torch.randn(5, 2, INPUT),), dynamic={"x": {0: "seq", 1: "batch"}})
    ifs = [n for n in graph.nodes if n.op == "If"]
    assert len(ifs) == 1 and all(any(n.op == "Loop" for n in ifs[0].attrs[b].nodes)
                                 for b in ("then_branch", "else_branch"))
    program = kiln.load(kiln.save(graph, tmp_path / "switch.kiln"))
    for T, B in ((1, 1), (4, 3), (9, 2)):
        for sign in (1.0, -1.0):
            x = torch.randn(T, B, INPUT) + sign
            with torch.no_grad():
                want = [to_numpy(model(x))]
            _close(kiln.evaluate(graph, [x.numpy()]), want, f"evaluator T={T} B={B}")
            _close(program.run([x.numpy()], as_list=True), want, f"runtime T={T} B={B}")
