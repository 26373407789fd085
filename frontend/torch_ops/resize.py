"""Resizing: ``F.interpolate`` (what ``nn.Upsample``, ``nn.UpsamplingNearest2d/Bilinear2d`` and the
deprecated ``F.upsample*`` call) and torch's low-level ``torch._C._nn.upsample_*`` kernels, as the
IR's Resize (ONNX Resize-19 meaning) wherever that is exact.

The tracer sees ``F.interpolate`` itself (it dispatches ``__torch_function__`` before doing anything),
so the table is written in its vocabulary; the ``upsample_*`` builtins it calls are mapped too, for
code that calls them directly. How torch's modes read as ONNX coordinate modes:

============================  ==================================================================
torch                         Resize
============================  ==================================================================
nearest                       nearest, asymmetric, nearest_mode=floor
nearest-exact                 nearest, half_pixel, nearest_mode=round_prefer_ceil
(bi/tri)linear, bicubic       linear / cubic (a=-0.75), half_pixel, or align_corners
antialias=True                linear / cubic (a=-0.5, torch's and PIL's), antialias=1,
                              exclude_outside=1 (torch never reads past the edge)
area                          AveragePool / GlobalAveragePool when the window is even, else one
                              constant averaging MatMul per axis (static sizes only)
lanczos; antialias with       one constant MatMul per axis, the weights taken from torch's own
align_corners=True            kernel on a one-hot input (static sizes only: ONNX has no lanczos,
                              and torch's antialiased align_corners is a half-pixel rule with
                              scale (in-1)/(out-1), which no Resize mode can say)
============================  ==================================================================

Scales. With ``scale_factor`` (and ``recompute_scale_factor`` not set) torch maps coordinates with
1/scale_factor and sizes the output floor(in * scale_factor) in double; Resize's ``scales`` do the
same with a float32 scale. So a float32 scale is picked that gives torch's size at a static dim;
at a symbolic dim an exactly representable factor (2, 0.5, 1.5...) is exact for every size, and
any other is rounded up and the extra row sliced off at run time, to floor(in * factor) computed
in float64 as torch does. With ``size``, ``recompute_scale_factor=True`` or ``align_corners=True``
the coordinates depend on the sizes only: Resize gets ``sizes`` (symbolic when they are).

Nearest's index rules are discrete, and torch computes them in float32 with two special cases
(out == in copies, out == 2 * in shifts), so they are checked against torch's own kernel at trace
time: for a static axis the Resize table must equal torch's (else the axis becomes a Gather of
torch's indices); for a symbolic axis with a scale factor, for every input size up to
``NEAREST_CHECK_SIZES`` (else refused). Sizes given as symbolic values cannot be enumerated; see
docs/NOTES.md.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from kiln.errors import UnsupportedOpError
from kiln.frontend.symbolic import SymInt
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import dim_of
from kiln.ir.dtypes import DType
from kiln.ir.ops.resize import axis_taps

# Symbolic axes with a nearest scale factor are checked against torch for every size up to this.
NEAREST_CHECK_SIZES = 512

_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3, "bicubic": 2}
_AA_OPS = {"bilinear": "_upsample_bilinear2d_aa", "bicubic": "_upsample_bicubic2d_aa",
           "lanczos": "_upsample_lanczos2d_aa"}
_NEAREST_OPS = {"nearest": "upsample_nearest1d", "nearest-exact": "_upsample_nearest_exact1d"}


def _resize_attrs(mode: str, align_corners: bool, antialias: bool) -> dict:
    if mode == "nearest":
        return {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
    if mode == "nearest-exact":
        return {"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
                "nearest_mode": "round_prefer_ceil"}
    attrs = {"mode": "cubic" if mode == "bicubic" else "linear",
             "coordinate_transformation_mode": "align_corners" if align_corners else "half_pixel"}
    if mode == "bicubic":
        attrs["cubic_coeff_a"] = -0.5 if antialias else -0.75
    if antialias:
        attrs.update(antialias=1, exclude_outside=1)
    return attrs


def _per_axis(v: Any, n: int) -> list:
    if isinstance(v, (list, tuple, torch.Size)):
        return list(v)
    return [v] * n


# ---------------------------------------------------------------------------- F.interpolate
@maps(F.interpolate)
def interpolate(t, res, input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                recompute_scale_factor=None, antialias=False):
    # torch has run the call already: the arguments are valid for it.
    n = input.dim() - 2
    if size is not None:
        return _emit(t, res, input, mode, bool(align_corners), bool(antialias),
                     sizes=_per_axis(size, n), scales=[None] * n)
    factors = [float(s) for s in _per_axis(scale_factor, n)]
    if recompute_scale_factor or mode == "area":
        sizes = [_floor_mul(t, input, 2 + i, s) for i, s in enumerate(factors)]
        return _emit(t, res, input, mode, bool(align_corners), bool(antialias), sizes=sizes, scales=[None] * n,
                     size_factors=factors)
    return _emit(t, res, input, mode, bool(align_corners), bool(antialias), sizes=None, scales=factors)


@maps(F.upsample)
def upsample(t, res, input, size=None, scale_factor=None, mode="nearest", align_corners=None):
    return interpolate(t, res, input, size, scale_factor, mode, align_corners)


@maps(F.upsample_nearest)
def upsample_nearest(t, res, input, size=None, scale_factor=None):
    return interpolate(t, res, input, size, scale_factor, "nearest")


@maps(F.upsample_bilinear)
def upsample_bilinear(t, res, input, size=None, scale_factor=None):
    return interpolate(t, res, input, size, scale_factor, "bilinear", True)


# ---------------------------------------------------------------------------- torch's kernels
_SCALE_NAMES = ("scales_d", "scales_h", "scales_w")


def _low_level(mode: str, n: int, has_align: bool, antialias: bool = False):
    """A handler for one of torch's kernels: ``(input, output_size[, align_corners], scale_factors)``
    (the .vec form) or ``(input, output_size[, align_corners], scales_h=None, scales_w=None)``."""
    def handler(t, res, input, output_size=None, *args, **kwargs):
        args = list(args)
        if has_align:
            align = bool(args.pop(0) if args else kwargs.pop("align_corners", False))
        else:
            align = False
        if "scale_factors" in kwargs:
            args = [kwargs.pop("scale_factors")]
        names = ("scales",) if n == 1 else _SCALE_NAMES[3 - n:]
        args += [kwargs.pop(k) for k in names[len(args):] if k in kwargs]
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            scales = [None if s is None else float(s) for s in args[0]]  # the .vec form
        else:
            scales = [None if s is None else float(s) for s in args] + [None] * (n - len(args))
        if output_size is None:
            return _emit(t, res, input, mode, align, antialias, sizes=None, scales=scales)
        return _emit(t, res, input, mode, align, antialias, sizes=list(output_size), scales=scales)

    handler.__name__ = f"upsample_{mode}{n}d"
    return handler


_nn = torch._C._nn
for _n in (1, 2, 3):
    maps(getattr(_nn, f"upsample_nearest{_n}d"))(_low_level("nearest", _n, False))
    maps(getattr(_nn, f"_upsample_nearest_exact{_n}d"))(_low_level("nearest-exact", _n, False))
maps(_nn.upsample_linear1d)(_low_level("linear", 1, True))
maps(_nn.upsample_bilinear2d)(_low_level("bilinear", 2, True))
maps(_nn.upsample_trilinear3d)(_low_level("trilinear", 3, True))
maps(_nn.upsample_bicubic2d)(_low_level("bicubic", 2, True))
maps(_nn._upsample_bilinear2d_aa)(_low_level("bilinear", 2, True, antialias=True))
maps(_nn._upsample_bicubic2d_aa)(_low_level("bicubic", 2, True, antialias=True))
if hasattr(_nn, "_upsample_lanczos2d_aa"):
    maps(_nn._upsample_lanczos2d_aa)(_low_level("lanczos", 2, True, antialias=True))


# ---------------------------------------------------------------------------- the emitter
def _emit(t, res, input, mode: str, align_corners: bool, antialias: bool, *, sizes: Optional[list],
          scales: list, size_factors: Optional[list] = None):
    """The IR for one resize of ``input``'s spatial axes. ``sizes`` (ints/SymInts) or, when None,
    the ``scales`` (one float per axis) give the output; with sizes, ``scales`` may still hold the
    factors torch maps coordinates with (its low-level kernels take both). ``size_factors``: the
    sizes are floor(in * factor) (recompute_scale_factor), which nearest's check can enumerate."""
    n = input.dim() - 2
    x = t.value(input)
    dims = list(x.type.shape[2:])
    out = list(res.shape[2:])
    static = all(isinstance(d, int) for d in dims)
    if res.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64) and \
            not mode.startswith("nearest"):
        raise UnsupportedOpError(f"{t.where()}: F.interpolate(mode='{mode}') of a {res.dtype} tensor is not "
                                 "supported: torch rounds integer interpolation in fixed point; cast to float")
    if sizes is not None and any(isinstance(s, torch.Tensor) for s in sizes):
        raise UnsupportedOpError(f"{t.where()}: F.interpolate with sizes given as tensors is not supported; "
                                 "give ints (x.shape[i] stays symbolic)")
    if mode == "area":
        return _area(t, input, x, dims, out)
    if mode == "lanczos" or (antialias and align_corners):
        if not static:
            what = "mode='lanczos'" if mode == "lanczos" else "antialias=True with align_corners=True"
            raise UnsupportedOpError(f"{t.where()}: F.interpolate({what}) needs static spatial sizes "
                                     f"(got {dims}): it maps to constant per-axis weights")
        return _matrices(t, x, mode, align_corners, dims, out, scales)
    attrs = _resize_attrs(mode, align_corners, antialias)
    use_scales = sizes is None and not align_corners
    if sizes is None:
        if align_corners:  # coordinates use the sizes only
            sizes = [_floor_mul(t, input, 2 + i, s) for i, s in enumerate(scales)]
    elif any(s is not None for s in scales) and not align_corners:
        # torch's low-level form with both: Resize's scales say it when they give the same size.
        if static and all(s is not None and int(float(np.float32(s)) * d) == o
                          for s, d, o in zip(scales, dims, out)):
            use_scales = True
        else:
            raise UnsupportedOpError(f"{t.where()}: a resize to sizes {out} with coordinate scales {scales} "
                                     "has no Resize form")
    if mode.startswith("nearest"):
        gathered = _check_nearest(t, mode, dims, out, scales if use_scales else [None] * n, attrs, static,
                                  None if use_scales else size_factors)
        if gathered is not None:
            return _gather(t, x, gathered)
    if use_scales:
        return _with_scales(t, input, x, attrs, dims, out, scales)
    return _with_sizes(t, input, x, attrs, sizes)


