"""The peer of `kiln serve` in bench/serve_bench.py: a plain FastAPI endpoint calling onnxruntime.

This is what a user would write by hand to serve an ONNX model over HTTP without an inference
server: one ``onnxruntime.InferenceSession`` (default session options, CPU provider), pydantic
models for a V2-style JSON request (``{"inputs": [{"name", "shape", "datatype", "data"}]}``) and
response, a synchronous endpoint (FastAPI runs it in its thread pool, so concurrent requests call
``session.run`` in parallel, which onnxruntime allows), no batching, served by uvicorn with one
worker. It speaks just enough of the V2 protocol (``POST /v2/models/{name}/infer`` with FP32 JSON
tensors, ``GET /v2/health/ready``) for the benchmark's load generator to drive it and kiln serve
alike.

Run: .venv/bin/python bench/serve_peer.py MODEL.onnx --name NAME [--host 127.0.0.1] [--port 8000]
     [--access-log]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

# The V2 datatypes this peer accepts (the benchmark only sends FP32), and the reverse map for outputs.
DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64}
V2_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class InputTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list


class InferRequest(BaseModel):
    id: str | None = None
    inputs: list[InputTensor]


class OutputTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list


class InferResponse(BaseModel):
    model_name: str
    id: str | None = None
    outputs: list[OutputTensor]


def create_app(model_path: Path, name: str) -> FastAPI:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    app = FastAPI(title=f"onnxruntime peer: {name}")

    @app.get("/v2/health/ready")
    def ready() -> dict:
        return {"ready": True}

    @app.post("/v2/models/{model}/infer", response_model=InferResponse)
    def infer(model: str, request: InferRequest) -> InferResponse:
        if model != name:
            raise HTTPException(404, f"unknown model {model!r}")
        feed = {}
        for t in request.inputs:
            if t.datatype not in DTYPES:
                raise HTTPException(400, f"input {t.name!r}: unsupported datatype {t.datatype}")
            feed[t.name] = np.asarray(t.data, dtype=DTYPES[t.datatype]).reshape(t.shape)
        try:
            results = session.run(None, feed)
        except Exception as e:  # noqa: BLE001 - onnxruntime's errors are all bad input here
            raise HTTPException(400, str(e)) from e
        outputs = [OutputTensor(name=o.name, shape=list(r.shape), datatype=V2_NAMES[r.dtype],
                                data=r.reshape(-1).tolist())
                   for o, r in zip(session.get_outputs(), results)]
        return InferResponse(model_name=name, id=request.id, outputs=outputs)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="an .onnx file")
    ap.add_argument("--name", required=True, help="the model name in the URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--access-log", action="store_true", help="log every request (uvicorn's default; off here)")
    args = ap.parse_args()
    uvicorn.run(create_app(args.model, args.name), host=args.host, port=args.port, workers=1,
                access_log=args.access_log, log_level="warning")


if __name__ == "__main__":
    main()
