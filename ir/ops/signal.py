"""ai.onnx signal ops: ``DFT`` (20), ``STFT`` (17), the window generators ``HannWindow``, ``HammingWindow`` and
``BlackmanWindow`` (17), and ``MelWeightMatrix`` (17).

Complex values follow ONNX's convention: a trailing dim of 2 holds (real, imaginary); a trailing dim of 1 is a
real signal. Transforms run through ``numpy.fft`` in single precision for float16/bfloat16/float32 (as ONNX's
reference evaluator does for float32) and double for float64, and round once to the input's dtype.

DFT. kiln implements DFT-20: ``axis`` is an optional int64 scalar *input* (default -2, the last signal dim;
accepted range [-r, -2] U [0, r-2]), so it may be a run-time value (the output's dims are then unknown, its rank
is not). DFT-17, where ``axis`` is an attribute (default 1), has the same semantics otherwise; the ONNX importer
turns its attribute into a constant ``axis`` input, and the ONNX exporter writes DFT-17 (axis attribute) at
opsets 18/19 when the axis is a constant. Modes: ``onesided=0`` a full complex DFT (``inverse=1``: the inverse,
divided by n); ``onesided=1, inverse=0`` RFFT (real input only, n // 2 + 1 bins); ``onesided=1, inverse=1``
IRFFT (one-sided complex input only, a real signal of n samples). ``dft_length`` n zero-pads or truncates the
signal along the axis (numpy's ``n``); its default is the axis' size, 2 * (size - 1) for IRFFT. The spec's
"real input only"/"complex input only" rules are enforced (ONNX's reference evaluator would slice or squeeze
anyway; ONNX Runtime refuses them too).

STFT. signal [batch, length, 1 | 2], frames of ``frame_length`` (default: the window's length, else the whole
signal) every ``frame_step`` samples, frames = (length - frame_length) // frame_step + 1 (the frame must fit the
signal), each multiplied by ``window`` (default all ones) and transformed with a ``frame_length``-point DFT,
one-sided (RFFT, real signals only) by default. Output [batch, frames, bins, 2].

Windows. w[k] for k in [0, size), N = size (``periodic=1``) or size - 1: Hann sin^2(pi k / N), Hamming
25/46 - 21/46 cos(2 pi k / N), Blackman 0.42 - 0.5 cos(2 pi k / N) + 0.08 cos(4 pi k / N), computed in double
with the reference evaluator's expressions and cast to ``output_datatype`` (integer types truncate). A symmetric
window of size 1 is 0/0 in ONNX's definition: NaN, as ONNX's reference evaluator, its function body and ONNX
Runtime give, for float outputs; refused for integer ones (NaN has no integer value).

MelWeightMatrix. [dft_length // 2 + 1, num_mel_bins] triangular filters of peak 1 between mel-spaced spectrogram
bins, the bin edges computed exactly as ONNX's reference evaluator does (mel(f) = 2595 log10(1 + f / 700),
num_mel_bins + 2 points spaced by (mel(upper) - mel(lower)) / (num_mel_bins + 2), bin = floor((dft_length + 1) f
/ sample_rate)); a band edge that falls outside the spectrogram's bins is refused, not wrapped around.

The window and MelWeightMatrix output shapes come from their (scalar) size inputs: known when those are
constants (a symbol passes through, as for Range), unknown otherwise.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, INDEX, INT, compute_dtype
from kiln.ir.ops._dims import scalar_input
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType

# The element types ONNX lets a window / MelWeightMatrix be generated in (T2/T3: every int and float type).
_GENERATED = FLOAT | INT


def _scalar(a: Optional[np.ndarray]) -> Optional[int]:
    return None if a is None else int(np.asarray(a).reshape(-1)[0])


def _const_int(ctx: InferContext, i: int) -> Optional[int]:
    """The value of scalar input i when it is a constant (None when absent or computed)."""
    if not ctx.has_input(i):
        return None
    c = ctx.const(i)
    return None if c is None or c.size != 1 else int(c.reshape(-1)[0])


def _flag(ctx: InferContext, name: str) -> int:
    v = ctx.attrs[name]
    if v not in (0, 1):
        ctx.fail(f"{name} must be 0 or 1, got {v}")
    return int(v)


def _output_dtype(code) -> DType:
    """The DType of ONNX TensorProto code ``code`` for a generated tensor; ValueError naming the allowed ones."""
    try:
        dt = DType(int(code))
    except ValueError:
        dt = None
    if dt not in _GENERATED:
        allowed = ", ".join(f"{d.value} ({d})" for d in sorted(_GENERATED, key=lambda d: d.value))
        raise ValueError(f"output_datatype={code} is not an element type these ops generate; allowed: {allowed}")
    return dt


def _infer_output_dtype(ctx: InferContext) -> DType:
    try:
        return _output_dtype(ctx.attrs["output_datatype"])
    except ValueError as e:
        ctx.fail(str(e))


def _size_dim(ctx: InferContext, i: int, what: str, minimum: int = 0) -> Dim:
    """Dim given by scalar int input i: its value when constant (checked >= minimum), a symbol when it is one."""
    vals = ctx.symbolic(i)
    if vals is None or len(vals) != 1:
        return None
    d = vals[0]
    if isinstance(d, int) and d < minimum:
        ctx.fail(f"{what} must be >= {minimum}, got {d}")
    return d


def _complex(x: np.ndarray) -> np.ndarray:
    """x [..., 1 | 2] as a real or complex numpy array without its last dim, in the precision the op computes."""
    work = compute_dtype(x.dtype)
    re = x[..., 0].astype(work)
    if x.shape[-1] == 1:
        return re
    return re + 1j * x[..., 1].astype(work)


def _interleave(y: np.ndarray, dtype) -> np.ndarray:
    """A complex numpy array as ONNX's [..., 2] (real, imaginary), rounded once to ``dtype``."""
    return np.stack([y.real, y.imag], axis=-1).astype(dtype)


