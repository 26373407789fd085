"""kiln's optional native CPU kernels (``_native.c``): what they cover, and the switch.

The extension is built at install where a C compiler is found (pyproject.toml, an optional extension) and shipped
prebuilt in wheels; without it kiln runs its numpy kernels, which stay the reference for every answer.
``KILN_NATIVE=0`` in the environment turns the native kernels off (read once, at import);
``KILN_NATIVE_THREADS=N`` lets one convolution use up to N threads (default: a run's threads where the extension's
sgemm runs the products, else 1; see MAX_THREADS).

Covered: 2-D float32 convolutions computed directly (``direct_conv2d``): depthwise convs, and dense convs
with few multiply-adds per output (``DIRECT_MAX_TAPS``: input channels per group x kernel taps;
``DIRECT_MAX_POINTWISE`` for 1x1), where im2col + GEMM copies more than it multiplies (the 3-channel stem).
The other one-group float32 convs run as GEMM convolutions (``gemm_conv2d``): a native im2col (one pass, the
padding written as zeros), the product, and one native output pass that adds the bias and applies an activation.
A covered Conv followed by Relu, HardSwish, HardSigmoid, Clip or LeakyRelu is fused at load into one call that
applies the activation in the output pass (``fusable``, ``epilogue_kernel``).

Where the CPU has AVX-512F the products are the extension's own sgemm (``has_sgemm``; ``KILN_NATIVE_SGEMM=0``
keeps numpy's): the GEMM convolutions' (their weights packed once at load), MatMul and Gemm against a constant
weight (``linear``, the weight packed once; also through a ``Transpose`` node of a constant weight), and MatMul of
two computed float32 operands (``matmul``: attention's products, batched), whichever kernels numpy's OpenBLAS
runs (``sgemm_wanted``): one thread, 190-230 GFLOP/s on a 2-core Zen 5 against OpenBLAS's Haswell kernels'
100-125 and its SkylakeX kernels' 110-230, and the models faster than on either (bench/RESULTS.md). Then numpy's
BLAS runs on one thread in kiln's runs (threads.own_gemm): its workers, spinning after each multi-threaded GEMM,
slowed the sgemm's threads beside them 1.7x.
Also row kernels for float32 C-contiguous arrays: exact Gelu (the numpy kernel's formula, one pass),
LayerNormalization and Softmax over the last axis (one or two passes per row where numpy makes 5-15). And
chains of Add/Sub/Mul/Div/Max/Min/Neg/Abs/Relu/Sqrt, Clip with constant bounds, Exp, Sigmoid and Tanh, fused at
load into a FusedElementwise that runs as one call over cache-sized chunks (``elementwise_kernel``): bit for bit
the unfused numpy kernels' answers, but for Exp, Sigmoid and Tanh (a few ulp from numpy's). Standalone
HardSwish/HardSigmoid (``activation``) and GlobalAveragePool (``mean_rows``) in one pass.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

import numpy as np

from kiln.ir.ops.nn import make_window, static_pads, window_out_shape
from kiln.runtime.threads import kernel_threads, own_gemm

_native: Any = None
UNAVAILABLE: Optional[str] = None  # why the extension is not used, for kiln info and the tests
if os.environ.get("KILN_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
    UNAVAILABLE = "turned off by KILN_NATIVE"
else:
    try:
        from kiln.runtime.kernels.cpu import _native
    except ImportError as e:  # not built: no C compiler at install (pyproject.toml declares it optional)
        UNAVAILABLE = f"not built at install, reinstall with a C compiler present ({e})"

# Dense convs with at most this many multiply-adds per output go direct, 1x1 convs with at most this many input
# channels per group; the GEMM is faster past them. Measured on a 2-core EPYC, AVX2: the 3-channel 3x3 stem (27)
# 1.7x faster direct; 1x1 over 16-24 channels 1.2-1.5x, over 48 and more 0.5-1.0x (bench/RESULTS.md, issue 24).
# With the AVX-512 tiles (2-core Zen 5, ms GEMM / direct, batch 1): ResNet's 7x7 stem over 3 channels (147 taps)
# 0.88 / 0.69 (b8 7.9 / 5.6), 5x5 over 3 (75) 0.34 / 0.19, 3x3 over 8 (72) 0.27 / 0.17, over 12 (108) 0.10 / 0.06,
# over 16 (144) 0.20 / 0.19 and 0.16 / 0.13 (stride 2), 5x5 over 8 (200) 0.26 / 0.25; past it the GEMM wins or ties
# (3x3 over 24 (216): 0.27 / 0.28, stride 2 0.11 / 0.15; over 32 (288) 0.36 / 0.36, 0.17 / 0.19). Without AVX-512
# (the 8-float tiles) only the first measurement stands: 27.
DIRECT_MAX_TAPS = 200 if _native is not None and _native.has_sgemm else 27
DIRECT_MAX_POINTWISE = 24
# A 1x1 stride-1 conv of several samples through the GEMM is one batched sgemm call, the weights shared and the pool
# splitting the samples, not a call per sample: on the 2-core Zen 5 at batch 8, MobileNetV3-style's pointwise convs
# ran 1.4-2.0x faster, the model at b8 1.14-1.22x (bench/pointwise_bench.py). False: the call per sample (the
# benchmark's baseline; the answers are the same bits either way).
BATCHED_POINTWISE = True
# ... for products of at most this many multiply-adds a sample: a call's fixed cost and its two short halves are what
# the batched call saves, and larger products have none to save (ResNet-50's 1x1 convs at 56x56, 51M a sample: the
# batched call took 0.99-1.20x the per-sample time at batches 2, 3 and 5 on 2 threads)
BATCHED_POINTWISE_MACS = 8 << 20


def _batches_pointwise(n: int, m: int, k: int, span: int) -> bool:
    """Whether n samples of a plain 1x1 conv (m outputs, k inputs, span pixels) take the one batched sgemm call."""
    return n > 1 and BATCHED_POINTWISE and m * span * k <= BATCHED_POINTWISE_MACS


# A thread per this many multiply-adds at most. The threads are the sgemm's pool (kept, spinning briefly between
# calls), so a second one costs microseconds, not the ~20-30 us a thread created per call did. 1 << 18 left
# MobileNetV3-style's depthwise convs (0.2-0.5M multiply-adds) on one thread: b1 0.59 -> 0.51 ms with 1 << 16 (one
# process, interleaved, in a slow phase of the 2-core Zen 5).
MACS_PER_THREAD = 1 << 16
# At most this many threads per call (KILN_NATIVE_THREADS; default: as many as a run may use, kernel_threads, where
# the extension's sgemm runs the products, else 1).
# It was 1 while numpy's OpenBLAS ran the GEMMs: its workers, spinning after each, took the second core from a
# native thread (MobileNetV3-style b1 1.28 ms on one thread, 1.39 on two). Where the extension's sgemm runs the
# products (AVX-512), the BLAS stays at one thread; measured on the 2-core Zen 5, MobileNetV3-style, one thread
# against the pool's two: b1 0.58 -> 0.52 ms, b8 5.5 -> 3.9 ms. Threads stay 1 on a busy host (kernel_threads).
# Where the CPU has AVX-512F the extension's sgemm runs the products, whichever kernels numpy's OpenBLAS runs. Until
# this was measured model by model it deferred to an OpenBLAS on AVX-512 kernels (SkylakeX, Cooperlake,
# SapphireRapids: one product at a time they were as fast on a 16-core Xeon), which turned off with it everything
# built on it (Winograd, the packed weights with the bias and activation in the product's output pass, attention's
# strided products), and `import kiln` itself asks for SkylakeX on a Zen 5 (kiln/blas_env.py). bench/RESULTS.md,
# "kiln's sgemm or numpy's AVX-512 OpenBLAS": the reference models ran 1.64x faster with it on the 16-core Xeon at 16
# threads and 1.31x at 2 (one row slower: BERT-style hidden 768 b1 at 2 threads, 68 against 59 ms), and 1.41-3.30x
# on the 2-core Zen 5. Product by product there (bench/cpu_options_bench.py) it beat MKL and BLIS on every shape
# and OpenBLAS's SkylakeX kernels on 13 of 18 (the 5 others, large products, by 1.03-1.13x).


def sgemm_wanted(setting: str, cpu_has_avx512: bool) -> bool:
    """Whether the extension's sgemm runs the products: ``KILN_NATIVE_SGEMM`` 0 (never), else (1, or unset: auto)
    wherever the CPU has AVX-512F."""
    setting = setting.strip().lower()
    return cpu_has_avx512 and setting not in ("0", "false", "no", "off")


SGEMM = _native is not None and sgemm_wanted(os.environ.get("KILN_NATIVE_SGEMM", ""), bool(_native.has_sgemm))
MAX_THREADS = max(1, int(os.environ.get("KILN_NATIVE_THREADS", "") or (64 if SGEMM else 1)))
# SGEMM_MR, SGEMM_NR: the rows of the sgemm's A panels and the columns of its B panels (_native.c's GEMM_MR, NR).
SGEMM_MR, SGEMM_NR = 12, 32
_ROWS, _PACKED, _TRANSPOSED = 0, 1, 2   # sgemm's operand modes
_BIAS_NONE, _BIAS_ROWS, _BIAS_COLS = 0, 1, 2
# An sgemm runs on one thread below this many multiply-adds (~2 us of work): its pool's threads wait spinning
# briefly between products, so a second one costs a few microseconds (a 128x64x784 product, 6.4M: 56 us on one
# thread, 33 on two). Measured on the 2-core Zen 5 against 1M: ViT-Tiny-style b1 0.88 -> 0.73 ms, MobileNetV3-style
# b1 0.52 -> 0.48 ms, the BERT-style and MLP rows unchanged.
SGEMM_MACS_PER_THREAD = 1 << 18
# Products of fewer rows stay numpy's. 1: every product is the sgemm's, whose tiles of fewer than 12 rows compute
# only the rows there are (a batch-1 MLP 784-512-512-10: 39.5 -> 36.4 us against BLAS's GEMV at one thread).
SGEMM_MIN_ROWS = 1


if SGEMM:
    # kiln's products run on the extension's threads: numpy's BLAS is kept to one thread in runs, so that its
    # workers never spin beside them (threads.py)
    own_gemm(True)


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


def direct_conv2d(w: np.ndarray, window: Any, group: int, bias: Optional[np.ndarray],
                  activation: tuple = (0, 0.0, 0.0)) -> Callable:
    """A Conv kernel over ``_native.direct_conv2d``: ``run(x)`` -> a fresh [N, M, OH, OW] float32 array, its
    geometry (pads in effect, output size) from the IR's own rules; ``activation`` (code, alpha, beta), see
    ``activation_of``, applied in the output pass."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
    m, cpg, kh, kw = w.shape
    taps = cpg * kh * kw
    (sh, sw), (dh, dw) = window.strides, window.dilations
    conv = _native.direct_conv2d_fast
    code, alpha, beta = activation
    alpha, beta = float(alpha), float(beta)
    # input shape -> (output shape, the extension's 16 sizes, multiply-adds): the IR's geometry rules once per input
    # size, and one tuple per call instead of 25 arguments to parse
    geometry: dict = {}

    def run(x: np.ndarray) -> np.ndarray:
        if type(x) is not np.ndarray or x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)  # native byte order, C order
        g = geometry.get(x.shape)
        if g is None:
            n, c, h, wd = x.shape
            begin, _, _ = static_pads(window, (h, wd))
            oh, ow = window_out_shape(window, (h, wd))
            g = ((n, m, oh, ow), (n, c, h, wd, m, oh, ow, kh, kw, group, sh, sw, dh, dw, begin[0], begin[1]),
                 n * m * oh * ow * taps)
            if len(geometry) > 64:  # many sizes (dynamic spatial dims): keep the cache bounded
                geometry.clear()
            geometry[x.shape] = g
        y = np.empty(g[0], np.float32)
        if g[2]:
            conv(x, w, b, y, g[1], min(MAX_THREADS, kernel_threads(), max(1, g[2] // MACS_PER_THREAD)), code, alpha,
                 beta)
        return y
    return run


# ----------------------------------------------------------------------------- GEMM convolutions
# The GEMM convs (what covers_conv leaves: dense convs over many channels x taps) build their columns for this many
# samples at a time: enough columns for an efficient GEMM (late 7x7 maps batch several samples into one product),
# at most GEMM_COLS_BYTES of columns. One sample whose map gives MIN_GEMM_COLS columns is its own GEMM, which
# writes the output in place (no copy out).
MIN_GEMM_COLS = 1024
GEMM_COLS_BYTES = 8 << 20


_SCRATCH = threading.local()


def scratch(role: str, shape: tuple) -> np.ndarray:
    """A float32 work array of ``shape`` for ``role`` ("cols", "acc", "tiles", "products"), this thread's, kept
    between calls (grown, never shrunk: at most a few times GEMM_COLS_BYTES or WINOGRAD_BYTES each). Fresh
    multi-MB arrays were page-faulted in on every call: a 64-channel 56x56 Winograd conv made 1,536 faults a call,
    3.1 ms where its work is 0.9. Kernels never return one: their outputs are fresh."""
    size = 1
    for d in shape:
        size *= d
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    buf = buffers.get(role)
    if buf is None or buf.size < size:
        buf = buffers[role] = np.empty(max(size, 1), np.float32)
    return buf[:size].reshape(shape)


def covers_gemm_conv(x_dtype: Any, w: np.ndarray, window: Any, group: int) -> bool:
    """Whether ``gemm_conv2d`` takes this Conv: float32, 2-D, static weights, one group (numpy's im2col keeps
    grouped convs; depthwise and few-tap ones are ``covers_conv``'s)."""
    return (_native is not None and np.dtype(x_dtype) == np.float32 and w.ndim == 4 and w.dtype == np.float32
            and group == 1)


def has_sgemm() -> bool:
    """Whether the extension's own AVX-512 sgemm runs the products here (``SGEMM``: ``sgemm_wanted``)."""
    return _native is not None and SGEMM  # SGEMM already asks for the CPU's AVX-512F (sgemm_wanted)


def _panels(src: np.ndarray, width: int, by_rows: bool) -> np.ndarray:
    rows, cols = src.shape
    panels = -(-(rows if by_rows else cols) // width)
    dst = np.empty((panels, cols if by_rows else rows, width), np.float32)
    _native.pack(np.ascontiguousarray(src, np.float32), dst, rows, cols, width, by_rows)
    return dst


def pack_rows(a: np.ndarray) -> np.ndarray:
    """``a`` [M, K] as ``_native.sgemm``'s A operand: panels of SGEMM_MR rows, [ceil(M/MR), K, MR], zero rows
    past M (one native pass: numpy's pad-and-transpose took 83 of ResNet-18's 105 ms of load)."""
    return _panels(a, SGEMM_MR, True)


def pack_cols(b: np.ndarray) -> np.ndarray:
    """``b`` [K, N] as ``_native.sgemm``'s packed B operand: panels of SGEMM_NR columns, [ceil(N/NR), K, NR], zero
    columns past N. A transposed view of a contiguous weight (nn.Linear's [N, K]) packs as row panels of it."""
    if not b.flags.c_contiguous and b.T.flags.c_contiguous:
        return _panels(b.T, SGEMM_NR, True)
    return _panels(b, SGEMM_NR, False)


# Constant operands (a conv's or a Linear layer's weights, Winograd's transformed weights) are packed for the sgemm
# from a kernel's PACK_AT_CALL-th call on, not at load: calls before it read the weights as they lie (mmap'd from the
# file: the sgemm packs them block by block into its small buffers; Winograd's transform goes into a temporary).
# Packing every weight at load or on the first run wrote ResNet-18's 46 MB of packed and transformed weights into
# fresh memory, page-faulted in: 25-90 ms of a fresh process's first run (measured on the 2-core Zen 5, against a
# 13 ms run). Both ways compute the same sums in the same order, so every call answers the same bits.
# The packing runs on one background thread (PACK_IN_BACKGROUND; the native passes release the GIL): made on the
# calling thread it was the second run's cost, ResNet-18 b1 53 ms and BERT-style hidden 768 b1 195 ms in a fresh
# process against 10.7 and 18.9 steady. Calls keep reading the weights as they lie until the packed copy is there.
PACK_AT_CALL = 2
PACK_IN_BACKGROUND = True


class _Lazy:
    """A value made by ``make()`` once ``get()`` has been called PACK_AT_CALL times: on the packing thread
    (PACK_IN_BACKGROUND; ``get()`` answers None until it is there) or on the caller's. None before it, and for
    good where making it failed (out of memory, say: the kernel keeps reading its weights as they lie). Two threads
    may both make it (each gets a right value; one is kept)."""

    __slots__ = ("make", "value", "calls", "submitted")

    def __init__(self, make: Callable[[], np.ndarray]):
        self.make, self.value, self.calls, self.submitted = make, None, 0, False

    def get(self) -> Optional[np.ndarray]:
        value = self.value
        if value is None:
            self.calls += 1
            if self.calls >= PACK_AT_CALL and not self.submitted:
                self.submitted = True
                if PACK_IN_BACKGROUND:
                    _PACKER.submit(self)
                else:
                    value = self.value = self.make()
        return value


class _Packer:
    """One daemon thread making the submitted ``_Lazy`` values in turn. A forked child (a server's worker) gets a
    fresh queue and thread, and what the parent had not made yet is submitted again by its next call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: Any = None
        self._pending: set = set()  # submitted, not made yet

    def submit(self, lazy: _Lazy) -> None:
        import queue
        with self._lock:
            self._pending.add(lazy)
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._work, args=(self._queue,), name="kiln-pack", daemon=True).start()
            self._queue.put(lazy)

    def _work(self, jobs: Any) -> None:
        while True:
            lazy = jobs.get()
            try:
                lazy.value = lazy.make()
            except Exception:  # noqa: BLE001 - MemoryError, say: the kernel reads its weights as they lie
                pass
            with self._lock:
                self._pending.discard(lazy)

    def wait(self, timeout: float = 60.0) -> bool:
        """Whether everything submitted has been made (or failed) within ``timeout`` seconds."""
        import time
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if time.monotonic() > end:
                return False
            time.sleep(0.001)

    def after_fork_in_child(self) -> None:
        pending = self._pending
        self._lock, self._queue, self._pending = threading.Lock(), None, set()
        for lazy in pending:
            if lazy.value is None:
                lazy.submitted = False


_PACKER = _Packer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_PACKER.after_fork_in_child)


def wait_packed(timeout: float = 60.0) -> bool:
    """Wait until the weights the kernels have asked to pack are packed (tests, benchmarks); False on timeout."""
    return _PACKER.wait(timeout)


def linear(weight: np.ndarray, bias: Optional[np.ndarray], activation: tuple = (0, 0.0, 0.0)) -> Optional[Callable]:
    """``act(x @ weight + bias)`` for float32 ``x`` [..., K] against a constant ``weight`` [K, N] (bias [N] or None;
    ``activation`` (code, alpha, beta), see ``activation_of``) through ``_native.sgemm`` with the weight packed once,
    or None where it does not run (no AVX-512, not float32). ``run(x)`` -> a fresh [..., N] float32 array."""
    if not has_sgemm() or weight.ndim != 2 or weight.dtype != np.float32 \
            or (bias is not None and (bias.dtype != np.float32 or bias.size != weight.shape[1])):
        return None
    k, n = weight.shape
    packed = _Lazy(lambda: pack_cols(weight))
    # until packed (PACK_AT_CALL): the weight as it lies, by rows, or as the transpose of nn.Linear's [N, K]
    if not weight.flags.c_contiguous and weight.T.flags.c_contiguous:
        plain, plain_mode = weight.T, _TRANSPOSED
    else:
        plain, plain_mode = np.ascontiguousarray(weight), _ROWS
    b = None if bias is None else np.ascontiguousarray(bias, np.float32).reshape(n)
    bias_mode = _BIAS_NONE if b is None else _BIAS_COLS
    sgemm = _native.sgemm

    def run(x: np.ndarray) -> np.ndarray:
        if not x.flags.c_contiguous and x.ndim > 2 and x.strides[-1] == x.itemsize:
            # a permutation of a contiguous stack (a seq-first view of batch-first memory): the product runs in
            # memory order and comes back permuted the same way, a view (as linalg._matmul_folded does)
            order = sorted(range(x.ndim - 1), key=lambda i: -x.strides[i]) + [x.ndim - 1]
            base = x.transpose(order)
            if base.flags.c_contiguous:
                return run(base).transpose(np.argsort(order))
        lead = x.shape[:-1]
        m = 1
        for d in lead:
            m *= d
        a = np.ascontiguousarray(x, np.float32)
        y = np.empty(lead + (n,), np.float32)
        if m:
            w = packed.get()
            sgemm(a, plain if w is None else w, y, b, m, n, k, _ROWS, plain_mode if w is None else _PACKED, bias_mode,
                  *activation, gemm_threads(m, n, k))
        return y
    return run


def matmul(a: np.ndarray, b: np.ndarray) -> Optional[np.ndarray]:
    """``a @ b`` (numpy's matmul semantics) for float32 operands of at least 2 dims through ``_native.matmul`` (the
    sgemm), or None where it does not take them (no AVX-512, another dtype, k = 0, broadcast leading dims other than
    one side's absence): then the caller runs numpy's. Strided views (attention's heads split from [batch, seq,
    heads, dim] memory, ``K^T``) are read in place: the extension finds each product's operands from the arrays'
    own strides. An operand it cannot read in place (neither of its last two axes at unit stride) is copied."""
    if not has_sgemm() or a.dtype != np.float32 or b.dtype != np.float32 or a.ndim < 2 or b.ndim < 2:
        return None
    lead_a, lead_b = a.shape[:-2], b.shape[:-2]
    if a.shape[-1] != b.shape[-2] or a.shape[-1] == 0 or (lead_a and lead_b and lead_a != lead_b):
        return None
    m, k = a.shape[-2:]
    n = b.shape[-1]
    lead = lead_a or lead_b
    y = np.empty(lead + (m, n), np.float32)
    if y.size == 0:
        return y
    threads = gemm_threads(y.size // n, n, k)
    if not _native.matmul(a, b, y, threads):
        _native.matmul(np.ascontiguousarray(a), np.ascontiguousarray(b), y, threads)
    return y


def gemm_threads(m: int, n: int, k: int) -> int:
    """Threads for one sgemm: what a run may use (kernel_threads: the BLAS's count, 1 on a busy host), one per
    SGEMM_MACS_PER_THREAD multiply-adds at most, a product of fewer than SGEMM_MR rows counted as SGEMM_MR (its
    cost is reading B, as a panel's)."""
    return max(1, min(kernel_threads(), max(m, SGEMM_MR) * n * k // SGEMM_MACS_PER_THREAD))


def _geometry_of(window: Any, cache: dict, sizes: tuple) -> tuple:
    """(pad top, pad left, oh, ow) of ``window`` over an input of ``sizes``, the IR's own rules, cached."""
    g = cache.get(sizes)
    if g is None:
        begin, _, _ = static_pads(window, sizes)
        g = (begin[0], begin[1], *window_out_shape(window, sizes))
        if len(cache) > 64:  # many sizes (dynamic spatial dims): keep the cache bounded
            cache.clear()
        cache[sizes] = g
    return g


def gemm_conv2d(w: np.ndarray, window: Any, bias: Optional[np.ndarray],
                activation: tuple = (0, 0.0, 0.0)) -> Callable:
    """A one-group Conv as native im2col + numpy's GEMM (BLAS) + one native output pass that adds the bias and
    applies ``activation`` (see ``activation_of``): ``run(x)`` -> a fresh [N, M, OH, OW] float32 array. A 1x1
    stride-1 unpadded conv multiplies the input itself (no columns)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
    m, c, kh, kw = w.shape
    k = c * kh * kw
    w2 = w.reshape(m, k)
    (sh, sw), (dh, dw) = window.strides, window.dilations
    code, alpha, beta = activation
    finish = code != 0 or b is not None
    im2col, gemm_out = _native.im2col, _native.gemm_out
    geometry: dict = {}
    lazy = _Lazy(lambda: pack_rows(w2)) if has_sgemm() else None
    if lazy is not None:
        sgemm = _native.sgemm

        def product(cols: np.ndarray, out: np.ndarray, fused: bool, packed: Optional[np.ndarray]) -> None:
            """out = cols' product with the weights (+ the bias and activation where ``fused``): ``packed``, or
            before they are (PACK_AT_CALL) the weights as they lie."""
            n_cols = cols.shape[1]
            bias_mode = _BIAS_ROWS if fused and b is not None else _BIAS_NONE
            sgemm(w2 if packed is None else packed, cols, out, b if bias_mode else None, m, n_cols, k,
                  _ROWS if packed is None else _PACKED, _ROWS, bias_mode, code if fused else 0, alpha, beta,
                  gemm_threads(m, n_cols, k))

        def batched(x3: np.ndarray, y3: np.ndarray, packed: Optional[np.ndarray]) -> None:
            """The samples' products in one call, the weights shared (stride 0), bias and activation fused: the
            pool hands each thread whole samples. As many as divide evenly among the threads go in it; the rest
            (a batch of 3 on 2 threads: 1) are a call each, split by columns (whole samples left one thread with
            two of three: ResNet-50-sized 1x1 convs at batch 3 ran 1.4x slower than a call per sample)."""
            n_s, _, span = x3.shape
            threads = gemm_threads(m * n_s, span, k)
            whole = n_s - n_s % threads
            if whole > 1:
                bias_mode = _BIAS_ROWS if b is not None else _BIAS_NONE
                sgemm(w2 if packed is None else packed, x3[:whole], y3[:whole], b, m, span, k,
                      _ROWS if packed is None else _PACKED, _ROWS, bias_mode, code, alpha, beta, threads, whole, 0,
                      k * span, m * span)
            else:
                whole = 0
            for s in range(whole, n_s):
                product(x3[s], y3[s], True, packed)
    else:
        def product(cols: np.ndarray, out: np.ndarray, fused: bool, packed: None) -> None:
            np.matmul(w2, cols, out=out)
            if fused and finish:
                gemm_out(out, out, b, m, 1, cols.shape[1], code, alpha, beta)

    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        n, _, h, wd = x.shape
        pt, pl, oh, ow = _geometry_of(window, geometry, (h, wd))
        span = oh * ow
        y = np.empty((n, m, oh, ow), np.float32)
        if y.size == 0:
            return y
        y3 = y.reshape(n, m, span)
        packed = None if lazy is None else lazy.get()
        if (kh, kw, sh, sw, pt, pl, oh, ow) == (1, 1, 1, 1, 0, 0, h, wd):  # the columns are the input
            x3 = x.reshape(n, c, span)
            if lazy is not None and _batches_pointwise(n, m, k, span):
                batched(x3, y3, packed)
                return y
            for s in range(n):
                product(x3[s], y3[s], True, packed)
            return y
        chunk = max(1, min(n, -(-MIN_GEMM_COLS // span), GEMM_COLS_BYTES // max(1, k * span * 4)))
        cols = scratch("cols", (k * chunk * span,))
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            part = cols[:k * size * span].reshape(k, size * span)  # the last, smaller chunk: a prefix
            im2col(x[start:start + size], part, size, c, h, wd, kh, kw, sh, sw, dh, dw, pt, pl, oh, ow)
            if size == 1:  # the GEMM writes the output, the bias and activation applied in place
                product(part, y3[start], True, packed)
            else:
                acc = scratch("acc", (m, size * span))
                product(part, acc, False, packed)
                gemm_out(acc, y[start:start + size], b, m, size, span, code, alpha, beta)
        return y
    return run


# ----------------------------------------------------------------------------- Winograd F(2x2, 3x3)
# 3x3 stride-1 convs over at least this many input and output channels run as Winograd's 16 products (2.25x fewer
# multiply-adds than im2col's product; the transforms are adds), where a chunk of samples gives each product at
# least WINOGRAD_MIN_TILES columns (else the GEMM convolution runs). Measured on the 2-core Zen 5 (ms, Winograd
# against the GEMM convolution, ResNet-18's layers, one process): 64x56x56 b1 0.78/1.49, b8 4.0/6.2; 128x28x28 b1
# 0.52/1.06, b8 4.3/8.0; 256x14x14 (49 tiles) b1 1.02/1.01, b8 5.1/6.4; 512x7x7 (16 tiles) b1 0.99/0.99 (the GEMM's,
# below 64 tiles), b8 6.7/6.9. The 64-channel layers won only once the transformed planes stopped being 4 KiB
# multiples apart (_unaliased): before, the input transform took 0.30 ms there, and Winograd lost (0.95/0.80).
# With the faster transforms, 32 tiles: 256x14x14 (49 tiles) b1 0.69/1.02 alone, and ResNet-18 b1 14.1-14.2 ->
# 13.2-13.3 ms (64 -> 32); 16 tiles (512x7x7 b1) wins alone (0.85/1.04) but loses in the model (14.8 ms): its
# transformed weights, 16/9 of the 9.4 MB, come from memory every run.
WINOGRAD_MIN_CHANNELS = 64
WINOGRAD_MIN_TILES = 32
# Transformed inputs per chunk of samples (a chunk has at least WINOGRAD_MIN_TILES tiles where the batch has them).
# Measured on the 2-core Zen 5 (ms, one conv, chunks of 8 / 2 / 1 MB): 512x7x7 b32 20.5 / 15.2 / 14.1, b8 4.7 /
# 3.9 / 3.6; 256x14x14 b32 20.2 / 15.9 / 16.1; 128x28x28 b32 16.5 / 14.1 / 14.0; 64x56x56 b8 4.4 / 4.1 / 4.1 (one
# sample is 3.2 MB there: every size gives chunks of one). The 16 products' inputs and outputs of a smaller chunk
# stay in the L2 between the transforms and the product, though the transformed weights are read once a chunk.
WINOGRAD_BYTES = 1 << 20
WINOGRAD = os.environ.get("KILN_WINOGRAD", "1").strip().lower() not in ("0", "false", "no", "off")
# B^T d B, A^T m A and G g G^T (in double, once per conv, on its first Winograd call) are in _native.c


def _unaliased(floats: int) -> int:
    """A stride of at least ``floats`` floats that is not within 256 bytes of a multiple of 4 KiB: the 16 transformed
    planes are written and read as 16 streams, and at a 4 KiB multiple apart they fell into the same L1 sets (64
    channels of 56x56: 784 tiles, 200,704 bytes a plane, 49 x 4 KiB: the input transform took 0.30 ms, 0.06 for
    128 channels of 28x28 with half the tiles)."""
    offset = (floats * 4) % 4096
    return floats + 64 if offset < 256 or offset > 4096 - 256 else floats


def covers_winograd(w: np.ndarray, window: Any, group: int) -> bool:
    """Whether ``winograd_conv2d`` takes this Conv: float32 3x3, stride 1, no dilation, one group, enough channels,
    on the extension's sgemm (AVX-512)."""
    return (WINOGRAD and has_sgemm() and w.ndim == 4 and w.dtype == np.float32 and group == 1
            and w.shape[2:] == (3, 3) and tuple(window.strides) == (1, 1) and tuple(window.dilations) == (1, 1)
            and min(w.shape[0], w.shape[1]) >= WINOGRAD_MIN_CHANNELS)


def winograd_conv2d(w: np.ndarray, window: Any, bias: Optional[np.ndarray],
                    activation: tuple = (0, 0.0, 0.0)) -> Callable:
    """A 3x3 stride-1 one-group Conv as Winograd F(2x2, 3x3): the input's 4x4 tiles transformed natively
    (``_native.winograd_input``), 16 products of the transformed weights (packed once) with them in one batched
    ``_native.sgemm``, and the output transform with the bias and ``activation`` in one native pass. Its rounding
    differs from the direct sum's by a few float32 ulps of the inputs' scale (tested against float64)."""
    m, c = w.shape[:2]
    b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
    w32 = np.ascontiguousarray(w, np.float32)

    def transform() -> np.ndarray:  # G g G^T of each kernel, packed for the 16 products, in one native pass
        u = np.empty((16, -(-m // SGEMM_MR), c, SGEMM_MR), np.float32)
        _native.winograd_weights(w32, u, m, c)
        return u
    # kept from the PACK_AT_CALL-th call on; a temporary before (a map too small for Winograd never makes it)
    transformed = _Lazy(transform)
    code, alpha, beta = activation
    sgemm, transform_in, transform_out = _native.sgemm, _native.winograd_input, _native.winograd_output
    geometry: dict = {}
    fallback: list = []  # the GEMM convolution, made on first need (few tiles: small maps at small batches)

    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        n, _, h, wd = x.shape
        pt, pl, oh, ow = _geometry_of(window, geometry, (h, wd))
        th, tw = (oh + 1) // 2, (ow + 1) // 2
        per_sample = max(1, th * tw)
        chunk = max(1, min(n, max(WINOGRAD_BYTES // (16 * c * per_sample * 4), -(-WINOGRAD_MIN_TILES // per_sample))))
        if chunk * th * tw < WINOGRAD_MIN_TILES:
            if not fallback:
                fallback.append(gemm_conv2d(w, window, bias, activation))
            return fallback[0](x)
        y = np.empty((n, m, oh, ow), np.float32)
        if y.size == 0:
            return y
        packed = transformed.get()
        if packed is None:
            packed = transform()
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            tiles = size * th * tw
            kv, km = _unaliased(c * tiles), _unaliased(m * tiles)
            v = scratch("tiles", (16, kv))
            transform_in(x[start:start + size], v, size, c, h, wd, pt, pl, th, tw, kv)
            prod = scratch("products", (16, km))
            sgemm(packed, v, prod, None, m, tiles, c, _PACKED, _ROWS, _BIAS_NONE, 0, 0.0, 0.0,
                  gemm_threads(16 * m, tiles, c), 16, packed[0].size, kv, km)
            transform_out(prod, y[start:start + size], b, size, m, oh, ow, th, tw, code, alpha, beta, km)
        return y
    return run


# ----------------------------------------------------------------------------- a Conv and its activation
# kiln.FusedEpilogue bodies of a Conv and one of these ops run as one native call: the activation is applied in
# the output pass (no second pass over the output, no temporaries). The codes are _native.c's ACT_*.
ACTIVATIONS = {"Relu": 1, "HardSwish": 2, "HardSigmoid": 3, "Clip": 4, "LeakyRelu": 5}


def activation_of(node: Any, const_of: Callable[[Any], Optional[np.ndarray]]) -> Optional[tuple]:
    """(code, alpha, beta) for ``_native.direct_conv2d`` if ``node`` is an activation it applies (float32, a
    Clip's bounds constants), else None. ``const_of(value)`` gives a value's constant array or None."""
    if node.domain != "" or node.op not in ACTIVATIONS or len(node.outputs) != 1:
        return None
    t = node.outputs[0].type
    if t is None or t.dtype is None or np.dtype(t.dtype.numpy) != np.float32:
        return None
    attrs = node.schema.fill_attrs(node.attrs)
    code = ACTIVATIONS[node.op]
    if node.op == "HardSwish":
        return code, 1.0 / 6.0, 0.5
    if node.op == "HardSigmoid":
        return code, float(attrs["alpha"]), float(attrs["beta"])
    if node.op == "LeakyRelu":
        return code, float(attrs["alpha"]), 0.0
    if node.op == "Clip":
        bounds = []
        for k, default in ((1, -np.inf), (2, np.inf)):
            v = node.inputs[k] if len(node.inputs) > k else None
            if v is None:
                bounds.append(default)
                continue
            c = const_of(v)
            if c is None or c.size != 1:
                return None
            bounds.append(float(np.asarray(c, np.float32).reshape(())))
        return code, bounds[0], bounds[1]
    return code, 0.0, 0.0


def _conv_parts(conv: Any, const_of: Callable[[Any], Optional[np.ndarray]]) -> Optional[tuple]:
    """(w, window, group, bias) of a Conv ``direct_conv2d`` or ``gemm_conv2d`` covers, else None."""
    if conv.domain != "" or conv.op != "Conv" or len(conv.inputs) < 2:
        return None
    w = const_of(conv.inputs[1])
    bias = const_of(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] is not None else None
    if w is None or (len(conv.inputs) > 2 and conv.inputs[2] is not None and bias is None):
        return None
    x_type = conv.inputs[0].type
    if x_type is None or x_type.dtype is None or w.ndim != 4:
        return None
    attrs = conv.schema.fill_attrs(conv.attrs)
    window = make_window(attrs["kernel_shape"] or w.shape[2:], strides=attrs["strides"],
                         dilations=attrs["dilations"], pads=attrs["pads"], auto_pad=attrs["auto_pad"])
    if not (covers_conv(x_type.dtype.numpy, w, window, attrs["group"])
            or covers_gemm_conv(x_type.dtype.numpy, w, window, attrs["group"])):
        return None
    return w, window, attrs["group"], bias


def conv_kernel(w: np.ndarray, window: Any, group: int, bias: Optional[np.ndarray], activation: tuple) -> Callable:
    """The native kernel of a Conv ``_conv_parts`` accepted: direct where ``covers_conv``, Winograd where
    ``covers_winograd``, else the GEMM's."""
    if covers_conv(np.float32, w, window, group):
        direct = direct_conv2d(w, window, group, bias, activation=activation)
        if not (BATCHED_POINTWISE and has_sgemm() and group == 1 and _plain_pointwise(w, window)):
            return direct
        # A 1x1 over few channels: direct for one sample, one batched sgemm for several (bench/pointwise_bench.py:
        # at batch 8 it beat the direct kernel on 3 of MobileNetV3-style's 4 such convs, 16 -> 32 channels at 56x56
        # 131 -> 119 us, and lost on 16 -> 16, 57 -> 76)
        batched = gemm_conv2d(w, window, bias, activation)
        m, c = w.shape[:2]

        def run(x: np.ndarray) -> np.ndarray:
            if x.ndim == 4 and _batches_pointwise(x.shape[0], m, c, x.shape[2] * x.shape[3]):
                return batched(x)
            return direct(x)
        return run
    if covers_winograd(w, window, group):
        return winograd_conv2d(w, window, bias, activation)
    return gemm_conv2d(w, window, bias, activation)


def _plain_pointwise(w: np.ndarray, window: Any) -> bool:
    """A 1x1 window at stride 1 without dilation or padding (what gemm_conv2d multiplies without columns)."""
    return w.shape[2:] == (1, 1) and tuple(window.strides) == (1, 1) and tuple(window.dilations) == (1, 1) \
        and not any(window.pads or ())


def fusable(anchor: Any, consumer: Any) -> bool:
    """``fuse_epilogues``'s ``accept`` for the CPU runtime: a Conv this extension covers (directly or as its GEMM
    convolution) and one activation; or a float32 product against a constant weight the sgemm runs (a MatMul, a
    Gemm) and one activation, or a MatMul and the Add of a constant row bias."""
    const_of = _const_of_value
    if anchor.op == "Conv":
        return _conv_parts(anchor, const_of) is not None and activation_of(consumer, const_of) is not None
    return _linear_epilogue(anchor, consumer, const_of) is not None


def _weight_of(v: Any, const_of: Callable[[Any], Optional[np.ndarray]]) -> Optional[np.ndarray]:
    """A product's constant weight: ``v``'s constant, or the constant a 2-D Transpose of ``v`` reads, transposed
    (linalg.weight_input's rule)."""
    w = const_of(v)
    if w is not None or v is None or v.producer is None:
        return w
    t = v.producer
    if t.domain != "" or t.op != "Transpose" or not t.inputs or t.inputs[0] is None or t.inputs[0].const is None:
        return None
    source = np.asarray(t.inputs[0].const)
    perm = t.attrs.get("perm")
    return source.T if source.ndim == 2 and (perm is None or list(perm) == [1, 0]) else None


def _linear_epilogue(anchor: Any, consumer: Any, const_of: Callable[[Any], Optional[np.ndarray]]) -> Optional[tuple]:
    """(weight [K, N], bias [N] or None, activation) of a product and its consumer that ``linear`` runs as one
    sgemm with its output pass, or None. The bias is added after the whole sum and the activation after it, as the
    unfused ops do: the answers are theirs bit for bit."""
    if anchor.domain != "" or anchor.op not in ("MatMul", "Gemm") or not has_sgemm() or len(anchor.inputs) < 2:
        return None
    x_type, out_type = anchor.inputs[0].type, anchor.outputs[0].type
    if x_type is None or x_type.dtype is None or np.dtype(x_type.dtype.numpy) != np.float32 \
            or out_type is None or out_type.shape is None:
        return None
    bias = None
    if anchor.op == "MatMul":
        w = _weight_of(anchor.inputs[1], const_of)
        if x_type.shape is None or len(x_type.shape) < 2:
            return None
    else:
        attrs = anchor.schema.fill_attrs(anchor.attrs)
        if attrs["alpha"] != 1.0 or attrs["transA"]:
            return None
        w = const_of(anchor.inputs[1])
        if w is not None and attrs["transB"]:
            w = w.T
        if len(anchor.inputs) > 2 and anchor.inputs[2] is not None:
            bias = const_of(anchor.inputs[2])
            if bias is None or attrs["beta"] != 1.0 or w is None or bias.shape not in ((w.shape[1],), (1, w.shape[1])):
                return None
    if w is None or w.ndim != 2 or w.dtype != np.float32 or (bias is not None and bias.dtype != np.float32):
        return None
    n = w.shape[1]
    activation = activation_of(consumer, const_of)
    if activation is not None:
        return w, bias, activation
    # Add(product, b) / Add(b, product) of a constant row bias, the product's own shape kept
    if consumer.domain != "" or consumer.op != "Add" or anchor.op != "MatMul" or len(consumer.inputs) != 2:
        return None
    other = [v for v in consumer.inputs if v is not anchor.outputs[0]]
    if len(other) != 1:
        return None
    b = const_of(other[0])
    rank = len(out_type.shape)
    if b is None or b.dtype != np.float32 or b.size != n or b.ndim > rank or (b.ndim and b.shape[-1] != n):
        return None
    return w, b.reshape(n), (0, 0.0, 0.0)


def _const_of_value(v: Any) -> Optional[np.ndarray]:
    return None if v is None or v.const is None else np.asarray(v.const)


def epilogue_kernel(node: Any, attrs: dict) -> Optional[Callable]:
    """The kernel of a ``kiln.FusedEpilogue`` whose body ``fusable`` let ``fuse_epilogues`` make (a covered Conv and
    one activation; a product and its row bias or activation), or None: its weights are the node's outer constants."""
    if _native is None:
        return None
    body = attrs["body"]
    if len(body.nodes) != 2:
        return None
    conv, act = body.nodes
    outer = {b: v for b, v in zip(body.inputs, node.inputs)}

    def const_of(v: Any) -> Optional[np.ndarray]:
        if v is not None and v.const is not None:
            return np.asarray(v.const)
        return _const_of_value(outer.get(v))

    if conv.op in ("MatMul", "Gemm"):  # a product and its bias or activation: one sgemm
        if conv.outputs[0] not in act.inputs or list(body.outputs) != [act.outputs[0]]:
            return None
        # constants as const_of reads them, and a weight behind a Transpose outside the body as _weight_of does
        parts = _linear_epilogue(conv, act, lambda v: _weight_of(outer.get(v, v), _const_of_value))
        product = None if parts is None else linear(*parts)
        if product is None:
            return None
        x_index = body.inputs.index(conv.inputs[0]) if conv.inputs[0] in body.inputs else None
        if x_index is None:
            return None

        def run_product(*args: Any) -> np.ndarray:
            return product(args[x_index])
        return run_product
    if list(act.inputs[:1]) != [conv.outputs[0]] or list(body.outputs) != [act.outputs[0]]:
        return None
    parts = _conv_parts(conv, const_of)
    activation = activation_of(act, const_of)
    if parts is None or activation is None:
        return None
    body_run = conv_kernel(*parts, activation)

    def run(x: np.ndarray, *rest: Any) -> np.ndarray:  # rest: the weights and the activation's bounds
        return body_run(x)
    return run


# ----------------------------------------------------------------------------- MaxPool
def max_pool2d(window: Any) -> Callable:
    """A 2-D MaxPool over ``_native.max_pool`` for float32 [N, C, H, W] (rows_ok): ``run(x)`` -> a fresh
    [N, C, OH, OW] array, the geometry from the IR's rules; planes split over the pool for large inputs."""
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.strides, window.dilations
    geometry: dict = {}
    pool = _native.max_pool

    def run(x: np.ndarray) -> np.ndarray:
        n, c, h, w = x.shape
        pt, pl, oh, ow = _geometry_of(window, geometry, (h, w))
        y = np.empty((n, c, oh, ow), np.float32)
        if y.size:
            pool(x, y, n * c, h, w, oh, ow, kh, kw, sh, sw, dh, dw, pt, pl, row_threads(x.size))
        return y
    return run


# ----------------------------------------------------------------------------- row kernels
# The row kernels split their rows over the sgemm's thread pool, one thread per this many floats at most (a
# [32, 128, 512] Gelu: 1.7 ms on one thread; BERT-style 2 layers b1 0.745 ms with 64K a thread, 0.672 with 16K).
ROW_FLOATS_PER_THREAD = 1 << 14


def row_threads(size: int) -> int:
    """Threads for a row kernel over ``size`` floats: what a run may use (kernel_threads), at most one per
    ROW_FLOATS_PER_THREAD."""
    return max(1, min(kernel_threads(), size // ROW_FLOATS_PER_THREAD))


def rows_ok(x: np.ndarray) -> bool:
    """Whether the row kernels take ``x``: float32, C-contiguous (as the runtime's arrays almost always are)."""
    return _native is not None and x.dtype == np.float32 and x.flags.c_contiguous and x.size > 0


def gelu(x: np.ndarray, neg_h: np.ndarray) -> np.ndarray:
    """Exact Gelu of a float32 C-contiguous ``x`` (rows_ok) as x / (1 + exp(x * neg_h(x^2))): the numpy kernel's
    formula and polynomial (``neg_h``, float32, highest power first), one pass."""
    y = np.empty_like(x)
    _native.gelu(x, y, neg_h, max(1, min(kernel_threads(), x.size // GELU_FLOATS_PER_THREAD)))
    return y


# Gelu costs ~10 cycles a float (its erf polynomial), several times a LayerNorm's: a thread per this many floats
# (ROW_FLOATS_PER_THREAD's 16K left a ViT-style model's 17 x 768 Gelu on one thread: b1 0.618 -> 0.597 ms with 4K,
# one process, interleaved; BERT-style 2 layers unchanged).
GELU_FLOATS_PER_THREAD = 1 << 12


def layer_norm(x: np.ndarray, scale: np.ndarray, bias: Optional[np.ndarray], eps: float) -> np.ndarray:
    """LayerNormalization over the last axis of ``x`` (rows_ok) with per-column ``scale``/``bias`` (float32)."""
    n = x.shape[-1]
    y = np.empty_like(x)
    _native.layer_norm(x, y, n, _row_vector(scale, n), None if bias is None else _row_vector(bias, n),
                       float(eps), row_threads(x.size))
    return y


def _row_vector(v: np.ndarray, n: int) -> np.ndarray:
    """``v`` as a float32 C-contiguous [n]: itself when it already is one (a LayerNorm's weights, every call; the
    broadcast copy cost 2 us a vector, a third of a ViT-style model's 17 x 192 LayerNorm)."""
    if v.shape == (n,) and v.dtype == np.float32 and v.flags.c_contiguous:
        return v
    return np.ascontiguousarray(np.broadcast_to(v, (n,)), np.float32)


def scale_rows(x: np.ndarray, s: np.ndarray, y: np.ndarray, n: int) -> None:
    """y = x * s, float32 (rows_ok), ``s`` one factor per row of ``n`` floats of ``x``; ``y`` may be ``x``."""
    _native.scale(x, s, y, n, row_threads(x.size))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of ``x`` (rows_ok)."""
    y = np.empty_like(x)
    _native.softmax(x, y, x.shape[-1], row_threads(x.size))
    return y


# ----------------------------------------------------------------------------- fused elementwise chains
# FusedElementwise bodies of these ops (each correctly rounded, so the answers are the unfused kernels' bit for bit,
# but for Exp, Sigmoid and Tanh) run as one native call over cache-sized chunks; the codes are _native.c's EW_*; the
# number is the op's inputs.
ELEMENTWISE = {"Add": (0, 2), "Sub": (1, 2), "Mul": (2, 2), "Div": (3, 2), "Max": (4, 2), "Min": (5, 2),
               "Neg": (6, 1), "Abs": (7, 1), "Relu": (8, 1), "Sqrt": (9, 1),
               # not numpy's bits: within a few ulp of its kernels (_native.c, "elementwise")
               "Exp": (10, 1), "Sigmoid": (11, 1), "Tanh": (12, 1)}
_EW_MAX, _EW_MIN = ELEMENTWISE["Max"][0], ELEMENTWISE["Min"][0]
# The ops a chain the loader fuses for elementwise_kernel may hold: ELEMENTWISE's, and Clip (the fusion pass takes
# it only with constant or omitted bounds), run as Max then Min: the IR's own Clip is np.maximum then np.minimum,
# whose NaN and signed-zero rules EW_MAX and EW_MIN follow.
CHAIN_OPS = frozenset(ELEMENTWISE) | {"Clip"}
_FULL, _SCALAR, _PERIODIC = 0, 1, 2


def _float32_value(v: Any) -> bool:
    t = None if v is None else v.type
    return t is not None and t.dtype is not None and np.dtype(t.dtype.numpy) == np.float32


def _chain_steps(n: Any) -> Optional[list]:
    """Body node ``n`` as the extension's chain instructions, [(code, second operand Value or None)], read in turn
    from its first input; None where the extension does not run it."""
    if n.domain != "":
        return None
    if n.op == "Clip":
        _, lo, hi = (tuple(n.inputs) + (None, None))[:3]
        steps = [(code, bound) for code, bound in ((_EW_MAX, lo), (_EW_MIN, hi)) if bound is not None]
        return steps if steps and len(n.inputs) <= 3 and n.inputs[0] is not None else None
    spec = ELEMENTWISE.get(n.op)
    if spec is None or len(n.inputs) != spec[1] or any(v is None for v in n.inputs):
        return None
    return [(spec[0], n.inputs[1] if spec[1] == 2 else None)]


def elementwise_kernel(node: Any, attrs: dict, fallback: Callable) -> Optional[Callable]:
    """The kernel of a ``kiln.FusedElementwise`` whose body is float32 ops of ``CHAIN_OPS``, or None. An
    operand that is neither full size, a scalar nor a suffix of the output's shape (a per-channel [C, 1, 1]
    under [N, C, H, W]) makes that call take ``fallback`` (the nested plan)."""
    if _native is None:
        return None
    body = attrs["body"]
    reg: dict = {}
    consts: list = []
    for v in body.inputs:
        if not _float32_value(v):
            return None
        reg[v] = len(reg)
    for v in body.initializers.values():
        if not _float32_value(v) or v.const is None:
            return None
        reg[v] = len(reg)
        consts.append(np.array(v.const, np.float32, order="C"))  # not ascontiguousarray: it makes 0-d 1-d
    nin = len(reg)
    # temporaries: a register is reused once the value in it is read for the last time (a chain of 1,000 ops
    # needs two), never for a body output
    last_use = {v: k for k, n in enumerate(body.nodes) for v in n.inputs}
    keep = set(body.outputs)
    free: list = []
    nreg = nin
    prog: list = []
    for k, n in enumerate(body.nodes):
        steps = _chain_steps(n)
        if steps is None or len(n.outputs) != 1 or not _float32_value(n.outputs[0]) \
                or any(v is not None and v not in reg for v in n.inputs):
            return None
        for v in set(n.inputs) - {None}:  # dead after this op: its temporary may take the result
            if reg[v] >= nin and last_use.get(v) == k and v not in keep:
                free.append(reg[v])
        if free:
            dst = free.pop()
        else:
            dst, nreg = nreg, nreg + 1
        reg[n.outputs[0]] = dst
        a = reg[n.inputs[0]]
        for code, operand in steps:  # an op's later steps read its own result: elementwise, so dst may be a
            prog += [code, dst, a, -1 if operand is None else reg[operand]]
            a = dst
    outs = [reg.get(v) for v in body.outputs]
    if any(r is None or r < nin for r in outs) or nin > 65536:
        return None  # an output that is an input or a constant: the nested plan copes
    program = np.array(prog + outs, np.int32)
    run_native = _native.elementwise

    layouts: dict = {}  # the inputs' shapes -> (output shape, size, kinds, periods), or None: take the fallback

    def layout(args: tuple) -> Optional[tuple]:
        arrays = list(args) + consts
        shape = np.broadcast_shapes(*(a.shape for a in arrays))
        total = int(np.prod(shape))
        kinds, periods = [], []
        for a in arrays:
            if a.size == total:  # the output's shape, up to leading 1s
                kinds.append(_FULL)
            elif a.size == 1:
                kinds.append(_SCALAR)
            else:
                lead = 0
                while lead < a.ndim and a.shape[lead] == 1:
                    lead += 1
                tail = a.shape[lead:]
                if shape[len(shape) - len(tail):] != tail:
                    return None
                kinds.append(_PERIODIC)
            periods.append(a.size)
        return shape, total, kinds, periods

    def run(*args: Any) -> Any:
        key = tuple(a.shape for a in args)
        found = layouts.get(key, layouts)  # the dict itself marks "not seen" (None is "take the fallback")
        if found is layouts:  # a benign race between threads: both compute the same layout
            found = layout(args) if all(a.dtype == np.float32 for a in args) else None
            if len(layouts) > 64:  # many shapes (a dynamic dim): keep the cache bounded
                layouts.clear()
            layouts[key] = found
        if found is None or any(a.dtype != np.float32 for a in args):
            return fallback(*args)
        shape, total, kinds, periods = found
        ins = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in args] + consts
        outputs = [np.empty(shape, np.float32) for _ in outs]
        if total:
            run_native(ins, kinds, periods, outputs, program, nreg, total, row_threads(total))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    return run


def activation(x: np.ndarray, code: int, alpha: float, beta: float) -> np.ndarray:
    """A fresh ``act(x)`` of a float32 C-contiguous ``x`` (rows_ok), ``code`` as in ``ACTIVATIONS``: one pass,
    float32 arithmetic (the numpy kernels' two-rounding ``x * a + b`` may be an FMA here: an ulp apart)."""
    y = np.empty_like(x)
    _native.activation(x, y, code, float(alpha), float(beta), row_threads(x.size))
    return y


def mean_rows(x: np.ndarray) -> np.ndarray:
    """The mean of each row of a float32 C-contiguous 2-D ``x`` (GlobalAveragePool): float32 partial sums in 16
    lanes added in double, then divided once (more exact than numpy's float32 pairwise sum, so not its bits)."""
    y = np.empty(x.shape[0], np.float32)
    _native.mean(x, y, x.shape[1], row_threads(x.size))
    return y
