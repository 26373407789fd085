"""The V2 codec against the real tritonclient[http] encoder/decoder, and every bad input it must refuse.

Requests are built with tritonclient's own request builder (the bytes ``InferenceServerClient.infer``
posts) and parsed with kiln.server.protocol; responses are encoded by kiln and parsed with
``tritonclient.http.InferResult.from_response_body``, as the client does with a server's reply.
"""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kiln.ir.types import TensorType
from kiln.runtime.program import TensorSpec
from kiln.server.protocol import (
    DATATYPES,
    InferRequest,
    ProtocolError,
    RequestedOutput,
    encode_infer_response,
    parse_infer_request,
    tensor_metadata,
    v2_datatype,
)

th = pytest.importorskip("tritonclient.http")
from tritonclient.http._utils import _get_inference_request  # noqa: E402

MAX = 1 << 20


def triton_request(inputs, outputs=None, request_id="", timeout=None, params=None):
    """The (body, Inference-Header-Content-Length) tritonclient's infer() would send."""
    return _get_inference_request(inputs, request_id, outputs, 0, False, False, 0, timeout, params)


def triton_input(name, array, binary):
    inp = th.InferInput(name, list(array.shape), v2_datatype(array.dtype))
    return inp.set_data_from_numpy(array, binary_data=binary)


def sample(datatype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dt = DATATYPES[datatype]
    if dt.kind == "b":
        return np.asarray(rng.random(shape) < 0.5)
    if dt.kind == "f":
        return np.asarray(rng.standard_normal(shape) * 100).astype(dt)
    info = np.iinfo(dt)
    arr = np.asarray(rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True))
    if arr.size >= 2:  # the extremes must survive both encodings
        arr.flat[0], arr.flat[-1] = info.min, info.max
    return arr


def parse(doc, header_length=None, max_elements=MAX):
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return parse_infer_request(body, header_length, max_elements=max_elements)


def one_input(name="x", shape=(2,), datatype="FP32", **fields):
    item = {"name": name, "shape": list(shape), "datatype": datatype}
    item.update(fields)
    return {"inputs": [item]}


def refused(doc, header_length=None, *, status=400, says=(), max_elements=MAX):
    with pytest.raises(ProtocolError) as info:
        parse(doc, header_length, max_elements=max_elements)
    err = info.value
    assert err.status == status, err.message
    for text in (says,) if isinstance(says, str) else says:
        assert text in err.message, err.message
    return err


def respond(outputs, requested=None, binary_default=False, request_id=None):
    body, headers = encode_infer_response("m", "3", request_id, outputs, requested, binary_default)
    length = headers.get("Inference-Header-Content-Length")
    result = th.InferResult.from_response_body(body, header_length=None if length is None else int(length))
    return result, body, headers


# ---------------------------------------------------------------------------------------------
# Requests built by tritonclient


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_tritonclient_request_round_trips_every_datatype(datatype, binary):
    arr = sample(datatype, (3, 5))
    body, length = triton_request([triton_input("x", arr, binary)])
    assert (length is not None) == binary
    req = parse_infer_request(body, length, max_elements=MAX)
    got = req.inputs["x"]
    assert got.dtype == arr.dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)


def test_tritonclient_mixed_binary_and_json_inputs_at_odd_offsets():
    # Inputs of different item sizes: the binary parts land at unaligned offsets in the body.
    arrays = {"a": sample("INT8", (7,)), "b": sample("FP64", (2, 3)), "c": sample("BOOL", (5,)),
              "d": sample("FP16", (3,)), "e": sample("UINT64", (4,)), "f": sample("INT32", (2, 2))}
    inputs = [triton_input(n, a, binary=n not in "bd") for n, a in arrays.items()]
    body, length = triton_request(inputs, request_id="req-7")
    req = parse_infer_request(body, length, max_elements=MAX)
    assert req.id == "req-7"
    assert list(req.inputs) == list(arrays)
    for name, arr in arrays.items():
        assert req.inputs[name].dtype == arr.dtype
        np.testing.assert_array_equal(req.inputs[name], arr)


def test_tritonclient_outputs_timeout_and_parameters():
    x = sample("FP32", (1, 4))
    outputs = [th.InferRequestedOutput("y", binary_data=True), th.InferRequestedOutput("z", binary_data=False)]
    body, length = triton_request([triton_input("x", x, True)], outputs, timeout=2500, params={"k": 1})
    req = parse_infer_request(body, length, max_elements=MAX)
    assert req.outputs == [RequestedOutput("y", True), RequestedOutput("z", False)]
    assert req.binary_default is False
    assert req.timeout_ms == 2.5  # Triton's timeout is in microseconds
    assert req.parameters["k"] == 1