def _with_sizes(t, input, x, attrs: dict, sizes: list):
    lead = list(x.type.shape[:2])
    if all(isinstance(d, int) for d in lead):
        return t.emit("Resize", x, None, None, t.shape_value(lead + sizes), **attrs)
    axes = list(range(2, input.dim()))
    return t.emit("Resize", x, None, None, t.shape_value(sizes), axes=axes, **attrs)


def _with_scales(t, input, x, attrs: dict, dims: list, out: list, factors: list):
    chosen, slice_to = [], []
    for i, (d, o, s) in enumerate(zip(dims, out, factors)):
        if isinstance(d, int):
            chosen.append(fit_scale(s, d, o))
            continue
        s32 = np.float32(s)
        if float(s32) < s:
            s32 = np.nextafter(s32, np.float32(np.inf))
        chosen.append(s32)
        if float(s32) != s:
            # floor(in * s32) may pass torch's floor(in * s) by one row: cut at run time.
            slice_to.append((2 + i, _floor_mul(t, input, 2 + i, s)))
    scales = np.array([1.0, 1.0] + [float(c) for c in chosen], np.float32)
    y = t.emit("Resize", x, None, t.constant(scales, "scales"), None, **attrs)
    if slice_to:
        axes = [a for a, _ in slice_to]
        y = t.emit("Slice", y, t.constant(np.zeros(len(axes), np.int64), "starts"),
                   t.shape_value([e for _, e in slice_to]), t.constant(np.array(axes, np.int64), "axes"))
    return y


