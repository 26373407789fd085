"""kiln's optional native CPU kernels (``_native.c``): what they cover, and the switch.

The extension is built at install where a C compiler is found (setup.py, an optional extension) and shipped
prebuilt in wheels; without it kiln runs its numpy kernels, which stay the reference for every answer.
``KILN_NATIVE=0`` in the environment turns the native kernels off (read once, at import).

Covered: 2-D float32 convolutions computed directly (``direct_conv2d``): depthwise convs, and dense convs
with few multiply-adds per output (``DIRECT_MAX_TAPS``: input channels per group x kernel taps), where
im2col + GEMM copies more than it multiplies (the 3-channel stem). The GEMM keeps the rest.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np

from kiln.ir.ops.nn import static_pads, window_out_shape
from kiln.runtime.threads import kernel_threads

try:
    if os.environ.get("KILN_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        raise ImportError("turned off by KILN_NATIVE")
    from kiln.runtime.kernels.cpu import _native
except ImportError as e:  # not built (no compiler at install), or turned off
    _native = None
    UNAVAILABLE: Optional[str] = str(e)
else:
    UNAVAILABLE = None

# Dense convs with at most this many multiply-adds per output go direct, 1x1 convs with at most this many input
# channels per group; the GEMM is faster past them (measured on a 2-core EPYC, AVX2: the 3-channel 3x3 stem (27)
# 1.7x faster direct; 1x1 over 16-24 channels 1.2-1.5x, over 48 and more 0.5-1.0x; bench/RESULTS.md, issue 24).
DIRECT_MAX_TAPS = 27
DIRECT_MAX_POINTWISE = 24
# A thread per this many multiply-adds at most: below ~1M a thread costs more to start (~20-30 us here) than
# it saves (a 48x28x28 depthwise 3x3, 0.34M: 34 us on one thread, 55 on two).
MACS_PER_THREAD = 1 << 20


def available() -> bool:
    return _native is not None


def covers_conv(x_dtype: Any, w: np.ndarray, window: Any, group: int) -> bool:
    """Whether ``direct_conv2d`` takes this Conv (float32, 2-D, static weights; depthwise or few taps)."""
    if _native is None or np.dtype(x_dtype) != np.float32 or w.ndim != 4 or w.dtype != np.float32:
        return False
    if w.shape[3] > 64 or window.strides[1] > 16:  # _native's limits
        return False
    m, cpg, kh, kw = w.shape
    depthwise = cpg == 1 and group == m and group > 1
    if (kh, kw) == (1, 1):
        return depthwise or cpg <= DIRECT_MAX_POINTWISE
    return depthwise or cpg * kh * kw <= DIRECT_MAX_TAPS


def direct_conv2d(w: np.ndarray, window: Any, group: int, bias: Optional[np.ndarray]) -> Callable:
    """A Conv kernel over ``_native.direct_conv2d``: ``run(x)`` -> a fresh [N, M, OH, OW] float32 array, its
    geometry (pads in effect, output size) from the IR's own rules."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
    m, cpg, kh, kw = w.shape
    taps = cpg * kh * kw
    (sh, sw), (dh, dw) = window.strides, window.dilations
    conv = _native.direct_conv2d

    geometry: dict = {}  # (h, w) -> (pad top, pad left, oh, ow): the IR's rules, once per input size

    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)  # native byte order, C order
        n, c, h, wd = x.shape
        g = geometry.get((h, wd))
        if g is None:
            begin, _, _ = static_pads(window, (h, wd))
            g = geometry[(h, wd)] = (begin[0], begin[1], *window_out_shape(window, (h, wd)))
        pt, pl, oh, ow = g
        y = np.empty((n, m, oh, ow), np.float32)
        if y.size:
            threads = min(kernel_threads(), max(1, y.size * taps // MACS_PER_THREAD))
            conv(x, w, b, y, n, c, h, wd, m, oh, ow, kh, kw, group, sh, sw, dh, dw, pt, pl, threads)
        return y
    return run
