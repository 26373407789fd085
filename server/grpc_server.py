"""The gRPC face of ``kiln serve``: Triton's ``inference.GRPCInferenceService`` (what ``tritonclient.grpc``
calls; a superset of KServe's ``grpc_predict_v2.proto``) on the same request path as the HTTP routes.

RPCs: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig, ModelStatistics,
RepositoryIndex, ModelInfer, ModelStreamInfer, and the system and CUDA shared memory Register/Unregister/
Status (on the HTTP app's own registries, so a region registered over one protocol serves requests over
the other; inputs and outputs name regions with the same ``shared_memory_*`` parameters as over HTTP). The
repository load/unload, trace and log RPCs answer UNIMPLEMENTED naming themselves.

Design decisions, and why:

- **Stubs: the ones tritonclient ships** (``tritonclient.grpc.service_pb2``/``service_pb2_grpc``/
  ``model_config_pb2``), not code generated here from vendored .proto files. (1) They are generated from
  the very .proto files tritonclient's client sends, so the wire format matches the reference client by
  construction. (2) protobuf's generated code checks the protobuf runtime's version at import;
  tritonclient pins a protobuf its stubs accept, where stubs generated here with one grpcio-tools would
  break on the next protobuf major. (3) A process that imports both kiln's server and tritonclient (a test,
  a Ray Serve replica that also calls Triton) would get two definitions of ``inference.*`` in protobuf's
  one descriptor pool, which protobuf refuses at import. The cost is a client package
  (``tritonclient[grpc]``, small, pure Python plus numpy) as a dependency of the ``serve`` extra.
- **In the HTTP process, on its event loop** (grpc.aio), started and stopped by ``kiln serve`` next to
  uvicorn (server/cli.py): the models, batchers, workers, metrics and limits are the HTTP app's own
  objects (``app.state.kiln``), so there is one queue per model and one drain. A sibling process would
  need a second copy of every batcher or an extra hop to the first.
- **One request path.** A ModelInferRequest's fields become the request object HTTP's JSON header would
  hold (each raw input as a ``binary_data_size`` over ``raw_input_contents``, read as zero-copy numpy
  views, never joined; typed ``contents`` become its ``data``) and are checked by
  :func:`kiln.server.protocol.parse_request_object`, the function HTTP's body goes through after its JSON
  is read; the checks against the model, the deadline, the batcher and the error mapping are
  :func:`kiln.server.app.run_infer`, the HTTP route's own. So every bad input is refused with the message
  HTTP gives, and the HTTP status maps to a gRPC code: 400/415 INVALID_ARGUMENT, 404 NOT_FOUND, 413
  RESOURCE_EXHAUSTED (also grpc's own refusal of a message over ``--max-body-mb``), 503 UNAVAILABLE, 504
  DEADLINE_EXCEEDED, 500 INTERNAL. The client's gRPC deadline lowers the request's deadline like
  Triton's ``timeout`` parameter.
- **Outputs go back as ``raw_output_contents``** (little-endian, row major), one per output in the
  order of ``outputs``, which is what ``tritonclient.grpc``'s ``InferResult.as_numpy`` reads.
- **ModelStreamInfer** answers each request with one ModelStreamInferResponse, in request order; a
  request that fails gets ``error_message`` (and an ``infer_response`` carrying only its id and model),
  and the stream goes on, as Triton does. At most :data:`STREAM_IN_FLIGHT` requests of one stream are
  in the batcher at once: past that the stream stops reading, so gRPC's flow control slows the client
  instead of the stream filling the model's queue.
- **Drain.** On SIGTERM readiness turns false and new requests get UNAVAILABLE (the HTTP app's drain);
  :meth:`GrpcServer.stop` then refuses new RPCs, lets each open stream answer what it has read, ends
  it with UNAVAILABLE ("server is shutting down"), and waits for running RPCs (at most ``grace``).
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import Any, Optional

import grpc
import numpy as np
from google.protobuf import json_format

from kiln.errors import KilnError
from kiln.server import protocol
from kiln.server.app import _OFFLOAD_BYTES, ApiError, _close_cuda_regions, _index_entry, _model_not_ready_reason, \
    _shm_call, admit, register_cuda_region, register_system_region, run_infer, triton_model_config
from kiln.version import __version__

try:  # tritonclient >= 2.41 names them service_pb2; older ones grpc_service_pb2
    from tritonclient.grpc import model_config_pb2, service_pb2 as pb, service_pb2_grpc as pb_grpc
except ImportError:  # pragma: no cover - older tritonclient
    from tritonclient.grpc import grpc_service_pb2 as pb, grpc_service_pb2_grpc as pb_grpc, model_config_pb2

log = logging.getLogger("kiln.server")

#: The port ``kiln serve`` listens on for gRPC unless told otherwise (Triton's).
DEFAULT_GRPC_PORT = 8001
#: Requests of one stream in the batcher at once; past this the stream stops reading (flow control).
STREAM_IN_FLIGHT = 256

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          415: grpc.StatusCode.INVALID_ARGUMENT, 500: grpc.StatusCode.INTERNAL,
          501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE,
          504: grpc.StatusCode.DEADLINE_EXCEEDED}

#: The typed ``contents`` field of each datatype (FP16 and BF16 have none: raw_input_contents only).
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def code_of(status: int) -> grpc.StatusCode:
    """The gRPC status code of an HTTP status."""
    return _CODES.get(status, grpc.StatusCode.INTERNAL if status >= 500 else grpc.StatusCode.INVALID_ARGUMENT)


def _param_value(p: Any) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def _params(params: Any) -> dict:
    return {k: _param_value(v) for k, v in params.items()}


def to_v2_body(request: Any) -> tuple[bytes, Optional[int]]:
    """A ModelInferRequest as the V2 HTTP body (and Inference-Header-Content-Length) carrying the same
    request: raw contents as the binary extension, typed contents as JSON ``data``. (The server parses
    :func:`v2_request`'s objects directly; this is their HTTP spelling, for tests and tools.)"""
    body, parts = v2_request(request)
    header = protocol._dumps(body)
    if parts is None:
        return header, None
    return b"".join([header, *(p for p in parts if p is not None)]), len(header)


def v2_request(request: Any) -> tuple[dict, Optional[list]]:
    """A ModelInferRequest as the V2 request object its HTTP body's JSON would parse to (raw contents named
    by ``binary_data_size``, typed contents as ``data``), and its raw contents, one per input in input order
    (None for an input in shared memory), or None when it has none: what
    :func:`protocol.parse_request_object` checks, with no JSON written or parsed and no bytes copied."""
    raw = request.raw_input_contents
    # An input in shared memory has no raw contents: raw_input_contents belong, in order, to the other
    # inputs (what tritonclient sends, and how Triton reads them).
    n_shm = sum("shared_memory_region" in t.parameters for t in request.inputs)
    n_raw = len(request.inputs) - n_shm
    if raw and len(raw) != n_raw:
        raise ApiError(400, f"the request has {n_raw} inputs{' not in shared memory' if n_shm else ''} but "
                            f"{len(raw)} raw_input_contents: give raw contents for every such input or for none")
    inputs, parts, k = [], [], 0
    for t in request.inputs:
        item: dict = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        params = _params(t.parameters)
        part = None
        if raw and "shared_memory_region" not in params:
            if t.HasField("contents"):
                raise ApiError(400, f"input '{t.name}' has both contents and raw_input_contents; give one")
            part = raw[k]  # one bytes object (each access to the repeated field makes a new one)
            params["binary_data_size"] = len(part)
            k += 1
        elif t.HasField("contents"):
            field = _CONTENTS.get(t.datatype)
            given = [f.name for f, _ in t.contents.ListFields()]
            if field is None:
                if t.datatype in protocol.DATATYPES or t.datatype == "BF16":
                    raise ApiError(400, f"input '{t.name}' is {t.datatype}, which has no typed contents field: "
                                        "send it in raw_input_contents")
                item["data"] = []  # an unknown datatype: the parser names it
            elif any(g != field for g in given):
                raise ApiError(400, f"input '{t.name}' is {t.datatype}: its contents go in {field}, got "
                                    f"{', '.join(given)}")
            else:
                item["data"] = list(getattr(t.contents, field))
        if params:
            item["parameters"] = params
        inputs.append(item)
        parts.append(part)
    body: dict = {"inputs": inputs}
    if request.id:
        body["id"] = request.id
    params = _params(request.parameters)
    if params:
        body["parameters"] = params
    if request.outputs:
        body["outputs"] = [{"name": o.name, **({"parameters": _params(o.parameters)} if o.parameters else {})}
                           for o in request.outputs]
    return body, parts if raw else None


def _parse(request: Any, state: Any) -> protocol.InferRequest:
    """A ModelInferRequest parsed and checked as HTTP's body would be (one validation path, HTTP's
    messages), straight from the message: no V2 JSON written and parsed again, raw contents never joined.
    ProtocolError or ApiError if refused."""
    body, parts = v2_request(request)
    return protocol.parse_request_object(body, b"" if parts is None else parts, max_elements=state.max_body_bytes,
                                         shared_memory=state.shared, binary_header=parts is not None)


def encode_response(model: Any, request_id: str, outputs: dict, requested: Any, shared: Any) -> Any:
    """A ModelInferResponse: each output's metadata and its raw little-endian bytes, in output order (an
    output written to a shared memory region has empty contents and its region's parameters)."""
    resp = pb.ModelInferResponse(model_name=model.name, model_version=str(model.version), id=request_id)
    shm = {o.name: o for o in requested or () if o.shared_memory is not None}
    for name, value in outputs.items():
        arr = np.asarray(value)
        out = resp.outputs.add(name=name, datatype=protocol.v2_datatype(arr.dtype), shape=arr.shape)
        wire = protocol._wire(arr.dtype.newbyteorder("="))
        if name in shm:
            o = shm[name]
            written = o.written if o.written is not None else shared.write(
                o.shared_memory, f"output '{name}'", np.asarray(arr, dtype=wire))
            for k, v in {**o.shared_memory, "shared_memory_byte_size": written}.items():
                if isinstance(v, str):
                    out.parameters[k].string_param = v
                else:
                    out.parameters[k].int64_param = int(v)
            resp.raw_output_contents.append(b"")
        else:
            resp.raw_output_contents.append(np.ascontiguousarray(arr, dtype=wire).tobytes())
    return resp


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    """The RPCs, on the HTTP app's :class:`~kiln.server.app.ServerState`."""

    def __init__(self, state: Any, closing: asyncio.Event):
        self.state = state
        self.closing = closing

    # ------------------------------------------------------------------ helpers
    async def _call(self, context: Any, fn: Any, *args: Any) -> Any:
        try:
            return await fn(*args)
        except ApiError as e:
            await context.abort(code_of(e.status), e.message)

    def _resolve(self, name: str, version: str) -> Any:
        return self.state.resolve(name, version or None)

    def _loaded(self, name: str, version: str) -> Any:
        model = self._resolve(name, version)
        if not model.loaded:
            raise ApiError(503, _model_not_ready_reason(self.state, model))
        return model

    # ------------------------------------------------------------------ health and metadata
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, context):
        async def run():
            model = self._resolve(request.name, request.version)
            return pb.ModelReadyResponse(ready=bool(model.ready and not self.state.draining))
        return await self._call(context, run)

    async def ServerMetadata(self, request, context):
        extensions = ["binary_tensor_data", "model_configuration", "statistics", "model_repository"]
        if self.state.shm.enabled:  # as the HTTP app's GET /v2
            extensions.append("system_shared_memory")
            if self.state.cuda_shm.devices:
                extensions.append("cuda_shared_memory")
        return pb.ServerMetadataResponse(name="kiln", version=__version__, extensions=extensions)

    async def ModelMetadata(self, request, context):
        async def run():
            model = self._loaded(request.name, request.version)
            ex = model.executor
            return pb.ModelMetadataResponse(
                name=model.name, versions=sorted(self.state.models[model.name], key=int),
                platform=model.entry.config.backend,
                inputs=[pb.ModelMetadataResponse.TensorMetadata(**protocol.tensor_metadata(s)) for s in ex.inputs],
                outputs=[pb.ModelMetadataResponse.TensorMetadata(**protocol.tensor_metadata(s))
                         for s in ex.outputs])
        return await self._call(context, run)

    async def ModelConfig(self, request, context):
        async def run():
            body = triton_model_config(self._loaded(request.name, request.version))
            config = json_format.ParseDict(body, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
            config.parameters["kiln"].string_value = json.dumps(body["kiln"])
            return pb.ModelConfigResponse(config=config)
        return await self._call(context, run)

    async def ModelStatistics(self, request, context):
        async def run():
            state = self.state
            if not request.name:
                chosen = state.served()
            elif not request.version:
                state.resolve(request.name, None)
                chosen = [state.models[request.name][v] for v in sorted(state.models[request.name], key=int)]
            else:
                chosen = [state.resolve(request.name, request.version)]
            body = {"model_stats": [state.metrics.model_stats(m.name, m.version) for m in chosen]}
            return json_format.ParseDict(body, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)
        return await self._call(context, run)

    async def RepositoryIndex(self, request, context):
        state = self.state
        index = [_index_entry(state, m) for name in sorted(state.models)
                 for m in (state.models[name][v] for v in sorted(state.models[name], key=int))]
        if request.ready:
            index = [e for e in index if e["state"] == "READY"]
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in index])

    # ------------------------------------------------------------------ inference
    async def infer(self, request: Any, deadline_s: Optional[float]) -> Any:
        """One ModelInferRequest answered, or ApiError: the HTTP route's path after the transport."""
        state = self.state
        model = state.resolve(request.model_name, request.model_version or None)
        started = time.perf_counter()
        try:
            admit(state, model)
            try:
                # Only large typed contents are worth a thread (a Python list per input to check and convert):
                # raw contents become zero-copy numpy views of the message's bytes.
                if not request.raw_input_contents and request.ByteSize() > _OFFLOAD_BYTES:
                    req = await asyncio.to_thread(_parse, request, state)
                else:
                    req = _parse(request, state)
            except protocol.ProtocolError as e:
                raise ApiError(e.status, e.message) from None
            decode_s = time.perf_counter() - started
            outputs = await run_infer(state, model, req, None if deadline_s is None else deadline_s * 1000.0)
            encode_started = time.perf_counter()
            try:
                resp = encode_response(model, request.id, outputs, req.outputs, state.shared)
            except protocol.ProtocolError as e:
                raise ApiError(e.status, f"cannot encode the response: {e.message}",
                               outcome="backend" if e.status >= 500 else "invalid_request") from None
        except ApiError as e:
            state.metrics.observe_request(model.name, model.version, e.outcome, time.perf_counter() - started,
                                          "grpc")
            raise
        state.metrics.observe_codec(model.name, model.version, decode_s, time.perf_counter() - encode_started)
        state.metrics.observe_request(model.name, model.version, "success", time.perf_counter() - started, "grpc")
        return resp

    async def ModelInfer(self, request, context):
        try:
            return await self.infer(request, context.time_remaining())
        except ApiError as e:
            await context.abort(code_of(e.status), e.message)
        except Exception as e:  # noqa: BLE001 - answered INTERNAL, logged with its traceback
            log.exception("gRPC inference on model %s failed", request.model_name)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    async def _stream_one(self, request: Any) -> Any:
        try:
            return pb.ModelStreamInferResponse(infer_response=await self.infer(request, None))
        except ApiError as e:
            message = e.message
        except Exception as e:  # noqa: BLE001 - answered in the stream, logged with its traceback
            log.exception("gRPC stream inference on model %s failed", request.model_name)
            message = f"internal error: {type(e).__name__}: {e}"
        return pb.ModelStreamInferResponse(
            error_message=message,
            infer_response=pb.ModelInferResponse(model_name=request.model_name,
                                                 model_version=request.model_version, id=request.id))

    async def ModelStreamInfer(self, request_iterator, context):
        answers: asyncio.Queue = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await slots.acquire()
                    task = asyncio.ensure_future(self._stream_one(request))
                    task.add_done_callback(lambda _: slots.release())
                    answers.put_nowait(task)
            finally:
                answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            while True:
                if answers.empty() and self.closing.is_set():
                    break
                nxt = asyncio.ensure_future(answers.get())
                await asyncio.wait([nxt, closing], return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # closing, and nothing read is unanswered
                    nxt.cancel()
                    break
                task = nxt.result()
                if task is None:  # the client closed its side: every request is answered
                    return
                yield await task
            # The server is stopping: stop reading, answer what was read, then end the stream.
            reader.cancel()
            while not answers.empty():
                task = answers.get_nowait()
                if task is not None:
                    yield await task
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        finally:
            reader.cancel()
            closing.cancel()

    # ------------------------------------------------------------------ shared memory
    # The HTTP app's own registries (state.shm: server/shm.py, state.cuda_shm: server/cuda_shm.py), through
    # the functions its routes call: a region registered over one protocol is named in requests over the
    # other, refusals carry HTTP's messages (400 -> INVALID_ARGUMENT), and an empty name means every region,
    # as in Triton. Without client shm allowed, or (CUDA) without a model on a GPU, register is refused
    # saying so and status lists nothing, as over HTTP.
    async def _shm_status(self, registry, name: str, response, context):
        async def run():
            regions = _shm_call(registry.status, name) if name else registry.status()
            return response(regions={r["name"]: response.RegionStatus(**r) for r in regions})
        return await self._call(context, run)

    async def SystemSharedMemoryStatus(self, request, context):
        return await self._shm_status(self.state.shm, request.name, pb.SystemSharedMemoryStatusResponse, context)

    async def SystemSharedMemoryRegister(self, request, context):
        async def run():
            register_system_region(self.state, request.name, {"key": request.key, "offset": request.offset,
                                                              "byte_size": request.byte_size})
            return pb.SystemSharedMemoryRegisterResponse()
        return await self._call(context, run)

    async def SystemSharedMemoryUnregister(self, request, context):
        self.state.shm.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        return await self._shm_status(self.state.cuda_shm, request.name, pb.CudaSharedMemoryStatusResponse,
                                      context)

    async def CudaSharedMemoryRegister(self, request, context):
        async def run():  # the raw 64-byte handle, as HTTP's JSON carries it (base64)
            handle = base64.b64encode(request.raw_handle).decode("ascii")
            register_cuda_region(self.state, request.name, {"raw_handle": {"b64": handle},
                                                            "device_id": request.device_id,
                                                            "byte_size": request.byte_size})
            return pb.CudaSharedMemoryRegisterResponse()
        return await self._call(context, run)

    async def CudaSharedMemoryUnregister(self, request, context):
        await _close_cuda_regions(self.state, self.state.cuda_shm.unregister(request.name or None))
        return pb.CudaSharedMemoryUnregisterResponse()

    # ------------------------------------------------------------------ not served over gRPC
    async def _unimplemented(self, context, what: str):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{what} is not implemented by kiln serve's gRPC "
                                                           "endpoint")

    async def RepositoryModelLoad(self, request, context):
        await self._unimplemented(context, "RepositoryModelLoad")

    async def RepositoryModelUnload(self, request, context):
        await self._unimplemented(context, "RepositoryModelUnload")

    async def TraceSetting(self, request, context):
        await self._unimplemented(context, "TraceSetting")

    async def LogSettings(self, request, context):
        await self._unimplemented(context, "LogSettings")


class GrpcServer:
    """grpc.aio's server for ``state`` (the HTTP app's ServerState), on the running event loop."""

    def __init__(self, state: Any, host: str, port: int, max_message_bytes: int):
        self.state, self.host, self.port, self.max_message_bytes = state, host, port, max_message_bytes
        self.server: Any = None
        self.closing: Optional[asyncio.Event] = None

    @property
    def address(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind and start; returns the port (the one picked for port 0). KilnError if the port is taken."""
        self.closing = asyncio.Event()
        self.server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),  # else a second server on the same port silently shares it
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", -1),
        ])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(self.state, self.closing), self.server)
        where = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            port = self.server.add_insecure_port(where)
        except RuntimeError:
            port = 0
        if not port:
            raise KilnError(f"cannot listen for gRPC on {where} (is the port in use? pick another with "
                            "--grpc-port, or --no-grpc)")
        self.port = port
        self.state.metrics.add_protocol("grpc")  # kiln_request_duration_seconds{protocol="grpc"} at zero
        await self.server.start()
        return port

    async def stop(self, grace: float) -> None:
        """Refuse new RPCs, end open streams once what they read is answered, wait for the rest."""
        if self.server is None:
            return
        self.closing.set()
        await self.server.stop(grace)
