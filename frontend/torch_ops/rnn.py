"""Recurrent layers: the cells (``torch.lstm_cell``, ``gru_cell``, ``rnn_tanh_cell``,
``rnn_relu_cell``, what nn.LSTMCell/GRUCell/RNNCell call) and the sequence ops nn.LSTM/GRU/RNN
call (``torch.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``).

A sequence op becomes, per layer (see docs/NOTES.md, "Recurrent layers"):

1. the input projection of every time step at once, ``x @ W_ih^T + b`` as one MatMul over the
   whole sequence (what cuDNN does: the only part of the recurrence with no dependence between
   steps), for each direction; the backward direction projects the time-reversed input;
2. one ``Loop`` over the time steps, its trip count read from the input's shape at run time, so
   the graph is right at any sequence length. The directions are stacked on a leading axis of
   size D (1 or 2), so both run in the same loop: the body gathers step i of the projections
   [T, D, B, G*H], adds ``h @ W_hh^T`` (a [D, B, Hr] x [D, Hr, G*H] batched product) and applies
   the gates. The new state is carried and also a scan output ([T, D, B, Hr]);
3. the scan split back into directions (the backward one reversed in time) and concatenated on
   the feature axis, which is the next layer's input.

Weights are prepared (stacked, biases summed, LSTM's sigmoid rows halved: see _lstm_gates) by
ops on the parameters in the enclosing graph, which constant folding turns into single
initializers; their transposes stay views at run time. Gate order is torch's: LSTM (i, f, g, o),
GRU (r, z, n). A cell is the same step math without the loop.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from kiln.errors import UnsupportedOpError
from kiln.frontend.torch_ops import maps
from kiln.frontend.tracer import kiln_dtype
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Value
from kiln.ir.types import TensorType

_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
_INT64_MIN = -2**63


# ---------------------------------------------------------------------------- small emitters
def _ints(t, *values: int) -> Value:
    return t.constant(np.array(values, np.int64), "idx")


def _slice(t, x: Value, start: int, end: int, axis: int) -> Value:
    return t.emit("Slice", x, _ints(t, start), _ints(t, end), _ints(t, axis))


def _reverse(t, x: Value, axis: int = 0) -> Value:
    """x reversed along ``axis`` (a Slice with step -1, which keeps a symbolic length)."""
    return t.emit("Slice", x, _ints(t, -1), _ints(t, _INT64_MIN), _ints(t, axis), _ints(t, -1))


def _unsqueeze(t, x: Value, axis: int) -> Value:
    return t.emit("Unsqueeze", x, _ints(t, axis))


def _transpose(t, w: Value) -> Value:
    return t.emit("Transpose", w, perm=[1, 0])


def _stack(t, xs: list, axis: int = 0) -> Value:
    """Per-direction values stacked on a new ``axis`` (one direction: an Unsqueeze)."""
    parts = [_unsqueeze(t, x, axis) for x in xs]
    return parts[0] if len(parts) == 1 else t.emit("Concat", *parts, axis=axis)


# ---------------------------------------------------------------------------- weights
class _Weights:
    """One direction of one layer, as IR values: the input projection's weight and bias, and what
    each step needs (``W_hh``, GRU's ``b_hn``, LSTM's ``W_hr``, in torch's layout).

    The input-side bias folds in every hidden-side bias the gates simply add: all of ``b_hh``
    for LSTM and RNN, the r and z parts for GRU (its n gate multiplies ``h @ W_hn^T + b_hn`` by
    r, so ``b_hn`` stays in the step)."""

    def __init__(self, t, kind: str, params: Sequence[torch.Tensor], has_biases: bool, proj: bool, dt: DType):
        w_ih, w_hh = t.value(params[0], dt), t.value(params[1], dt)
        hidden = params[0].shape[0] // _GATES[kind]
        half = _lstm_halves(hidden, dt) if kind == "lstm" else None
        if half is not None:  # LSTM: the i, f, o rows halved (see _lstm_gates)
            w_ih = t.emit("Mul", w_ih, t.constant(half[:, None], "halves"))
            w_hh = t.emit("Mul", w_hh, t.constant(half[:, None], "halves"))
        self.w_ih_t = _transpose(t, w_ih)
        self.w_hh = w_hh
        self.w_hr = t.value(params[-1], dt) if proj else None
        self.b_in: Optional[Value] = None
        self.b_hn: Optional[Value] = None
        if has_biases and params[2] is not None:
            b_ih, b_hh = t.value(params[2], dt), t.value(params[3], dt)
            if kind == "gru":
                rz = _slice(t, b_hh, 0, 2 * hidden, 0)
                zero = t.constant(np.zeros(hidden, dt.numpy), "zeros")
                self.b_in = t.emit("Add", b_ih, t.emit("Concat", rz, zero, axis=0))
                self.b_hn = _slice(t, b_hh, 2 * hidden, 3 * hidden, 0)
            else:
                self.b_in = t.emit("Add", b_ih, b_hh)
                if half is not None:
                    self.b_in = t.emit("Mul", self.b_in, t.constant(half, "halves"))

    def project(self, t, x: Value) -> Value:
        """``x @ W_ih^T + b`` over every leading axis of x (all time steps at once)."""
        p = t.emit("MatMul", x, self.w_ih_t)
        return p if self.b_in is None else t.emit("Add", p, self.b_in)


def _step_weights(t, ws: list) -> tuple[Value, Optional[Value], Optional[Value]]:
    """(``W_hh^T``, ``b_hn``, ``W_hr^T``) of the directions, for the step.

    One direction: the plain transposed weights (they broadcast over the state's direction axis
    of size 1, and a 2-D right operand keeps MatMul one GEMM). Two: stacked on a leading axis
    [D, ...] first and transposed after, so the stack folds to one constant and the transpose
    stays a free view at run time (folding leaves a weight's Transpose alone)."""
    def stacked(vals: list, transpose: bool) -> Optional[Value]:
        if vals[0] is None:
            return None
        if len(vals) == 1:
            return _transpose(t, vals[0]) if transpose else vals[0]
        v = _stack(t, vals if transpose else [_unsqueeze(t, x, 0) for x in vals], 0)
        return t.emit("Transpose", v, perm=[0, 2, 1]) if transpose else v  # b_hn: [D, 1, H]

    return (stacked([w.w_hh for w in ws], True), stacked([w.b_hn for w in ws], False),
            stacked([w.w_hr for w in ws], True))


# ---------------------------------------------------------------------------- one step
def _step(t, kind: str, p: Value, h: Value, c: Optional[Value], w_hh_t: Value, b_hn: Optional[Value],
          w_hr_t: Optional[Value]) -> tuple[Value, Optional[Value]]:
    """The recurrence of one time step, given the step's input projection ``p``: new (h, c)."""
    q = t.emit("MatMul", h, w_hh_t)
    if kind == "lstm":
        i, f, g, o = _lstm_gates(t, t.emit("Add", p, q))
        c2 = t.emit("Add", t.emit("Mul", f, c), t.emit("Mul", i, g))
        h2 = t.emit("Mul", o, t.emit("Tanh", c2))
        return (h2 if w_hr_t is None else t.emit("MatMul", h2, w_hr_t)), c2
    if kind == "gru":
        p_rz, p_n = _split_gru(t, p)
        q_rz, q_n = _split_gru(t, q)
        r, z = t.emit("Split", t.emit("Sigmoid", t.emit("Add", p_rz, q_rz)), axis=-1, num_outputs=2, outputs=2)
        if b_hn is not None:
            q_n = t.emit("Add", q_n, b_hn)
        n = t.emit("Tanh", t.emit("Add", p_n, t.emit("Mul", r, q_n)))
        # (1 - z) * n + z * h, as n + z * (h - n): one op fewer.
        return t.emit("Add", n, t.emit("Mul", z, t.emit("Sub", h, n))), None
    act = "Tanh" if kind == "rnn_tanh" else "Relu"
    return t.emit(act, t.emit("Add", p, q)), None


def _lstm_halves(hidden: int, dt: DType) -> np.ndarray:
    """0.5 for the rows of LSTM's sigmoid gates (i, f, o), 1 for the tanh gate (g)."""
    return np.repeat(np.array([0.5, 0.5, 1.0, 0.5], dt.numpy), hidden)


def _lstm_gates(t, z: Value) -> tuple:
    """The four LSTM gates from their pre-activations, the sigmoid ones given halved.

    sigmoid(x) = 0.5 + 0.5 * tanh(x / 2), and the weights and biases of the i, f and o rows are
    halved once, where they are folded (exact: a power of two), so z holds [x_i/2, x_f/2, x_g,
    x_o/2] and all four gates are one Tanh and one multiply-add over [B, 4H], then a Split into
    views: 4 ops a step where 3 Sigmoids + 1 Tanh + Split took 5 (the CPU runtime's Sigmoid is
    itself this tanh form, 4 passes)."""
    four = z.type.shape[-1]
    half = _lstm_halves(four // 4, z.type.dtype)
    shift = np.where(half == 0.5, half, 0).astype(half.dtype)
    a = t.emit("Add", t.emit("Mul", t.emit("Tanh", z), t.constant(half, "halves")), t.constant(shift, "shift"))
    return t.emit("Split", a, axis=-1, num_outputs=4, outputs=4)


def _split_gru(t, x: Value) -> tuple[Value, Value]:
    """GRU's gates [r | z | n] as ([r | z], n)."""
    three = x.type.shape[-1]
    return t.emit("Split", x, _ints(t, 2 * three // 3, three // 3), axis=-1, outputs=2)


# ---------------------------------------------------------------------------- cells
def _cell(t, kind: str, input, h, c, w_ih, w_hh, b_ih, b_hh) -> tuple[Value, Optional[Value]]:
    dt = kiln_dtype(input.dtype)
    params = [w_ih, w_hh, b_ih, b_hh]
    w = _Weights(t, kind, params, b_ih is not None and b_hh is not None, False, dt)
    p = w.project(t, t.value(input, dt))
    return _step(t, kind, p, t.value(h, dt), None if c is None else t.value(c, dt), _transpose(t, w.w_hh), w.b_hn,
                 None)


@maps(torch.lstm_cell)
def lstm_cell(t, res, input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    return _cell(t, "lstm", input, hx[0], hx[1], w_ih, w_hh, b_ih, b_hh)


@maps(torch.gru_cell)
def gru_cell(t, res, input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    return _cell(t, "gru", input, hx, None, w_ih, w_hh, b_ih, b_hh)[0]


@maps(torch.rnn_tanh_cell)
def rnn_tanh_cell(t, res, input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    return _cell(t, "rnn_tanh", input, hx, None, w_ih, w_hh, b_ih, b_hh)[0]


@maps(torch.rnn_relu_cell)
def rnn_relu_cell(t, res, input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    return _cell(t, "rnn_relu", input, hx, None, w_ih, w_hh, b_ih, b_hh)[0]


# ---------------------------------------------------------------------------- sequences
_PACKED = ("packed sequences (nn.utils.rnn.pack_padded_sequence / pack_sequence) are not supported by kiln's "
           "tracer; run the RNN on the padded [T, B, ...] tensor instead and pick each sequence's last step "
           "with its length (e.g. out[lengths - 1, arange(B)]; for a bidirectional layer, reverse each "
           "sequence within its length first), or export one sequence at a time (batch 1, no padding)")


def _refuse_packed(t) -> None:
    raise UnsupportedOpError(f"{t.where()}: {_PACKED}")


@maps(torch._pack_padded_sequence)
def pack_padded_sequence(t, res, *args, **kwargs):
    _refuse_packed(t)


@maps(torch.lstm)
def lstm(t, res, input, hx, params, has_biases=True, num_layers=1, dropout=0.0, train=False,
         bidirectional=False, batch_first=False):
    if isinstance(hx, torch.Tensor):  # lstm(data, batch_sizes, hx, params, ...): a PackedSequence
        _refuse_packed(t)
    return _sequence(t, "lstm", input, list(hx), params, has_biases, num_layers, dropout, train, bidirectional,
                     batch_first)


def _single_state(kind: str):
    def handler(t, res, input, hx, params, has_biases=True, num_layers=1, dropout=0.0, train=False,
                bidirectional=False, batch_first=False):
        if isinstance(params, torch.Tensor):  # gru(data, batch_sizes, hx, params, ...): a PackedSequence
            _refuse_packed(t)
        return _sequence(t, kind, input, [hx], params, has_biases, num_layers, dropout, train, bidirectional,
                         batch_first)

    handler.__name__ = kind
    return handler


maps(torch.gru)(_single_state("gru"))
maps(torch.rnn_tanh)(_single_state("rnn_tanh"))
maps(torch.rnn_relu)(_single_state("rnn_relu"))


def _sequence(t, kind: str, input: torch.Tensor, hx: list, params: Sequence[torch.Tensor], has_biases: bool,
              num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple:
    if train and dropout > 0 and num_layers > 1:
        raise UnsupportedOpError(f"{t.where()}: '{kind}' with dropout between layers in training mode is random; "
                                 "kiln traces inference (call model.eval())")
    if input.dim() != 3:
        raise UnsupportedOpError(f"{t.where()}: torch.{kind} takes a 3-D input here, got shape "
                                 f"{tuple(input.shape)}")
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    proj = kind == "lstm" and per == (5 if has_biases else 3)
    dt = kiln_dtype(input.dtype)
    x = t.value(input, dt)
    if batch_first:
        x = t.emit("Transpose", x, perm=[1, 0, 2])
    states = [t.value(s, dt) for s in hx]
    finals: list[list[Value]] = [[] for _ in states]
    for layer in range(num_layers):
        chunk = params[layer * dirs * per:(layer + 1) * dirs * per]
        ws = [_Weights(t, kind, chunk[d * per:(d + 1) * per], has_biases, proj, dt) for d in range(dirs)]
        init = [_slice(t, s, layer * dirs, (layer + 1) * dirs, 0) for s in states]
        x, last = _layer(t, kind, x, ws, init)
        for acc, v in zip(finals, last):
            acc.append(v)
    if batch_first:
        x = t.emit("Transpose", x, perm=[1, 0, 2])
    outs = [v[0] if len(v) == 1 else t.emit("Concat", *v, axis=0) for v in finals]
    return (x, *outs)


def _layer(t, kind: str, x: Value, ws: list, init: list) -> tuple[Value, list]:
    """One layer over the whole sequence x [T, B, F]: (output [T, B, D*Hr], final states [D, B, *])."""
    proj = [w.project(t, x if d == 0 else _reverse(t, x)) for d, w in enumerate(ws)]
    projected = _stack(t, proj, 1)  # [T, D, B, G*H]
    steps = t.emit("Squeeze", t.emit("Shape", x, start=0, end=1), _ints(t, 0))
    w_hh_t, b_hn, w_hr_t = _step_weights(t, ws)
    body = t.current.subgraph(f"{kind}_steps")
    _body_input(body, "i", TensorType(DType.INT64, ()))
    go = _body_input(body, "cond", TensorType(DType.BOOL, ()))
    state_in = [_body_input(body, f"state_{k}", v.type) for k, v in enumerate(init)]
    t.dependent.update(body.inputs)
    with t.subgraph(body):
        p = t.emit("Gather", projected, body.inputs[0], axis=0)  # [D, B, G*H]
        h, c = _step(t, kind, p, state_in[0], state_in[1] if kind == "lstm" else None, w_hh_t, b_hn, w_hr_t)
        new = [h] if c is None else [h, c]
        body.outputs = [go, *new, h]
    out = t.emit("Loop", steps, None, *init, outputs=len(init) + 1, body=body)
    *last, scan = out  # scan: [T, D, B, Hr]
    if len(ws) == 1:
        return t.emit("Squeeze", scan, _ints(t, 1)), last
    forward = t.emit("Gather", scan, t.constant(np.array(0, np.int64), "dir"), axis=1)
    backward = _reverse(t, t.emit("Gather", scan, t.constant(np.array(1, np.int64), "dir"), axis=1))
    return t.emit("Concat", forward, backward, axis=-1), last


def _body_input(body: Graph, hint: str, ty: TensorType) -> Value:
    v = body._new_value(None, ty, hint)
    body.inputs.append(v)
    return v
