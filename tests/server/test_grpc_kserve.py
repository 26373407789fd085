"""KServe's own gRPC client against ``kiln serve`` (issue 25: "KServe's gRPC clients work unchanged").

``kserve.InferenceGRPCClient`` (the KServe Python SDK, grpc.aio, its own stubs generated from KServe's
``grpc_predict_v2.proto``) on a real ``kiln serve`` process: liveness, readiness, model readiness, and
ModelInfer with raw and typed contents, answers equal to ``Program.run``; KServe's stubs for the metadata
RPCs its client does not wrap; a bad input and an unknown model come back with the status codes and the
messages the Triton client sees (tests/server/test_grpc.py)."""
from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
grpc = pytest.importorskip("grpc")
kserve = pytest.importorskip("kserve")

import kiln  # noqa: E402
from kiln.server.attacks import ServeProcess  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(scope="module")
def server():
    s = ServeProcess([str(MLP), "--name", "mlp", "--workers", "1", "--max-batch-size", "32"])
    yield s
    assert s.stop() == 0, "".join(s.output)


def address(server: ServeProcess) -> str:
    m = re.search(r"gRPC at (127\.0\.0\.1:\d+)", "".join(server.output))
    assert m, "".join(server.output)
    return m.group(1)


def run(coro):
    return asyncio.run(coro)


def test_kserve_client_health_and_infer(server):
    from kserve import InferenceGRPCClient, InferInput, InferRequest
    from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb

    program = kiln.load(MLP)
    rng = np.random.default_rng(25)

    async def calls():
        client = InferenceGRPCClient(address(server), timeout=30)
        try:
            assert await client.is_server_live()
            assert await client.is_server_ready()
            assert await client.is_model_ready("mlp")
            answers = []
            for k, binary in enumerate([True, False, True, False]):
                x = rng.standard_normal((k + 1, 16)).astype(np.float32)
                i = InferInput("x", list(x.shape), "FP32")
                i.set_data_from_numpy(x, binary_data=binary)  # raw_input_contents, or fp32_contents
                r = await client.infer(InferRequest(model_name="mlp", infer_inputs=[i], request_id=f"r{k}"))
                assert r.id == f"r{k}" and r.model_name == "mlp"
                answers.append((x, {o.name: o.as_numpy() for o in r.outputs}))
            # the RPCs KServe's client does not wrap, through KServe's own generated stubs
            stub = client._client_stub
            meta = await stub.ServerMetadata(pb.ServerMetadataRequest())
            model = await stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp"))
            bad = pb.ModelInferRequest(model_name="mlp", inputs=[pb.ModelInferRequest.InferInputTensor(
                name="x", datatype="FP32", shape=[2, 16])], raw_input_contents=[bytes(2 * 16 * 4 - 4)])
            with pytest.raises(grpc.aio.AioRpcError) as bad_input:
                await stub.ModelInfer(bad)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.ModelReady(pb.ModelReadyRequest(name="nope"))
            return answers, meta, model, bad_input.value, unknown.value
        finally:
            await client.close()

    answers, meta, model, bad_input, unknown = run(calls())
    for x, got in answers:
        want = program.run({"x": x})
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert meta.name == "kiln" and "binary_tensor_data" in meta.extensions
    assert model.name == "mlp" and [t.name for t in model.inputs] == ["x"]
    assert model.inputs[0].datatype == "FP32" and list(model.inputs[0].shape) == [-1, 16]
    assert bad_input.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs 128" in bad_input.details()
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.details()
