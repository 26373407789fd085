"""The KServe/Triton Open Inference Protocol (V2) over REST: a pure codec, no web framework.

Why a module of its own: every byte a client sends passes through here before it can reach a
model, so this is where hostile or careless input is stopped. ``parse_infer_request`` turns a
request body into numpy arrays and raises :class:`ProtocolError` (with an HTTP status and a
message naming the offending input) for anything malformed; ``encode_infer_response`` turns
outputs back into a body that the real ``tritonclient[http]`` ``InferResult`` parses unchanged.
Keeping it free of FastAPI makes it testable byte for byte and usable from other front ends.

Wire format (https://kserve.github.io/website/docs/concepts/architecture/data-plane/v2-protocol
and Triton's binary tensor data extension, checked against tritonclient's http client):

* A request is a JSON object ``{"id"?, "parameters"?, "inputs": [...], "outputs"?: [...]}``.
  Each input is ``{"name", "shape", "datatype", "parameters"?, "data"?}``. ``data`` is a flat
  row-major list or a nested list of exactly the declared shape.
* Binary tensor extension: the JSON header is followed by raw tensor bytes. The HTTP header
  ``Inference-Header-Content-Length`` gives the JSON length; an input with
  ``parameters.binary_data_size`` takes that many bytes, in input order, little-endian, row
  major, no padding; BOOL is one byte, 0 or 1. The sizes must account for the body exactly.
* Outputs: ``outputs[i].parameters.binary_data`` asks for one output as binary; the request
  parameter ``binary_data_output`` is the default for outputs not listed (tritonclient sends it
  when no outputs are named). A binary response carries ``Inference-Header-Content-Length`` and
  ``parameters.binary_data_size`` per binary output.

Decisions, documented here because clients see them:

* Datatypes: BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64 and BF16; BYTES is refused with
  400 (kiln models take numeric tensors). BF16 is Triton's: in binary data, 2 bytes per element,
  little-endian bfloat16 bits (``ml_dtypes.bfloat16``, what tritonclient's ``as_numpy`` reads). Triton
  refuses BF16 in JSON both ways; kiln is lenient where it cannot be wrong: JSON numbers are rounded
  to the nearest bfloat16 on input (as FP16 rounds), and a BF16 output requested as JSON is written
  as numbers, each exactly the bfloat16 value (every bfloat16 is a float32), which
  ``np.array(data, dtype=ml_dtypes.bfloat16)`` reads back bit for bit. BF16 needs ``ml_dtypes``
  (a bfloat16 model does not load without it either).
* JSON values must have the JSON type of the datatype, as Triton requires: integer types take
  JSON integers only (no 1.5, no 1.0, no NaN/Infinity, no true/false) within the type's range;
  BOOL takes only ``true``/``false`` (not 0/1); float types take numbers, including Python's
  ``NaN``/``Infinity`` extension, but not finite values that overflow the type (1e39 for FP32).
* Size cap: an input whose declared element count exceeds ``max_elements`` gets 413 (Content
  Too Large): a client sending a legitimately large tensor learns it hit a server limit, not that
  its request is malformed. The cap is checked from the shape alone, before any data is looked
  at, and nothing is ever allocated from a shape: JSON data must have exactly prod(shape)
  elements and binary data exactly prod(shape) * itemsize bytes actually present in the body.
* Timeouts: request parameter ``timeout_ms`` (milliseconds, > 0 and at most ``MAX_TIMEOUT_MS``,
  2**50 ms, so that every accepted value is a finite float) or Triton's ``timeout`` (integer
  microseconds, a uint64 as in Triton, as tritonclient's ``infer(timeout=...)`` sends; 0 means
  "none", as in Triton). If both are given the smaller wins. The server applies ``min(server
  default, this)``. Every parameter kiln reads is type- and range-checked here, and an integer of
  any size (JSON has no limit) is compared as an integer, never converted first: a 400-digit
  ``timeout_ms`` is a 400, not an ``OverflowError``.
* Binary inputs are zero-copy read-only views of the body (copied only when misaligned): the
  runtime never writes its inputs. JSON inputs are fresh arrays.
* System shared memory (server/shm.py): an input whose parameters name a ``shared_memory_region``
  (with ``shared_memory_byte_size``, optional ``shared_memory_offset``) is a read-only view of that
  registered region, and must carry no ``data`` or ``binary_data_size``; its byte size must be
  exactly prod(shape) * itemsize. A requested output with those parameters is written into the
  region, and its response entry carries only ``parameters`` (no data), as in Triton. Unknown
  regions and spans outside a region are refused with 400 before inference.
* ``"outputs": []`` means the same as no ``outputs``: every output. This module knows nothing
  of models: missing, extra or unknown inputs and outputs, and shapes or datatypes that do not
  match the model, are the caller's checks (``inputs: []`` parses fine here).
* Non-finite floats in JSON responses are written as ``NaN``/``Infinity`` (Python's and
  rapidjson's extension, which tritonclient parses); ask for binary outputs to stay strict.

Speed: JSON is parsed and written with ``pydantic_core`` (``from_json``/``to_json``, Rust; it comes
with FastAPI, so with the ``serve`` extra) when it is importable, else with the ``json`` module. For
a 16384-float FP32 tensor that is 1.3 ms instead of 3.9 ms to parse and 0.9 ms instead of 7.9 ms to
write on the 2-core development machine; the ``json`` module's float parsing and ``repr`` dominate a
JSON request's cost in the server. Both
accept and write ``NaN``/``Infinity``/``-Infinity`` and integers of any size; ``pydantic_core`` also
refuses lone surrogates (``"\\ud800"``) and nesting deeper than 200 levels, which no valid request has.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np

try:  # see "Speed" above
    from pydantic_core import from_json as _fast_loads
    from pydantic_core import to_json as _fast_dumps
except ImportError:  # pragma: no cover - the serve extra installs it (through FastAPI)
    _fast_loads = _fast_dumps = None


def _loads(text: bytes) -> Any:
    """Parse JSON (``NaN``/``Infinity`` allowed); ValueError or RecursionError if malformed."""
    if _fast_loads is not None:
        return _fast_loads(text)
    return json.loads(text)


def _dumps(obj: Any) -> bytes:
    """Compact JSON of plain Python objects, non-finite floats written as ``NaN``/``Infinity``."""
    if _fast_dumps is not None:
        return _fast_dumps(obj, inf_nan_mode="constants")
    return json.dumps(obj, separators=(",", ":")).encode()


DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
_BY_NUMPY = {dt: name for name, dt in DATATYPES.items()}
# V2 names of kiln dtypes (DType.short) for model metadata.
_BY_SHORT = {dt.name: name for name, dt in DATATYPES.items()}
_BY_SHORT.update({"bool": "BOOL", "bfloat16": "BF16"})
_REFUSED = {
    "BYTES": "BYTES (string) tensors are not supported: kiln models take numeric tensors",
}
#: The largest ``timeout_ms`` a request may give (2**50 ms, about 35,700 years): any larger number is
#: refused as out of range rather than converted to a float that may overflow.
MAX_TIMEOUT_MS = 2 ** 50
_MAX_TIMEOUT_US = 2 ** 64 - 1  # Triton's ``timeout`` is a uint64


def _bf16() -> Optional[np.dtype]:
    """numpy's bfloat16 (ml_dtypes), or None when ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - the dev extra installs it
        return None
    return np.dtype(ml_dtypes.bfloat16)


