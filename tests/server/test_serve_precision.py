"""``precision`` in a model's config (and ``kiln serve --precision``): the model converted at load in the
server's executors (threads and worker processes), answers close to the float32 model, and the refusals."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")

import kiln  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.server.repository import ModelConfig  # noqa: E402
from kiln.server.workers import ProcessExecutor, ThreadExecutor  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"


@pytest.mark.parametrize("data, message", [
    ({"precision": "fp8"}, "must be \"fp32\", \"fp16\" or \"bf16\""),
    ({"precision": "fp16", "backend": "onnxruntime"}, "kiln's own conversion"),
])
def test_precision_config_errors(data, message):
    with pytest.raises(KilnError, match=message):
        ModelConfig.from_json(data)


def test_precision_from_the_command_line_overrides_the_file():
    config = ModelConfig.from_json({"precision": "fp16"}, overrides={"precision": "bf16"})
    assert config.precision == "bf16" and ModelConfig().precision is None


@pytest.mark.parametrize("kind", ["threads", "processes"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_executors_load_the_model_converted(kind, precision):
    import asyncio
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    want = kiln.load(MLP).run({"x": x})
    config = ModelConfig.from_json({"precision": precision, "workers": 0 if kind == "threads" else 1})
    ex = ThreadExecutor(MLP, config) if kind == "threads" else ProcessExecutor(MLP, config)
    ex.start()
    try:
        got = asyncio.run(ex.run({"x": x}))
    finally:
        asyncio.run(ex.close())
    tol = 3e-3 if precision == "fp16" else 3e-2
    for name, w in want.items():
        err = np.abs(got[name] - w).max()
        assert 0 < err <= tol * np.abs(w).max(), (name, err)  # converted (not bit-equal), and close