def fit_scale(factor: float, size: int, out: int) -> np.float32:
    """The float32 nearest to ``factor`` with floor(size * it) == out (Resize's output size)."""
    s = np.float32(factor)
    for _ in range(64):
        got = int(float(s) * size)
        if got == out:
            return s
        s = np.nextafter(s, np.float32(np.inf if got < out else -np.inf))
    return np.float32(out / size)  # not reached for sizes below 2**24


def _floor_mul(t, input, axis: int, factor: float) -> Any:
    """floor(size(axis) * factor) as torch computes it (in double): an int, or a SymInt."""
    d = dim_of(t, input, axis)
    concrete = math.floor(int(d) * factor)
    if not isinstance(d, SymInt):
        return concrete
    f = t.emit("Cast", d.value, to=DType.FLOAT64.value)
    f = t.emit("Floor", t.emit("Mul", f, t.constant(np.array(factor, np.float64), "factor")))
    return SymInt(concrete, t, t.emit("Cast", f, to=DType.INT64.value))


# ---------------------------------------------------------------------------- nearest, checked
def _torch_nearest(mode: str, size: int, out: int, scale: Optional[float]) -> np.ndarray:
    """The input index torch's own kernel reads for each output index of one axis."""
    x = torch.arange(size, dtype=torch.float64).reshape(1, 1, size)
    with torch._C.DisableTorchFunction():
        y = getattr(torch._C._nn, _NEAREST_OPS[mode])(x, [out], scale)
    return y.reshape(-1).numpy().astype(np.int64)


