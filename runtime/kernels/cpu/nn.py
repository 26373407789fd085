"""Conv: 2-D convolutions as GEMMs over an im2col buffer, 1x1 convs as one GEMM on a view,
depthwise convs as a batched per-channel product over their columns where those fit in cache, else as a sum over
kernel taps of shifted slices times per-channel weights. Where the optional native extension is built, the float32
convs it covers (depthwise, few taps: native.covers_conv) run its direct convolution instead, the other one-group
float32 convs its GEMM convolution (native.gemm_conv2d: native im2col, the product, a native output pass), and
these numpy kernels are the fallback.

The im2col is built from contiguous slices, not 2-D strided windows: the input is copied
straight into zeroed stride-phase images (one strided copy per phase, no np.pad and no padded
copy to split), which are flattened row by row, so each kernel tap's block is one flat slice
(see phase_geometry). Columns are made for a chunk of samples at a time so the buffer stays a
few MB at any batch size. Where a GEMM's result is large next to its columns (the 7x7 stem over
3 channels) the columns are exact [OH, OW] windows instead and each sample's GEMM writes the
output directly, the bias folded in as a row of ones (see _direct).

Measured alternatives that lost on a 2-core Xeon (OpenBLAS, 2 threads): building the columns in
cache-sized row strips (the smaller GEMMs cost more than the cheaper copies save), and building
them with a second Python thread (no gain: the copies are bandwidth-bound and the GEMM already
uses both cores).

Weights are constants in a loaded model, so their GEMM layout ([group, M/g, C/g*kh*kw]) is made
once in the factory. Anything else (1-D/3-D, narrow floats, computed weights) runs the
reference. float32 products go through BLAS in float32, as the reference does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from kiln.ir.ops.nn import make_window, static_pads, window_out_shape
from kiln.runtime.kernels.cpu import kernel, native, reference_kernel
from kiln.runtime.kernels.cpu.linalg import BLAS_DTYPES, const_input, input_dtype


@kernel("Conv")
def conv(node, attrs) -> Callable[..., Any]:
    w = const_input(node, 1)
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    bias = const_input(node, 2)
    if input_dtype(node) not in BLAS_DTYPES or w is None or w.ndim != 4 or (has_bias and bias is None):
        return reference_kernel(node, attrs)
    window = make_window(attrs["kernel_shape"] or w.shape[2:], strides=attrs["strides"],
                         dilations=attrs["dilations"], pads=attrs["pads"], auto_pad=attrs["auto_pad"])
    group = attrs["group"]
    m = w.shape[0]
    # _im2col and _depthwise add the bias while copying their result out; _pointwise's GEMM
    # writes the result directly, so the bias is one more pass here.
    bias_col = None
    patches = _patches_on_sgemm(w, window, group, bias) if input_dtype(node) == np.float32 else None
    if patches is not None:
        body = patches
    elif native.covers_conv(input_dtype(node), w, window, group) \
            or native.covers_gemm_conv(input_dtype(node), w, window, group):
        body = native.conv_kernel(w, window, group, bias, (0, 0.0, 0.0))  # direct, Winograd or GEMM
    elif group == m and w.shape[1] == 1 and group > 1:
        body = _depthwise(w, window, bias)
    elif w.shape[2:] == (1, 1) and group == 1 and window.pads == (0,) * 4 and window.auto_pad == "NOTSET":
        body = _pointwise(w, window)
        bias_col = None if bias is None else bias.reshape(m, 1)
    elif _is_patchify(w, window, group):
        body = _patchify(w)
        bias_col = None if bias is None else bias.reshape(m, 1)
    else:
        body = _im2col(w, window, group, bias)

    def run(x, w_unused, b_unused=None):
        y = body(x)  # fresh [N, M, OH, OW]
        if bias_col is not None:
            y3 = y.reshape(y.shape[0], m, -1)
            y3 += bias_col
        return y
    return run


def _is_patchify(w: np.ndarray, window, group: int) -> bool:
    """A ViT patch embedding: windows that tile the input (stride = kernel, no padding, no dilation)."""
    return (group == 1 and tuple(window.strides) == tuple(w.shape[2:]) and window.dilations == (1, 1)
            and window.pads == (0,) * 4 and window.auto_pad in ("NOTSET", "VALID"))


def _patches_on_sgemm(w: np.ndarray, window, group: int, bias) -> Optional[Callable]:
    """A patch embedding (_is_patchify) on the extension's sgemm, or None: the patches as rows [N*OH*OW, C*KH*KW]
    (one reshape-and-transpose copy) times the weights packed once as [C*KH*KW, M], the bias added in the product's
    output pass, and the result's [N, OH, OW, M] copied to [N, M, OH, OW]. The GEMM convolution's im2col gathered
    each 16x16x3 patch tap by tap (ViT-style 3x64x64: 51 -> ~28 us). Each output is the same sum, in the same order,
    as the GEMM convolution's."""
    m, c, kh, kw = w.shape
    # 1x1 stride-1 convs tile their input too: they stay the direct or GEMM convolution's (as rows they would be
    # a transpose of the whole map each way: MobileNetV3-style b8's 16->16 at 56x56 took 0.84 ms so)
    if w.dtype != np.float32 or kh * kw == 1 or not _is_patchify(w, window, group) or not native.has_sgemm():
        return None
    product = native.linear(np.ascontiguousarray(w.reshape(m, c * kh * kw).T),
                            None if bias is None else np.asarray(bias, np.float32).reshape(m))
    if product is None:
        return None

    def run(x):
        n, _, h, wd = x.shape
        oh, ow = h // kh, wd // kw
        rows = x[:, :, :oh * kh, :ow * kw].reshape(n, c, oh, kh, ow, kw).transpose(0, 2, 4, 1, 3, 5)
        y = product(rows.reshape(n * oh * ow, c * kh * kw))  # [N*OH*OW, M]
        return np.ascontiguousarray(y.reshape(n, oh, ow, m).transpose(0, 3, 1, 2))
    return run


