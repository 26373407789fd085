"""ai.onnx recurrent ops ``RNN``, ``GRU`` and ``LSTM`` (version 14; 22 only adds bfloat16).

X [seq, batch, input] (``layout=1``: [batch, seq, input]); W [dirs, G*hidden, input], R [dirs, G*hidden, hidden],
B [dirs, 2*G*hidden] (Wb then Rb), sequence_lens [batch] (int32), initial_h (initial_c) [dirs, batch, hidden]
(``layout=1``: [batch, dirs, hidden]), LSTM's peepholes P [dirs, 3*hidden]. G is 1 (RNN), 3 (GRU, gates z r h)
or 4 (LSTM, gates i o f c). Outputs Y [seq, dirs, batch, hidden] (``layout=1``: [batch, seq, dirs, hidden]), Y_h
(and LSTM's Y_c) [dirs, batch, hidden] (``layout=1``: [batch, dirs, hidden]).

``direction`` is forward, reverse or bidirectional (forward in direction 0, reverse in 1). ``activations`` are
the ONNX ones (Relu, Tanh, Sigmoid, Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid, Elu, Softsign,
Softplus; names case-insensitive), n per direction (RNN 1, GRU 2, LSTM 3) or n for every direction;
``activation_alpha``/``activation_beta`` are consumed in order by the activations that take them (as ONNX
Runtime does), the op's defaults otherwise. ``clip`` bounds every gate's pre-activation to [-clip, clip]
(not the cell state passed to LSTM's h). ``input_forget`` couples LSTM's forget gate to its input gate
(f = 1 - i). GRU's ``linear_before_reset`` applies the reset gate after R_h's product (PyTorch's form).

sequence_lens: batch entry b runs its first L_b steps only (the reverse direction from step L_b - 1 down to
0); Y past L_b is 0 and Y_h/Y_c is the state after its last valid step (the initial state when L_b = 0).

Narrow floats (float16, bfloat16) compute in float32 and round once on the way out.
"""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import TensorType

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTS = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh")}
_DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}

# name -> (uses alpha, uses beta, default alpha, default beta)
_ACTIVATIONS = {
    "relu": (False, False, None, None),
    "tanh": (False, False, None, None),
    "sigmoid": (False, False, None, None),
    "affine": (True, True, 1.0, 0.0),
    "leakyrelu": (True, False, 0.01, None),
    "thresholdedrelu": (True, False, 1.0, None),
    "scaledtanh": (True, True, 1.0, 1.0),
    "hardsigmoid": (True, True, 0.2, 0.5),
    "elu": (True, False, 1.0, None),
    "softsign": (False, False, None, None),
    "softplus": (False, False, None, None),
}


def _apply(name: str, x: np.ndarray, a, b) -> np.ndarray:
    t = x.dtype.type
    if name == "relu":
        return np.maximum(x, t(0))
    if name == "tanh":
        return np.tanh(x)
    if name == "sigmoid":
        return t(1) / (t(1) + np.exp(-x))
    if name == "affine":
        return t(a) * x + t(b)
    if name == "leakyrelu":
        return np.where(x >= 0, x, t(a) * x)
    if name == "thresholdedrelu":
        return np.where(x > t(a), x, t(0))
    if name == "scaledtanh":
        return t(a) * np.tanh(t(b) * x)
    if name == "hardsigmoid":
        return np.clip(t(a) * x + t(b), t(0), t(1))
    if name == "elu":
        return np.where(x >= 0, x, t(a) * (np.exp(x) - t(1)))
    if name == "softsign":
        return x / (t(1) + np.abs(x))
    if name == "softplus":
        return np.logaddexp(t(0), x)
    raise ValueError(f"unknown activation {name}")


def _activation_plan(kind: str, num_dirs: int, activations, alphas, betas, fail) -> list:
    """Per direction, the list of (name, alpha, beta) the op applies."""
    n = len(_DEFAULT_ACTS[kind])
    names = list(activations) if activations else list(_DEFAULT_ACTS[kind]) * num_dirs
    if len(names) == n and num_dirs == 2:
        names = names * 2
    if len(names) != n * num_dirs:
        fail(f"{kind} takes {n} activation(s) per direction ({n * num_dirs} for {num_dirs} direction(s)), "
             f"not {len(names)}: {names}")
    alphas, betas = list(alphas or ()), list(betas or ())
    plan = []
    for name in names:
        key = name.lower() if isinstance(name, str) else name
        if key not in _ACTIVATIONS:
            fail(f"{kind} activation {name!r} is not one of ONNX's: {', '.join(sorted(_ACTIVATIONS))}")
        uses_a, uses_b, da, db = _ACTIVATIONS[key]
        a = alphas.pop(0) if uses_a and alphas else da
        b = betas.pop(0) if uses_b and betas else db
        plan.append((key, a, b))
    return [plan[d * n:(d + 1) * n] for d in range(num_dirs)]


