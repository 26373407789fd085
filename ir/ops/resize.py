"""Resize with the meaning of ONNX Resize-19 (modes nearest/linear/cubic, every coordinate
transformation mode incl. half_pixel_symmetric, scales or sizes, axes, keep_aspect_ratio_policy,
antialias, tf_crop_and_resize's roi and extrapolation value).

Resize is separable: each resized axis is resampled on its own, one after the other, and each
axis is described by a table computed from sizes alone (no data): for every output position, the
input positions it reads ("taps") and their weights. The reference below and every fast kernel
(CPU, CUDA, the mobile stub) share that description, so the op's meaning is written once:

1. :func:`resize_plan` - output shape, and per resized axis its scale (given, or out/in for
   ``sizes``; ``keep_aspect_ratio_policy`` picks one scale for all axes) and its roi pair;
2. :func:`source_coordinates` - each output index mapped back to a real input coordinate by the
   coordinate transformation mode (tf_crop_and_resize also marks positions outside the input);
3. :func:`axis_taps` - taps and weights for the mode: nearest picks one index by ``nearest_mode``;
   linear/cubic take 2/4 neighbours (ties to the left, as the ONNX reference windows do), or with
   ``antialias`` the filter stretched by 1/scale when downsampling and normalized; edge indices
   are clamped (ONNX's edge padding), or with ``exclude_outside`` dropped and the rest renormalized;
4. the reference applies the tables with gathers in float64 and rounds once (integer types round
   half to even and saturate, as ``onnx.reference`` does).

An axis whose scale is 1 (to 1e-9), size unchanged and roi the whole axis is left alone, exactly
as ``onnx.reference`` skips it; every other axis is resampled even when its table is the identity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, NUMERIC
from kiln.ir.ops._dims import INT64, check_axes
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType, normalize_axis

MODES = ("nearest", "linear", "cubic")
COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                    "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
ASPECT_POLICIES = ("stretch", "not_larger", "not_smaller")

RESIZE_ATTRS = [
    Attr("antialias", AttrKind.INT, 0),
    Attr("axes", AttrKind.INTS, None),
    Attr("coordinate_transformation_mode", AttrKind.STRING, "half_pixel"),
    Attr("cubic_coeff_a", AttrKind.FLOAT, -0.75),
    Attr("exclude_outside", AttrKind.INT, 0),
    Attr("extrapolation_value", AttrKind.FLOAT, 0.0),
    Attr("keep_aspect_ratio_policy", AttrKind.STRING, "stretch"),
    Attr("mode", AttrKind.STRING, "nearest"),
    Attr("nearest_mode", AttrKind.STRING, "round_prefer_floor"),
]
DEFAULTS = {a.name: a.default for a in RESIZE_ATTRS}


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class AxisTaps:
    """How one resized axis is resampled: output position i reads ``index[i, t]`` with weight
    ``weight[i, t]`` (``weight`` is None for nearest: one tap of weight 1). ``outside[i]``
    (tf_crop_and_resize only, else None) marks positions that take the extrapolation value."""

    axis: int
    in_size: int
    out_size: int
    index: np.ndarray            # int64 [out, taps], every entry in [0, in_size)
    weight: Optional[np.ndarray]  # float64 [out, taps] or None
    outside: Optional[np.ndarray]  # bool [out] or None

    @property
    def taps(self) -> int:
        return self.index.shape[1]


@dataclass(frozen=True)
class ResizePlan:
    out_shape: tuple
    axes: tuple  # AxisTaps of the axes actually resampled, in axis order

    @property
    def extrapolates(self) -> bool:
        return any(t.outside is not None and t.outside.any() for t in self.axes)


def present(a: Optional[np.ndarray]) -> bool:
    """Whether an optional tensor input is given: ONNX writes 'absent' as an empty tensor too."""
    return a is not None and np.asarray(a).size > 0


def resize_axes(attrs: dict, rank: int) -> list:
    axes = attrs.get("axes")
    if axes is None:
        return list(range(rank))
    out = [normalize_axis(int(a), rank, "axes") for a in axes]
    if len(set(out)) != len(out):
        raise ValueError(f"axes {list(axes)} name an axis twice")
    return out


def output_geometry(in_shape: Sequence[int], roi, scales, sizes, attrs: dict) -> tuple:
    """(output shape, scale of every axis, roi pair of every axis or None): step 1 of the meaning."""
    rank = len(in_shape)
    axes = resize_axes(attrs, rank)
    has_scales, has_sizes = present(scales), present(sizes)
    if has_scales == has_sizes:
        raise ValueError("Resize needs exactly one of scales and sizes" + (", got both" if has_scales else ""))
    scale = [1.0] * rank
    out = [int(d) for d in in_shape]
    if has_sizes:
        wanted = [int(v) for v in np.asarray(sizes).reshape(-1)]
        if len(wanted) != len(axes):
            raise ValueError(f"sizes {wanted} must hold one value per resized axis ({len(axes)})")
        if any(s < 0 for s in wanted):
            raise ValueError(f"sizes {wanted} must not be negative")
        for a, s in zip(axes, wanted):
            if in_shape[a] == 0 and s > 0:
                raise ValueError(f"cannot resize axis {a} of size 0 to {s}")
        ratios = [s / in_shape[a] if in_shape[a] else 1.0 for a, s in zip(axes, wanted)]
        policy = attrs.get("keep_aspect_ratio_policy", "stretch")
        if policy == "stretch":
            for a, s, r in zip(axes, wanted, ratios):
                out[a], scale[a] = s, r
        else:
            r = min(ratios) if policy == "not_larger" else max(ratios)
            for a in axes:
                scale[a], out[a] = r, int(r * in_shape[a] + 0.5)
    else:
        given = [float(v) for v in np.asarray(scales, np.float32).reshape(-1)]
        if len(given) != len(axes):
            raise ValueError(f"scales {given} must hold one value per resized axis ({len(axes)})")
        if any(not s > 0 for s in given):
            raise ValueError(f"scales {given} must be positive")
        for a, s in zip(axes, given):
            scale[a], out[a] = s, int(s * in_shape[a])
    pairs = None
    if present(roi):
        # Kept in the roi's own dtype: onnx.reference computes the crop window in it (a float32
        # 0.1 * 5 is not 0.5), which decides nearest's ties.
        r = list(np.asarray(roi).reshape(-1))
        if len(r) != 2 * len(axes):
            raise ValueError(f"roi holds {len(r)} values; it needs a start and an end per resized axis "
                             f"({2 * len(axes)})")
        pairs = [(0.0, 1.0)] * rank
        for j, a in enumerate(axes):
            pairs[a] = (r[j], r[j + len(axes)])
    return tuple(out), scale, pairs


def source_coordinates(in_size: int, out_size: int, scale: float, mode: str,
                       roi: Optional[tuple] = None) -> tuple:
    """(x_original of each output index as float64, outside mask or None): step 2.

    As in ONNX (and its reference), ``length_resized`` in align_corners, pytorch_half_pixel and
    tf_crop_and_resize is the real ``scale * in_size``, not the rounded output size."""
    y = np.arange(out_size, dtype=np.float64)
    width = scale * in_size
    outside = None
    if mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "pytorch_half_pixel":
        x = np.full(out_size, -0.5) if width == 1 else (y + 0.5) / scale - 0.5
    elif mode == "align_corners":
        x = np.zeros(out_size) if width == 1 else y * (in_size - 1) / (width - 1)
    elif mode == "half_pixel_symmetric":
        offset = in_size / 2 * (1 - out_size / width)
        x = offset + (y + 0.5) / scale - 0.5
    elif mode == "tf_crop_and_resize":
        start, end = roi if roi is not None else (0.0, 1.0)
        if width == 1:
            x = np.full(out_size, (end - start) * (in_size - 1) / 2)
        else:
            x = y * (end - start) * (in_size - 1) / (width - 1)
        x = x + start * (in_size - 1)
        outside = (x < 0) | (x > in_size - 1)
    else:
        raise ValueError(f"coordinate_transformation_mode '{mode}' is not one of {', '.join(COORDINATE_MODES)}")
    return x, outside


def _keys(d: np.ndarray, a: float) -> np.ndarray:
    """The cubic convolution kernel (Keys) with coefficient ``a`` at distances ``d`` >= 0."""
    d2, d3 = d * d, d * d * d
    near = (a + 2) * d3 - (a + 3) * d2 + 1
    far = a * d3 - 5 * a * d2 + 8 * a * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _tent(d: np.ndarray) -> np.ndarray:
    return np.clip(1 - d, 0, None)


def axis_taps(axis: int, in_size: int, out_size: int, scale: float, attrs: dict,
              roi: Optional[tuple] = None) -> AxisTaps:
    """The taps and weights of one axis: step 3."""
    x, outside = source_coordinates(in_size, out_size, scale, attrs["coordinate_transformation_mode"], roi)
    mode = attrs["mode"]
    last = max(in_size - 1, 0)
    floor = np.floor(x)
    if mode == "nearest":
        frac = x - floor
        rule = attrs["nearest_mode"]
        if rule == "round_prefer_floor":
            up = frac > 0.5
        elif rule == "round_prefer_ceil":
            up = frac >= 0.5
        elif rule == "floor":
            up = np.zeros(out_size, bool)
        elif rule == "ceil":
            up = frac > 0
        else:
            raise ValueError(f"nearest_mode '{rule}' is not one of {', '.join(NEAREST_MODES)}")
        index = np.clip(floor.astype(np.int64) + up, 0, last)
        return AxisTaps(axis, in_size, out_size, index[:, None], None, outside)
    antialias = bool(attrs.get("antialias", 0))
    stretch = min(scale, 1.0) if antialias else 1.0
    if mode == "linear":
        n = 2 - 2 * int(math.floor(-1 / stretch) + 1) if antialias else 2
        kernel = _tent
    elif mode == "cubic":
        n = 2 - 2 * int(math.floor(-2 / stretch) + 1) if antialias else 4
        a = float(attrs["cubic_coeff_a"])
        kernel = lambda d: _keys(d, a)  # noqa: E731
    else:
        raise ValueError(f"mode '{mode}' is not one of {', '.join(MODES)}")
    # n nearest neighbours, ties to the smaller index: an integer x sits at the right of the
    # middle pair (ONNX's reference chooses its windows this way).
    first = np.where(x == floor, floor - n // 2, floor - n // 2 + 1).astype(np.int64)
    index = first[:, None] + np.arange(n, dtype=np.int64)
    weight = kernel(np.abs(index - x[:, None]) * stretch)
    if antialias:
        weight = weight / weight.sum(axis=1, keepdims=True)
    if attrs.get("exclude_outside", 0):
        weight = np.where((index < 0) | (index >= in_size), 0.0, weight)
        total = weight.sum(axis=1, keepdims=True)
        weight = weight / np.where(total == 0, 1.0, total)
    return AxisTaps(axis, in_size, out_size, np.clip(index, 0, last), weight, outside)


def resize_plan(in_shape: Sequence[int], roi, scales, sizes, attrs: dict) -> ResizePlan:
    """The whole description of one Resize for an input shape: steps 1 and 3 for every axis."""
    attrs = {**DEFAULTS, **attrs}
    out, scale, pairs = output_geometry(in_shape, roi, scales, sizes, attrs)
    taps = []
    for a in range(len(in_shape)):
        pair = None if pairs is None else pairs[a]
        whole = pair is None or (math.isclose(float(pair[0]), 0.0, abs_tol=1e-9) and math.isclose(float(pair[1]), 1.0))
        if math.isclose(scale[a], 1.0) and out[a] == in_shape[a] and whole:
            continue
        if out[a] == 0 or in_shape[a] == 0:
            continue  # an empty axis: the output is empty whatever the table
        taps.append(axis_taps(a, int(in_shape[a]), out[a], scale[a], attrs, pair))
    return ResizePlan(tuple(out), tuple(taps))


# --------------------------------------------------------------------------- the reference


def apply_taps(x: np.ndarray, taps: AxisTaps) -> np.ndarray:
    """Resample ``x`` along ``taps.axis`` (float data; the weights' dtype sets the precision)."""
    if taps.weight is None:
        return np.take(x, taps.index[:, 0], axis=taps.axis)
    shape = [1] * x.ndim
    shape[taps.axis] = taps.out_size
    y = None
    for t in range(taps.taps):
        term = np.take(x, taps.index[:, t], axis=taps.axis) * taps.weight[:, t].reshape(shape).astype(x.dtype)
        y = term if y is None else y + term
    return y


def fill_outside(y: np.ndarray, plan: ResizePlan, value: float) -> np.ndarray:
    """Positions outside the roi (tf_crop_and_resize) on any axis take ``value``, in place."""
    for t in plan.axes:
        if t.outside is not None and t.outside.any():
            where = [slice(None)] * y.ndim
            where[t.axis] = np.flatnonzero(t.outside)
            y[tuple(where)] = value
    return y


def saturate(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round once to ``dtype``: integers round half to even and clamp, floats clamp to the
    finite range (onnx.reference's saturate_cast)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.round(y), info.min, info.max).astype(dtype)
    if dtype.kind == "f":
        info = np.finfo(dtype)
        return np.clip(y, info.min, info.max).astype(dtype)
    return y.astype(dtype)  # bfloat16 (ml_dtypes): its range is float32's


def _check_attrs(attrs: dict) -> Optional[str]:
    for name, allowed in (("mode", MODES), ("coordinate_transformation_mode", COORDINATE_MODES),
                          ("nearest_mode", NEAREST_MODES), ("keep_aspect_ratio_policy", ASPECT_POLICIES)):
        if attrs[name] not in allowed:
            return f"{name} '{attrs[name]}' is not one of {', '.join(allowed)}"
    for name in ("antialias", "exclude_outside"):
        if attrs[name] not in (0, 1):
            return f"{name} must be 0 or 1, not {attrs[name]}"
    return None


# --------------------------------------------------------------------------- inference


def _given(ctx: InferContext, i: int, count: int, what: str) -> Optional[bool]:
    """True/False when input i is (not) given, None when its length is unknown (it may be empty)."""
    if not ctx.has_input(i):
        return False
    t = ctx.inputs[i]
    if t is None or t.shape is None or len(t.shape) != 1 or not isinstance(t.shape[0], int):
        if t is not None and t.shape is not None and len(t.shape) != 1:
            ctx.fail(f"{what} must be 1-D, got shape {list(t.shape)}")
        return None
    if t.shape[0] == 0:
        return False
    if t.shape[0] != count:
        ctx.fail(f"{what} holds {t.shape[0]} values, one per resized axis ({count}) is needed")
    return True


def _scaled_dim(d: Dim, s: float) -> Dim:
    if isinstance(d, int):
        return int(s * d)
    return d if s == 1.0 else None


def infer_resize(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    problem = _check_attrs(ctx.attrs)
    if problem:
        ctx.fail(problem)
    if x.shape is None:
        return TensorType(x.dtype, None)
    rank = len(x.shape)
    axes = check_axes(ctx, ctx.attrs["axes"], rank) if ctx.attrs["axes"] is not None else list(range(rank))
    has_scales = _given(ctx, 2, len(axes), "scales")
    has_sizes = _given(ctx, 3, len(axes), "sizes")
    if has_scales and has_sizes:
        ctx.fail("give scales or sizes, not both")
    if has_scales is False and has_sizes is False:
        ctx.fail("one of scales and sizes must be given")
    if ctx.attrs["coordinate_transformation_mode"] == "tf_crop_and_resize":
        _given(ctx, 1, 2 * len(axes), "roi")
    out = list(x.shape)
    unknown = [None if a in axes else d for a, d in enumerate(out)]
    if has_sizes:
        values = ctx.symbolic(3)
        if values is None:
            return TensorType(x.dtype, unknown)
        if any(isinstance(v, int) and v < 0 for v in values):
            ctx.fail(f"sizes {list(values)} must not be negative")
        if ctx.attrs["keep_aspect_ratio_policy"] == "stretch":
            for a, v in zip(axes, values):
                out[a] = v
            return TensorType(x.dtype, out)
        if not all(isinstance(v, int) for v in values) or not all(isinstance(out[a], int) for a in axes):
            return TensorType(x.dtype, unknown)
        static = [d if a in axes else 1 for a, d in enumerate(out)]  # other axes keep their dims
        shape, _, _ = output_geometry(static, None, None, np.array(values, np.int64), ctx.attrs)
        return TensorType(x.dtype, [shape[a] if a in axes else d for a, d in enumerate(out)])
    if has_scales:
        scales = ctx.const(2)
        if scales is None:
            return TensorType(x.dtype, unknown)
        values = [float(v) for v in np.asarray(scales, np.float32).reshape(-1)]
        if any(not s > 0 for s in values):
            ctx.fail(f"scales {values} must be positive")
        for a, s in zip(axes, values):
            out[a] = _scaled_dim(out[a], s)
        return TensorType(x.dtype, out)
    return TensorType(x.dtype, unknown)


@op("Resize", inputs=[In("X", NUMERIC), In("roi", FLOAT, optional=True, rank=1),
                      In("scales", {DType.FLOAT32}, optional=True, rank=1), In("sizes", INT64, optional=True, rank=1)],
    attrs=RESIZE_ATTRS, infer=infer_resize)
def resize(x, roi=None, scales=None, sizes=None, **attrs):
    """Resample X on the axes given by ``axes`` (default all) to the size that ``sizes`` gives
    or ``floor(size * scales)``; see the module doc for the steps."""
    problem = _check_attrs({**DEFAULTS, **attrs})
    if problem:
        raise ValueError(problem)
    plan = resize_plan(x.shape, roi, scales, sizes, attrs)
    y = x.astype(np.float64)
    for taps in plan.axes:
        y = apply_taps(y, taps)
    y = y.reshape(plan.out_shape)
    if plan.extrapolates:
        y = fill_outside(np.array(y), plan, attrs.get("extrapolation_value", 0.0))
    return saturate(y, x.dtype)
