"""Recurrent layers on the CUDA backend (issue 15): nn.LSTM/GRU/RNN traced with a symbolic
sequence length and batch, run by kiln.load(..., device="cuda") at other lengths, against torch
eager on the CPU. The Loop's trip count is read on the host each run; the body (gather of the
step's input projection, the recurrent MatMul, the gate math) runs on the device.

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module); on the device machine:
``python -m pytest tests/runtime/test_cuda_rnn.py``. Tolerances are float32's (TF32 is off by
default): 1e-5 on the small models, 1e-4 relative on the hidden-256 one, whose sums are longer."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()
torch = pytest.importorskip("torch")

import kiln  # noqa: E402
from kiln.frontend.tracer import to_numpy  # noqa: E402

nn = torch.nn


class Seq(nn.Module):
    """The RNN with its initial states as model inputs (when given)."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, h0=None, c0=None):
        if h0 is None:
            out, state = self.rnn(x)
        else:
            out, state = self.rnn(x, h0 if c0 is None else (h0, c0))
        return (out, *state) if isinstance(state, tuple) else (out, state)


CASES = [  # (id, module factory, batch_first, initial states given, rtol, atol)
    ("lstm-2layer-bi-bf", lambda: nn.LSTM(3, 5, num_layers=2, bidirectional=True, batch_first=True), True, False,
     1e-5, 1e-5),
    ("lstm-proj-h0", lambda: nn.LSTM(3, 5, num_layers=2, proj_size=2), False, True, 1e-5, 1e-5),
    ("gru-2layer-bi-h0", lambda: nn.GRU(3, 5, num_layers=2, bidirectional=True), False, True, 1e-5, 1e-5),
    ("gru-nobias", lambda: nn.GRU(3, 5, bias=False, batch_first=True), True, False, 1e-5, 1e-5),
    ("rnn-relu-bi", lambda: nn.RNN(3, 5, nonlinearity="relu", bidirectional=True), False, False, 1e-5, 1e-5),
    ("lstm-256", lambda: nn.LSTM(64, 256, num_layers=2), False, False, 1e-4, 1e-5),
]


def _inputs(model, T: int, B: int, batch_first: bool, states: bool) -> tuple:
    rnn = model.rnn
    x = torch.randn(B, T, rnn.input_size) if batch_first else torch.randn(T, B, rnn.input_size)
    if not states:
        return (x,)
    lead = rnn.num_layers * (2 if rnn.bidirectional else 1)
    h0 = torch.randn(lead, B, getattr(rnn, "proj_size", 0) or rnn.hidden_size)
    return (x, h0, torch.randn(lead, B, rnn.hidden_size)) if isinstance(rnn, nn.LSTM) else (x, h0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_traced_rnn_matches_torch_on_the_gpu(case, graphs, tmp_path):
    _, factory, batch_first, states, rtol, atol = case
    torch.manual_seed(0)
    model = Seq(factory()).eval()
    example = _inputs(model, 7, 2, batch_first, states)
    dynamic = {"x": {0: "batch", 1: "seq"} if batch_first else {0: "seq", 1: "batch"}}
    dynamic.update({n: {1: "batch"} for n in ("h0", "c0")[:len(example) - 1]})
    graph = kiln.trace(model, example, dynamic=dynamic)
    program = kiln.load(kiln.save(graph, tmp_path / "rnn.kiln"), device="cuda", output="numpy", cuda_graphs=graphs)
    for T, B in ((1, 1), (3, 4), (20, 2), (7, 2)):
        inputs = _inputs(model, T, B, batch_first, states)
        with torch.no_grad():
            want = [to_numpy(t) for t in model(*inputs)]
        got = program.run([to_numpy(x) for x in inputs], as_list=True)
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape, f"T={T} B={B} output {k}: {g.shape} vs {w.shape}"
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol,
                                       err_msg=f"T={T} B={B} output {k}; host fallbacks {program.fallback_ops}")
    assert program.fallback_ops == {}, f"ops run on the host: {program.fallback_ops}"


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_cells_on_the_gpu(kind, tmp_path):
    torch.manual_seed(1)
    cell = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn_tanh": nn.RNNCell}[kind](3, 5).eval()

    def step(x, h, c):
        out = cell(x, (h, c)) if kind == "lstm" else cell(x, h)
        return out if isinstance(out, tuple) else (out,)

    example = (torch.randn(2, 3), torch.randn(2, 5), torch.randn(2, 5))
    graph = kiln.trace(step, example, dynamic={n: {0: "batch"} for n in ("x", "h", "c")})
    program = kiln.load(kiln.save(graph, tmp_path / "cell.kiln"), device="cuda", output="numpy")
    for B in (1, 6):
        inputs = (torch.randn(B, 3), torch.randn(B, 5), torch.randn(B, 5))
        with torch.no_grad():
            want = [to_numpy(t) for t in step(*inputs)]
        got = program.run([to_numpy(x) for x in inputs], as_list=True)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