def _known(d) -> bool:
    return isinstance(d, int)


def _check_dim(ctx: InferContext, what: str, shape, axis: int, want, desc: str) -> None:
    got = shape[axis]
    if _known(got) and _known(want) and got != want:
        ctx.fail(f"{what} has shape {list(shape)}: dim {axis} must be {desc} = {want}, not {got}")


def _infer(kind: str):
    g = _GATES[kind]

    def infer(ctx: InferContext):
        x, w, r = ctx.input(0), ctx.input(1), ctx.input(2)
        dt = x.dtype
        for i, name in ((1, "W"), (2, "R"), (3, "B"), (5, "initial_h"), (6, "initial_c"), (7, "P")):
            if ctx.has_input(i) and ctx.inputs[i] is not None and ctx.inputs[i].dtype is not dt:
                ctx.fail(f"{name} is {ctx.inputs[i].dtype} but X is {dt}")
        attrs = ctx.attrs
        direction = attrs["direction"]
        if direction not in _DIRECTIONS:
            ctx.fail(f"direction must be forward, reverse or bidirectional, not {direction!r}")
        dirs = _DIRECTIONS[direction]
        layout = attrs["layout"]
        if layout not in (0, 1):
            ctx.fail(f"layout must be 0 or 1, not {layout}")
        if kind == "GRU" and attrs["linear_before_reset"] not in (0, 1):
            ctx.fail(f"linear_before_reset must be 0 or 1, not {attrs['linear_before_reset']}")
        if kind == "LSTM" and attrs["input_forget"] not in (0, 1):
            ctx.fail(f"input_forget must be 0 or 1, not {attrs['input_forget']}")
        clip = attrs["clip"]
        if clip is not None and not clip > 0:
            ctx.fail(f"clip must be positive, not {clip}")
        _activation_plan(kind, dirs, attrs["activations"], attrs["activation_alpha"], attrs["activation_beta"],
                         ctx.fail)
        hidden = attrs["hidden_size"]
        if hidden is not None and hidden <= 0:
            ctx.fail(f"hidden_size must be positive, not {hidden}")
        for t, name in ((x, "X"), (w, "W"), (r, "R")):
            if t.shape is not None and len(t.shape) != 3:
                ctx.fail(f"{name} must be 3-D, not {list(t.shape)}")
        if hidden is None and r.shape is not None and _known(r.shape[2]):
            hidden = r.shape[2]
        if hidden is None and w.shape is not None and _known(w.shape[1]):
            if w.shape[1] % g:
                ctx.fail(f"W's dim 1 ({w.shape[1]}) is not a multiple of {g} gates")
            hidden = w.shape[1] // g
        seq, batch, inp = (None, None, None) if x.shape is None else \
            ((x.shape[1], x.shape[0], x.shape[2]) if layout else tuple(x.shape))
        gh = g * hidden if _known(hidden) else None
        if w.shape is not None:
            _check_dim(ctx, "W", w.shape, 0, dirs, f"num_directions ({direction})")
            _check_dim(ctx, "W", w.shape, 1, gh, f"{g} * hidden_size")
            _check_dim(ctx, "W", w.shape, 2, inp, "X's input size")
        if r.shape is not None:
            _check_dim(ctx, "R", r.shape, 0, dirs, f"num_directions ({direction})")
            _check_dim(ctx, "R", r.shape, 1, gh, f"{g} * hidden_size")
            _check_dim(ctx, "R", r.shape, 2, hidden, "hidden_size")
        if ctx.has_input(3) and ctx.inputs[3] is not None and ctx.inputs[3].shape is not None:
            b = ctx.inputs[3].shape
            if len(b) != 2:
                ctx.fail(f"B must be 2-D, not {list(b)}")
            _check_dim(ctx, "B", b, 0, dirs, f"num_directions ({direction})")
            _check_dim(ctx, "B", b, 1, 2 * gh if gh else None, f"2 * {g} * hidden_size")
        if ctx.has_input(4) and ctx.inputs[4] is not None:
            sl = ctx.inputs[4]
            if sl.dtype is not DType.INT32:
                ctx.fail(f"sequence_lens must be int32, not {sl.dtype}")
            if sl.shape is not None:
                if len(sl.shape) != 1:
                    ctx.fail(f"sequence_lens must be 1-D, not {list(sl.shape)}")
                _check_dim(ctx, "sequence_lens", sl.shape, 0, batch, "batch size")
        state = (dirs, batch, hidden) if not layout else (batch, dirs, hidden)
        state_desc = ("num_directions", "batch size", "hidden_size") if not layout else \
            ("batch size", "num_directions", "hidden_size")
        for i, name in ((5, "initial_h"), (6, "initial_c")):
            if i >= len(ctx.inputs) or not ctx.has_input(i) or ctx.inputs[i] is None or ctx.inputs[i].shape is None:
                continue
            s = ctx.inputs[i].shape
            if len(s) != 3:
                ctx.fail(f"{name} must be 3-D, not {list(s)}")
            for axis in range(3):
                _check_dim(ctx, name, s, axis, state[axis], state_desc[axis])
        if kind == "LSTM" and ctx.has_input(7) and ctx.inputs[7] is not None and ctx.inputs[7].shape is not None:
            p = ctx.inputs[7].shape
            if len(p) != 2:
                ctx.fail(f"P must be 2-D, not {list(p)}")
            _check_dim(ctx, "P", p, 0, dirs, f"num_directions ({direction})")
            _check_dim(ctx, "P", p, 1, 3 * hidden if _known(hidden) else None, "3 * hidden_size")
        if x.shape is None:
            y = TensorType(dt, None)
        else:
            y = TensorType(dt, (batch, seq, dirs, hidden) if layout else (seq, dirs, batch, hidden))
        outs = [y] + [TensorType(dt, state)] * (ctx.num_outputs - 1)
        return outs[:ctx.num_outputs]

    return infer