def _datatype_name(dt: np.dtype) -> Optional[str]:
    """The V2 datatype of a numpy dtype (either byte order), or None."""
    name = _BY_NUMPY.get(dt)  # the common case first: numpy 2's dtype.name costs ~3 us (a Python property)
    if name is not None:
        return name
    if dt.name == "bfloat16":
        return "BF16"
    return _BY_NUMPY.get(dt.newbyteorder("="))


def _wire(dt: np.dtype) -> np.dtype:
    """The little-endian wire dtype of a datatype's numpy dtype."""
    return _WIRE.get(dt, dt)  # bfloat16: ml_dtypes has no byte-swapped variant; little-endian hosts only
# Wire byte order is little-endian; on little-endian hosts that is the native dtype itself.
_WIRE = {dt: dt if sys.byteorder == "little" else dt.newbyteorder("<") for dt in DATATYPES.values()}
_MAX_RANK = 32  # numpy's portable limit; far above any real model input
_NONE = object()  # "no such element" (None is a JSON value: null)


class ProtocolError(Exception):
    """A request the protocol layer refuses: ``status`` is the HTTP status (400, 413, 500)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class MalformedJson(ProtocolError):
    """The request's JSON (the whole body, or the header before the binary tensors) does not parse at all.

    A class of its own because a body sent under a Content-Type that does not say JSON (curl ``-d``'s
    ``application/x-www-form-urlencoded``) is read as JSON only if it parses: the server then answers 415,
    naming the Content-Type to send, instead of a JSON parser's message."""

    def __init__(self, message: str):
        super().__init__(400, message)