def _patchify(w: np.ndarray) -> Callable:
    """Non-overlapping windows: the columns are the input's patches, one reshape-and-transpose copy (no tap
    loop: a 16x16 patch over 3 channels is 768 taps, which the im2col's per-tap slices took 0.9 ms to gather
    at 64x64), then one GEMM per sample straight into the output."""
    m, c, kh, kw = w.shape
    w2 = np.ascontiguousarray(w.reshape(m, c * kh * kw))

    def run(x):
        n, _, h, wd = x.shape
        oh, ow = h // kh, wd // kw
        patches = x[:, :, :oh * kh, :ow * kw].reshape(n, c, oh, kh, ow, kw).transpose(0, 1, 3, 5, 2, 4)
        cols = patches.reshape(n, c * kh * kw, oh * ow)
        y = np.empty((n, m, oh, ow), x.dtype)
        np.matmul(w2, cols, out=y.reshape(n, m, oh * ow))
        return y
    return run


def tap_view(xp: np.ndarray, window, tap: tuple, out: list) -> np.ndarray:
    """The [N, C, OH, OW] strided view of ``xp`` that kernel tap (i, j) multiplies."""
    (i, j), (sh, sw), (dh, dw) = tap, window.strides, window.dilations
    return xp[:, :, i * dh: i * dh + sh * (out[0] - 1) + 1: sh, j * dw: j * dw + sw * (out[1] - 1) + 1: sw]


def _pointwise(w: np.ndarray, window) -> Callable:
    w2 = np.ascontiguousarray(w.reshape(w.shape[0], w.shape[1]))
    sh, sw = window.strides

    def run(x):
        if (sh, sw) != (1, 1):
            x = x[:, :, ::sh, ::sw]
        n, c, h, wd = x.shape
        return np.matmul(w2, x.reshape(n, c, h * wd)).reshape(n, -1, h, wd)
    return run


# Column buffers are built for a chunk of samples at a time: enough columns for an efficient
# GEMM (small late-stage maps batch several samples into one product) but at most COLS_BYTES,
# so the buffer stays in cache-sized pieces at any batch size.
MIN_COLS = 1024
COLS_BYTES = 8 << 20