def _common_attrs(kind: str) -> list:
    attrs = [Attr("activation_alpha", AttrKind.FLOATS, None), Attr("activation_beta", AttrKind.FLOATS, None),
             Attr("activations", AttrKind.STRINGS, None), Attr("clip", AttrKind.FLOAT, None),
             Attr("direction", AttrKind.STRING, "forward"), Attr("hidden_size", AttrKind.INT, None),
             Attr("layout", AttrKind.INT, 0)]
    if kind == "GRU":
        attrs.append(Attr("linear_before_reset", AttrKind.INT, 0))
    if kind == "LSTM":
        attrs.append(Attr("input_forget", AttrKind.INT, 0))
    return attrs


def _inputs(kind: str) -> list:
    ins = [In("X", FLOAT, rank=3), In("W", FLOAT, rank=3), In("R", FLOAT, rank=3),
           In("B", FLOAT, optional=True, rank=2), In("sequence_lens", {DType.INT32}, optional=True, rank=1),
           In("initial_h", FLOAT, optional=True, rank=3)]
    if kind == "LSTM":
        ins += [In("initial_c", FLOAT, optional=True, rank=3), In("P", FLOAT, optional=True, rank=2)]
    return ins


def _outputs(kind: str) -> list:
    outs = [Out("Y", FLOAT, optional=True), Out("Y_h", FLOAT, optional=True)]
    if kind == "LSTM":
        outs.append(Out("Y_c", FLOAT, optional=True))
    return outs


