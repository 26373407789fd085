"""The gRPC face of ``kiln serve``: Triton's ``inference.GRPCInferenceService`` (what ``tritonclient.grpc``
calls; a superset of KServe's ``grpc_predict_v2.proto``) on the same request path as the HTTP routes.

RPCs: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig, ModelStatistics,
RepositoryIndex, ModelInfer and ModelStreamInfer. The shared-memory, repository load/unload, trace and log
RPCs answer UNIMPLEMENTED naming themselves (use the HTTP routes for shared memory).

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
- **One request path.** A ModelInferRequest is turned into the V2 request the HTTP binary extension
  would carry (a JSON header naming each input's ``binary_data_size``, then ``raw_input_contents``; typed
  ``contents`` become the JSON ``data``) and parsed by :func:`kiln.server.protocol.parse_infer_request`;
  the checks against the model, the deadline, the batcher and the error mapping are
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
import json
import logging
import time
from typing import Any, Optional

import grpc
import numpy as np
from google.protobuf import json_format

from kiln.errors import KilnError
from kiln.server import protocol
from kiln.server.app import _OFFLOAD_BYTES, ApiError, _index_entry, _model_not_ready_reason, admit, run_infer, \
    triton_model_config
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
    request: raw contents as the binary extension, typed contents as JSON ``data``."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ApiError(400, f"the request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents: "
                            "give raw contents for every input or for none")
    inputs = []
    for i, t in enumerate(request.inputs):
        item: dict = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        params = _params(t.parameters)
        if raw:
            if t.HasField("contents"):
                raise ApiError(400, f"input '{t.name}' has both contents and raw_input_contents; give one")
            params["binary_data_size"] = len(raw[i])
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
    body: dict = {"inputs": inputs}
    if request.id:
        body["id"] = request.id
    params = _params(request.parameters)
    if params:
        body["parameters"] = params
    if request.outputs:
        body["outputs"] = [{"name": o.name, **({"parameters": _params(o.parameters)} if o.parameters else {})}
                           for o in request.outputs]
    header = protocol._dumps(body)
    if not raw:
        return header, None
    return b"".join([header, *raw]), len(header)


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
            body, header_length = to_v2_body(request)
            try:
                if len(body) > _OFFLOAD_BYTES and not request.raw_input_contents:
                    req = await asyncio.to_thread(protocol.parse_infer_request, body, header_length,
                                                  max_elements=state.max_body_bytes, shared_memory=state.shared)
                else:
                    req = protocol.parse_infer_request(body, header_length, max_elements=state.max_body_bytes,
                                                       shared_memory=state.shared)
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
            state.metrics.observe_request(model.name, model.version, e.outcome, time.perf_counter() - started)
            raise
        state.metrics.observe_codec(model.name, model.version, decode_s, time.perf_counter() - encode_started)
        state.metrics.observe_request(model.name, model.version, "success", time.perf_counter() - started)
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

    # ------------------------------------------------------------------ not served over gRPC
    async def _unimplemented(self, context, what: str):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{what} is not implemented by kiln serve's gRPC "
                                                           "endpoint (the HTTP endpoint has the shared memory routes)")

    async def SystemSharedMemoryStatus(self, request, context):
        await self._unimplemented(context, "SystemSharedMemoryStatus")

    async def SystemSharedMemoryRegister(self, request, context):
        await self._unimplemented(context, "SystemSharedMemoryRegister")

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._unimplemented(context, "SystemSharedMemoryUnregister")

    async def CudaSharedMemoryStatus(self, request, context):
        await self._unimplemented(context, "CudaSharedMemoryStatus")

    async def CudaSharedMemoryRegister(self, request, context):
        await self._unimplemented(context, "CudaSharedMemoryRegister")

    async def CudaSharedMemoryUnregister(self, request, context):
        await self._unimplemented(context, "CudaSharedMemoryUnregister")

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
        await self.server.start()
        return port

    async def stop(self, grace: float) -> None:
        """Refuse new RPCs, end open streams once what they read is answered, wait for the rest."""
        if self.server is None:
            return
        self.closing.set()
        await self.server.stop(grace)