def test_no_outputs_named_means_all_outputs_binary_as_tritonclient_asks():
    body, length = triton_request([triton_input("x", sample("FP32", (2,)), False)])
    req = parse_infer_request(body, length, max_elements=MAX)
    assert req.outputs is None and req.binary_default is True and req.timeout_ms is None
    assert req.id is None


@settings(max_examples=60, deadline=None)
@given(datatype=st.sampled_from(list(DATATYPES)),
       shape=st.lists(st.integers(0, 4), min_size=0, max_size=4),
       binary=st.booleans(), seed=st.integers(0, 1000))
def test_round_trip_property(datatype, shape, binary, seed):
    arr = sample(datatype, tuple(shape), seed)
    body, length = triton_request([triton_input("t", arr, binary)])
    got = parse_infer_request(body, length, max_elements=MAX).inputs["t"]
    assert got.shape == arr.shape and got.dtype == arr.dtype
    np.testing.assert_array_equal(got, arr)
    # and back out through the response encoder, read by tritonclient
    result, _, _ = respond({"t": got}, [RequestedOutput("t", not binary)])
    back = result.as_numpy("t")
    assert back.dtype == arr.dtype
    np.testing.assert_array_equal(back, arr)


# ---------------------------------------------------------------------------------------------
# Hand-written JSON requests: the forms the spec allows


def test_nested_data_of_exactly_the_shape_is_accepted():
    req = parse(one_input(shape=(2, 3), datatype="INT64", data=[[1, 2, 3], [4, 5, 6]]))
    np.testing.assert_array_equal(req.inputs["x"], np.arange(1, 7).reshape(2, 3))
    assert req.inputs["x"].dtype == np.int64


def test_scalar_and_empty_tensors():
    req = parse({"inputs": [{"name": "s", "shape": [], "datatype": "FP32", "data": [2.5]},
                            {"name": "e", "shape": [0, 3], "datatype": "INT32", "data": []},
                            {"name": "f", "shape": [2, 0], "datatype": "BOOL", "data": [[], []]}]})
    assert req.inputs["s"].shape == () and req.inputs["s"] == np.float32(2.5)
    assert req.inputs["e"].shape == (0, 3) and req.inputs["e"].dtype == np.int32
    assert req.inputs["f"].shape == (2, 0) and req.inputs["f"].dtype == np.bool_


def test_float_types_take_ints_nan_infinity_and_huge_ints():
    body = b'{"inputs":[{"name":"x","shape":[5],"datatype":"FP64","data":[1, NaN, Infinity, -Infinity, ' \
           + str(2 ** 70).encode() + b']}]}'
    x = parse(body).inputs["x"]
    assert x[0] == 1 and np.isnan(x[1]) and x[2] == np.inf and x[3] == -np.inf and x[4] == 2.0 ** 70


def test_integer_extremes_are_accepted():
    req = parse({"inputs": [
        {"name": "a", "shape": [2], "datatype": "UINT64", "data": [0, 2 ** 64 - 1]},
        {"name": "b", "shape": [2], "datatype": "INT64", "data": [-2 ** 63, 2 ** 63 - 1]},
        {"name": "c", "shape": [2], "datatype": "INT8", "data": [-128, 127]}]})
    assert req.inputs["a"].tolist() == [0, 2 ** 64 - 1]
    assert req.inputs["b"].tolist() == [-2 ** 63, 2 ** 63 - 1]
    assert req.inputs["c"].tolist() == [-128, 127]


def test_bools_elsewhere_in_the_request_do_not_trip_numeric_inputs():
    doc = one_input(shape=(3,), data=[1.5, 2, -3])
    doc["parameters"] = {"binary_data_output": True, "flag": False}
    doc["outputs"] = [{"name": "true_out", "parameters": {"binary_data": False}}]
    req = parse(doc)
    assert req.inputs["x"].tolist() == [1.5, 2.0, -3.0] and req.binary_default is True
    assert req.outputs == [RequestedOutput("true_out", False)]


