"""Convolution (N-d, float32 and float16) through cuDNN, reached from CuPy device pointers by nvidia-cudnn-frontend.

Why: the CuPy-only path (nn.py: im2col + cuBLAS) copies every input window into a column
buffer and runs a plain GEMM; on the device's H200 that ran 1.6x to 9.2x slower than cuDNN on
3x3 convolutions (issue 8). CuPy 14 there has no cuDNN module, but cuDNN itself is on the
machine (torch's wheels bring it), and the frontend's Python graph API takes raw device
pointers, so no torch is needed at run time. The frontend is an optional dependency (the
``gpu`` extra); when it does not import or its self-test fails, ``available()`` says no, and
``why_unavailable()`` says why, and the Conv kernel keeps the im2col path.

How: one frontend graph per (input shape, weight shape, pads, strides, dilations, epilogue,
TF32): ``conv_fprop``, then the epilogue the caller asks for (the [1, M, 1, 1] bias, a
residual tensor, ReLU: the ``kiln.FusedEpilogue`` patterns of ResNet-style blocks) as pointwise
ops of the same cuDNN graph, built once: validate, build_operation_graph,
create_execution_plans (heuristics A, then FALLBACK), deselect engines by numerical note,
deselect engines needing more workspace than the program's cap (unless none is left),
check_support, build_plans (the heuristics' first engine that builds). When no engine takes the
whole epilogue, shorter prefixes of it are tried down to the bare convolution, and the caller
applies what is left (``Plan.fused`` says how far cuDNN got). N-d convolutions (1-D as 2-D
with a unit height, 3-D as is) and grouped convolutions are described by the weight's
[M, C/group, *k] dims; a shape cuDNN refuses raises ``Unsupported`` at build and the caller
keeps im2col for it.

TF32: for float32, engines whose numerical notes say TENSOR_CORE or DOWN_CONVERT_INPUTS (the
TF32 ones) are deselected unless TF32 is allowed (the program's ``CudaOptions.tf32``), the same
filter torch applies for ``cudnn.allow_tf32 = False``. Only float32 takes this path; float64
stays on im2col.

Settings (issue 17): each ``Executor`` takes its program's TF32 switch, workspace cap and
epilogue fusion when it is made (at load, from the bound ``CudaOptions``), and the plan cache is
keyed by the two that change which engine is chosen (TF32, the cap; epilogue fusion changes the
epilogue asked for, already in the key): two programs with different settings share a plan only
where it is the same plan. ``set_mode``, ``WORKSPACE_CAP`` and ``FUSE_EPILOGUE`` are the
deprecated process defaults (``set_mode`` sets the default of programs made afterwards; the two
constants are what the environment said at import, for reports, and are read by nothing here).

Streams and CUDA graphs: one cuDNN handle per (device, stream), like linalg's cuBLAS handles,
created on first use outside a capture, and one workspace per (device, stream), shared by every
convolution on it and grown (outside captures) to the largest plan's need (``workspace``); a
captured graph keeps its stream's workspace alive (``pinned``), so a capture allocates nothing.
Whether an execute can be captured at all is checked once by the self-test (capture a small
convolution, replay it, compare): ``capture_ok()``; if it cannot, the Conv kernel uses im2col
while a stream is capturing.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import cupy as cp
import numpy as np

from kiln.runtime.cuda_options import CONV_DEFAULT, CONV_MODES, DEFAULT_WORKSPACE_MIB
from kiln.runtime.kernels.cuda import options

_STATE: dict = {"module": None, "checked": False, "why": None, "capture": None, "handles": {}}
_PLANS: dict = {}   # key -> Plan, or an Unsupported instance (the reason is kept)
_WORKSPACES: dict = {}  # (device, stream ptr) -> the stream's workspace (see workspace())
_LOCK = threading.Lock()
# "auto": cuDNN from nn.CUDNN_MIN_BATCH samples up, im2col below (nn.py explains why);
# "cudnn" / "im2col": force one (tests, benchmarks). Per program: CudaOptions.conv; KILN_CUDA_CONV
# or set_mode (deprecated) set the default.
_MODE = CONV_DEFAULT
# Engines needing a workspace above this many bytes are passed over while another engine takes
# the same graph (then, and only then, the cap is dropped): the heuristics' first choice for some
# of ResNet-50's shapes at batch 32 wanted 170 MiB on an H200. Per program:
# CudaOptions.cudnn_workspace_mib (default KILN_CUDNN_WORKSPACE_MIB, "none": no cap); the constant
# below is the environment's value at import, kept for reports. The workspace is one buffer per
# stream (``workspace``), so the cap bounds it.
_cap = os.environ.get("KILN_CUDNN_WORKSPACE_MIB", "32")
WORKSPACE_CAP = None if _cap.lower() == "none" else int(float(_cap) * (1 << 20))
# Residual add and ReLU inside the cuDNN graph (where an engine takes them); KILN_CUDNN_EPILOGUE=0
# (per program: CudaOptions.cudnn_epilogue=False) keeps cuDNN to convolution + bias, the rest then
# being one pass after it (for A/B timing). The constant is the environment's at import (reports).
FUSE_EPILOGUE = os.environ.get("KILN_CUDNN_EPILOGUE", "1") != "0"


class Unsupported(Exception):
    """cuDNN has no engine for this convolution (or the frontend refused it)."""


def set_mode(mode: Optional[str]) -> None:
    """Deprecated (issue 17): the conv path of programs made afterwards without ``conv=``
    (None: back to KILN_CUDA_CONV / "auto"). Programs already loaded keep theirs."""
    if mode is not None and mode not in CONV_MODES:
        raise ValueError(f"conv mode must be auto, cudnn or im2col, not {mode!r}")
    _MODE["mode"] = mode


def mode() -> str:
    """The conv path of the bound program (or of a program made now)."""
    return options().conv


_DEFAULT_CAP = int(DEFAULT_WORKSPACE_MIB * (1 << 20))
_FROM_OPTIONS = object()


def _module():
    """The ``cudnn`` frontend module, or None (the reason kept in _STATE["why"])."""
    if _STATE["module"] is None and _STATE["why"] is None:
        try:
            import cudnn  # noqa: PLC0415 - optional dependency
            cudnn.backend_version()
            _STATE["module"] = cudnn
        except Exception as e:  # noqa: BLE001 - any failure means "no cuDNN here"
            _STATE["why"] = f"nvidia-cudnn-frontend unusable: {type(e).__name__}: {e}"
    return _STATE["module"]


def _handle(stream):
    key = (cp.cuda.Device().id, stream.ptr)
    h = _STATE["handles"].get(key)
    if h is None:
        cudnn = _STATE["module"]
        h = cudnn.create_handle()
        cudnn.set_stream(h, stream.ptr)
        _STATE["handles"][key] = h
    return h


def capturing() -> bool:
    s = cp.cuda.get_current_stream()
    probe = getattr(s, "is_capturing", None)
    if probe is not None:
        return bool(probe())
    return cp.cuda.runtime.streamIsCapturing(s.ptr) != 0


class Plan:
    """A built cuDNN graph for one convolution key; executes on any buffers of that shape.

    ``epilogue`` asks for ops after the convolution inside the same cuDNN graph, in this order:
    ``"bias"`` (add the [1, M, 1, 1] bias), ``"residual"`` (add a tensor of the output's
    shape), ``"relu"``. Engines for a fused graph may not exist (for float32 without tensor
    cores most fused patterns have none), so the build tries the whole epilogue first, then
    ever shorter prefixes of it, down to the bare convolution; ``fused`` is the prefix that
    built, and the caller applies the rest itself."""

    def __init__(self, cudnn, x_shape, w_shape, pre, post, strides, dilations, epilogue: tuple, tf32: bool,
                 workspace_cap: Optional[int] = _DEFAULT_CAP, dtype: str = "float32", layout: str = "nchw"):
        f32 = cudnn.data_type.FLOAT
        # float16; bfloat16 is held as uint16 words (cuda/__init__.py: a convolution's uint16 array is bfloat16)
        io = {"float16": cudnn.data_type.HALF, "uint16": cudnn.data_type.BFLOAT16}.get(str(dtype), f32)
        self.layout = layout
        last = None
        attempts = [(n, cap) for n in range(len(epilogue), -1, -1)
                    for cap in ((workspace_cap, None) if workspace_cap is not None else (None,))]
        for n, cap in attempts:
            try:
                self._build(cudnn, f32, x_shape, w_shape, pre, post, strides, dilations, epilogue[:n], tf32, cap, io)
                self.fused = tuple(epilogue[:n])
                self.capped = cap is not None
                break
            except Exception as e:  # noqa: BLE001 - the frontend raises several types
                last = e
        else:
            raise Unsupported(f"{type(last).__name__}: {last}")
        self.workspace_bytes = int(self.graph.get_workspace_size())

    @property
    def fused_bias(self) -> bool:
        return "bias" in self.fused

    def _build(self, cudnn, f32, x_shape, w_shape, pre, post, strides, dilations, epilogue, tf32, cap, io=None):
        # float16 (issue 18): tensors in half, the convolution and its epilogue computed in float32.
        io = f32 if io is None else io
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32)
        st = _channels_last if self.layout == "nhwc" else _row_major
        X = g.tensor(name="X", dim=list(x_shape), stride=st(x_shape), data_type=io)
        W = g.tensor(name="W", dim=list(w_shape), stride=st(w_shape), data_type=io)
        Y = g.conv_fprop(image=X, weight=W, pre_padding=list(pre), post_padding=list(post),
                         stride=list(strides), dilation=list(dilations), compute_data_type=f32)
        nsp = len(x_shape) - 2
        # The output's layout is stated, not inferred: left to the frontend, a conv output can get
        # a channels-last stride order, and the NCHW buffer handed to execute would be misread.
        out = [x_shape[0], w_shape[0]] + [(x_shape[i + 2] + pre[i] + post[i] - (w_shape[i + 2] - 1) * dilations[i] - 1)
                                          // strides[i] + 1 for i in range(nsp)]
        B = R = None
        for step in epilogue:
            if step == "bias":
                m = w_shape[0]
                B = g.tensor(name="B", dim=[1, m] + [1] * nsp, stride=st([1, m] + [1] * nsp), data_type=io)
                Y = g.add(a=Y, b=B, compute_data_type=f32)
            elif step == "residual":
                R = g.tensor(name="R", dim=list(out), stride=st(out), data_type=io)
                Y = g.add(a=Y, b=R, compute_data_type=f32)
            elif step == "relu":
                Y = g.relu(input=Y, compute_data_type=f32)
            else:
                raise ValueError(f"unknown epilogue step {step!r}")
        Y.set_output(True).set_data_type(io).set_dim(out).set_stride(st(out))
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if not tf32 and io is f32:  # half runs on tensor cores by design
            g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS])
        if cap is not None:
            g.deselect_workspace_greater_than(cap)
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
        self.graph = g
        self.uids = (X.uid, W.uid, None if B is None else B.uid, None if R is None else R.uid, Y.uid)
        self.out_shape = tuple(out)

    def execute(self, x, w, b, y, workspace, residual=None) -> None:
        """y = epilogue(conv(x, w)) for the fused steps, on the current stream."""
        xu, wu, bu, ru, yu = self.uids
        pack = {xu: x.data.ptr, wu: w.data.ptr, yu: y.data.ptr}
        if bu is not None:
            pack[bu] = b.data.ptr
        if ru is not None:
            pack[ru] = residual.data.ptr
        ws = None if workspace is None else workspace.ptr
        self.graph.execute(pack, ws, handle=_handle(cp.cuda.get_current_stream()))


def _channels_last(shape) -> list:
    """NHWC strides (in elements) of a logical [N, C, *spatial] tensor: C the fastest dim."""
    n, c, *sp = (max(int(d), 1) for d in shape)
    inner = [0] * len(sp)
    acc = c
    for i in range(len(sp) - 1, -1, -1):
        inner[i] = acc
        acc *= sp[i]
    return [acc, 1] + inner


def is_channels_last(a) -> bool:
    """Whether ``a`` ([N, C, *spatial]) is laid out NHWC in memory (a transposed view of an NHWC buffer)."""
    return a.ndim >= 3 and list(s // a.itemsize for s in a.strides) == _channels_last(a.shape)


def channels_last(a):
    """``a`` laid out NHWC (a view when it already is, else one copy): the logical shape is unchanged."""
    if is_channels_last(a):
        return a
    perm = (0,) + tuple(range(2, a.ndim)) + (1,)
    inv = (0, a.ndim - 1) + tuple(range(1, a.ndim - 1))
    return cp.ascontiguousarray(a.transpose(perm)).transpose(inv)


def empty_channels_last(shape, dtype):
    perm_shape = (shape[0],) + tuple(shape[2:]) + (shape[1],)
    inv = (0, len(shape) - 1) + tuple(range(1, len(shape) - 1))
    return cp.empty(perm_shape, dtype).transpose(inv)


def _row_major(shape) -> list:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(int(d), 1)
    return strides[::-1]


def plan(x_shape, w_shape, pre, post, strides, dilations, epilogue=(), *, tf32: Optional[bool] = None,
         workspace_cap=_FROM_OPTIONS, dtype: str = "float32", layout: str = "nchw") -> Plan:
    """The built plan for this float32 convolution and epilogue (cached), or raise Unsupported.
    ``tf32`` and ``workspace_cap`` (bytes, None: no cap) default to the bound program's."""
    cudnn = _module()
    if cudnn is None:
        raise Unsupported(_STATE["why"])
    if tf32 is None:
        tf32 = options().tf32
    if workspace_cap is _FROM_OPTIONS:
        workspace_cap = options().workspace_cap_bytes
    key = (tuple(x_shape), tuple(w_shape), tuple(pre), tuple(post), tuple(strides), tuple(dilations),
           tuple(epilogue), bool(tf32), workspace_cap, str(np.dtype(dtype)), layout)
    with _LOCK:
        p = _PLANS.get(key)
        if p is None:
            if capturing():
                raise Unsupported("no cuDNN plan is built while a stream is capturing")
            try:
                p = Plan(cudnn, *key)
            except Unsupported as e:
                p = e
            _PLANS[key] = p
    if isinstance(p, Unsupported):
        raise p
    return p