@dataclass
class RequestedOutput:
    """An output the client named, and whether it wants it as binary data."""

    name: str
    binary: bool
    shared_memory: Optional[dict] = None  # the output's parameters when it goes to a shared memory region
    written: Optional[int] = None  # bytes already written to its region (a CUDA region: by a GPU worker)


@dataclass
class InferRequest:
    """A validated inference request: every input is a numpy array of its declared shape."""

    id: Optional[str]
    inputs: dict[str, np.ndarray]
    outputs: Optional[list[RequestedOutput]] = None  # None: all outputs, each binary iff binary_default
    binary_default: bool = False  # parameters.binary_data_output
    timeout_ms: Optional[float] = None  # from parameters timeout_ms / timeout (µs); None: server default
    parameters: dict = field(default_factory=dict)  # the request's parameters object, as sent


def v2_datatype(np_dtype: Any) -> str:
    """The V2 datatype name of a numpy dtype (``"FP32"`` for float32, either byte order)."""
    if isinstance(np_dtype, np.dtype) and np_dtype in _BY_NUMPY:  # fast path, as in _datatype_name
        return _BY_NUMPY[np_dtype]
    if getattr(np_dtype, "name", np_dtype) == "bfloat16":
        return "BF16"
    try:
        dt = np.dtype(np_dtype)
    except TypeError as e:
        raise ProtocolError(500, f"dtype {np_dtype!r} has no V2 datatype") from e
    if dt.kind in "OSU":
        return "BYTES"
    name = _datatype_name(dt)
    if name is None:
        raise ProtocolError(500, f"dtype {dt} has no V2 datatype")
    return name


def tensor_metadata(spec) -> dict:
    """``{"name", "datatype", "shape"}`` of a runtime TensorSpec; symbolic/unknown dims are -1.

    A shape of unknown rank (rare for graph inputs) is reported as ``[-1]``: V2 metadata has no
    way to say "any rank".
    """
    datatype = _BY_SHORT.get(spec.dtype)
    if datatype is None:
        raise ProtocolError(500, f"tensor {spec.name!r} has dtype {spec.dtype}, which has no V2 datatype")
    shape = spec.shape
    dims = [-1] if shape is None else [d if isinstance(d, int) else -1 for d in shape]
    return {"name": spec.name, "datatype": datatype, "shape": dims}


# ---------------------------------------------------------------------------------------------
# Requests


