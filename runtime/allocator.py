"""Keep large numpy buffers in the heap between runs (glibc only).

glibc's malloc serves every block above ``M_MMAP_THRESHOLD`` (128 KiB to start, adapting up to
32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` on free. An inference run
allocates and frees the same large activations every time, so each run page-faults all of them
in again: on a 2-core Xeon that was about a fifth of a BERT-style encoder's time at batch 32
(75 -> 59 ms) and a tenth of a ResNet-18's at batch 1 (37 -> 33 ms). ONNX Runtime and torch
avoid it with arenas or caching allocators; numpy has none, so kiln raises the thresholds once,
when the first CPU program is built:

- ``M_MMAP_THRESHOLD`` = 1 GiB: blocks below it come from the heap and are reused;
- ``M_TRIM_THRESHOLD`` = 2 GiB: freed heap memory is kept rather than returned at once;
- ``M_TOP_PAD`` = 64 MiB: the heap grows in larger steps.

The cost is that the process keeps its peak activation memory after a run (as the peers' arenas
do); blocks of 1 GiB and more still go back at once. This changes process-wide malloc settings,
so it can be turned off with the environment variable ``KILN_MALLOC_TUNING=0``. On other C
libraries (musl, macOS, Windows) it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
SETTINGS = ((M_MMAP_THRESHOLD, 1 << 30), (M_TRIM_THRESHOLD, 1 << 31), (M_TOP_PAD, 64 << 20))

_lock = threading.Lock()
_state: dict = {}


def tune_allocator() -> bool:
    """Apply the settings once per process; True if they are in effect."""
    with _lock:
        if "applied" not in _state:
            _state["applied"] = _apply()
        return _state["applied"]


def _apply() -> bool:
    if os.environ.get("KILN_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        # The soname, not ctypes.util.find_library (which may run ldconfig: tens of ms at start-up).
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
        # gnu_get_libc_version exists only in glibc: musl's mallopt is a no-op stub.
        libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
