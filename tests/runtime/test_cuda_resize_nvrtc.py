"""The CUDA Resize sources compile under NVRTC, for every dtype variant, without a GPU: NVRTC is a
library, found here through the ``nvidia-cuda-nvrtc-cu12`` wheel or CuPy's CUDA path (the module
skips where neither is installed). Running them is tests/runtime/test_cuda_resize.py's job."""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _libnvrtc():
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc") if importlib.util.find_spec("nvidia") else None
    dirs = [os.path.join(p, "lib") for p in (spec.submodule_search_locations if spec else [])]
    dirs += [os.path.join(os.environ.get("CUDA_PATH", "/usr/local/cuda"), "lib64")]
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "libnvrtc.so*"))):
            if "builtins" not in path and "alt" not in path:
                try:
                    return ctypes.CDLL(path)
                except OSError:
                    continue
    pytest.skip("no NVRTC library (pip install nvidia-cuda-nvrtc-cu12 to run this check)")


def _compile(lib, source: str, name: str) -> None:
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None) == 0
    opts = [b"--std=c++17", b"--gpu-architecture=compute_80"]
    status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert status == 0, f"{name} does not compile:\n{log.value.decode()}"


def test_resize_kernels_compile(monkeypatch):
    lib = _libnvrtc()
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    pkg = types.ModuleType("kiln.runtime.kernels.cuda")
    pkg.kernel = lambda *ops, host=(): (lambda f: f)
    pkg.host = pkg.in_dtype = None
    monkeypatch.setitem(sys.modules, "kiln.runtime.kernels.cuda", pkg)
    spec = importlib.util.spec_from_file_location("kiln_cuda_resize_src", ROOT / "runtime/kernels/cuda/resize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sources = []
    monkeypatch.setattr(mod, "_compile", lambda src, name: sources.append((src, name)))
    for itemsize in mod._WORDS:
        mod._nearest_kernel(itemsize)
    for dt in mod._TYPES:
        mod._pass_kernels(dt)
    assert len(sources) == len(mod._WORDS) + 2 * len(mod._TYPES)
    for src, name in sources:
        assert f"void {name}(" in src
        _compile(lib, src, name)