def test_requested_outputs_default_to_binary_data_output():
    doc = one_input(data=[1, 2])
    doc["parameters"] = {"binary_data_output": True}
    doc["outputs"] = [{"name": "a"}, {"name": "b", "parameters": {"binary_data": False}}]
    assert parse(doc).outputs == [RequestedOutput("a", True), RequestedOutput("b", False)]
    doc["outputs"] = []
    assert parse(doc).outputs is None


@pytest.mark.parametrize("params, expected", [
    ({"timeout_ms": 250}, 250.0),
    ({"timeout": 3000}, 3.0),
    ({"timeout": 0}, None),  # Triton: 0 is "no timeout"
    ({"timeout_ms": 10, "timeout": 3_000_000}, 10.0),
    ({"timeout_ms": 10, "timeout": 2000}, 2.0),
])
def test_timeouts(params, expected):
    doc = one_input(data=[1, 2])
    doc["parameters"] = params
    assert parse(doc).timeout_ms == expected


def test_binary_inputs_are_not_copied_when_aligned():
    header = json.dumps(one_input(shape=(4,), datatype="UINT8", parameters={"binary_data_size": 4})).encode()
    body = header + bytes([1, 2, 3, 250])
    x = parse_infer_request(body, len(header), max_elements=MAX).inputs["x"]
    assert x.tolist() == [1, 2, 3, 250] and x.dtype == np.uint8
    assert np.shares_memory(x, np.frombuffer(body, np.uint8))


def test_json_float32_parses_into_a_float32_array():
    values = np.random.default_rng(1).standard_normal(784).astype(np.float32)
    req = parse(one_input(shape=(1, 784), data=values.tolist()))
    assert req.inputs["x"].dtype == np.float32
    np.testing.assert_array_equal(req.inputs["x"], values.reshape(1, 784))


# ---------------------------------------------------------------------------------------------
# Bad requests


def binary_doc(inputs, *payloads):
    header = json.dumps({"inputs": inputs}).encode()
    return header + b"".join(payloads), len(header)


@pytest.mark.parametrize("body, says", [
    (b"", "empty"),
    (b"{not json", "malformed JSON"),
    (b"\xff\xfe\x00garbage", "malformed JSON"),
    (b"[" * 100000 + b"]" * 100000, "malformed JSON"),  # deeper than the parser recurses
    (b"[1, 2]", "must be a JSON object"),
    (b'"inputs"', "must be a JSON object"),
    (b"{}", "no 'inputs'"),
    (b'{"inputs": {"name": "x"}}', "'inputs' must be a list"),
    (b'{"inputs": [3]}', "inputs[0] must be an object"),
    (b'{"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]}', "inputs[0] needs a non-empty string 'name'"),
    (b'{"id": 5, "inputs": []}', "'id' must be a string"),
    (b'{"parameters": [], "inputs": []}', "'parameters' must be an object"),
    (b'{"parameters": {"binary_data_output": 1}, "inputs": []}', "binary_data_output"),
    (b'{"parameters": {"timeout_ms": -1}, "inputs": []}', "timeout_ms"),
    (b'{"parameters": {"timeout_ms": "5"}, "inputs": []}', "timeout_ms"),
    (b'{"parameters": {"timeout": 1.5}, "inputs": []}', "'timeout'"),
    (b'{"inputs": [], "outputs": {}}', "'outputs' must be a list"),
    (b'{"inputs": [], "outputs": [{"name": "y"}, {"name": "y"}]}', "output 'y' is requested more than once"),
    (b'{"inputs": [], "outputs": [{}]}', "outputs[0] needs a non-empty string 'name'"),
    (b'{"inputs": [], "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]}', "output 'y'"),
    (b'{"inputs": [], "outputs": [{"name": "y", "parameters": {"classification": 3}}]}', "classification"),
    (b'{"inputs": [], "outputs": [{"name": "y", "parameters": {"shared_memory_region": "r"}}]}', "shared memory"),
])
def test_malformed_requests(body, says):
    refused(body, says=says)


