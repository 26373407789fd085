"""BLAS threads, set per run and per op, so that the CPU runtime never collapses on a busy host (issue 21).

numpy's BLAS (OpenBLAS in numpy's wheels; MKL or BLIS in some builds) runs a GEMM on a team of threads that
meet at a barrier. On a host whose cores are all taken (several model servers, a build, other BLAS
processes), one team member is preempted and the others wait for it a whole scheduler slice, every GEMM:
measured on 2 cores with six BLAS-busy neighbours, an MLP went from 0.43 to 196 ms. A single-threaded GEMM has
no barrier, so it only loses the CPU share the neighbours take.

kiln therefore sets the BLAS thread count itself, through the library's own ``*_set_num_threads`` entry point
(found in the process's loaded libraries, as threadpoolctl does; no new dependency):

- ``ThreadPolicy.threads_for_run()``: before each run, the team size this run may use: ``max_threads`` (the
  program's ``threads=``, default the BLAS's own count at load) while the host has cores to spare, and 1 as soon
  as the runnable tasks the kernel reports (``/proc/loadavg``, sampled at most every ``SAMPLE_SECONDS``) reach
  the cores this process may use. The sample is instantaneous, so a run adapts within milliseconds.
- ``blas_threads(n)``: sets the count when it differs from the last one set (one C call).

A run sets the count once; small products are single-threaded by OpenBLAS itself. kiln's own parallel kernels
(the native kernels, runtime/kernels/cpu/native.py) take the same count (``kernel_threads()``), so they go
single-threaded on a busy host too. They run on the extension's kept pool, whose workers spin at most 100 us and
whose tasks go to whichever thread asks first, the calling one included: a worker the scheduler has not run yet
never holds up a call (two threads a run on the busy host of bench/busy_host_bench.py: a ViT-style model 152 ms
with the tasks split up front, 1.5 ms claimed; 0.8 ms quiet). The count is a process-wide
setting: runs on several threads at once share it (the server's workers pin it through the environment and
run with ``threads=`` equal to it).
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Callable, Optional

SAMPLE_SECONDS = 0.02
# (library name fragment, setter, getter) in the order tried; numpy's wheels ship scipy-openblas (64-bit ints).
_ENTRY_POINTS = (
    ("openblas", "scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("openblas", "scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
    ("openblas", "openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas", "openblas_set_num_threads", "openblas_get_num_threads"),
    ("mkl_rt", "MKL_Set_Num_Threads", "MKL_Get_Max_Threads"),
    ("blis", "bli_thread_set_num_threads", "bli_thread_get_num_threads"),
)


class Blas:
    """The loaded BLAS's thread-count entry points."""

    def __init__(self, path: str, setter: Callable, getter: Callable):
        self.path = path
        self._set = setter
        self._get = getter
        self._lock = threading.Lock()
        self.current = int(getter())
        # The count the process started with (OPENBLAS_NUM_THREADS, else the cores): a program's default cap,
        # whatever count an earlier program's run left set.
        self.default = self.current

    def get(self) -> int:
        return int(self._get())

    def set(self, n: int) -> None:
        if n != self.current:
            with self._lock:
                self._set(n)
                self.current = n


def _loaded_libraries() -> list:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/" in line}
    except OSError:  # not Linux: no discovery (the count stays the BLAS's own)
        return []
    return sorted(p for p in paths if p.endswith(".so") or ".so." in p or p.endswith(".dylib"))


_BLAS: list = []  # [Blas or None], filled on first use


def blas() -> Optional[Blas]:
    """numpy's BLAS, or None where its thread count cannot be set (then nothing is changed)."""
    if not _BLAS:
        import numpy  # noqa: F401 - its BLAS must be loaded to be found
        found = None
        for path in _loaded_libraries():
            name = os.path.basename(path).lower()
            for fragment, set_name, get_name in _ENTRY_POINTS:
                if fragment not in name:
                    continue
                try:
                    lib = ctypes.CDLL(path)
                    setter, getter = getattr(lib, set_name), getattr(lib, get_name)
                except (OSError, AttributeError):
                    continue
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                found = Blas(path, setter, getter)
                break
            if found is not None:
                break
        _BLAS.append(found)
    return _BLAS[0]


