"""Resize on the CPU: the op's per-axis tables (kiln.ir.ops.resize.resize_plan) turned, once per
input shape, into whole-array numpy passes, one per resized axis.

Most real resizes are periodic: with a rational scale p/q every run of p outputs reads the inputs
of the previous run shifted by q, with the same weights (an x2 bilinear upsample has two phases,
weights 3/4, 1/4 and 1/4, 3/4). Each phase is then a strided view of the output computed from
strided views of the input - ``dst = a + w * (b - a)`` for two taps, ``dst[...] = src`` for
nearest - so no index array is gathered and the innermost axis stays a vectorized loop (numpy's
fancy indexing along the last axis costs about 10x a strided copy). Outputs that break the period
(clamped edges, non-rational scales) are gathered with ``np.take``. A scale with a period longer
than MAX_PERIOD outputs runs as gathers and per-tap weights over the whole axis.

Axes are resampled smallest ratio first (downsampling before upsampling keeps intermediates
small), the innermost axis last among equals. float32/float64 compute in their own dtype, float16
and bfloat16 in float32 (rounded once); integer nearest copies exactly; integer linear/cubic runs
the reference (it rounds half to even and saturates).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from kiln.ir.ops.resize import DEFAULTS, AxisTaps, ResizePlan, fill_outside, resize_plan, saturate
from kiln.runtime.kernels.cpu import reference_kernel
from kiln.runtime.kernels.cpu.linalg import const_input, input_dtype

MAX_PERIOD = 8
MIN_PHASE = 4      # a phase shorter than this many outputs is not worth its own numpy calls
_WEIGHT_TOL = 1e-9
_DIRECT = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class _Phase:
    start: int          # first output index
    step: int           # outputs between two members (the period)
    count: int
    taps: tuple         # (input start, input step, weight) per tap


@dataclass(frozen=True)
class _Axis:
    axis: int
    out_size: int
    phases: tuple
    rest: Optional[np.ndarray]       # output indices outside the phases
    index: Optional[np.ndarray]      # [len(rest), taps] their inputs
    weight: Optional[np.ndarray]     # [len(rest), taps] their weights (None: nearest)


def _period(taps: AxisTaps) -> Optional[tuple]:
    """(period, input shift, first, end): outputs [first, end) repeat with that period."""
    idx, w = taps.index, taps.weight
    n = taps.out_size
    for k in range(1, min(MAX_PERIOD, n // 2) + 1):
        d = idx[k:] - idx[:-k]
        shift = int(np.median(d[:, 0]))
        if shift < 1:
            continue
        ok = np.all(d == shift, axis=1)
        if w is not None:
            ok &= np.all(np.abs(w[k:] - w[:-k]) <= _WEIGHT_TOL, axis=1)
        if not ok.any():
            continue
        # The longest run of rows j whose successor j + k keeps the pattern.
        padded = np.concatenate([[False], ok, [False]])
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        starts, ends = edges[0::2], edges[1::2]
        best = int(np.argmax(ends - starts))
        first, end = int(starts[best]), int(ends[best]) + k
        if end - first >= k * MIN_PHASE:
            return k, shift, first, end
    return None


def compile_axis(taps: AxisTaps, dtype: np.dtype) -> _Axis:
    """The passes of one axis: periodic phases as strided views, the rest as gathers."""
    weight = None if taps.weight is None else taps.weight.astype(dtype)
    found = _period(taps)
    if found is None:
        return _Axis(taps.axis, taps.out_size, (), np.arange(taps.out_size), taps.index.astype(np.intp), weight)
    k, shift, first, end = found
    phases = []
    for p in range(k):
        j = first + p
        count = (end - j + k - 1) // k
        if count <= 0:
            continue
        tap_list = tuple((int(taps.index[j, t]), shift, None if weight is None else weight[j, t].item())
                         for t in range(taps.taps)
                         if weight is None or weight[j, t] != 0)
        phases.append(_Phase(j, k, count, tap_list))
    rest = np.concatenate([np.arange(0, first), np.arange(end, taps.out_size)]).astype(np.intp)
    if len(rest) <= MAX_EDGE_ROWS:
        # A few edge outputs (clamped taps) as one-output phases of sliced views: cheaper per block
        # than a gather and a fancy-indexed store.
        phases += [_Phase(int(j), 1, 1, _merged(taps.index[j], None if weight is None else weight[j])) for j in rest]
        rest = rest[:0]
    return _Axis(taps.axis, taps.out_size, tuple(phases), rest if len(rest) else None,
                 taps.index[rest].astype(np.intp) if len(rest) else None,
                 None if weight is None or not len(rest) else weight[rest])


MAX_EDGE_ROWS = 8


def _merged(index: np.ndarray, weight: Optional[np.ndarray]) -> tuple:
    """One output's taps with repeated input indices summed (clamping repeats the edge)."""
    if weight is None:
        return ((int(index[0]), 1, None),)
    total: dict = {}
    for i, w in zip(index.tolist(), weight.tolist()):
        total[i] = total.get(i, 0.0) + w
    return tuple((i, 1, weight.dtype.type(w).item()) for i, w in total.items() if w != 0)