def workspace(nbytes: int):
    """The cuDNN workspace of the current stream, at least ``nbytes`` (None for 0).

    One buffer per (device, stream), shared by every convolution run on that stream (they run
    one after another), grown when a plan needs more. A grown-out buffer is not freed while a
    CUDA graph may point at it: ``CudaProgram`` captures each graph on a private stream right
    after an eager warm-up on that stream (so nothing grows inside the capture, and the buffer is
    already big enough), and keeps that stream's buffers alive with the graph (``pinned``).
    Before this, every Conv node kept a workspace of its own: ResNet-50 at batch 32 peaked at 846
    MiB on an H200 against torch's 464."""
    if nbytes <= 0:
        return None
    stream = cp.cuda.get_current_stream()
    key = (cp.cuda.Device().id, stream.ptr)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.mem.size < nbytes:
        if capturing():
            raise Unsupported("cuDNN workspace would grow inside a capture")
        ws = _WORKSPACES[key] = cp.cuda.memory.alloc(nbytes)
    return ws


def pinned(stream) -> list:
    """The workspace buffers a graph captured on ``stream`` may point at (keep them alive with it)."""
    ws = _WORKSPACES.get((cp.cuda.Device().id, stream.ptr))
    return [] if ws is None else [ws]


class Executor:
    """One Conv node's cuDNN path; the plans are shared across nodes of the same key, the
    workspace across everything on the stream (``workspace``). ``tf32``, ``workspace_cap``
    (bytes) and ``fuse_epilogue`` default to the bound program's options, taken now (at load)."""

    def __init__(self, w, b, strides, dilations, *, tf32: Optional[bool] = None, workspace_cap=_FROM_OPTIONS,
                 fuse_epilogue: Optional[bool] = None):
        self.w, self.b = w, b  # device arrays: [M, C/group, *k] and [1, M, 1, ...] (or None)
        # float16 2-D convolutions run channels-last (NHWC: tensor cores without layout transforms inside
        # cuDNN; torch's channels_last): the weights are kept KRSC, inputs made NHWC (a view when the
        # previous convolution already wrote NHWC), outputs written NHWC (logical NCHW views, so every
        # other kernel reads them through their strides).
        self.layout = "nhwc" if w.dtype in (np.float16, np.uint16) and w.ndim == 4 else "nchw"
        if self.layout == "nhwc":
            self.w = channels_last(w)
        self.strides, self.dilations = tuple(strides), tuple(dilations)
        opts = options() if tf32 is None or workspace_cap is _FROM_OPTIONS or fuse_epilogue is None else None
        self.tf32 = opts.tf32 if tf32 is None else bool(tf32)
        self.workspace_cap = opts.workspace_cap_bytes if workspace_cap is _FROM_OPTIONS else workspace_cap
        self.fuse_epilogue = opts.cudnn_epilogue if fuse_epilogue is None else bool(fuse_epilogue)

    def epilogue(self, residual: bool = False, relu: bool = False) -> tuple:
        return tuple(s for s, on in (("bias", self.b is not None), ("residual", residual), ("relu", relu)) if on)

    def plan_for(self, x_shape, pre, post, epilogue=None) -> Plan:
        if epilogue is None:
            epilogue = self.epilogue()
        return plan(x_shape, self.w.shape, pre, post, self.strides, self.dilations, epilogue,
                    tf32=self.tf32, workspace_cap=self.workspace_cap, dtype=self.w.dtype, layout=self.layout)

    def __call__(self, x, pre, post, out_shape, residual=None, relu: bool = False, finish=None):
        """conv(x) + bias [+ residual] [then relu]. The steps cuDNN did not fuse are done by
        ``finish(y, bias or None, residual or None, relu)`` in place (default: CuPy ops)."""
        ep = self.epilogue(residual is not None, relu)
        if not self.fuse_epilogue:
            ep = ep[:1] if ep[:1] == ("bias",) else ()
        p = self.plan_for(x.shape, pre, post, ep)
        expected = (x.shape[0], self.w.shape[0]) + tuple(out_shape)
        if p.out_shape is not None and tuple(p.out_shape) != expected:
            raise Unsupported(f"cuDNN infers output {p.out_shape}, ONNX {expected}")
        ws = workspace(p.workspace_bytes)
        nhwc = self.layout == "nhwc"
        x = channels_last(x) if nhwc else cp.ascontiguousarray(x)
        y = empty_channels_last(expected, x.dtype) if nhwc else cp.empty(expected, x.dtype)
        if residual is not None and "residual" in p.fused:
            residual = channels_last(residual) if nhwc else cp.ascontiguousarray(residual)
        p.execute(x, self.w, self.b if p.fused_bias else None, y, ws, residual)
        b = None if p.fused_bias else self.b
        r = None if residual is None or "residual" in p.fused else residual
        act = relu and "relu" not in p.fused
        if b is not None or r is not None or act:
            (finish or _finish)(y, b, r, act)
        return y