def parse_infer_request(body: bytes, header_length: Optional[int], *, max_elements: int,
                        shared_memory: Any = None) -> InferRequest:
    """Parse and validate a V2 infer request body (see the module docstring for the rules).

    ``header_length`` is the value of the ``Inference-Header-Content-Length`` HTTP header (None
    when absent: the whole body is JSON). ``shared_memory`` is the server's region registry
    (:class:`kiln.server.shm.SystemSharedMemory`); without it, inputs and outputs naming a shared
    memory region are refused. Raises :class:`ProtocolError` for anything invalid.
    """
    if not body:
        raise ProtocolError(400, "empty request body: expected a JSON inference request")
    view = memoryview(body)
    if header_length is None:
        header = bytes(body)
        binary = view[len(body):]
    else:
        if isinstance(header_length, bool) or not isinstance(header_length, int) or header_length <= 0:
            raise ProtocolError(400, f"Inference-Header-Content-Length must be a positive integer, "
                                     f"got {header_length!r}")
        if header_length > len(body):
            raise ProtocolError(400, f"Inference-Header-Content-Length is {header_length} but the body "
                                     f"has only {len(body)} bytes")
        header = bytes(view[:header_length])
        binary = view[header_length:]

    try:
        request = _loads(header)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise MalformedJson(f"malformed JSON in request: {e}") from None
    if not isinstance(request, dict):
        raise ProtocolError(400, f"the request must be a JSON object, got {_json_type(request)}")
    return parse_request_object(request, binary, max_elements=max_elements, shared_memory=shared_memory,
                                header=header, binary_header=header_length is not None)