def _view(ndim: int, axis: int, start: int, step: int, count: int) -> tuple:
    where = [slice(None)] * ndim
    where[axis] = slice(start, start + step * (count - 1) + 1, step)
    return tuple(where)


def _phase(x: np.ndarray, y: np.ndarray, ax: _Axis, ph: _Phase) -> None:
    dst = y[_view(y.ndim, ax.axis, ph.start, ph.step, ph.count)]
    srcs = [(x[_view(x.ndim, ax.axis, s, st, ph.count)], w) for s, st, w in ph.taps]
    if not srcs:
        dst[...] = 0
        return
    if srcs[0][1] is None or (len(srcs) == 1 and abs(srcs[0][1] - 1) <= _WEIGHT_TOL):
        np.copyto(dst, srcs[0][0])
        return
    # numpy's arithmetic loops are slow into an output strided along its innermost axis (about
    # 5x a contiguous one): there the phase is computed contiguous and copied in once.
    strided = ax.axis == y.ndim - 1 and ph.step != 1
    out = np.empty(dst.shape, dst.dtype) if strided else dst
    if len(srcs) == 2 and abs(srcs[0][1] + srcs[1][1] - 1) <= _WEIGHT_TOL:
        (a, _), (b, wb) = srcs
        np.subtract(b, a, out=out)  # a + wb * (b - a): three passes, no temporary
        out *= wb
        out += a
    else:
        np.multiply(srcs[0][0], srcs[0][1], out=out)
        for src, w in srcs[1:]:
            out += src * w
    if strided:
        np.copyto(dst, out)


def _gather(x: np.ndarray, y: np.ndarray, ax: _Axis) -> None:
    """The outputs outside the phases (all of them on a non-periodic axis), by ``np.take``: written
    straight into ``y`` when they are the whole axis, two taps as ``a + w * (b - a)`` in place."""
    full = len(ax.rest) == ax.out_size
    shape = [1] * y.ndim
    shape[ax.axis] = len(ax.rest)
    part = list(y.shape)
    part[ax.axis] = len(ax.rest)
    dst = y if full else np.empty(part, y.dtype)
    if ax.weight is None:
        np.take(x, ax.index[:, 0], axis=ax.axis, out=dst)
    elif ax.index.shape[1] == 2 and np.all(np.abs(ax.weight.sum(axis=1) - 1) <= _WEIGHT_TOL):
        np.take(x, ax.index[:, 0], axis=ax.axis, out=dst)
        b = np.take(x, ax.index[:, 1], axis=ax.axis)
        b -= dst
        b *= ax.weight[:, 1].reshape(shape)
        dst += b
    else:
        np.take(x, ax.index[:, 0], axis=ax.axis, out=dst)
        dst *= ax.weight[:, 0].reshape(shape)
        for t in range(1, ax.index.shape[1]):
            term = np.take(x, ax.index[:, t], axis=ax.axis)
            term *= ax.weight[:, t].reshape(shape)
            dst += term
    if not full:
        where = [slice(None)] * y.ndim
        where[ax.axis] = ax.rest
        y[tuple(where)] = dst