def _run(kind: str, x, w, r, b, sequence_lens, initial_h, initial_c, p, attrs) -> tuple:
    """The shared recurrence (module docstring); returns (Y, Y_h[, Y_c]) in X's dtype."""
    out_dt = x.dtype
    acc = compute_dtype(out_dt)
    t_ = acc.type
    g = _GATES[kind]
    direction, layout, clip = attrs["direction"], attrs["layout"], attrs["clip"]
    dirs = _DIRECTIONS[direction]
    plans = _activation_plan(kind, dirs, attrs["activations"], attrs["activation_alpha"],
                             attrs["activation_beta"], _raise)
    hidden = r.shape[-1]
    x = x.astype(acc)
    if layout:
        x = x.swapaxes(0, 1)
    seq, batch, _ = x.shape

    def state0(s):
        if s is None:
            return np.zeros((dirs, batch, hidden), acc)
        s = s.astype(acc)
        return s.swapaxes(0, 1) if layout else s

    h0, c0 = state0(initial_h), state0(initial_c)
    if sequence_lens is None:
        lens = np.full(batch, seq, np.int64)
    else:
        lens = np.asarray(sequence_lens).reshape(-1).astype(np.int64)
        if lens.shape[0] != batch or np.any(lens < 0) or np.any(lens > seq):
            raise ValueError(f"{kind}: sequence_lens {lens.tolist()} must give {batch} lengths in 0..{seq}")
    y = np.zeros((seq, dirs, batch, hidden), acc)
    y_h = np.zeros((dirs, batch, hidden), acc)
    y_c = np.zeros((dirs, batch, hidden), acc)

    def cl(v):
        return v if clip is None else np.clip(v, t_(-clip), t_(clip))

    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        wd, rd = w[d].astype(acc), r[d].astype(acc)
        bd = np.zeros(2 * g * hidden, acc) if b is None else b[d].astype(acc)
        wb, rb = bd[:g * hidden], bd[g * hidden:]
        acts = plans[d]

        def f(i, v, acts=acts):
            name, a, bb = acts[i]
            return _apply(name, v, a, bb)

        xw = x @ wd.T + wb  # [seq, batch, G*hidden]
        h, c = h0[d], c0[d]
        if kind == "LSTM" and p is not None:
            pi, po, pf = np.split(p[d].astype(acc), 3)
        else:
            pi = po = pf = None
        steps = range(seq - 1, -1, -1) if reverse else range(seq)
        for t in steps:
            active = (t < lens).reshape(batch, 1)
            if kind == "RNN":
                h_new = f(0, cl(xw[t] + h @ rd.T + rb))
            elif kind == "GRU":
                xz, xr, xh = np.split(xw[t], 3, axis=-1)
                rz, rr, rh = np.split(rd, 3, axis=0)
                bz, br, bh = np.split(rb, 3)
                z = f(0, cl(xz + h @ rz.T + bz))
                rg = f(0, cl(xr + h @ rr.T + br))
                if attrs["linear_before_reset"]:
                    hh = f(1, cl(xh + rg * (h @ rh.T + bh)))
                else:
                    hh = f(1, cl(xh + (rg * h) @ rh.T + bh))
                h_new = (t_(1) - z) * hh + z * h
            else:
                gates = xw[t] + h @ rd.T + rb
                gi, go, gf, gc = np.split(gates, 4, axis=-1)
                if pi is not None:
                    gi = gi + pi * c
                    gf = gf + pf * c
                i_ = f(0, cl(gi))
                f_ = t_(1) - i_ if attrs["input_forget"] else f(0, cl(gf))
                c_new = f_ * c + i_ * f(1, cl(gc))
                if po is not None:
                    go = go + po * c_new
                o_ = f(0, cl(go))
                h_new = o_ * f(2, c_new)
                c = np.where(active, c_new, c)
            h = np.where(active, h_new, h)
            y[t, d] = np.where(active, h_new, t_(0))
        y_h[d] = h
        if kind == "LSTM":
            y_c[d] = c
    if layout:
        y, y_h, y_c = y.transpose(2, 0, 1, 3), y_h.swapaxes(0, 1), y_c.swapaxes(0, 1)
    outs = (y.astype(out_dt), y_h.astype(out_dt))
    if kind == "LSTM":
        outs += (y_c.astype(out_dt),)
    return outs


def _raise(msg: str):
    raise ValueError(msg)


@op("RNN", inputs=_inputs("RNN"), outputs=_outputs("RNN"), attrs=_common_attrs("RNN"), infer=_infer("RNN"))
def rnn(x, w, r, b=None, sequence_lens=None, initial_h=None, *, activation_alpha=None, activation_beta=None,
        activations=None, clip=None, direction="forward", hidden_size=None, layout=0):
    """ONNX RNN: H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb) (module docstring)."""
    return _run("RNN", x, w, r, b, sequence_lens, initial_h, None, None, dict(
        activation_alpha=activation_alpha, activation_beta=activation_beta, activations=activations, clip=clip,
        direction=direction, layout=layout))


@op("GRU", inputs=_inputs("GRU"), outputs=_outputs("GRU"), attrs=_common_attrs("GRU"), infer=_infer("GRU"))
def gru(x, w, r, b=None, sequence_lens=None, initial_h=None, *, activation_alpha=None, activation_beta=None,
        activations=None, clip=None, direction="forward", hidden_size=None, layout=0, linear_before_reset=0):
    """ONNX GRU, gates z r h (module docstring)."""
    return _run("GRU", x, w, r, b, sequence_lens, initial_h, None, None, dict(
        activation_alpha=activation_alpha, activation_beta=activation_beta, activations=activations, clip=clip,
        direction=direction, layout=layout, linear_before_reset=linear_before_reset))


@op("LSTM", inputs=_inputs("LSTM"), outputs=_outputs("LSTM"), attrs=_common_attrs("LSTM"), infer=_infer("LSTM"))
def lstm(x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None, *, activation_alpha=None,
         activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None, layout=0,
         input_forget=0):
    """ONNX LSTM, gates i o f c, peepholes i o f (module docstring)."""
    return _run("LSTM", x, w, r, b, sequence_lens, initial_h, initial_c, p, dict(
        activation_alpha=activation_alpha, activation_beta=activation_beta, activations=activations, clip=clip,
        direction=direction, layout=layout, input_forget=input_forget))
