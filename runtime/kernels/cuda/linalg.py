"""MatMul, Gemm and Einsum through cuBLAS for float32/float64, and MatMul/Gemm for float16 (float32
accumulation on tensor cores, issue 18).

Products call cuBLAS directly through ctypes (``cublas_matmul`` below:
``cublas{S,D}gemmStridedBatched`` on a handle kiln owns, bound to the current stream) rather
than through ``cupy.matmul`` or CuPy's cuBLAS bindings, because CuPy refuses every cuBLAS call
while a stream is being captured ("calling cuBLAS API during stream capture is currently
unsupported", CuPy 14.2), and a CUDA graph of a model without its matrix products is no graph
at all. cuBLAS itself supports capture once its workspace is fixed: each handle gets its own
workspace at creation (``cublasSetWorkspace``). Layouts cuBLAS cannot take directly (a batch that is not one
uniform stride) go through ``cupy.matmul`` (never captured then).

TF32 (issue 17: per program, never per process): each (device, stream) has two cuBLAS handles,
one per math mode (default and TF32), sharing the stream's one workspace; a product takes the
handle of its program's ``tf32`` (bound into the kernel at load; ``cublas_matmul(..., tf32=None)``
takes the running program's, see kernels/cuda/__init__.py). No math mode is ever switched on a
live handle, so two programs with different settings on one stream, one thread or several,
cannot see each other's mode, and a capture records the mode of the program being captured.
cuBLASLt's compute type is part of each LtBias plan (keyed by its tf32). CuPy's own products
(``cupy.einsum`` for Einsum, the ``cupy.matmul`` fallbacks for layouts cuBLAS cannot take) run at
CuPy's process-wide compute type, which kiln no longer sets: full float32 unless the process
itself asks CuPy for TF32 (``CUPY_TF32=1``); a ``tf32=True`` program may so run those few ops
strict (TF32 is a permission, not a promise). A stack times a matrix is folded into one 2-D
GEMM; constant weights are uploaded once, already transposed where Gemm asks for it. Integer and
half inputs run on the host.
"""
from __future__ import annotations

import ctypes
import math
import threading
from typing import Any, Callable, Optional

import cupy as cp
import numpy as np

from kiln.errors import KilnError
from kiln.runtime.kernels.cuda import FLOATS, const_input, device_array, in_dtype, is_bf16, kernel, options


# handles: (device, stream ptr) -> {"ws": workspace, False: default-math handle, True: TF32 handle}
_STATE: dict = {"handles": {}, "lt": {}, "lib": None}
_CREATE = threading.Lock()
WORKSPACE_BYTES = 32 << 20
_OP_N, _OP_T = 0, 1
_DEFAULT_MATH, _TF32_MATH = 0, 3