def blas_kernels() -> Optional[str]:
    """The kernel set numpy's OpenBLAS chose when it loaded (``Haswell``, ``SkylakeX``, ...), or None where the
    BLAS is not an OpenBLAS that says (kiln/blas_env.py: why it matters on CPUs OpenBLAS does not know)."""
    b = blas()
    if b is None:
        return None
    lib = ctypes.CDLL(b.path)
    for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                 "openblas_get_corename"):
        f = getattr(lib, name, None)
        if f is not None:
            f.argtypes, f.restype = [], ctypes.c_char_p
            value = f()
            return value.decode(errors="replace") if value else None
    return None


# The thread count kiln's own parallel kernels (the native convolutions) use: the last count a run set for the
# BLAS, or the BLAS's own count before any run (a process-wide setting, as the BLAS's is).
_KERNEL_THREADS: list = []


def kernel_threads() -> int:
    """Threads for kiln's own parallel kernels: what the run now going set for the BLAS (1 on a busy host)."""
    if not _KERNEL_THREADS:
        b = blas()
        _KERNEL_THREADS.append(b.default if b is not None else usable_cores())
    return _KERNEL_THREADS[0]


def _set_kernel_threads(n: int) -> None:
    if _KERNEL_THREADS:
        _KERNEL_THREADS[0] = n
    else:
        _KERNEL_THREADS.append(n)


# Whether kiln's float32 products run on its native extension's own GEMM (native.py sets it, where the CPU has
# AVX-512): then a run's threads go to that GEMM and numpy's BLAS, left with small or odd-typed products, runs on
# one thread. Its workers spin for a while after each multi-threaded GEMM; beside kiln's own GEMM threads they
# took the cores: BERT-style 4 layers at batch 1 ran in 42 ms with BLAS at 2 threads, 25 ms at 1 (2-core Zen 5).
_OWN_GEMM: list = [False]


def own_gemm(flag: bool) -> None:
    _OWN_GEMM[0] = bool(flag)


def _blas_count(n: int) -> int:
    return 1 if _OWN_GEMM[0] else n


def blas_threads(n: int) -> None:
    """Set kiln's own kernels to ``n`` threads, and numpy's BLAS (nothing where the BLAS is not found) to ``n``, or
    to 1 where kiln's products run on its own GEMM (``own_gemm``)."""
    n = max(1, int(n))
    _set_kernel_threads(n)
    b = blas()
    if b is not None:
        b.set(_blas_count(n))


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a container's)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def runnable_tasks() -> Optional[int]:
    """Tasks runnable on the host right now (the kernel's instantaneous count, this thread included)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None


class ThreadPolicy:
    """How many BLAS threads a run of one program uses (module docstring)."""

    def __init__(self, max_threads: Optional[int] = None, *, adaptive: bool = True):
        b = blas()
        default = b.default if b is not None else 1
        self.max_threads = max(1, int(max_threads)) if max_threads is not None else max(1, default)
        self.adaptive = adaptive and self.max_threads > 1 and b is not None
        self.cores = usable_cores()
        self._sampled_at = -1.0
        self._threads = self.max_threads
        self.busy_runs = 0  # runs made single-threaded because the host was busy (reported by kiln bench)

    def threads_for_run(self) -> int:
        if not self.adaptive:
            return self.max_threads
        now = time.monotonic()
        if now - self._sampled_at >= SAMPLE_SECONDS:
            self._sampled_at = now
            runnable = runnable_tasks()
            # Not counted as others: this thread, and the team's other threads, which may still be spinning
            # after the last run's GEMM.
            busy = runnable is not None and runnable - self._threads >= self.cores
            self._threads = 1 if busy else self.max_threads
        if self._threads == 1 and self.max_threads > 1:
            self.busy_runs += 1
        return self._threads

    def apply(self) -> None:
        """Set the BLAS count for the run about to start."""
        n = self.threads_for_run()
        _set_kernel_threads(n)
        b = blas()
        if b is not None:
            b.set(_blas_count(n))