def parse_request_object(request: dict, binary: Any, *, max_elements: int, shared_memory: Any = None,
                         header: bytes = b"", binary_header: bool = True) -> InferRequest:
    """The checks of :func:`parse_infer_request` on a request already decoded into plain Python objects: its
    JSON header parsed (HTTP), or a gRPC ModelInferRequest turned into the same dict without any JSON
    (server/grpc_server.py ``v2_request``). One validation path, so every front end refuses a bad request
    with the same message.

    ``binary`` is the binary part: one buffer in which the binary inputs follow each other in input order,
    each taking its ``binary_data_size`` bytes and together every byte (HTTP's binary extension), or a list
    with one buffer per input, input ``i``'s being ``binary[i]`` (gRPC's ``raw_input_contents``).
    ``binary_header`` says whether the request said where its JSON ends (HTTP's
    Inference-Header-Content-Length; always so over gRPC). ``header`` is the JSON text the request was
    parsed from, searched for ``true``/``false`` when numeric data holds a 0 or a 1 (``_may_hold_bools``):
    ``b""`` where no JSON was parsed and values keep their types (gRPC's typed contents, whose field the
    caller has matched with the datatype, so a numeric input's data holds no booleans)."""
    per_input = isinstance(binary, list)
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(400, f"request 'id' must be a string, got {_json_type(request_id)}")
    params = _object(request.get("parameters"), "request 'parameters'")
    binary_default = _bool_param(params, "binary_data_output", "request parameter")
    timeout_ms = _timeout_ms(params)

    inputs_json = request.get("inputs")
    if inputs_json is None:
        raise ProtocolError(400, "the request has no 'inputs'")
    if not isinstance(inputs_json, list):
        raise ProtocolError(400, f"'inputs' must be a list, got {_json_type(inputs_json)}")

    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for i, item in enumerate(inputs_json):
        if not isinstance(item, dict):
            raise ProtocolError(400, f"inputs[{i}] must be an object, got {_json_type(item)}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ProtocolError(400, f"inputs[{i}] needs a non-empty string 'name'")
        if name in inputs:
            raise ProtocolError(400, f"input '{name}' appears more than once")
        what = f"input '{name}'"
        datatype = _datatype(item.get("datatype"), what)
        shape = _shape(item.get("shape"), what)
        in_params = _object(item.get("parameters"), f"{what} 'parameters'")
        has_data = "data" in item
        size = in_params.get("binary_data_size")
        if "shared_memory_region" in in_params:
            if shared_memory is None:
                raise ProtocolError(400, f"{what} uses shared memory, which this server does not support")
            if has_data or size is not None:
                raise ProtocolError(400, f"{what} names a shared memory region and also carries data")
            # No allocation follows from the shape (the input is a view of the region, whose size the
            # registry bounds), so the body-size cap on elements does not apply; the byte size check does.
            count = _element_count(shape, max(max_elements, shared_memory.max_bytes), what)
            inputs[name] = shared_memory.read(in_params, what, datatype, shape, count)
            continue
        for key in ("shared_memory_byte_size", "shared_memory_offset"):
            if key in in_params:
                raise ProtocolError(400, f"{what} has '{key}' but no 'shared_memory_region'")
        count = _element_count(shape, max_elements, what)
        if size is not None:
            if has_data:
                raise ProtocolError(400, f"{what} has both 'data' and a binary_data_size")
            if not binary_header:
                raise ProtocolError(400, f"{what} has a binary_data_size but the request has no "
                                         f"Inference-Header-Content-Length header")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ProtocolError(400, f"{what} binary_data_size must be a non-negative integer, "
                                         f"got {size!r}")
            if per_input:
                inputs[name] = _from_binary(memoryview(binary[i]), 0, size, shape, count, datatype, what)
            else:
                inputs[name] = _from_binary(binary, offset, size, shape, count, datatype, what)
                offset += size
        elif has_data:
            inputs[name] = _from_json(item["data"], shape, count, datatype, what, header)
        else:
            raise ProtocolError(400, f"{what} has neither 'data' nor a binary_data_size")
    if not per_input and offset != len(binary):
        raise ProtocolError(400, f"the inputs' binary_data_size values add up to {offset} bytes but "
                                 f"{len(binary)} bytes follow the JSON header")

    return InferRequest(id=request_id, inputs=inputs,
                        outputs=_requested_outputs(request, binary_default, shared_memory),
                        binary_default=binary_default, timeout_ms=timeout_ms, parameters=params)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _object(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(400, f"{what} must be an object, got {_json_type(value)}")
    return value


def _bool_param(params: dict, key: str, what: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError(400, f"{what} '{key}' must be true or false, got {value!r}")
    return value


def _timeout_ms(params: dict) -> Optional[float]:
    found = []
    ms = params.get("timeout_ms")
    if ms is not None:
        # Compared before any conversion: an int of any size compares exactly with an int, and a float is
        # checked for NaN/infinity first (both refused), so float(ms) below never overflows.
        if (isinstance(ms, bool) or not isinstance(ms, (int, float))
                or (isinstance(ms, float) and not math.isfinite(ms)) or not 0 < ms <= MAX_TIMEOUT_MS):
            raise ProtocolError(400, f"request parameter 'timeout_ms' must be a number of milliseconds "
                                     f"above 0 and at most {MAX_TIMEOUT_MS}, got {_show(ms)}")
        found.append(float(ms))
    us = params.get("timeout")
    if us is not None:
        if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us <= _MAX_TIMEOUT_US:
            raise ProtocolError(400, f"request parameter 'timeout' must be an integer number of "
                                     f"microseconds from 0 to 2**64-1, got {_show(us)}")
        if us > 0:  # Triton: 0 means no timeout requested
            found.append(us / 1000.0)
    return min(found) if found else None


def _datatype(value: Any, what: str) -> np.dtype:
    if not isinstance(value, str):
        raise ProtocolError(400, f"{what} needs a string 'datatype'")
    dt = DATATYPES.get(value)
    if dt is None and value == "BF16":
        dt = _bf16()
        if dt is None:
            raise ProtocolError(400, f"{what}: BF16 tensors need the ml_dtypes package on the server")
    if dt is None:
        if value in _REFUSED:
            raise ProtocolError(400, f"{what}: {_REFUSED[value]}")
        raise ProtocolError(400, f"{what} has unknown datatype {value!r}; expected one of "
                                 f"{', '.join(DATATYPES)}")
    return dt


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ProtocolError(400, f"{what} needs a 'shape' list")
    if len(value) > _MAX_RANK:
        raise ProtocolError(400, f"{what} has rank {len(value)}; at most {_MAX_RANK} dims are supported")
    for d in value:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ProtocolError(400, f"{what} shape {value} must be non-negative integers")
    return tuple(value)


def _element_count(shape: tuple[int, ...], max_elements: int, what: str) -> int:
    # Every dim is capped too, so that a zero elsewhere cannot smuggle in a dim numpy rejects.
    count = 0 if 0 in shape else 1
    for d in shape:
        count *= d
        if count > max_elements or d > max_elements:  # stop early: never multiply out an absurd shape
            raise ProtocolError(413, f"{what} declares shape {_short_list(shape)}, over this server's "
                                     f"limit of {max_elements} elements per input")
    return count


def _short_list(shape: tuple[int, ...]) -> str:
    return str(list(shape)) if len(shape) <= 8 else "[" + ", ".join(map(str, shape[:8])) + ", ...]"


def _from_binary(binary: memoryview, offset: int, size: int, shape: tuple[int, ...], count: int,
                 dt: np.dtype, what: str) -> np.ndarray:
    expected = count * dt.itemsize
    if size != expected:
        raise ProtocolError(400, f"{what} binary_data_size is {size} bytes but shape {_short_list(shape)} "
                                 f"of {_datatype_name(dt)} needs {expected}")
    if offset + size > len(binary):
        raise ProtocolError(400, f"{what} binary data ends at byte {offset + size} of the binary part "
                                 f"but only {len(binary)} bytes follow the JSON header")
    raw = binary[offset:offset + size]
    if dt.kind == "b":
        octets = np.frombuffer(raw, dtype=np.uint8)
        if count and octets.max() > 1:
            raise ProtocolError(400, f"{what} BOOL binary data must be bytes 0 or 1")
    arr = np.frombuffer(raw, dtype=_wire(dt)).reshape(shape)
    if not arr.flags.aligned or not arr.dtype.isnative:  # a misaligned view or a big-endian host
        arr = arr.astype(dt)
    return arr


def _from_json(data: Any, shape: tuple[int, ...], count: int, dt: np.dtype, what: str,
               header: bytes) -> np.ndarray:
    if not isinstance(data, list):
        raise ProtocolError(400, f"{what} 'data' must be a list, got {_json_type(data)}")
    if count == 0:
        if next(_leaves(data), _NONE) is not _NONE:
            raise ProtocolError(400, f"{what} has shape {list(shape)} (no elements) but 'data' has values")
        return np.empty(shape, dtype=dt)
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError, RecursionError):
        raise ProtocolError(400, f"{what} 'data' is a ragged nested list; it must be flat or "
                                 f"nested to shape {list(shape)}") from None
    if arr.ndim != 1 and arr.shape != shape:
        raise ProtocolError(400, f"{what} 'data' is nested as {list(arr.shape)}, which is not its "
                                 f"shape {list(shape)} (send it flat or nested to the shape)")
    if arr.size != count:
        raise ProtocolError(400, f"{what} has {arr.size} data values but shape {list(shape)} needs {count}")

    kind = arr.dtype.kind
    datatype = _datatype_name(dt)
    if dt.kind == "b":
        if kind != "b":
            bad = next((v for v in _leaves(data) if not isinstance(v, bool)), _NONE)
            raise ProtocolError(400, f"{what} is BOOL: its data must be true or false, got {_show(bad)}")
        return arr.reshape(shape)
    if kind == "b" or (kind in "iuf" and _may_hold_bools(arr, header)
                       and any(isinstance(v, bool) for v in _leaves(data))):
        raise ProtocolError(400, f"{what} is {datatype}: its data must be numbers, not true/false")
    if dt.kind in "iu":
        if kind in "iu":
            info = np.iinfo(dt)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                bad = lo if lo < info.min else hi
                raise ProtocolError(400, f"{what}: value {bad} is out of range for {datatype}")
            return arr.astype(dt).reshape(shape)
        # numpy fell back to float64 or objects: either a bad value, or valid ints past int64 mixed
        # with others (UINT64 data such as [1, 2**64 - 1]); settle it value by value.
        problem = _bad_int(data, dt, datatype)
        if problem:
            raise ProtocolError(400, f"{what}: {problem}")
        return np.array(list(_leaves(data)), dtype=dt).reshape(shape)
    # float datatypes
    if kind not in "iuf":
        bad = next((v for v in _leaves(data) if isinstance(v, bool) or not isinstance(v, (int, float))),
                   _NONE)
        if bad is not _NONE:
            raise ProtocolError(400, f"{what} is {datatype}: its data must be numbers, got {_show(bad)}")
        arr = _huge_ints_to_float(data, what, datatype)  # numbers numpy kept as objects: ints past 64 bits
    with np.errstate(over="ignore"):
        out = arr.astype(dt)
    if not np.isfinite(out).all() and (np.isfinite(arr) & ~np.isfinite(out)).any():
        raise ProtocolError(400, f"{what}: a value is out of range for {datatype}")
    return out.reshape(shape)


def _may_hold_bools(arr: np.ndarray, header: bytes) -> bool:
    """Could numeric ``arr`` hide JSON true/false? numpy turns ``[true, 2]`` into ``[1, 2]`` silently.
    Only a 0 or a 1 can come from a bool, and only a header that spells true/false holds one; the
    value test goes first because it is a vector op, while searching a large header is not free."""
    return bool(((arr == 0) | (arr == 1)).any()) and (b"true" in header or b"false" in header)


def _huge_ints_to_float(data: list, what: str, datatype: str) -> np.ndarray:
    try:
        return np.asarray([float(v) for v in _leaves(data)], dtype=np.float64)
    except OverflowError:
        raise ProtocolError(400, f"{what}: a value is out of range for {datatype}") from None


def _bad_int(data: list, dt: np.dtype, datatype: str) -> Optional[str]:
    """Why integer data must be refused, naming the first bad value; None if it is all valid."""
    info = np.iinfo(dt)
    for v in _leaves(data):
        if isinstance(v, bool):
            return f"{datatype} data must be integers, not {str(v).lower()}"
        if isinstance(v, int):
            if not info.min <= v <= info.max:
                return f"value {v} is out of range for {datatype}"
        elif isinstance(v, float):
            return f"{datatype} data must be JSON integers, got {_show(v)}"
        else:
            return f"{datatype} data must be integers, got {_show(v)}"
    return None


def _leaves(data: Any) -> Iterator[Any]:
    """The scalars of a nested list in row-major order."""
    if isinstance(data, list):
        for item in data:
            if isinstance(item, list):
                yield from _leaves(item)
            else:
                yield item
    else:
        yield data


def _show(value: Any) -> str:
    """A JSON value as the client wrote it (true, null, "a"), for error messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # pragma: no cover - parsed JSON always dumps
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _requested_outputs(request: dict, binary_default: bool,
                       shared_memory: Any = None) -> Optional[list[RequestedOutput]]:
    outputs_json = request.get("outputs")
    if outputs_json is None:
        return None
    if not isinstance(outputs_json, list):
        raise ProtocolError(400, f"'outputs' must be a list, got {_json_type(outputs_json)}")
    if not outputs_json:
        return None  # as if absent: all outputs
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for i, item in enumerate(outputs_json):
        if not isinstance(item, dict):
            raise ProtocolError(400, f"outputs[{i}] must be an object, got {_json_type(item)}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ProtocolError(400, f"outputs[{i}] needs a non-empty string 'name'")
        if name in seen:
            raise ProtocolError(400, f"output '{name}' is requested more than once")
        seen.add(name)
        params = _object(item.get("parameters"), f"output '{name}' 'parameters'")
        shm_params = None
        if "shared_memory_region" in params:
            if shared_memory is None:
                raise ProtocolError(400, f"output '{name}' asks for shared memory, which this server does "
                                         f"not support")
            shared_memory.check(params, f"output '{name}'")  # unknown region or out of bounds: 400 now
            shm_params = {k: params[k] for k in ("shared_memory_region", "shared_memory_byte_size",
                                                 "shared_memory_offset") if k in params}
        else:
            for key in ("shared_memory_byte_size", "shared_memory_offset"):
                if key in params:
                    raise ProtocolError(400, f"output '{name}' has '{key}' but no 'shared_memory_region'")
        if params.get("classification", 0) not in (0, None):
            raise ProtocolError(400, f"output '{name}' asks for classification, which this server does "
                                     f"not support")
        binary = params.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise ProtocolError(400, f"output '{name}' parameter 'binary_data' must be true or false, "
                                     f"got {binary!r}")
        outputs.append(RequestedOutput(name, binary and shm_params is None, shm_params))
    return outputs


# ---------------------------------------------------------------------------------------------
# Responses


def encode_infer_response(model_name: str, model_version: str, request_id: Optional[str],
                          outputs: dict[str, np.ndarray], requested: Optional[list[RequestedOutput]],
                          binary_default: bool, shared_memory: Any = None) -> tuple[bytes, dict[str, str]]:
    """Encode outputs as a V2 response body; returns ``(body, headers)``.

    ``requested`` None sends every output (in dict order), binary iff ``binary_default``;
    otherwise the requested outputs in request order with their own binary flags. An output
    requested into a shared memory region is written there through ``shared_memory`` (the
    registry) and its entry carries no data, only ``parameters.shared_memory_*`` (the byte size
    written). Headers hold ``Content-Type`` and, when any output is binary,
    ``Inference-Header-Content-Length``.
    """
    chosen = ([RequestedOutput(name, binary_default) for name in outputs] if requested is None
              else requested)
    entries = []
    buffers: list[Any] = []
    for req in chosen:
        if req.name not in outputs:
            raise ProtocolError(400, f"output '{req.name}' is not an output of model '{model_name}'")
        arr = np.asarray(outputs[req.name])
        datatype = _datatype_name(arr.dtype)
        if datatype is None:
            raise ProtocolError(500, f"output '{req.name}' has dtype {arr.dtype}, which this protocol "
                                     f"cannot send")
        entry: dict[str, Any] = {"name": req.name, "datatype": datatype, "shape": list(arr.shape)}
        if req.shared_memory is not None:
            if shared_memory is None:
                raise ProtocolError(400, f"output '{req.name}' asks for shared memory, which this server "
                                         f"does not support")
            written = req.written if req.written is not None else shared_memory.write(
                req.shared_memory, f"output '{req.name}'", np.asarray(arr, dtype=_wire(arr.dtype.newbyteorder("="))))
            entry["parameters"] = {**req.shared_memory, "shared_memory_byte_size": written}
        elif req.binary:
            data = np.ascontiguousarray(arr, dtype=_wire(arr.dtype.newbyteorder("=")))
            raw = memoryview(data.reshape(-1).view(np.uint8)) if data.size else b""
            entry["parameters"] = {"binary_data_size": data.nbytes}
            buffers.append(raw)
        elif datatype == "BF16":  # every bfloat16 is exactly a float32 (and its shortest repr reads back)
            entry["data"] = arr.astype(np.float32).reshape(-1).tolist()
        else:
            entry["data"] = arr.reshape(-1).tolist()
        entries.append(entry)

    response: dict[str, Any] = {"model_name": model_name, "model_version": str(model_version)}
    if request_id is not None:
        response["id"] = request_id
    response["outputs"] = entries
    header = _dumps(response)
    if not buffers:
        return header, {"Content-Type": "application/json"}
    body = b"".join([header, *buffers])
    return body, {"Content-Type": "application/octet-stream",
                  "Inference-Header-Content-Length": str(len(header))}
