"""``kiln.Guard`` on the GPU without a synchronization per guard.

A guard's input usually lives on the device (``bool(mask.all())``, a scalar computed by the
model). Copying it to the host at the guard would stall the stream there and, worse, could not
be captured into a CUDA graph. So a guard is one small kernel that compares the value with the
expected one on the device and writes a record ``[mismatches, first mismatching index, value
there]`` (float64); the program (runtime/cuda_program.py) reads the run's records once, after
the outputs, and raises the first failed guard (:class:`kiln.checks.GuardFailed`, the message
every backend gives) before any output is returned. In an eager run the records are device
arrays; inside a captured graph the kernel writes its record straight into page-locked host
memory, so a replay costs the kernel and a read, no copy.

A guard whose input is a host value (shape arithmetic stays on the host: a symbolic size
compared in Python) is checked at once on the host, at no cost to the device.

``read`` semantics (kiln.checks): bool (``x != 0``), int (truncated), float, item and value
(equal, or within ``rtol`` relative where the guard has one: float data). A tensor of the wrong size for a scalar
read, or of another shape than the expected one, fails on the host from its shape alone.
"""
from __future__ import annotations

import numpy as np

from kiln import checks
from kiln.runtime.kernels.cuda.codegen import compile_kernel

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double", np.dtype(np.float16): "__half",
          np.dtype(np.int8): "signed char", np.dtype(np.uint8): "unsigned char", np.dtype(np.int16): "short",
          np.dtype(np.uint16): "unsigned short", np.dtype(np.uint32): "unsigned int",
          np.dtype(np.uint64): "unsigned long long",
          np.dtype(np.int32): "int", np.dtype(np.int64): "long long", np.dtype(np.bool_): "bool"}
_MODES = {"bool": 0, "int": 1, "float": 2, "item": 3, "value": 3}

_SOURCE = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ double to_double(T v) { return (double)v; }
extern "C" __global__ void kiln_guard(const T* __restrict__ x, const double* __restrict__ expected,
                                      long long n, int mode, double rtol, double* __restrict__ record) {
    __shared__ unsigned long long bad_count[256];
    __shared__ long long first_bad[256];
    unsigned long long count = 0;
    long long first = -1;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        double v = to_double(x[i]);
        double e = expected[i];
        bool ok;
        if (mode == 0) ok = (v != 0.0) == (e != 0.0);
        else if (mode == 1) ok = trunc(v) == e;
        else ok = v == e || fabs(v - e) <= rtol * fmax(fabs(v), fabs(e)) || (v != v && e != e);
        if (!ok) { count += 1; if (first < 0) first = i; }
    }
    bad_count[threadIdx.x] = count;
    first_bad[threadIdx.x] = first;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            bad_count[threadIdx.x] += bad_count[threadIdx.x + s];
            long long a = first_bad[threadIdx.x], b = first_bad[threadIdx.x + s];
            first_bad[threadIdx.x] = (a < 0) ? b : ((b < 0) ? a : (a < b ? a : b));
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        record[0] = (double)bad_count[0];
        record[1] = (double)first_bad[0];
        record[2] = first_bad[0] >= 0 ? to_double(x[first_bad[0]]) : 0.0;
    }
}
"""
_HALF = "__device__ __forceinline__ double to_double(__half v) { return (double)__half2float(v); }"


def _kernel(dtype: np.dtype):
    ctype = _CTYPE[dtype]
    src = _SOURCE
    if ctype == "__half":
        src = src.replace("__device__ __forceinline__ double to_double(T v) { return (double)v; }", _HALF)
    return compile_kernel(f"#define T {ctype}\n" + src, "kiln_guard")


class DeviceGuard:
    """One guard node: ``launch(x)`` returns its record (a device array) or None when the check
    was decided on the host; ``raise_if_failed(record)`` reads a record fetched to the host."""

    def __init__(self, attrs: dict):
        self.expected = np.asarray(attrs["expected"])
        self.read = attrs.get("read", "value")
        self.rtol = float(attrs.get("rtol", 0.0))
        self.text = {"what": attrs.get("what", "a value"), "location": attrs.get("location", ""),
                     "code": attrs.get("code", "")}
        self._expected_dev = None

    def launch(self, x, records) -> None:
        """Check ``x``: at once on the host, or by a kernel writing a record ``records.new(self)``
        gives (runtime/cuda_program.py reads them after the run)."""
        import cupy as cp

        if isinstance(x, np.ndarray) or np.isscalar(x):
            checks.check(np.asarray(x), expected=self.expected, read=self.read, rtol=self.rtol, **self.text)
            return
        if self.read == "value" and tuple(x.shape) != self.expected.shape:
            self._fail_shape(x)
        if self.read != "value" and x.size != 1:
            self._fail_shape(x)
        if x.dtype not in _CTYPE:
            checks.check(x.get(), expected=self.expected, read=self.read, rtol=self.rtol, **self.text)
            return
        if self._expected_dev is None:
            self._expected_dev = cp.asarray(self.expected.astype(np.float64).reshape(-1))
        x = cp.ascontiguousarray(x)
        _kernel(x.dtype)((1,), (256,), (x, self._expected_dev, np.int64(x.size), np.int32(_MODES[self.read]),
                                        np.float64(self.rtol), records.new(self)))

    def _fail_shape(self, x) -> None:
        raise checks.GuardFailed(checks.message(expected=self.expected, now=None, x=np.empty(x.shape),
                                                read=self.read, **self.text))

    def raise_if_failed(self, record: np.ndarray) -> None:
        if record[0] == 0:
            return
        index, value = int(record[1]), float(record[2])
        if self.read == "value":
            was = self.expected.reshape(-1)[index].item()
            now = f"{type(was)(value)!r} at flat index {index} (where the trace saw {was!r})"
        else:
            now = repr(checks.read_value(np.array(value, self.expected.dtype if self.read == "item" else
                                                  np.float64), self.read).item())
        raise checks.GuardFailed(checks.message(expected=self.expected, now=None, x=None, read=self.read,
                                                now_text=now, **self.text))