def run_axis(x: np.ndarray, ax: _Axis, out: Optional[np.ndarray] = None) -> np.ndarray:
    shape = list(x.shape)
    shape[ax.axis] = ax.out_size
    y = np.empty(shape, x.dtype) if out is None else out
    for ph in ax.phases:
        _phase(x, y, ax, ph)
    if ax.rest is not None:
        _gather(x, y, ax)
    return y


@dataclass(frozen=True)
class _Program:
    plan: ResizePlan
    axes: tuple         # compiled axes, on the input seen as [planes, *axes from ``lead`` on]
    compute: np.dtype
    lead: int           # leading axes that no pass touches, folded into one planes axis
    block: int          # planes per block


def compile_plan(plan: ResizePlan, in_shape: tuple, dtype: np.dtype) -> _Program:
    compute = dtype if dtype in _DIRECT or dtype.kind in "iub" else np.dtype(np.float32)
    lead = min((t.axis for t in plan.axes), default=len(in_shape))
    rank = len(in_shape)
    # The innermost axis first: its passes are the slow strided ones, so they get the smaller array.
    order = sorted(plan.axes, key=lambda t: (t.out_size / t.in_size, t.axis != rank - 1))
    moved = [AxisTaps(1 + t.axis - lead, t.in_size, t.out_size, t.index, t.weight, t.outside) for t in order]
    plane = int(np.prod(plan.out_shape[lead:], dtype=np.int64)) * compute.itemsize
    block = max(1, BLOCK_BYTES // max(plane, 1))
    return _Program(plan, tuple(compile_axis(t, compute) for t in moved), compute, lead, block)


# Planes (the leading axes no pass touches, e.g. N x C) are resampled a block at a time, so a
# pass's temporaries and the next pass's input stay in cache: each axis costs 3-4 numpy passes
# over its output, which from DRAM cost more than the whole resize does from L2.
BLOCK_BYTES = 1 << 20


def run_program(prog: _Program, x: np.ndarray, extrapolation_value: float) -> np.ndarray:
    if not prog.axes:
        y = x.astype(prog.compute)
    else:
        planes = int(np.prod(x.shape[:prog.lead], dtype=np.int64))
        src = x.reshape((planes,) + x.shape[prog.lead:])
        y = np.empty((planes,) + tuple(prog.plan.out_shape[prog.lead:]), prog.compute)
        for b in range(0, planes, prog.block):
            part = src[b:b + prog.block]
            if part.dtype != prog.compute:
                part = part.astype(prog.compute)
            for ax in prog.axes[:-1]:
                part = run_axis(part, ax)
            run_axis(part, prog.axes[-1], out=y[b:b + prog.block])
    y = y.reshape(prog.plan.out_shape)
    if prog.plan.extrapolates:
        y = fill_outside(y, prog.plan, extrapolation_value)
    return y if y.dtype == x.dtype else saturate(y, x.dtype)


def resize(node, attrs) -> Callable[..., Any]:
    dt = input_dtype(node)
    attrs = {**DEFAULTS, **attrs}
    if dt.kind in "iu" and attrs["mode"] != "nearest":
        return reference_kernel(node, attrs)
    given = [i for i in (1, 2, 3) if i < len(node.inputs) and node.inputs[i] is not None]
    constant = all(const_input(node, i) is not None for i in given)
    programs: dict = {}
    ev = float(attrs["extrapolation_value"])

    def run(x, roi=None, scales=None, sizes=None):
        key = (x.shape, x.dtype.str) if constant else (x.shape, x.dtype.str, *(
            None if a is None else (a.dtype.str, a.tobytes()) for a in (roi, scales, sizes)))
        prog = programs.get(key)
        if prog is None:
            if len(programs) > 64:
                programs.clear()  # a model fed ever new shapes must not grow without bound
            prog = compile_plan(resize_plan(x.shape, roi, scales, sizes, attrs), x.shape, x.dtype)
            programs[key] = prog
        return run_program(prog, x, ev)
    run.fresh = True  # every result is a new array (runtime/plan.py: later ops may write into it)
    return run