@pytest.mark.parametrize("item, says", [
    ({"shape": [2], "datatype": "FP32"}, "neither 'data' nor a binary_data_size"),
    ({"datatype": "FP32", "data": [1, 2]}, "needs a 'shape' list"),
    ({"shape": [2], "data": [1, 2]}, "needs a string 'datatype'"),
    ({"shape": [2], "datatype": "FLOAT", "data": [1, 2]}, "unknown datatype 'FLOAT'"),
    ({"shape": [2], "datatype": "fp32", "data": [1, 2]}, "unknown datatype 'fp32'"),
    ({"shape": [2], "datatype": "BYTES", "data": ["a", "b"]}, "BYTES"),
    ({"shape": [2], "datatype": "BF16", "data": [1e39, 2]}, "out of range for BF16"),
    ({"shape": [-1], "datatype": "FP32", "data": [1]}, "non-negative integers"),
    ({"shape": [2.0], "datatype": "FP32", "data": [1, 2]}, "non-negative integers"),
    ({"shape": [True, 2], "datatype": "FP32", "data": [1, 2]}, "non-negative integers"),
    ({"shape": ["2"], "datatype": "FP32", "data": [1, 2]}, "non-negative integers"),
    ({"shape": 2, "datatype": "FP32", "data": [1, 2]}, "needs a 'shape' list"),
    ({"shape": [1] * 33, "datatype": "FP32", "data": [1]}, "rank 33"),
    ({"shape": [2], "datatype": "FP32", "data": 1.0}, "'data' must be a list"),
    ({"shape": [3], "datatype": "FP32", "data": [1, 2]}, "2 data values but shape [3] needs 3"),
    ({"shape": [1], "datatype": "FP32", "data": [1, 2]}, "2 data values but shape [1] needs 1"),
    ({"shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3]]}, "ragged"),
    ({"shape": [3], "datatype": "FP32", "data": [1, [2, 3]]}, "ragged"),
    ({"shape": [2, 3], "datatype": "FP32", "data": [[1, 2], [3, 4], [5, 6]]}, "nested as [3, 2]"),
    ({"shape": [0], "datatype": "FP32", "data": [1]}, "no elements"),
    ({"shape": [2], "datatype": "FP32", "data": [1, "2"]}, 'got "2"'),
    ({"shape": [2], "datatype": "FP32", "data": [1, None]}, "got null"),
    ({"shape": [2], "datatype": "FP32", "data": [1, {}]}, "got {}"),
    ({"shape": [2], "datatype": "FP32", "data": [True, False]}, "not true/false"),
    ({"shape": [2], "datatype": "FP32", "data": [1.5, True]}, "not true/false"),
    ({"shape": [2], "datatype": "INT32", "data": [2, True]}, "not true/false"),
    ({"shape": [1], "datatype": "FP16", "data": [70000]}, "out of range for FP16"),
    ({"shape": [1], "datatype": "FP32", "data": [1e39]}, "out of range for FP32"),
    ({"shape": [2], "datatype": "INT32", "data": [1, 1.5]}, "got 1.5"),
    ({"shape": [2], "datatype": "INT32", "data": [1, 2.0]}, "got 2.0"),
    ({"shape": [1], "datatype": "INT32", "data": [2 ** 31]}, "value 2147483648 is out of range for INT32"),
    ({"shape": [1], "datatype": "INT8", "data": [-129]}, "value -129 is out of range for INT8"),
    ({"shape": [1], "datatype": "UINT8", "data": [-1]}, "value -1 is out of range for UINT8"),
    ({"shape": [1], "datatype": "UINT64", "data": [2 ** 64]}, "out of range for UINT64"),
    ({"shape": [2], "datatype": "INT64", "data": [-1, 2 ** 63]}, f"value {2 ** 63} is out of range for INT64"),
    ({"shape": [2], "datatype": "INT16", "data": [1, "3"]}, 'got "3"'),
    ({"shape": [2], "datatype": "INT16", "data": [1, None]}, "got null"),
    ({"shape": [2], "datatype": "BOOL", "data": [1, 0]}, "true or false, got 1"),
    ({"shape": [2], "datatype": "BOOL", "data": [True, 1]}, "true or false, got 1"),
    ({"shape": [2], "datatype": "BOOL", "data": [True, "false"]}, 'got "false"'),
    ({"shape": [1], "datatype": "BOOL", "data": [None]}, "got null"),
    ({"shape": [2], "datatype": "FP32", "data": [1, 2], "parameters": 5}, "'parameters' must be an object"),
    ({"shape": [2], "datatype": "FP32", "parameters": {"shared_memory_region": "r"}}, "shared memory"),
])
def test_bad_inputs_name_the_input(item, says):
    doc = {"inputs": [{"name": "x_in", **item}]}
    err = refused(doc, says=says)
    assert "'x_in'" in err.message


@pytest.mark.parametrize("token, says", [(b"NaN", "got NaN"), (b"Infinity", "got Infinity"),
                                          (b"-Infinity", "got -Infinity")])
def test_non_finite_values_for_int_inputs(token, says):
    refused(b'{"inputs":[{"name":"n","shape":[2],"datatype":"INT64","data":[1,' + token + b']}]}',
            says=("'n'", says))


def test_duplicate_input_names():
    refused({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}] * 2},
            says="input 'x' appears more than once")