def _kiln_nearest(attrs: dict, size: int, out: int, scale: Optional[float]) -> Optional[np.ndarray]:
    s = out / size if scale is None else float(fit_scale(scale, size, out))
    if scale is not None and int(s * size) != out:
        return None
    return axis_taps(0, size, out, s, attrs).index[:, 0]


def _check_nearest(t, mode: str, dims: list, out: list, scales: list, attrs: dict, static: bool,
                   size_factors: Optional[list] = None):
    """None when Resize's nearest tables are torch's; for static axes that differ, every axis's
    torch table (for a Gather); UnsupportedOpError for a symbolic axis that differs."""
    tables, differ = [], False
    for i, (d, o, s) in enumerate(zip(dims, out, scales)):
        if isinstance(d, int):
            want = _torch_nearest(mode, d, o, s)
            tables.append(want)
            got = _kiln_nearest(attrs, d, o, s)
            differ |= got is None or not np.array_equal(got, want)
            continue
        if s is None:
            if size_factors is not None:  # sizes floor(in * factor): enumerable
                _check_symbolic_sizes(t, mode, attrs, size_factors[i])
            continue  # sizes given as symbolic values: nothing to enumerate
        s32 = np.float32(s)
        if float(s32) < s:
            s32 = np.nextafter(s32, np.float32(np.inf))
        for size in range(1, NEAREST_CHECK_SIZES + 1):
            o_t = math.floor(size * s)
            if o_t < 1:
                continue
            want = _torch_nearest(mode, size, o_t, s)
            got = axis_taps(0, size, int(float(s32) * size), float(s32), attrs).index[:o_t, 0]
            if not np.array_equal(got, want):
                raise UnsupportedOpError(
                    f"{t.where()}: F.interpolate(mode='{mode}', scale_factor={s}) on a symbolic size: torch's "
                    f"float32 index rule differs from Resize's at input size {size}; give size= (or "
                    "recompute_scale_factor=True), or trace with static sizes")
    if differ and not static:
        raise UnsupportedOpError(f"{t.where()}: F.interpolate(mode='{mode}') on sizes {dims} -> {out}: torch's "
                                 "float32 index rule differs from Resize's on a static axis while another axis "
                                 "is symbolic; trace with static sizes or give size=")
    return tables if differ else None


