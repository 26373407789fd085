"""numpy's OpenBLAS on CPUs it does not know: the AVX-512 kernels chosen before numpy loads.

numpy's wheels bundle OpenBLAS built with DYNAMIC_ARCH: when the library loads it reads the CPU (cpuid) and picks
one kernel set. OpenBLAS 0.3.31 (numpy 2.4's) does not know AMD's Zen 5 (CPU family 26) and falls back to its
AVX2 ``Haswell`` kernels, although the CPU runs AVX-512 at full width. Measured on a 2-core Zen 5 (AMD EPYC,
family 26): one-thread sgemm 1024x1024x1024 125 GFLOP/s with ``Haswell``, 226 GFLOP/s with ``SkylakeX``
(1.8x); ResNet-18 at batch 1 in kiln 23.0 -> 16.0 ms (bench/RESULTS.md). onnxruntime's own GEMMs already use
AVX-512 there.

OpenBLAS takes the kernel set from ``OPENBLAS_CORETYPE`` when that is set before it loads, so ``import kiln``
(which imports nothing of numpy) sets ``OPENBLAS_CORETYPE=SkylakeX`` where all of these hold:

- numpy is not imported yet (once loaded, the library has chosen; ``kiln info`` then says what it chose);
- neither ``OPENBLAS_CORETYPE`` nor ``KILN_BLAS_CORETYPE`` is set (``KILN_BLAS_CORETYPE=keep`` leaves OpenBLAS
  to choose; any other value is set as ``OPENBLAS_CORETYPE``);
- the CPU is an AMD of family 26 or later with the AVX-512 subsets SkylakeX's kernels use (F, CD, BW, DQ, VL),
  read from the first processor of ``/proc/cpuinfo`` (Linux; elsewhere nothing is done).

Only that case was measured; CPUs OpenBLAS knows keep its choice. The variable is inherited by child processes
(the server's workers), which is what it should do there too. It changes which kernels compute a product, so the
last bits of a GEMM's result can differ from the same numpy without kiln (as they do between machines).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

AVX512_SUBSETS = ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")
CORETYPE = "SkylakeX"
FIRST_UNKNOWN_AMD_FAMILY = 26   # Zen 5; OpenBLAS 0.3.31 maps family 25 with AVX-512 (Zen 4) to SkylakeX itself


def first_cpu(path: str = "/proc/cpuinfo") -> dict:
    """The fields of the first processor in ``path`` (``{}`` where it cannot be read)."""
    fields: dict = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, sep, value = line.partition(":")
                if sep:
                    fields[key.strip()] = value.strip()
    except OSError:
        return {}
    return fields


def wanted_coretype(cpu: dict) -> Optional[str]:
    """The ``OPENBLAS_CORETYPE`` kiln asks for on the CPU ``cpu`` (first_cpu's fields), or None."""
    try:
        family = int(cpu.get("cpu family", ""))
    except ValueError:
        return None
    flags = set(cpu.get("flags", "").split())
    if cpu.get("vendor_id") == "AuthenticAMD" and family >= FIRST_UNKNOWN_AMD_FAMILY \
            and all(f in flags for f in AVX512_SUBSETS):
        return CORETYPE
    return None


def choose(environ=os.environ, modules=sys.modules, cpuinfo: str = "/proc/cpuinfo") -> Optional[str]:
    """Set ``OPENBLAS_CORETYPE`` in ``environ`` as the module docstring says; the value set, or None."""
    if "numpy" in modules or "OPENBLAS_CORETYPE" in environ:
        return None
    asked = environ.get("KILN_BLAS_CORETYPE", "").strip()
    if asked.lower() == "keep":
        return None
    value = asked or wanted_coretype(first_cpu(cpuinfo))
    if value:
        environ["OPENBLAS_CORETYPE"] = value
    return value or None