def _check_last(ctx: InferContext, last: Dim, what: str, onesided: int, inverse: int) -> None:
    if isinstance(last, int) and last not in (1, 2):
        ctx.fail(f"the last dim of {what} must be 1 (real) or 2 (complex: real, imaginary), got {last}")
    if onesided and not inverse and last == 2:
        ctx.fail(f"onesided=1 (a real-to-complex transform) takes a real {what} (last dim 1), got a complex one "
                 f"(last dim 2); use onesided=0")
    if onesided and inverse and last == 1:
        ctx.fail(f"onesided=1 with inverse=1 (IRFFT) takes a one-sided complex {what} (last dim 2), got a real one "
                 f"(last dim 1)")


def _check_signal(x: np.ndarray, what: str, onesided: int, inverse: int) -> None:
    if x.shape[-1] not in (1, 2):
        raise ValueError(f"the last dim of {what} must be 1 (real) or 2 (complex), got shape {list(x.shape)}")
    if onesided and not inverse and x.shape[-1] == 2:
        raise ValueError(f"onesided=1 (a real-to-complex transform) takes a real {what} (last dim 1), got a "
                         f"complex one")
    if onesided and inverse and x.shape[-1] == 1:
        raise ValueError(f"onesided=1 with inverse=1 (IRFFT) takes a complex {what} (last dim 2), got a real one")


# --------------------------------------------------------------------------- DFT


def _dft_axis_ok(axis: int, rank: int) -> bool:
    return -rank <= axis <= rank - 2 and axis != -1