def _finish(y, b, r, relu: bool) -> None:
    if b is not None:
        y += b
    if r is not None:
        y += r
    if relu:
        cp.maximum(y, 0, out=y)


def available() -> bool:
    """Whether cuDNN convolution works here: the frontend imports, and a small convolution
    (3x3, padded, strided, with bias) matches a float64 reference. Checked once."""
    if not _STATE["checked"]:
        _STATE["checked"] = True
        if _module() is not None:
            try:
                _self_test()
            except Exception as e:  # noqa: BLE001
                _STATE["why"] = f"cuDNN self-test failed: {type(e).__name__}: {e}"
                _STATE["module"] = None
    return _STATE["module"] is not None


def why_unavailable() -> Optional[str]:
    return _STATE["why"]


def capture_ok() -> bool:
    """Whether a cuDNN execute can be captured into a CUDA graph (probed by the self-test)."""
    return bool(_STATE["capture"]) and available()


def capture_failure() -> Optional[str]:
    c = _STATE["capture"]
    return None if c is True else c


def _reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, pad: int, stride: int) -> np.ndarray:
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, c, h, wd = x.shape
    m, _, kh, kw = w.shape
    oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
    y = np.zeros((n, m, oh, ow))
    for i in range(kh):
        for j in range(kw):
            patch = x[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
            y += np.einsum("nchw,mc->nmhw", patch, w[:, :, i, j].astype(np.float64))
    return y + b.reshape(1, m, 1, 1)


def _self_test() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 8, 9, 9)).astype(np.float32)
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    want = _reference(x, w, b, 1, 2)
    # Strict float32 and the default cap, whatever program asked first.
    ex = Executor(cp.asarray(w), cp.asarray(b.reshape(1, 16, 1, 1)), (2, 2), (1, 1), tf32=False,
                  workspace_cap=_DEFAULT_CAP, fuse_epilogue=True)
    got = ex(cp.asarray(x), (1, 1), (1, 1), want.shape[2:]).get()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    if not err < 1e-5:
        raise RuntimeError(f"relative error {err:.2e} against float64 (TF32 engines not deselected?)")
    # The longest epilogue, whatever part of it cuDNN fuses.
    r = rng.standard_normal(want.shape).astype(np.float32)
    want2 = np.maximum(want + r, 0)
    got2 = ex(cp.asarray(x), (1, 1), (1, 1), want.shape[2:], residual=cp.asarray(r), relu=True).get()
    err = np.linalg.norm(got2 - want2) / np.linalg.norm(want2)
    if not err < 1e-5:
        raise RuntimeError(f"bias + residual + relu epilogue: relative error {err:.2e} against float64")
    # Capture probe: the same convolution captured on a private stream, replayed, compared.
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        with stream:
            xd = cp.asarray(x)
            ex(xd, (1, 1), (1, 1), want.shape[2:])  # handle and workspace for this stream, outside the capture
            stream.synchronize()
            stream.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
            try:
                y = ex(xd, (1, 1), (1, 1), want.shape[2:])
            finally:
                graph = stream.end_capture()
            y.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
        err = np.linalg.norm(y.get() - want) / np.linalg.norm(want)
        _STATE["capture"] = True if err < 1e-5 else f"captured replay wrong (relative error {err:.2e})"
    except Exception as e:  # noqa: BLE001
        _STATE["capture"] = f"{type(e).__name__}: {e}"


__all__ = ["available", "why_unavailable", "capture_ok", "capture_failure", "capturing", "Executor",
           "Unsupported", "set_mode", "mode", "plan", "workspace", "pinned"]