def _open(stem: str):
    """``stem``.so of the CUDA runtime's major version (or unversioned) through ctypes, or None."""
    major = cp.cuda.runtime.runtimeGetVersion() // 1000
    for name in (f"{stem}.so.{major}", f"{stem}.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _lib():
    """libcublas through ctypes: CuPy's own bindings refuse every call during a stream capture."""
    lib = _STATE["lib"]
    if lib is None:
        lib = _open("libcublas")
        if lib is None:
            import cupy_backends.cuda.libs.cublas  # noqa: F401  (loads the library CuPy uses)
            lib = ctypes.CDLL(f"libcublas.so.{cp.cuda.runtime.runtimeGetVersion() // 1000}")
        lib.cublasGemmStridedBatchedEx.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
            ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        for fn in ("cublasSgemmStridedBatched", "cublasDgemmStridedBatched"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                         ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong,
                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong,
                                         ctypes.c_int]
        _STATE["lib"] = lib
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def set_tf32(allowed: bool) -> None:
    """Deprecated (issue 17): the process default for programs made afterwards without ``tf32``;
    no live handle changes (see the module docstring)."""
    from kiln.runtime.cuda_options import set_process_tf32
    set_process_tf32(bool(allowed))


def _default_tf32() -> bool:
    return bool(options().tf32)


def _stream_entry(stream) -> dict:
    key = (cp.cuda.Device().id, stream.ptr)
    entry = _STATE["handles"].get(key)
    if entry is None:
        with _CREATE:
            entry = _STATE["handles"].get(key)
            if entry is None:
                # A fixed workspace: nothing is allocated inside a capture.
                entry = _STATE["handles"][key] = {"ws": cp.cuda.memory.alloc(WORKSPACE_BYTES)}
    return entry


def stream_workspace(stream):
    """The cuBLAS workspace of ``stream`` (shared by its two handles and by cublasLt calls on it)."""
    return _stream_entry(stream)["ws"]


def _handle(stream, tf32: bool = False):
    """kiln's cuBLAS handle for ``stream`` and math mode (two per stream, one workspace)."""
    entry = _stream_entry(stream)
    h = entry.get(tf32)
    if h is None:
        with _CREATE:
            h = entry.get(tf32)
            if h is None:
                lib = _lib()
                h = ctypes.c_void_p()
                _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
                _check(lib.cublasSetStream_v2(h, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
                ws = entry["ws"]
                _check(lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(ws.ptr), ctypes.c_size_t(WORKSPACE_BYTES)),
                       "cublasSetWorkspace")
                _check(lib.cublasSetMathMode(h, _TF32_MATH if tf32 else _DEFAULT_MATH), "cublasSetMathMode")
                entry[tf32] = h
    return h


# float16 (issue 18): inputs and outputs in half, products accumulated in float32 on tensor cores
# (cublasGemmStridedBatchedEx with CUBLAS_COMPUTE_32F; alpha and beta are float32 then).
HALF = np.dtype(np.float16)
_ONE = {np.dtype(np.float32): np.ones(1, np.float32), np.dtype(np.float64): np.ones(1, np.float64),
        HALF: np.ones(1, np.float32)}
_ZERO = {np.dtype(np.float32): np.zeros(1, np.float32), np.dtype(np.float64): np.zeros(1, np.float64),
         HALF: np.zeros(1, np.float32)}
# bfloat16 (issue 18) is held on the device as uint16 words (cuda/__init__.py: device_array); MatMul and
# Gemm take no uint16 operands in ONNX, so a uint16 array here is bfloat16: CUDA_R_16BF, float32 accumulation.
U16 = np.dtype(np.uint16)
_ONE[U16], _ZERO[U16] = np.ones(1, np.float32), np.zeros(1, np.float32)
_R_16F, _R_16BF, _COMPUTE_32F, _GEMM_DEFAULT = 2, 14, 68, -1
_R_16 = {HALF: _R_16F, U16: _R_16BF}
#: What MatMul and Gemm run natively: float32, float64 and float16 (and bfloat16: ``gemm_dtype``).
GEMM_FLOATS = FLOATS + (HALF,)


def gemm_dtype(dt) -> bool:
    """Whether a MatMul/Gemm of graph dtype ``dt`` runs natively here (bfloat16 included)."""
    return dt in GEMM_FLOATS or is_bf16(dt)


def _operand(x):
    """(array, transposed, leading dim, batch stride) with x's last two dims as cuBLAS reads them,
    or None when its batch dims are not one uniform stride."""
    if x.ndim == 2:
        x3 = x.reshape((1,) + x.shape)
    else:
        lead = x.shape[:-2]
        x3 = x.reshape((math.prod(lead),) + x.shape[-2:]) if len(lead) > 1 else x  # may copy: fine
    item = x3.itemsize
    s0, s1, s2 = (st // item for st in x3.strides)
    rows, cols = x3.shape[1], x3.shape[2]
    if s2 == 1 and (s1 >= max(1, cols) or rows == 1):
        return x3, False, max(s1, cols, 1), s0
    if s1 == 1 and (s2 >= max(1, rows) or cols == 1):
        return x3, True, max(s2, rows, 1), s0
    return None


def cublas_matmul(a, b, alpha: float = 1.0, tf32: Optional[bool] = None):
    """``alpha * (a @ b)`` for float32/float64 stacks (batch dims broadcast as numpy's matmul),
    through cuBLAS on kiln's handle (alpha is the GEMM's own scale: free). Falls back to
    ``cupy.matmul`` for layouts it cannot describe. ``tf32``: allow TF32 for float32 (None:
    the bound program's setting)."""
    if a.dtype == U16 or b.dtype == U16:
        if a.ndim < 2 or b.ndim < 2 or a.dtype != b.dtype:  # no CuPy fallback reads bfloat16 words right
            raise KilnError(f"bfloat16 matmul of shapes {a.shape} and {b.shape} (with {a.dtype}/{b.dtype}) has no "
                            "GPU path yet: convert the model with precision='fp16', or run it on the CPU")
    if a.ndim < 2 or b.ndim < 2 or a.dtype != b.dtype or a.dtype not in _ONE:
        y = cp.matmul(a, b)
        if alpha != 1.0:
            y *= alpha
        return y
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    nb = math.prod(batch)
    out = cp.empty(batch + (m, n), a.dtype)
    if out.size == 0:
        return out
    if k == 0:
        out[...] = 0
        return out
    ops = []
    for x in (a, b):
        if x.shape[:-2] != batch and math.prod(x.shape[:-2]) != 1:
            if x.ndim - 2 != len(batch):
                x = x.reshape((1,) * (len(batch) + 2 - x.ndim) + x.shape)
            x = cp.broadcast_to(x, batch + x.shape[-2:])  # _operand's reshape copies if it must
        desc = _operand(x)
        if desc is None:
            x = cp.ascontiguousarray(x)
            desc = _operand(x)
        if desc is None and a.dtype == U16:
            raise KilnError(f"a bfloat16 operand of shape {x.shape} with strides {x.strides} has no cuBLAS layout")
        if desc is None:
            y = cp.matmul(a, b)
            if alpha != 1.0:
                y *= alpha
            return y
        x3, trans, ld, stride = desc
        if math.prod(x.shape[:-2]) == 1:
            stride = 0
        ops.append((x3, trans, ld, stride))
    (a3, ta, lda, sa), (b3, tb, ldb, sb) = ops
    # Row-major C = A @ B is column-major C^T = B^T @ A^T: cuBLAS gets B first.
    lib = _lib()
    if tf32 is None:
        tf32 = _default_tf32()
    h = _handle(cp.cuda.get_current_stream(), bool(tf32) and a.dtype == np.float32)
    scale = _ONE[a.dtype].dtype
    one, zero = (_ONE[a.dtype] if alpha == 1.0 else np.full(1, alpha, scale)), _ZERO[a.dtype]
    if a.dtype in _R_16:
        r = _R_16[a.dtype]
        _check(lib.cublasGemmStridedBatchedEx(
            h, _OP_T if tb else _OP_N, _OP_T if ta else _OP_N, n, m, k, one.ctypes.data, b3.data.ptr, r, ldb, sb,
            a3.data.ptr, r, lda, sa, zero.ctypes.data, out.data.ptr, r, n, m * n, nb, _COMPUTE_32F,
            _GEMM_DEFAULT), "cublasGemmStridedBatchedEx")
        return out
    fn = lib.cublasSgemmStridedBatched if a.dtype == np.float32 else lib.cublasDgemmStridedBatched
    _check(fn(h, _OP_T if tb else _OP_N, _OP_T if ta else _OP_N, n, m, k, one.ctypes.data, b3.data.ptr, ldb, sb,
              a3.data.ptr, lda, sa, zero.ctypes.data, out.data.ptr, n, m * n, nb), "cublasGemmStridedBatched")
    return out


# --------------------------------------------------------------------------- cuBLASLt: bias epilogue
# cublasLt (the library torch's addmm uses) adds a bias vector inside the GEMM's epilogue, so a
# Linear layer's ``x @ W + b`` is one kernel and one write of the output instead of a GEMM and a
# second pass over its result. Reached through ctypes for the reason above (CuPy refuses cuBLAS
# calls during a capture). Enum values are cublasLt.h's (CUDA 11.4 and later).
_LT_DESC_TRANSA, _LT_DESC_TRANSB, _LT_DESC_EPILOGUE, _LT_DESC_BIAS_POINTER = 3, 4, 7, 8
_LT_EPILOGUE_DEFAULT, _LT_EPILOGUE_RELU, _LT_EPILOGUE_BIAS, _LT_EPILOGUE_RELU_BIAS = 1, 2, 4, 6
_LT_PREF_MAX_WORKSPACE_BYTES = 1
_COMPUTE = {(np.dtype(np.float32), False): 68, (np.dtype(np.float32), True): 77,  # 32F, 32F_FAST_TF32
            (np.dtype(np.float64), False): 70, (np.dtype(np.float64), True): 70,
            (HALF, False): 68, (HALF, True): 68,  # half: accumulated in float32
            (U16, False): 68, (U16, True): 68}    # bfloat16 words: the same
_CUDA_TYPE = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, HALF: 2, U16: 14}  # 32F, 64F, 16F, 16BF


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _lt():
    """(libcublasLt, its handle for this device), or raise OSError where the library is missing."""
    key = cp.cuda.Device().id
    entry = _STATE["lt"].get(key)
    if entry is None:
        _lib()  # loads libcublas (and with it libcublasLt) the way CuPy does
        lib = _open("libcublasLt")
        if lib is None:
            raise OSError("libcublasLt not found")
        vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i32, i32]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i32, u64, u64, i64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, sz]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32,
                                                       ctypes.POINTER(_Heuristic), ctypes.POINTER(i32)]
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
        h = vp()
        _check(lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        entry = _STATE["lt"][key] = (lib, h)
    return entry


class LtBias:
    """``a @ b + bias [+ residual]`` (+ ReLU) for float matrices through one cublasLt matmul with
    a bias epilogue; ``bias`` is a device vector of b's column count, or None (no bias). A
    ``residual`` of the product's shape is added inside the same call as cublasLt's C operand with
    beta 1 (D = A B + C, then the bias and ReLU epilogue): a transformer's ``x + linear(h)`` without
    a pass of its own over the output (issue 18: those adds were 24 kernels of BERT). Descriptors and the
    heuristic's algorithm are built once per operand layout, outside any capture; the workspace
    is the cuBLAS handle's of the same stream (calls on one stream never overlap).
    ``__call__`` returns None for operands it cannot describe (the caller then multiplies and
    adds on its own). ``tf32``: the compute type (None: the bound program's, taken now)."""

    def __init__(self, bias, relu: bool = False, tf32: Optional[bool] = None):
        self.bias = bias
        self.relu = relu
        self.tf32 = _default_tf32() if tf32 is None else bool(tf32)
        self._plans: dict = {}

    def __call__(self, a, b, residual=None):
        if a.ndim > 2 and b.ndim == 2:
            if residual is not None:
                if residual.shape != a.shape[:-1] + (b.shape[1],) or not residual.flags.c_contiguous:
                    return None
                residual = residual.reshape(-1, b.shape[1])
            y = self(_as_rows(a), b, residual)
            return None if y is None else y.reshape(a.shape[:-1] + (b.shape[1],))
        if a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype or a.dtype not in _CUDA_TYPE or 0 in a.shape \
                or 0 in b.shape or (self.bias is not None and (self.bias.dtype != a.dtype or self.bias.size != b.shape[1])):
            return None
        if residual is not None and (residual.shape != (a.shape[0], b.shape[1]) or residual.dtype != a.dtype
                                     or not residual.flags.c_contiguous):
            return None
        da, db = _operand(a), _operand(b)
        if da is None or db is None:
            return None
        (a3, ta, lda, _), (b3, tb, ldb, _) = da, db
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        key = (a.dtype, ta, lda, tb, ldb, m, k, n, self.tf32)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(*key)
        if plan is False:
            return None
        lib, h, desc, la, lb, ld, algo = plan
        out = cp.empty((m, n), a.dtype)
        stream = cp.cuda.get_current_stream()
        ws = stream_workspace(stream)
        one, zero = _ONE[a.dtype], _ZERO[a.dtype]
        c = out if residual is None else residual
        # Row-major D = A @ B is column-major D^T = B^T @ A^T: cublasLt gets B first (as cublas_matmul).
        _check(lib.cublasLtMatmul(h, desc, one.ctypes.data, b3.data.ptr, la, a3.data.ptr, lb,
                                  (zero if residual is None else one).ctypes.data,
                                  c.data.ptr, ld, out.data.ptr, ld, ctypes.byref(algo), ws.ptr,
                                  WORKSPACE_BYTES, stream.ptr), "cublasLtMatmul")
        return out

    def _plan(self, dtype, ta, lda, tb, ldb, m, k, n, tf32):
        """(lib, handle, matmul desc, B layout, A layout, D layout, algo), or False when cublasLt
        has no algorithm for it."""
        try:
            lib, h = _lt()
        except OSError:
            return False
        vp = ctypes.c_void_p
        desc = vp()
        scale_type = _CUDA_TYPE[np.dtype(np.float32)] if dtype in (HALF, U16) else _CUDA_TYPE[dtype]
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE[(dtype, tf32)], scale_type),
               "cublasLtMatmulDescCreate")

        def set_attr(attr, value):
            _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   "cublasLtMatmulDescSetAttribute")
        set_attr(_LT_DESC_TRANSA, ctypes.c_int32(_OP_T if tb else _OP_N))
        set_attr(_LT_DESC_TRANSB, ctypes.c_int32(_OP_T if ta else _OP_N))
        if self.bias is None:
            set_attr(_LT_DESC_EPILOGUE, ctypes.c_uint32(_LT_EPILOGUE_RELU if self.relu else _LT_EPILOGUE_DEFAULT))
        else:
            set_attr(_LT_DESC_EPILOGUE, ctypes.c_uint32(_LT_EPILOGUE_RELU_BIAS if self.relu else _LT_EPILOGUE_BIAS))
            set_attr(_LT_DESC_BIAS_POINTER, vp(self.bias.data.ptr))
        t = _CUDA_TYPE[dtype]

        def layout(rows, cols, ld):
            lay = vp()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), t, rows, cols, ld), "cublasLtMatrixLayoutCreate")
            return lay
        # Column-major shapes as stored: B^T is n x k (k x n when transposed), A^T is k x m (m x k).
        la = layout(k, n, ldb) if tb else layout(n, k, ldb)
        lb = layout(m, k, lda) if ta else layout(k, m, lda)
        ld = layout(n, m, n)
        pref = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        wsb = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _LT_PREF_MAX_WORKSPACE_BYTES, ctypes.byref(wsb), 8),
               "cublasLtMatmulPreferenceSetAttribute")
        result, count = _Heuristic(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, ctypes.byref(result),
                                                    ctypes.byref(count))
        if status != 0 or count.value < 1 or result.state != 0:
            return False
        algo = (ctypes.c_uint64 * 8)(*result.algo)
        return lib, h, desc, la, lb, ld, algo


