"""Shared by the CUDA backend's test modules: ``cp, pytestmark = require_gpu()`` at the top of a
module skips it where CuPy is missing (CI) and marks its tests ``gpu``, skipped without a device."""
from __future__ import annotations

import pytest


def require_gpu():
    """(the cupy module, the module's pytestmark list); skips the importing module without CuPy."""
    cp = pytest.importorskip("cupy")
    try:
        devices = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        devices = 0
    return cp, [pytest.mark.gpu, pytest.mark.skipif(devices == 0, reason="no CUDA device")]