def test_huge_declared_shapes_are_refused_before_any_data_is_read():
    for shape in ([1 << 40, 1 << 40], [1 << 62] * 30, [0, 10 ** 30], [MAX + 1]):
        refused(one_input(shape=shape, data=[1]), status=413, says=("'x'", "limit of"))
    refused(one_input(shape=[4, 4], data=list(range(16))), status=413, max_elements=15, says="15 elements")
    # binary: a small size field cannot stand in for a huge shape either
    body, length = binary_doc([{"name": "x", "shape": [1 << 40], "datatype": "FP32",
                                "parameters": {"binary_data_size": 4}}], b"\0" * 4)
    refused(body, length, status=413)


def test_shape_at_the_cap_is_accepted():
    assert parse(one_input(shape=[4, 4], data=list(range(16))), max_elements=16).inputs["x"].shape == (4, 4)


def test_binary_errors():
    x = {"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}
    y = {"name": "y", "shape": [3], "datatype": "UINT8", "parameters": {"binary_data_size": 3}}
    good, length = binary_doc([x, y], b"\0" * 8, b"\1\2\3")
    assert parse_infer_request(good, length, max_elements=MAX).inputs["y"].tolist() == [1, 2, 3]

    refused(good[:-1], length, says=("'y'", "only 10 bytes follow"))  # truncated body
    refused(good + b"\0", length, says="add up to 11 bytes but 12 bytes follow")  # trailing bytes
    refused(good, None, says="malformed JSON")  # binary tail without the header length
    refused(good[:length], length, says="'x'")  # header only
    refused(good, len(good) + 1, says="Inference-Header-Content-Length is")
    refused(good, 0, says="positive integer")
    refused(good, -5, says="positive integer")
    refused(good, length - 3, says="malformed JSON")  # header length cuts the JSON

    wrong = dict(x, parameters={"binary_data_size": 6})
    body, length = binary_doc([wrong], b"\0" * 6)
    refused(body, length, says=("'x'", "binary_data_size is 6 bytes but shape [2] of FP32 needs 8"))
    for bad_size in (-8, 8.0, "8", True):
        body, length = binary_doc([dict(x, parameters={"binary_data_size": bad_size})], b"\0" * 8)
        refused(body, length, says=("'x'", "binary_data_size must be a non-negative integer"))
    both = dict(x, data=[1, 2])
    body, length = binary_doc([both], b"\0" * 8)
    refused(body, length, says=("'x'", "both 'data' and a binary_data_size"))
    header = json.dumps({"inputs": [x]}).encode()
    refused(header, None, says=("'x'", "no Inference-Header-Content-Length"))


def test_binary_bool_bytes_must_be_0_or_1():
    b = {"name": "b", "shape": [3], "datatype": "BOOL", "parameters": {"binary_data_size": 3}}
    body, length = binary_doc([b], bytes([1, 0, 1]))
    assert parse_infer_request(body, length, max_elements=MAX).inputs["b"].tolist() == [True, False, True]
    body, length = binary_doc([b], bytes([1, 2, 0]))
    refused(body, length, says=("'b'", "0 or 1"))


# ---------------------------------------------------------------------------------------------
# Responses, read by tritonclient


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_response_every_datatype_parses_in_tritonclient(binary):
    outputs = {name: sample(name, (2, 3), seed=i) for i, name in enumerate(DATATYPES)}
    result, body, headers = respond(outputs, binary_default=binary, request_id="abc")
    response = result.get_response()
    assert response["model_name"] == "m" and response["model_version"] == "3" and response["id"] == "abc"
    assert [o["name"] for o in response["outputs"]] == list(outputs)
    for name, arr in outputs.items():
        got = result.as_numpy(name)
        assert got.dtype == arr.dtype and got.shape == arr.shape, name
        np.testing.assert_array_equal(got, arr)
        assert result.get_output(name)["datatype"] == name
    if binary:
        assert headers["Content-Type"] == "application/octet-stream"
        header_length = int(headers["Inference-Header-Content-Length"])
        assert len(body) == header_length + sum(a.nbytes for a in outputs.values())
    else:
        assert headers == {"Content-Type": "application/json"}
        json.loads(body)  # the whole body is one JSON document


def test_response_requested_outputs_in_request_order_with_their_own_encoding():
    outputs = {"a": np.arange(4, dtype=np.float32), "b": np.array([[1, 2]], np.int64), "c": np.ones(1)}
    requested = [RequestedOutput("b", False), RequestedOutput("a", True)]
    result, body, headers = respond(outputs, requested, binary_default=True)
    response = result.get_response()
    assert [o["name"] for o in response["outputs"]] == ["b", "a"]
    assert response["outputs"][0]["data"] == [1, 2]
    assert response["outputs"][1]["parameters"] == {"binary_data_size": 16}
    assert "id" not in response
    np.testing.assert_array_equal(result.as_numpy("a"), outputs["a"])
    np.testing.assert_array_equal(result.as_numpy("b"), outputs["b"])
    assert result.as_numpy("c") is None


def test_response_scalar_empty_strided_and_big_endian_outputs():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    outputs = {"scalar": np.float64(3.25) * np.ones(()), "empty": np.zeros((0, 5), np.int32),
               "strided": base[:, ::2], "transposed": base.T, "big": np.arange(3, dtype=">i4"),
               "nonfinite": np.array([np.nan, np.inf, -np.inf], np.float32)}
    for binary in (False, True):
        result, _, _ = respond(outputs, binary_default=binary)
        for name, arr in outputs.items():
            got = result.as_numpy(name)
            assert got.shape == arr.shape and got.dtype == arr.dtype.newbyteorder("="), name
            np.testing.assert_array_equal(got, arr)


def test_response_refuses_unknown_requested_output_and_unsendable_dtypes():
    with pytest.raises(ProtocolError) as info:
        encode_infer_response("m", "1", None, {"y": np.ones(2)}, [RequestedOutput("z", False)], False)
    assert info.value.status == 400 and "'z'" in info.value.message
    for arr in (np.array(["a"]), np.ones(2, np.complex64), np.array([None])):
        with pytest.raises(ProtocolError) as info:
            encode_infer_response("m", "1", None, {"y": arr}, None, True)
        assert info.value.status == 500 and "output 'y' has dtype" in info.value.message


def test_full_request_response_cycle_through_tritonclient():
    x = sample("FP32", (2, 4))
    outputs = [th.InferRequestedOutput("y", binary_data=True)]
    body, length = triton_request([triton_input("x", x, False)], outputs, request_id="7")
    req = parse_infer_request(body, length, max_elements=MAX)
    assert isinstance(req, InferRequest)
    y = {"y": req.inputs["x"] * 2, "unrequested": req.inputs["x"]}
    result, _, _ = respond(y, req.outputs, req.binary_default, req.id)
    assert result.get_response()["id"] == "7"
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    assert result.as_numpy("unrequested") is None


# ---------------------------------------------------------------------------------------------
# Datatype names and model metadata


def test_v2_datatype_names():
    for name, dt in DATATYPES.items():
        assert v2_datatype(dt) == name
        assert v2_datatype(dt.newbyteorder(">")) == name
    assert v2_datatype(np.float32) == "FP32" and v2_datatype("bool") == "BOOL"
    assert v2_datatype(np.dtype("U3")) == "BYTES" and v2_datatype(object) == "BYTES"
    with pytest.raises(ProtocolError):
        v2_datatype(np.complex128)


def test_tensor_metadata():
    spec = TensorSpec("x", TensorType("float32", ("batch", 3, None)))
    assert tensor_metadata(spec) == {"name": "x", "datatype": "FP32", "shape": [-1, 3, -1]}
    assert tensor_metadata(TensorSpec("m", TensorType("bool", ()))) == {"name": "m", "datatype": "BOOL", "shape": []}
    assert tensor_metadata(TensorSpec("u", TensorType("int64", None)))["shape"] == [-1]
    assert tensor_metadata(TensorSpec("h", TensorType("float16", (2,))))["datatype"] == "FP16"
    assert tensor_metadata(TensorSpec("u8", TensorType("uint8", (2,))))["datatype"] == "UINT8"
    assert tensor_metadata(TensorSpec("b", TensorType("bfloat16", (2,))))["datatype"] == "BF16"