def _as_rows(a):
    """A stack [..., K] as one [rows, K] matrix: a view where the leading dims merge, else a copy."""
    rows = math.prod(a.shape[:-1])
    try:
        return a.reshape(rows, a.shape[-1])
    except ValueError:
        return cp.ascontiguousarray(a).reshape(rows, a.shape[-1])


def matmul2(a, b, alpha: float = 1.0, tf32: Optional[bool] = None):
    """``alpha * (a @ b)`` with a stacked ``a`` against a matrix ``b`` as one 2-D product."""
    if a.ndim > 2 and b.ndim == 2:
        return cublas_matmul(_as_rows(a), b, alpha, tf32).reshape(a.shape[:-1] + (b.shape[1],))
    if a.ndim == 1 or b.ndim == 1:
        y = cp.matmul(a, b)
        if alpha != 1.0:
            y *= alpha
        return y
    return cublas_matmul(a, b, alpha, tf32)


@kernel("MatMul")
def matmul(node, attrs) -> Optional[Callable[..., Any]]:
    if not gemm_dtype(in_dtype(node)):
        return None
    tf32 = options().tf32  # the program's, bound at load
    w = const_input(node, 1)
    if w is not None and w.ndim == 2:
        wd = device_array(w)

        def run(a, unused):
            return matmul2(a, wd, tf32=tf32)
        run.ignores = (1,)  # the weight is read from wd (CudaProgram then skips its slot's upload)
        return run

    def run_dynamic(a, b):
        return matmul2(a, b, tf32=tf32)
    return run_dynamic