def _chunk(n: int, k: int, span: int, itemsize: int) -> int:
    span = max(1, span)   # an empty output map still makes one chunk
    fit = COLS_BYTES // max(1, k * span * itemsize)
    return max(1, min(n, -(-MIN_COLS // span), fit))


def _bias_or_zero(bias, m: int, dtype) -> np.ndarray:
    """The bias as [M, 1, 1] (zeros without one): added while the GEMM result is copied out."""
    return np.zeros((m, 1, 1), dtype) if bias is None else bias.reshape(m, 1, 1).astype(dtype)


def _im2col(w: np.ndarray, window, group: int, bias) -> Callable:
    m, c_g, kh, kw = w.shape
    k = c_g * kh * kw
    wg = np.ascontiguousarray(w.reshape(group, m // group, k))
    bias3 = _bias_or_zero(bias, m, w.dtype)
    # The direct layout folds the bias into the GEMM (one group): a bias column on the
    # weights times a row of ones under the columns.
    fold = bias is not None and group == 1
    w_direct = np.concatenate([wg, bias.reshape(1, m, 1).astype(w.dtype)], axis=2) if fold else wg

    def run(x):
        n, c, h, wd = x.shape
        begin, out, hq, wq = phase_geometry(window, (h, wd), (kh, kw))
        sh, sw = window.strides
        taps = tap_offsets(window, (kh, kw), wq)
        y = np.empty((n, m, out[0], out[1]), x.dtype)
        if _direct(out, wq, m // group, k):
            buf = np.zeros((sh, sw, 1, c, hq, wq), x.dtype)   # borders stay zero across samples
            span = out[0] * out[1]
            cols = np.empty((group, k + fold, span), x.dtype)
            cols[:, k:] = 1
            body = cols[:, :k].reshape(c, len(taps), 1, span) if fold else cols.reshape(c, len(taps), 1, span)
            for s in range(n):
                _columns(fill_phases(buf, x[s:s + 1], begin, (sh, sw), hq, wq), taps, out, wq, True, body)
                ys = y[s].reshape(group, m // group, span)
                np.matmul(w_direct, cols, out=ys)
                if not fold and bias is not None:
                    ys += bias3.reshape(group, m // group, 1)
            return y
        # Flat slices compute wq - OW garbage columns per row; where that waste is large
        # (small maps) copy exact [OH, OW] windows instead.
        exact = (wq - out[1]) * 8 > out[1]
        span = out[0] * (out[1] if exact else wq)
        chunk = _chunk(n, k * group, span, x.dtype.itemsize)
        buf = np.zeros((sh, sw, chunk, c, hq, wq), x.dtype)   # borders stay zero across chunks
        cols = np.empty((c, len(taps), chunk, span), x.dtype)
        for start in range(0, n, chunk):
            part = x[start:start + chunk]
            size = part.shape[0]
            phases = fill_phases(buf[:, :, :size], part, begin, (sh, sw), hq, wq)
            body = cols[:, :, :size] if size < chunk else cols
            _columns(phases, taps, out, wq, exact, body)     # [C*kh*kw, size*span]
            acc = np.matmul(wg, body.reshape(group, k, size * span))
            acc = acc.reshape(m, size, out[0], -1)[:, :, :, :out[1]]
            # One pass: the copy out to NCHW adds the bias.
            np.add(acc.transpose(1, 0, 2, 3), bias3, out=y[start:start + size])
        return y
    return run


def _direct(out: list, wq: int, m: int, k: int) -> bool:
    """Whether one sample's GEMM should write its [M, OH*OW] result straight into the output.

    That needs exact [OH, OW] columns, which cost more to build than flat ones (a numpy call
    per output row instead of per tap), but it saves the pass that copies the result out to
    NCHW. The copy moves M*OH*OW values, the columns K*OH*wq, so it pays where M is large
    next to K: the 7x7 stem over 3 channels (K 147, M 64) takes 1.9-2.0 instead of 2.1 ms
    at batch 1 on a 2-core Xeon (17 vs 19 ms at batch 8); a 3x3 conv over 64 channels (K 576,
    M 64) stays faster with flat columns. Only
    where a sample gives enough columns for an efficient GEMM on its own.
    """
    return out[0] * out[1] >= MIN_COLS and 3 * m > k


def _columns(phases: np.ndarray, taps: list, out: list, wq: int, exact: bool, cols: np.ndarray) -> None:
    """im2col of a chunk into ``cols`` ([C, taps, size, span]): rows ordered (c, i, j) like
    the weights, columns (sample, position)."""
    _, _, size, c, flat = phases.shape
    oh, ow = out
    for t, (a, b, off) in enumerate(taps):
        src = phases[a, b].transpose(1, 0, 2)                 # [C, size, hq*wq]
        if exact:
            row, col = divmod(off, wq)
            grid = src.reshape(c, size, flat // wq, wq)[:, :, row:row + oh, col:col + ow]
            cols[:, t].reshape(c, size, oh, ow)[...] = grid
        else:
            cols[:, t] = src[:, :, off:off + oh * wq]


# Depthwise convs whose columns (C x taps x span floats) fit in this many bytes gather them and make one batched
# [1 x taps] x [taps x span] product per channel; larger ones accumulate tap by tap (two passes per tap over the
# [C, span] block). Measured on the 2-core EPYC over MobileNetV3's layer shapes, the same process, interleaved
# (issue 24): the product 1.05-1.9x faster up to 7 MB of columns (most at 14-28 pixels wide), 0.9-1.0x at 14-16 MB
# where the columns leave cache; MobileNetV3-Small-style b1 3.30 -> 2.85 ms.
DEPTHWISE_GEMM_BYTES = 8 << 20


def _depthwise(w: np.ndarray, window, bias) -> Callable:
    c, _, kh, kw = w.shape
    bias3 = _bias_or_zero(bias, c, w.dtype)
    weights = [np.ascontiguousarray(w[:, 0, i, j]).reshape(c, 1) for i in range(kh) for j in range(kw)]
    w3 = np.ascontiguousarray(w.reshape(c, 1, kh * kw))
    limit = DEPTHWISE_GEMM_BYTES

    def run(x):
        n, _, h, wd = x.shape
        begin, out, hq, wq = phase_geometry(window, (h, wd), (kh, kw))
        taps = tap_offsets(window, (kh, kw), wq)
        span = out[0] * wq
        sh, sw = window.strides
        buf = np.zeros((sh, sw, c, hq, wq), x.dtype)
        gemm = c * len(taps) * span * x.dtype.itemsize <= limit
        if gemm:
            cols = np.empty((c, len(taps), span), x.dtype)
            acc3 = np.empty((c, 1, span), x.dtype)
            acc = acc3.reshape(c, span)
        else:
            acc = np.empty((c, span), x.dtype)
            tmp = np.empty_like(acc)
        y = np.empty((n, c, out[0], out[1]), x.dtype)
        for s in range(n):
            # Per sample: the accumulator (or the columns) stay in cache across the taps.
            phases = fill_phases(buf, x[s], begin, (sh, sw), hq, wq)
            if gemm:
                for t, (a, b, off) in enumerate(taps):
                    cols[:, t] = phases[a, b, :, off:off + span]
                np.matmul(w3, cols, out=acc3)
            else:
                a, b, off = taps[0]
                np.multiply(phases[a, b, :, off:off + span], weights[0], out=acc)
                for (a, b, off), wt in zip(taps[1:], weights[1:]):
                    np.multiply(phases[a, b, :, off:off + span], wt, out=tmp)
                    acc += tmp
            np.add(acc.reshape(c, out[0], wq)[:, :, :out[1]], bias3, out=y[s])
        return y
    return run


def phase_geometry(window, sizes: tuple, kernel: tuple) -> tuple:
    """Sizes of the zero-padded per-phase images the shifted-slice im2col reads.

    A tap (i, j) of a stride-s conv reads input row oh*s + i*d: in the phase image of rows
    congruent to (i*d) % s, that is row oh + (i*d) // s. So after splitting the padded input
    into s*s phases, every tap is a stride-1 shift, and over a phase flattened row by row with
    row length wq, a tap's whole [OH, wq] input block is one contiguous slice (the columns past
    OW in each row are garbage the caller drops). Returns (begin pads, out, hq, wq).
    """
    begin, _, _ = static_pads(window, sizes)
    out = window_out_shape(window, sizes)
    shift = [((k - 1) * d) // s for k, d, s in zip(kernel, window.dilations, window.strides)]
    # One spare row: the last tap's flat slice runs up to shift_col elements past its block.
    hq = out[0] + shift[0] + 1
    wq = out[1] + shift[1]
    return begin, out, hq, wq


def tap_offsets(window, kernel: tuple, wq: int) -> list:
    """Per tap (row-major), (phase row, phase col, flat offset into that phase image)."""
    (sh, sw), (dh, dw) = window.strides, window.dilations
    taps = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            taps.append(((i * dh) % sh, (j * dw) % sw, ((i * dh) // sh) * wq + (j * dw) // sw))
    return taps


def fill_phases(buf: np.ndarray, x: np.ndarray, begin: list, strides: tuple, hq: int, wq: int) -> np.ndarray:
    """Write ``x`` ([..., H, W]) at the begin pads into the zeroed phase images ``buf``
    ([sh, sw, ..., hq, wq]; phase (a, b) holds the padded rows a, a + sh, ... and columns
    b, b + sw, ...) and return them flattened, [sh, sw, ..., hq*wq]. One strided copy per
    phase straight from ``x``, not a padded copy that is then split (a second full pass).
    Input rows and columns no window reaches are skipped."""
    sh, sw = strides
    top, left = begin
    h, w = x.shape[-2:]
    for a in range(sh):
        q0, q1 = _phase_range(a, top, sh, h, hq)
        for b in range(sw):
            p0, p1 = _phase_range(b, left, sw, w, wq)
            if q0 < q1 and p0 < p1:
                r0, c0 = a + sh * q0 - top, b + sw * p0 - left
                buf[a, b, ..., q0:q1, p0:p1] = x[..., r0:r0 + sh * (q1 - q0 - 1) + 1:sh, c0:c0 + sw * (p1 - p0 - 1) + 1:sw]
    return buf.reshape(buf.shape[:-2] + (hq * wq,))


def _phase_range(phase: int, pad: int, stride: int, size: int, count: int) -> tuple:
    """The phase positions [q0, q1) (below ``count``) whose padded index phase + stride*q is an
    input index: pad <= phase + stride*q < pad + size."""
    return -((phase - pad) // stride), min(count, -((phase - pad - size) // stride))