def _check_symbolic_sizes(t, mode: str, attrs: dict, factor: float) -> None:
    for size in range(1, NEAREST_CHECK_SIZES + 1):
        o = math.floor(size * factor)
        if o >= 1 and not np.array_equal(axis_taps(0, size, o, o / size, attrs).index[:, 0],
                                         _torch_nearest(mode, size, o, None)):
            raise UnsupportedOpError(
                f"{t.where()}: F.interpolate(mode='{mode}', scale_factor={factor}, recompute_scale_factor=True) on "
                f"a symbolic size: torch's float32 index rule differs from Resize's at input size {size}; trace with "
                "static sizes")


def _gather(t, x, tables: list):
    y = x
    for i, idx in enumerate(tables):
        if len(idx) == y.type.shape[2 + i] and np.array_equal(idx, np.arange(len(idx))):
            continue
        y = t.emit("Gather", y, t.constant(idx, "indices"), axis=2 + i)
    return y


# ---------------------------------------------------------------------------- constant weights
def _area(t, input, x, dims: list, out: list):
    if not all(isinstance(d, int) for d in dims):
        raise UnsupportedOpError(f"{t.where()}: F.interpolate(mode='area') needs static spatial sizes (got "
                                 f"{dims}): adaptive average pooling windows depend on them")
    n = len(dims)
    if all(o == 1 for o in out):
        return t.emit("GlobalAveragePool", x)
    if all(d % o == 0 for d, o in zip(dims, out)):
        kernel = [d // o for d, o in zip(dims, out)]
        return t.emit("AveragePool", x, kernel_shape=kernel, strides=kernel, pads=[0] * (2 * n))
    pool = getattr(F, f"adaptive_avg_pool{n}d")

    def weights(axis: int) -> np.ndarray:
        return _basis_weights(lambda b, sizes: pool(b, sizes), n, axis, dims[axis], out[axis], x.type.dtype)
    return _apply_matrices(t, x, dims, out, weights)


def _matrices(t, x, mode: str, align_corners: bool, dims: list, out: list, scales: list):
    kernel = getattr(torch._C._nn, _AA_OPS[mode])
    n = len(dims)

    def weights(axis: int) -> np.ndarray:
        scale = [None] * n
        scale[axis] = scales[axis] if scales and not align_corners else None
        return _basis_weights(lambda b, sizes: kernel(b, sizes, align_corners, *scale), n, axis, dims[axis],
                              out[axis], x.type.dtype)
    return _apply_matrices(t, x, dims, out, weights)


def _basis_weights(fn, n: int, axis: int, size: int, out: int, dtype: DType) -> np.ndarray:
    """[out, size]: the weights torch's separable kernel ``fn`` gives one axis, read off a batch of
    one-hot inputs (the other axes 4 wide and unchanged, where every filter is the identity)."""
    other = 4
    shape = [size, 1] + [other] * n
    shape[2 + axis] = size
    basis = torch.zeros(shape, dtype=torch.float64)
    index = [torch.arange(size), 0] + [slice(None)] * n
    index[2 + axis] = torch.arange(size)
    basis[tuple(index)] = 1
    sizes = [other] * n
    sizes[axis] = out
    with torch._C.DisableTorchFunction():
        y = fn(basis, sizes)
    pick = [slice(None), 0] + [0] * n
    pick[2 + axis] = slice(None)
    return y[tuple(pick)].numpy().T.astype(dtype.numpy)


def _apply_matrices(t, x, dims: list, out: list, weights):
    rank = len(dims) + 2
    y = x
    for i in range(len(dims)):
        w = weights(i)
        if dims[i] == out[i] and np.array_equal(w, np.eye(dims[i], dtype=w.dtype)):
            continue
        a = 2 + i
        if a == rank - 1:
            y = t.emit("MatMul", y, t.constant(np.ascontiguousarray(w.T), "resize_weights"))
        elif a == rank - 2:
            y = t.emit("MatMul", t.constant(w, "resize_weights"), y)
        else:
            perm = list(range(rank))
            perm[a], perm[-1] = perm[-1], perm[a]
            moved = t.emit("Transpose", y, perm=perm)
            moved = t.emit("MatMul", moved, t.constant(np.ascontiguousarray(w.T), "resize_weights"))
            y = t.emit("Transpose", moved, perm=perm)
    return y