@kernel("Gemm")
def gemm(node, attrs) -> Optional[Callable[..., Any]]:
    if not gemm_dtype(in_dtype(node)):
        return None
    alpha, beta = attrs["alpha"], attrs["beta"]
    ta, tb = attrs["transA"], attrs["transB"]
    tf32 = options().tf32
    b_const = const_input(node, 1)
    b_fixed = None if b_const is None else cp.ascontiguousarray(device_array(b_const.T if tb else b_const))
    c_const = const_input(node, 2)
    c_fixed = None if c_const is None else device_array(c_const * c_const.dtype.type(beta) if beta != 1.0 else c_const)
    if is_bf16(in_dtype(node)):
        # The scale and C below are CuPy arithmetic, wrong on bfloat16 words: in bfloat16 a Gemm is cublasLt's
        # product with C (beta * C, a vector of N) as its bias epilogue, or it is refused at load.
        has_c = len(node.inputs) > 2 and node.inputs[2] is not None
        n = None if node.outputs[0].type is None or node.outputs[0].type.shape is None else node.outputs[0].type.shape[-1]
        # C must be a row of N (a [N] or [1, N] bias), not an [M, 1] column that happens to have N elements
        if alpha != 1.0 or (has_c and (c_const is None or not isinstance(n, int) or c_const.size != n
                                       or c_const.shape[-1] != n)):
            return None
        lt = LtBias(None if not has_c else device_array(np.ascontiguousarray(
            (c_const * c_const.dtype.type(beta) if beta != 1.0 else c_const).reshape(-1))), tf32=tf32)

        def run_bf16(a, b, c=None):
            y = lt(a.T if ta else a, b_fixed if b_fixed is not None else (b.T if tb else b))
            if y is None:
                raise KilnError(f"cublasLt took no layout for this bfloat16 Gemm ({a.shape} x {b.shape})")
            return y
        run_bf16.ignores = tuple(i for i, f in ((1, b_fixed), (2, c_fixed)) if f is not None)
        return run_bf16

    def run(a, b, c=None):
        y = cublas_matmul(a.T if ta else a, b_fixed if b_fixed is not None else (b.T if tb else b), tf32=tf32)
        if alpha != 1.0:
            y *= alpha
        if c is not None:
            y += c_fixed if c_fixed is not None else (c * beta if beta != 1.0 else c)
        return y
    run.ignores = tuple(i for i, f in ((1, b_fixed), (2, c_fixed)) if f is not None)
    return run


@kernel("Einsum")
def einsum(node, attrs) -> Optional[Callable[..., Any]]:
    if in_dtype(node) not in FLOATS:
        return None
    eq = attrs["equation"]
    return lambda *xs: cp.einsum(eq, *xs)
