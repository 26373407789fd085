"""gRPC requests are parsed straight from the ModelInferRequest (server/grpc_server.py ``_parse``: no V2 JSON
written and parsed again) by protocol.parse_request_object, HTTP's own checks: every request here, good or
bad, gets from it exactly what HTTP's parser gives the same request spelled as a V2 body (``to_v2_body``):
the same arrays, or the same status and message."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("grpc")
pytest.importorskip("tritonclient.grpc")

from tritonclient.grpc import service_pb2 as pb  # noqa: E402

from kiln.server import grpc_server as gs, protocol  # noqa: E402
from kiln.server.app import ApiError  # noqa: E402


class State:
    max_body_bytes = 1 << 20
    shared = None


def request(*inputs, raw=True, outputs=(), **params):
    req = pb.ModelInferRequest(model_name="m", id="r1")
    for name, datatype, shape, value in inputs:
        t = req.inputs.add(name=name, datatype=datatype, shape=shape)
        if raw:
            req.raw_input_contents.append(value if isinstance(value, bytes) else np.asarray(value).tobytes())
        elif value is not None:
            getattr(t.contents, gs._CONTENTS[datatype]).extend(np.asarray(value).ravel().tolist())
    for name in outputs:
        req.outputs.add(name=name)
    for k, v in params.items():
        if isinstance(v, bool):
            req.parameters[k].bool_param = v
        elif isinstance(v, int):
            req.parameters[k].int64_param = v
        else:
            req.parameters[k].string_param = v
    return req


def outcome(fn):
    try:
        r = fn()
    except (protocol.ProtocolError, ApiError) as e:
        return ("error", e.status, e.message)
    return ("ok", r.id, {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in r.inputs.items()},
            None if r.outputs is None else [o.name for o in r.outputs], r.timeout_ms)


x = np.arange(32, dtype=np.float32).reshape(2, 16)
CASES = {
    "raw fp32": request(("x", "FP32", [2, 16], x)),
    "raw two inputs": request(("x", "FP32", [2, 16], x), ("n", "INT64", [2], np.array([1, 2], np.int64))),
    "typed fp32": request(("x", "FP32", [2, 16], x), raw=False),
    "typed int32": request(("i", "INT32", [3], np.array([1, -2, 3], np.int32)), raw=False),
    "typed bool": request(("b", "BOOL", [2], np.array([True, False])), raw=False),
    "outputs and timeout": request(("x", "FP32", [2, 16], x), outputs=("probs",), timeout=5000),
    "raw size wrong": request(("x", "FP32", [2, 16], x[:, :15].copy())),
    "raw bool not 0/1": request(("b", "BOOL", [2], b"\x00\x02")),
    "unknown datatype": request(("x", "FP31", [2, 16], x)),
    "BYTES": request(("s", "BYTES", [1], b"abc")),
    "negative dim": request(("x", "FP32", [-2, 16], x)),
    "over the element limit": request(("x", "FP32", [1 << 21, 16], x)),
    "duplicate input": request(("x", "FP32", [2, 16], x), ("x", "FP32", [2, 16], x)),
    "empty name": request(("", "FP32", [2, 16], x)),
    "typed too few values": request(("x", "FP32", [2, 16], x[:1]), raw=False),
    "typed int out of range": request(("i", "INT8", [1], np.array([300], np.int32)), raw=False),
    "no data": request(("x", "FP32", [2, 16], None), raw=False),
    "bad timeout": request(("x", "FP32", [2, 16], x), timeout_ms="soon"),
    "binary_data_output not bool": request(("x", "FP32", [2, 16], x), binary_data_output=3),
    "duplicate output": request(("x", "FP32", [2, 16], x), outputs=("probs", "probs")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_direct_parse_equals_http_parse(case):
    req = CASES[case]

    def via_http():
        body, header_length = gs.to_v2_body(req)
        return protocol.parse_infer_request(body, header_length, max_elements=State.max_body_bytes)

    direct, http = outcome(lambda: gs._parse(req, State)), outcome(via_http)
    assert direct == http
    assert direct[0] == ("ok" if case in ("raw fp32", "raw two inputs", "typed fp32", "typed int32", "typed bool",
                                          "outputs and timeout") else "error"), direct


def test_raw_inputs_are_views_of_the_message_bytes():
    r = gs._parse(CASES["raw fp32"], State)
    a = r.inputs["x"]
    assert not a.flags.owndata and not a.flags.writeable and a.dtype == np.float32
    np.testing.assert_array_equal(a, x)