def _infer_dft(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    inverse, onesided = _flag(ctx, "inverse"), _flag(ctx, "onesided")
    if ctx.has_input(1):
        scalar_input(ctx, 1, "dft_length")
    if ctx.has_input(2):
        scalar_input(ctx, 2, "axis")
    n = _const_int(ctx, 1)
    if n is not None and n < 1:
        ctx.fail(f"dft_length must be >= 1, got {n}")
    if x.shape is None:
        return TensorType(x.dtype, None)
    r = len(x.shape)
    if r < 2:
        ctx.fail(f"input must have rank >= 2 ([signal dims..., 1 | 2]), got shape {list(x.shape)}")
    _check_last(ctx, x.shape[-1], "input", onesided, inverse)
    irfft = bool(inverse and onesided)
    out_last = 1 if irfft else 2
    axis = _const_int(ctx, 2) if ctx.has_input(2) else -2
    if axis is None:  # a run-time axis: any signal dim may change
        return TensorType(x.dtype, (None,) * (r - 1) + (out_last,))
    if not _dft_axis_ok(axis, r):
        ctx.fail(f"axis {axis} is out of range for input of rank {r}: it must lie in [{-r}, -2] or [0, {r - 2}] "
                 f"(the last dim holds the real/imaginary parts)")
    axis %= r
    size = x.shape[axis]
    dim: Dim = None
    if n is None and not ctx.has_input(1):  # the default length
        if irfft:
            if isinstance(size, int):
                n = 2 * (size - 1)
                if n < 1:
                    ctx.fail(f"IRFFT's default dft_length 2 * (size - 1) is {n} for axis {axis} of size {size}; "
                             f"give dft_length >= 1")
        elif isinstance(size, int):
            n = size
            if n < 1:
                ctx.fail(f"axis {axis} has size 0, a DFT of no points; give dft_length >= 1")
        elif not onesided:
            dim = size  # a symbol passes through
    if n is not None:
        dim = n // 2 + 1 if (onesided and not inverse) else n
    shape = list(x.shape)
    shape[axis], shape[-1] = dim, out_last
    return TensorType(x.dtype, shape)


@op("DFT", inputs=[In("input", FLOAT), In("dft_length", INDEX, optional=True, max_elements=1),
                   In("axis", {DType.INT64}, optional=True, max_elements=1)],
    outputs=["output"], attrs=[Attr("inverse", AttrKind.INT, 0), Attr("onesided", AttrKind.INT, 0)],
    infer=_infer_dft)
def dft(x, dft_length=None, axis=None, *, inverse=0, onesided=0):
    """The (inverse, one-sided) discrete Fourier transform of x along ``axis`` (module docstring)."""
    r = x.ndim
    if r < 2:
        raise ValueError(f"DFT input must have rank >= 2, got shape {list(x.shape)}")
    _check_signal(x, "input", onesided, inverse)
    a = -2 if axis is None else _scalar(axis)
    if not _dft_axis_ok(a, r):
        raise ValueError(f"DFT axis {a} is out of range for input of rank {r} ([{-r}, -2] or [0, {r - 2}])")
    a %= r
    irfft = bool(inverse and onesided)
    if dft_length is not None:
        n = _scalar(dft_length)
    else:
        n = 2 * (x.shape[a] - 1) if irfft else x.shape[a]
    if n < 1:
        raise ValueError(f"DFT length must be >= 1, got {n} (axis {a} of size {x.shape[a]})")
    sig = _complex(x)
    if irfft:
        return np.fft.irfft(sig, n, axis=a)[..., None].astype(x.dtype)
    if inverse:
        y = np.fft.ifft(sig, n, axis=a)
    elif onesided:
        y = np.fft.rfft(sig, n, axis=a)
    else:
        y = np.fft.fft(sig, n, axis=a)
    return _interleave(y, x.dtype)


# --------------------------------------------------------------------------- STFT


def _infer_stft(ctx: InferContext) -> TensorType:
    sig = ctx.input(0)
    onesided = _flag(ctx, "onesided")
    step_t = scalar_input(ctx, 1, "frame_step")
    step = _const_int(ctx, 1)
    if step is not None and step < 1:
        ctx.fail(f"frame_step must be >= 1, got {step}")
    window_len: Dim = None
    if ctx.has_input(2):
        w = ctx.input(2)
        if w.dtype is not sig.dtype:
            ctx.fail(f"window is {w.dtype} but signal is {sig.dtype}; they must share a dtype")
        if w.shape is not None:
            if len(w.shape) != 1:
                ctx.fail(f"window must be 1-D [frame_length], got shape {list(w.shape)}")
            window_len = w.shape[0]
    length: Dim = None
    if ctx.has_input(3):
        t = scalar_input(ctx, 3, "frame_length")
        if t.dtype is not step_t.dtype:
            ctx.fail(f"frame_step is {step_t.dtype} but frame_length is {t.dtype}; they must share a dtype")
        length = _const_int(ctx, 3)
        if length is not None and length < 1:
            ctx.fail(f"frame_length must be >= 1, got {length}")
        if isinstance(length, int) and isinstance(window_len, int) and length != window_len:
            ctx.fail(f"frame_length is {length} but the window has {window_len} values; they must agree")
    elif ctx.has_input(2):
        length = window_len
        if length == 0:
            ctx.fail("window is empty; a frame needs at least 1 sample")
    if sig.shape is None:
        return TensorType(sig.dtype, (None, None, None, 2))
    if len(sig.shape) != 3:
        ctx.fail(f"signal must have rank 3 ([batch, length, 1 | 2]), got shape {list(sig.shape)}")
    batch, total, last = sig.shape
    _check_last(ctx, last, "signal", onesided, 0)
    if not ctx.has_input(2) and not ctx.has_input(3):
        length = total  # one frame of the whole signal
        if length == 0:
            ctx.fail("signal has length 0 and no frame_length or window is given: a frame needs at least 1 sample")
    frames: Dim = None
    if isinstance(length, int) and isinstance(total, int):
        if length > total:
            ctx.fail(f"frame_length {length} is longer than the signal ({total} samples)")
        if step is not None:
            frames = (total - length) // step + 1
    elif length is not None and length == total:
        frames = 1
    if isinstance(length, int):
        bins: Dim = length // 2 + 1 if onesided else length
    else:
        bins = None if onesided else length
    return TensorType(sig.dtype, (batch, frames, bins, 2))


@op("STFT", inputs=[In("signal", FLOAT), In("frame_step", INDEX, max_elements=1),
                    In("window", FLOAT, optional=True, rank=1),
                    In("frame_length", INDEX, optional=True, max_elements=1)],
    outputs=["output"], attrs=[Attr("onesided", AttrKind.INT, 1)], infer=_infer_stft)
def stft(signal, frame_step, window=None, frame_length=None, *, onesided=1):
    """The short-time Fourier transform of signal [batch, length, 1 | 2] (module docstring)."""
    if signal.ndim != 3:
        raise ValueError(f"STFT signal must have rank 3 ([batch, length, 1 | 2]), got shape {list(signal.shape)}")
    _check_signal(signal, "signal", onesided, 0)
    total = signal.shape[1]
    step = _scalar(frame_step)
    if frame_length is not None:
        length = _scalar(frame_length)
        if window is not None and window.shape[0] != length:
            raise ValueError(f"STFT frame_length is {length} but the window has {window.shape[0]} values")
    else:
        length = window.shape[0] if window is not None else total
    if step < 1 or length < 1:
        raise ValueError(f"STFT frame_step and frame_length must be >= 1, got {step} and {length}")
    if length > total:
        raise ValueError(f"STFT frame_length {length} is longer than the signal ({total} samples)")
    sig = _complex(signal)
    frames = np.lib.stride_tricks.sliding_window_view(sig, length, axis=1)[:, ::step]  # [batch, frames, length]
    if window is not None:
        frames = frames * window.astype(compute_dtype(window.dtype))
    y = np.fft.rfft(frames, length, axis=-1) if onesided else np.fft.fft(frames, length, axis=-1)
    return _interleave(y, signal.dtype)


# --------------------------------------------------------------------------- window functions


def _infer_window(ctx: InferContext) -> TensorType:
    scalar_input(ctx, 0, "size")
    _flag(ctx, "periodic")
    return TensorType(_infer_output_dtype(ctx), (_size_dim(ctx, 0, "size"),))


def _window(name: str, size, periodic: int, output_datatype: int, values) -> np.ndarray:
    """``values(k, N)`` on k = 0..size-1 (double) cast to ``output_datatype``."""
    target = _output_dtype(output_datatype)
    n = _scalar(size)
    if n < 0:
        raise ValueError(f"{name} size must be >= 0, got {n}")
    denom = n if periodic else n - 1
    with np.errstate(divide="ignore", invalid="ignore"):  # size 1, symmetric: 0/0 (ONNX's NaN)
        w = values(np.arange(n, dtype=np.float64), denom)
    if target.is_float:
        return w.astype(target.numpy)
    if np.isnan(w).any():
        raise ValueError(f"{name} of size 1 with periodic=0 is 0/0 (NaN) in ONNX's definition, which integer "
                         f"output_datatype {target} cannot hold")
    return np.trunc(w).astype(target.numpy)


_WINDOW_ATTRS = [Attr("periodic", AttrKind.INT, 1), Attr("output_datatype", AttrKind.INT, DType.FLOAT32.value)]


@op("HannWindow", inputs=[In("size", INDEX, max_elements=1)], outputs=["output"], attrs=_WINDOW_ATTRS,
    infer=_infer_window)
def hann_window(size, *, periodic=1, output_datatype=1):
    """sin^2(pi k / N), N = size (periodic) or size - 1."""
    return _window("HannWindow", size, periodic, output_datatype, lambda k, n: np.sin(k * np.pi / n) ** 2)


@op("HammingWindow", inputs=[In("size", INDEX, max_elements=1)], outputs=["output"], attrs=_WINDOW_ATTRS,
    infer=_infer_window)
def hamming_window(size, *, periodic=1, output_datatype=1):
    """25/46 - (1 - 25/46) cos(2 pi k / N), N = size (periodic) or size - 1."""
    alpha = 25.0 / 46.0
    beta = 1 - alpha
    return _window("HammingWindow", size, periodic, output_datatype,
                   lambda k, n: alpha - np.cos(k * np.pi * 2 / n) * beta)


def _blackman(k: np.ndarray, n: int) -> np.ndarray:
    y = np.cos((k * (np.pi * 2)) / n) * (-0.5)
    y += np.cos((k * (np.pi * 4)) / n) * 0.08
    return y + 0.42


@op("BlackmanWindow", inputs=[In("size", INDEX, max_elements=1)], outputs=["output"], attrs=_WINDOW_ATTRS,
    infer=_infer_window)
def blackman_window(size, *, periodic=1, output_datatype=1):
    """0.42 - 0.5 cos(2 pi k / N) + 0.08 cos(4 pi k / N), N = size (periodic) or size - 1."""
    return _window("BlackmanWindow", size, periodic, output_datatype, _blackman)


# --------------------------------------------------------------------------- MelWeightMatrix


def _infer_mel(ctx: InferContext) -> TensorType:
    names = ("num_mel_bins", "dft_length", "sample_rate", "lower_edge_hertz", "upper_edge_hertz")
    types = [scalar_input(ctx, i, name) for i, name in enumerate(names)]
    if len({t.dtype for t in types[:3]}) != 1:
        ctx.fail(f"num_mel_bins, dft_length and sample_rate must share an integer dtype, got "
                 f"{', '.join(str(t.dtype) for t in types[:3])}")
    if types[3].dtype is not types[4].dtype:
        ctx.fail(f"lower_edge_hertz and upper_edge_hertz must share a float dtype, got {types[3].dtype} and "
                 f"{types[4].dtype}")
    dtype = _infer_output_dtype(ctx)
    mels = _size_dim(ctx, 0, "num_mel_bins")
    dft_length = _const_int(ctx, 1)
    if dft_length is not None and dft_length < 1:
        ctx.fail(f"dft_length must be >= 1, got {dft_length}")
    rate = _const_int(ctx, 2)
    if rate is not None and rate < 1:
        ctx.fail(f"sample_rate must be >= 1, got {rate}")
    return TensorType(dtype, (None if dft_length is None else dft_length // 2 + 1, mels))


@op("MelWeightMatrix", inputs=[In("num_mel_bins", INDEX, max_elements=1), In("dft_length", INDEX, max_elements=1),
                               In("sample_rate", INDEX, max_elements=1), In("lower_edge_hertz", FLOAT, max_elements=1),
                               In("upper_edge_hertz", FLOAT, max_elements=1)],
    outputs=["output"], attrs=[Attr("output_datatype", AttrKind.INT, DType.FLOAT32.value)], infer=_infer_mel)
def mel_weight_matrix(num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz, *,
                      output_datatype=1):
    """[dft_length // 2 + 1, num_mel_bins] triangular mel filters (module docstring)."""
    target = _output_dtype(output_datatype)
    mels, n, rate = _scalar(num_mel_bins), _scalar(dft_length), _scalar(sample_rate)
    if mels < 0 or n < 1 or rate < 1:
        raise ValueError(f"MelWeightMatrix needs num_mel_bins >= 0, dft_length >= 1 and sample_rate >= 1, got "
                         f"{mels}, {n} and {rate}")
    bins = n // 2 + 1
    work = compute_dtype(np.asarray(lower_edge_hertz).dtype)
    lower = np.asarray(lower_edge_hertz).reshape(()).astype(work)
    upper = np.asarray(upper_edge_hertz).reshape(()).astype(work)
    # The reference evaluator's expressions, operation for operation (the mel of each edge in the edges' type,
    # then double), so that the floor below lands the edges on the same bins.
    low_mel = 2595 * np.log1p(lower / 700) / np.log(10)
    high_mel = 2595 * np.log1p(upper / 700) / np.log(10)
    step = (high_mel - low_mel) / (mels + 2)
    hz = 700 * np.expm1((np.arange(mels + 2) * step + low_mel) / 2595 * np.log(10))
    edges = (((n + 1) * hz) // rate).astype(np.int64)
    lo, mid, hi = edges[:-2], edges[1:-1], edges[2:]
    rise, fall = mid - lo, hi - mid
    # The bins each filter writes (its rising edge [lo, mid], just mid when lo == mid, its falling edge [mid, hi)).
    first = np.minimum(np.where(rise > 0, lo, np.where(rise == 0, mid, bins)), np.where(fall > 0, mid, bins))
    last = np.maximum(np.where(rise >= 0, mid, -1), np.where(fall > 0, hi - 1, -1))
    if mels and (first.min() < 0 or last.max() >= bins):
        raise ValueError(f"MelWeightMatrix: the bands of [{float(lower)}, {float(upper)}] Hz reach spectrogram bins "
                         f"[{int(first.min())}, {int(last.max())}], outside the {bins} bins of a {n}-point DFT at "
                         f"sample rate {rate}")
    j = np.arange(bins)[:, None]
    out = np.where((rise > 0) & (j >= lo) & (j <= mid), (j - lo) / np.where(rise > 0, rise, 1), 0.0)
    out = np.where((rise == 0) & (j == mid), 1.0, out)
    out = np.where((fall > 0) & (j >= mid) & (j < hi), (hi - j) / np.where(fall > 0, fall, 1), out)
    if not target.is_float:
        out = np.trunc(out)
    return out.astype(target.numpy)
