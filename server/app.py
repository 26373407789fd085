"""The HTTP face of ``kiln serve``: the KServe/Triton Open Inference Protocol (V2) over FastAPI.

:func:`create_app` turns a list of :class:`~kiln.server.repository.ModelEntry` into an ASGI app. Routes:

=======================================================  ===============================================
``GET  /v2/health/live``                                 200 while the process serves HTTP at all
``GET  /v2/health/ready``                                200 once every model is loaded, 503 while loading,
                                                         after a load failure, and while draining
``GET  /v2``                                             server metadata (name, version, extensions)
``GET  /v2/models/{m}[/versions/{v}]``                   model metadata; symbolic dims are -1
``GET  /v2/models/{m}[/versions/{v}]/ready``             200 ready, 503 not (yet / any more) ready
``GET  /v2/models/{m}[/versions/{v}]/config``            Triton's model configuration (name, platform, backend,
                                                         max_batch_size, input/output with TYPE_* data_type
                                                         and dims, dynamic_batching, instance_group); kiln's
                                                         own config and batching decision (stacked or not, and
                                                         why: the op and module path) under ``"kiln"``
``GET  /v2/models[/{m}[/versions/{v}]]/stats``           Triton's statistics extension (``model_stats``)
``POST /v2/repository/index``                            Triton's repository index: every served version with
                                                         its state (READY, LOADING, UNAVAILABLE, UNLOADING)
``POST /v2/models/{m}[/versions/{v}]/infer``             inference (JSON tensors, the binary extension, or
                                                         system or CUDA shared memory regions)
``GET  /v2/systemsharedmemory[/region/{r}]/status``      registered regions (server/shm.py; registering needs
``POST /v2/systemsharedmemory/region/{r}/register``      ``allow_client_shm``, or KILN_ALLOW_CLIENT_SHM=1)
``POST /v2/systemsharedmemory[/region/{r}]/unregister``
``GET  /v2/cudasharedmemory[/region/{r}]/status``        CUDA IPC regions (server/cuda_shm.py; registering
``POST /v2/cudasharedmemory/region/{r}/register``        needs client shm allowed and a model on cuda)
``POST /v2/cudasharedmemory[/region/{r}]/unregister``
``GET  /metrics``                                        Prometheus text (see server/metrics.py)
``GET  /docs``, ``/redoc``, ``/openapi.json``            the API documentation: Swagger UI and ReDoc pages whose
                                                         scripts this server serves itself (offline; below)
``GET  /docs/assets/{file}``                             those scripts, styles and icon
=======================================================  ===============================================

Design decisions, and why:

- **Every error is ``{"error": "..."}``** with a status that says whose fault it is, including the
  errors FastAPI/Starlette raise themselves (404 unknown route, 405 wrong method, 422 validation):
  clients of the V2 protocol (tritonclient among them) read the ``error`` key. 404 unknown model or
  version; 400 bad input (anything :mod:`kiln.server.protocol` or the model's signature refuses); 413
  body over ``max_body_bytes``; 415 a content type or encoding we cannot read; 503 + ``Retry-After``
  when the model's queue is full, while loading and while draining; 504 the request's deadline passed;
  500 the model or its worker process failed. The last resort is :class:`JsonErrors`, the outermost
  middleware: any exception no handler answered becomes a logged JSON 500 (``internal error: <type>:
  <message>``), never uvicorn's plain-text ``Internal Server Error``; and an exception of ours that
  carries a 4xx ``status`` (a :class:`~kiln.server.protocol.ProtocolError`, a :class:`kiln.InputError`)
  is answered with that status even when it escapes a route, since a bad input must never read as a
  server fault.
- **A body that parses as JSON is read as JSON**, whatever the client called it: no Content-Type,
  ``application/json``, ``text/json``, ``*+json``, and also ``application/x-www-form-urlencoded`` (what
  ``curl -d`` sends unless told otherwise) and ``text/plain``. Under those last two a body that is not JSON
  is a 415 naming the Content-Type to send. The binary tensor extension is keyed on its
  ``Inference-Header-Content-Length`` header (its type is ``application/octet-stream``); any other type
  (multipart, XML, images) is a 415 saying what to send.
- **/docs works offline.** FastAPI's default pages load Swagger UI and ReDoc from a CDN, so a server on a
  machine without internet access (a cluster node, a laptop on a plane) showed a blank page. The pages here
  load them from ``/docs/assets/``, served from the files the ``fastapi-offline`` package ships (Swagger UI
  5, which renders FastAPI's OpenAPI 3.1; the older ``swagger-ui-bundle`` package's Swagger UI 4 cannot),
  installed with the ``serve`` extra. Without that package the pages say how to install it, and never
  fall back to a CDN. (ReDoc's bundle itself still asks Redocly's CDN for the small logo in its sidebar
  credit and hides it when that fails; no script, style or font comes from anywhere but this server.)
- **The infer route reads the raw body itself** instead of declaring a pydantic body: a declared body
  would be parsed (and a 64 MB JSON body materialized as Python objects) before any check. The
  ``Content-Length`` is checked first and the stream is counted while it arrives, so an oversized body
  is refused with 413 after at most ``max_body_bytes`` of it have been read, before any parsing. A
  ``Content-Encoding: gzip``/``deflate`` body (tritonclient's ``request_compression_algorithm``) is
  inflated with the same bound, so a small compressed bomb cannot expand past it either.
- **Requests are checked against the model's signature before they are queued** (names, datatypes,
  ranks, fixed dims and shared symbolic dims, with the runtime's own ``check_inputs``): a bad request
  fails alone with 400 instead of failing the batch it would have been stacked into.
- **Element counts are bounded by the body size.** Every tensor element takes at least one byte of the
  body (JSON or binary), so ``parse_infer_request`` gets ``max_elements = max_body_bytes`` and refuses a
  huge declared shape before allocating anything.
- **Readiness** is false until every model version's executor has started, and false again from the
  moment a shutdown begins (:meth:`ServerState.begin_drain`), so a load balancer stops sending traffic
  while queued and running requests finish. Liveness stays true until the process exits.
- **Models load in the background** (the lifespan starts a task and returns), so ``/v2/health/live``
  answers during a slow load and orchestrators can tell "loading" from "dead".
- **Timeouts**: each model's ``timeout_ms`` is the default deadline; a request may lower it with its
  ``timeout_ms`` parameter (or Triton's ``timeout`` in microseconds, decoded by the protocol module),
  never raise it.
- Large bodies are decoded and large responses encoded on a worker thread, so one 50 MB request does
  not stall every other connection's event loop; small ones are handled inline, where a thread hop
  would cost more than the work.
"""
from __future__ import annotations

import asyncio
import html
import importlib.util
import inspect
import logging
import math
import os
import time
import zlib
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kiln.checks import GuardFailed
from kiln.errors import InputError, KilnError, ResourceError
from kiln.ir.ops.assertion import AssertionFailed
from kiln.runtime.program import check_inputs
from kiln.server import protocol
from kiln.server.errors import QueueFull, RegionTooSmall, RequestTimeout, WorkerError
from kiln.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kiln.server.metrics import Metrics
from kiln.server.gpu import gpu_slots, parse_device
from kiln.server.gpu_metrics import GpuMetrics, gpus_in_use
from kiln.server.repository import ModelEntry
from kiln.server.shm import DEFAULT_MAX_BYTES as SHM_MAX_BYTES
from kiln.server.shm import DEFAULT_MAX_REGIONS as SHM_MAX_REGIONS
from kiln.server.shm import SystemSharedMemory
from kiln.server.cuda_shm import CudaSharedMemory, DeviceInput, SharedMemory
from kiln.version import __version__

log = logging.getLogger("kiln.server")

DEFAULT_MAX_BODY_BYTES = 64 << 20
#: Bodies (and responses) larger than this are decoded (encoded) on a worker thread.
_OFFLOAD_BYTES = 256 << 10
#: Seconds a client is told to wait (``Retry-After``) after a 503.
RETRY_AFTER_S = 1
#: Content types read as a V2 request: JSON (none given means JSON), and octet-stream for the binary tensor
#: extension, whose split is keyed on the Inference-Header-Content-Length header, never on the type.
_JSON_TYPES = ("", "application/json", "text/json", "application/octet-stream")
#: Content types a body is read as JSON under only if it parses as JSON: curl's ``-d`` sends
#: ``application/x-www-form-urlencoded`` unless told otherwise, and some clients send ``text/plain``. A body
#: that does not parse under them is answered 415 naming the Content-Type to send (a form is never meant).
_LENIENT_TYPES = ("application/x-www-form-urlencoded", "text/plain")
_SEND_THIS = ("send the V2 request as JSON with 'Content-Type: application/json' (curl: -H 'Content-Type: "
              "application/json'), or the binary tensor extension as application/octet-stream with an "
              "Inference-Header-Content-Length header")

ExecutorFactory = Callable[[ModelEntry], Any]


# Run-time checks a model carries (kiln/ir/ops/guard.py, kiln/ir/ops/assertion.py) that an input failed:
# answered 400, like any input the model does not accept, with the check's message (line and values).
_REFUSALS = (GuardFailed, AssertionFailed)


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with ``status`` (and extra ``headers``)."""

    def __init__(self, status: int, message: str, headers: Optional[dict] = None, outcome: str = "invalid_request"):
        super().__init__(message)
        self.status, self.message, self.headers, self.outcome = status, message, headers or {}, outcome


def _error_response(status: int, message: str, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class JsonErrors:
    """Pure ASGI middleware, outermost: an exception no handler answered becomes ``{"error": ...}``.

    Starlette's own last resort (``ServerErrorMiddleware``) answers plain text and re-raises into uvicorn,
    which logs and closes the connection; this one answers JSON, logs the traceback once, and keeps the
    connection. An exception carrying an HTTP ``status`` below 500 (ProtocolError, InputError...) keeps its
    status. If the response had already started, nothing can be sent: the exception propagates and uvicorn
    closes the connection, which is all HTTP allows."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # noqa: BLE001 - the last resort: every error is answered as JSON
            if started:
                raise
            await _unexpected_error_response(scope, e)(scope, receive, send)


def _unexpected_error_response(scope, e: Exception) -> JSONResponse:
    """The JSON answer to an exception no handler answered: its own status when it carries one below 500
    (ProtocolError, InputError...), else 500, logged with its traceback."""
    status = 400 if isinstance(e, InputError) else getattr(e, "status", None)
    if isinstance(status, int) and 400 <= status < 500:
        return _error_response(status, getattr(e, "message", None) or str(e))
    log.error("unhandled error answering %s %s", scope.get("method"), scope.get("path"), exc_info=e)
    return _error_response(500, f"internal error: {type(e).__name__}: {e}")


class KilnApp(FastAPI):
    """The FastAPI app with one fast path: ``POST /v2/models/{m}[/versions/{v}]/infer`` is answered here,
    before FastAPI's middleware stack, router and dependency solving, which cost more than half of the HTTP
    process's time per request for a small model under load (py-spy on the H100 machine, BERT-base at 64
    clients: 57% of the event loop in FastAPI/Starlette layers around a handler that itself took 32%).
    The fast path runs the same handler (``_infer``) with the same answers: errors as ``{"error"}`` with
    their status and headers, an unexpected exception logged and answered 500 (JsonErrors' rules). Every
    other request, including a non-POST on an infer path, goes through FastAPI as before."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path.startswith("/v2/models/") and path.endswith("/infer"):
                parts = path.split("/")  # '', v2, models, NAME, [versions, V,] infer
                state = getattr(self.state, "kiln", None)
                if state is not None and (len(parts) == 5 or (len(parts) == 7 and parts[4] == "versions")) \
                        and parts[3]:
                    await self._infer_fast(state, scope, receive, send, parts[3],
                                           parts[5] if len(parts) == 7 else None)
                    return
        await super().__call__(scope, receive, send)

    async def _infer_fast(self, state, scope, receive, send, name: str, version: Optional[str]) -> None:
        # _infer sends nothing itself: it returns the response, sent here once.
        try:
            response = await _infer(state, Request(scope, receive), name, version)
        except ApiError as e:
            response = _error_response(e.status, e.message, e.headers)
        except Exception as e:  # noqa: BLE001 - as JsonErrors: every error is answered as JSON
            response = _unexpected_error_response(scope, e)
        await response(scope, receive, send)


def default_executor(entry: ModelEntry):
    """The executor ``kiln serve`` uses: worker processes, or threads in the server with ``workers=0``, in
    batch buckets when the config asks (server/workers.py make_executor; readiness waits for warm-up)."""
    from kiln.server.workers import make_executor
    return make_executor(entry.path, entry.config)


@dataclass
class ServedModel:
    """One model version being served: its entry, and (once loading starts) its executor, (once
    loaded) its batcher."""

    entry: ModelEntry
    executor: Any = None
    batcher: Any = None
    error: Optional[str] = None  # why loading failed

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def version(self) -> str:
        return self.entry.version

    @property
    def loaded(self) -> bool:
        return self.batcher is not None

    @property
    def ready(self) -> bool:
        return self.loaded and bool(self.executor.ready)


@dataclass
class ServerState:
    """Everything the routes share: the models by name and version, metrics, and the lifecycle flags."""

    models: dict[str, dict[str, ServedModel]]
    metrics: Metrics
    max_body_bytes: int
    executor_factory: ExecutorFactory
    on_ready: Optional[Callable[["ServerState"], Any]] = None
    on_load_error: Optional[Callable[[BaseException], Any]] = None
    loaded: bool = False
    load_error: Optional[BaseException] = None
    draining: bool = False
    connections: Any = None  # the ConnectionTracker of server/connections.py, when kiln serve runs the app
    shm: Optional[SystemSharedMemory] = None  # the system shared memory regions (server/shm.py)
    cuda_shm: Optional[CudaSharedMemory] = None  # the CUDA shared memory regions (server/cuda_shm.py)
    shared: Any = None  # both, as protocol.py sees them (cuda_shm.SharedMemory)
    _load_task: Optional[asyncio.Task] = None
    _drain_task: Optional[asyncio.Task] = None

    @property
    def ready(self) -> bool:
        return self.loaded and not self.draining and all(m.ready for m in self.served())

    def served(self) -> list[ServedModel]:
        return [m for versions in self.models.values() for m in versions.values()]

    def resolve(self, name: str, version: Optional[str]) -> ServedModel:
        """The served model version for a URL, or ApiError(404). No version: the highest one."""
        versions = self.models.get(name)
        if versions is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise ApiError(404, f"unknown model '{name}' (served models: {known})")
        if version is None or version == "":
            return versions[max(versions, key=int)]
        model = versions.get(version)
        if model is None:
            raise ApiError(404, f"model '{name}' has no version '{version}' (served versions: "
                                f"{', '.join(sorted(versions, key=int))})")
        return model

    # ------------------------------------------------------------------ lifecycle
    async def load(self) -> None:
        """Start every executor and build its batcher, all model versions at once (each start runs on its
        own thread: a repository of big models loads in the time of the slowest, not the sum). The server
        is ready when this returns without error; otherwise the first error goes to ``on_load_error``."""
        served = self.served()
        results = await asyncio.gather(*(self._load_one(m) for m in served), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for e in failures:
            if isinstance(e, asyncio.CancelledError):
                raise e
        # A model on a GPU that fails to load (out of GPU memory, a CUDA error) fails its own readiness,
        # with the reason (503 on its routes, UNAVAILABLE in the index), not the server (issue 17).
        gpu_failed = [(m, r) for m, r in zip(served, results) if isinstance(r, BaseException)
                      and str(getattr(m.entry.config, "device", "cpu") or "cpu").startswith("cuda")]
        for m, r in gpu_failed:
            log.error("model %s version %s failed to load on its GPU; serving the others without it: %s",
                      m.name, m.version, m.error)
        failures = [r for r in failures if not any(r is g for _, g in gpu_failed)]
        if failures:
            self.load_error = failures[0]
            if self.on_load_error is not None:
                self.on_load_error(failures[0])
            else:
                log.error("loading models failed: %s", failures[0])
            return
        self.loaded = True
        if self.on_ready is not None:
            self.on_ready(self)

    async def _load_one(self, model: ServedModel) -> None:
        from kiln.server.batcher import DynamicBatcher
        started = time.perf_counter()
        try:
            model.executor = self.executor_factory(model.entry)
            start = model.executor.start
            if inspect.iscoroutinefunction(start):
                await start()
            else:  # a blocking start (kiln.load, spawning processes) must not stall the event loop
                await asyncio.to_thread(start)
            _check_signature(model)
        except Exception as e:
            model.error = str(e) if isinstance(e, KilnError) else f"{type(e).__name__}: {e}"
            if model.executor is not None and str(getattr(model.entry.config, "device", "cpu")).startswith("cuda"):
                try:  # free the GPU now: workers a failed warm-up left running, a replacement under way
                    await model.executor.close()
                except Exception:  # noqa: BLE001 - the load error is what matters
                    pass
            raise
        model.batcher = DynamicBatcher(model.executor, model.entry.config, self.metrics, model.name, model.version)
        inner = getattr(model.executor, "inner", model.executor)
        if hasattr(inner, "timing_sink") and self.metrics is not None:  # GPU workers report copy times
            metrics, name, version = self.metrics, model.name, model.version
            inner.timing_sink = lambda t: metrics.observe_device(name, version, t)
        log.info("loaded model %s version %s from %s in %.2f s", model.name, model.version, model.entry.path,
                 time.perf_counter() - started)

    def begin_drain(self) -> asyncio.Task:
        """Stop taking new requests (readiness turns false at once) and drain every batcher: queued and
        running requests finish. Idempotent; returns the one drain task."""
        self.draining = True
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return self._drain_task

    async def _drain(self) -> None:
        batchers = [m.batcher for m in self.served() if m.batcher is not None]
        results = await asyncio.gather(*(b.drain() for b in batchers), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.error("draining a batcher failed: %s", r)

    async def shutdown(self) -> None:
        """Drain, then close every executor (worker processes exit)."""
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            try:
                await self._load_task
            except BaseException:  # noqa: BLE001 - a cancelled or failed load has nothing left to report
                pass
        await self.begin_drain()
        for model in self.served():
            try:
                if model.batcher is not None:
                    await model.batcher.close()  # stops its scheduler, then closes the executor
                elif model.executor is not None:
                    await model.executor.close()
            except Exception as e:  # noqa: BLE001 - keep closing the others
                log.error("closing model %s version %s failed: %s", model.name, model.version, e)
        if self.shm is not None:
            self.shm.close()  # every region unmapped (or, if a view is still alive, when it goes)
        if self.cuda_shm is not None:
            self.cuda_shm.unregister(None)  # the workers, now gone, closed their handles as they exited

    def gpu_executors(self, device_id: int) -> list:
        """The executors of models served on GPU ``device_id`` (for closing CUDA IPC handles there)."""
        return [m.executor for m in self.served()
                if m.executor is not None and device_id in _model_gpus(m)]


# ---------------------------------------------------------------------------------------------- the app
_INFER_REQUEST_SCHEMA = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string", "description": "echoed in the response"},
        "parameters": {
            "type": "object",
            "description": "binary_data_output (bool): all outputs as binary; timeout_ms (number in "
                           "(0, 2**50]): a deadline lower than the model's; timeout (int in [0, 2**64-1], "
                           "microseconds, 0 = none): Triton's spelling",
        },
        "inputs": {"type": "array", "items": {
            "type": "object", "required": ["name", "shape", "datatype"],
            "properties": {
                "name": {"type": "string"},
                "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "datatype": {"type": "string", "enum": sorted(protocol.DATATYPES)},
                "data": {"description": "row-major values, flat or nested (absent with binary_data_size)"},
                "parameters": {"type": "object", "description": "binary_data_size: bytes of this tensor "
                                                               "in the binary section after the JSON header"},
            }}},
        "outputs": {"type": "array", "items": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"},
                           "parameters": {"type": "object",
                                          "description": "binary_data (bool): return this output as binary"}}}},
    },
}

_INFER_DOC = {
    "requestBody": {
        "required": True,
        "description": "A V2 inference request. With the binary tensor extension the body is the JSON header "
                       "followed by the raw tensors, and the `Inference-Header-Content-Length` header gives the "
                       "JSON header's length. A body that parses as JSON is read as JSON also when it comes "
                       "without a Content-Type, or as `application/x-www-form-urlencoded` (`curl -d`'s default) "
                       "or `text/plain`.",
        "content": {
            "application/json": {
                "schema": _INFER_REQUEST_SCHEMA,
                "example": {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                        "data": [0.1, 0.2, 0.3, 0.4]}]},
            },
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
}


# ------------------------------------------------------------------------------- the docs pages, offline
#: The package whose files the /docs and /redoc pages load (see the module docstring), and those files with
#: the type each is served as.
DOCS_ASSETS_PACKAGE = "fastapi-offline"
_DOCS_ASSETS = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8",
                "swagger-ui.css": "text/css; charset=utf-8",
                "redoc.standalone.js": "text/javascript; charset=utf-8",
                "favicon.png": "image/png"}
_DOCS_ASSETS_URL = "/docs/assets"


def docs_assets_dir() -> Optional[Path]:
    """The folder holding Swagger UI's and ReDoc's files (the ``fastapi-offline`` package's ``static``
    folder), or None when that package is not installed or lacks one of them. Found without importing it."""
    spec = importlib.util.find_spec("fastapi_offline")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        folder = Path(location) / "static"
        if all((folder / name).is_file() for name in _DOCS_ASSETS):
            return folder
    return None


def _docs_missing(request: Request, page: str) -> Response:
    """/docs or /redoc without the assets package: how to get it (HTML for a browser, else ``{"error"}``),
    with 501, never a page that loads the UI from a CDN."""
    message = (f"the {page} page needs the {DOCS_ASSETS_PACKAGE} package, whose copy of {page} this server "
               f"serves itself (so the page works offline), and it is not installed: pip install "
               f"'kiln-compiler[serve]' (or pip install {DOCS_ASSETS_PACKAGE}), then restart kiln serve. The "
               f"OpenAPI description itself is at /openapi.json")
    if "text/html" not in request.headers.get("accept", ""):
        return _error_response(501, message)
    return HTMLResponse(f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kiln serve: {page} "
                        f"unavailable</title></head>\n<body><h1>{page} is not installed</h1>\n<p>"
                        f"{html.escape(message)}</p></body></html>\n", status_code=501)


def _error_doc(*codes: int) -> dict:
    text = {400: "bad input", 404: "unknown model or version", 413: "body too large",
            415: "unsupported content type or encoding", 500: "the model or its worker failed",
            503: "queue full, loading or shutting down (see Retry-After)", 504: "deadline exceeded"}
    schema = {"type": "object", "properties": {"error": {"type": "string"}}}
    return {c: {"description": text[c], "content": {"application/json": {"schema": schema}}} for c in codes}


def create_app(entries: list[ModelEntry], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               executor_factory: Optional[ExecutorFactory] = None, metrics: Optional[Metrics] = None,
               on_ready: Optional[Callable[[ServerState], Any]] = None,
               on_load_error: Optional[Callable[[BaseException], Any]] = None,
               allow_client_shm: Optional[bool] = None, shm_max_regions: int = SHM_MAX_REGIONS,
               shm_max_bytes: int = SHM_MAX_BYTES, wait_for_load: bool = False) -> FastAPI:
    """The V2 inference app for ``entries`` (from :func:`kiln.server.repository.discover`).

    ``executor_factory(entry)`` builds each model version's executor (default: :func:`default_executor`;
    tests pass fakes). Executors are started, and batchers built, in the background once the app's
    lifespan starts; ``on_ready(state)`` is called when all are loaded, ``on_load_error(exc)`` if one
    fails. The lifespan's shutdown drains every batcher, closes every executor and releases every shared
    memory region. ``allow_client_shm`` lets clients register system shared memory regions (at most
    ``shm_max_regions`` of ``shm_max_bytes`` in all; see server/shm.py for why it is off by default);
    None reads the environment variable ``KILN_ALLOW_CLIENT_SHM`` (``1``/``true``/``yes`` turn it on).
    ``wait_for_load``: the lifespan's startup returns only once every model is loaded (raising the first load
    error), for hosts that count an app ready when its startup is done (a Ray Serve replica); kiln serve
    itself loads in the background and answers 503 until ready. ``app.state.kiln`` is the :class:`ServerState`."""
    if not entries:
        raise KilnError("nothing to serve: no model entries")
    if max_body_bytes <= 0:
        raise KilnError(f"max_body_bytes must be positive, got {max_body_bytes}")
    factory = executor_factory or default_executor
    metrics = metrics or Metrics()
    models: dict[str, dict[str, ServedModel]] = {}
    for entry in entries:
        if entry.version in models.get(entry.name, {}):
            raise KilnError(f"model {entry.name!r} version {entry.version} is listed twice")
        models.setdefault(entry.name, {})[entry.version] = ServedModel(entry)
    state = ServerState(models, metrics, max_body_bytes, factory, on_ready, on_load_error)
    if allow_client_shm is None:
        allow_client_shm = os.environ.get("KILN_ALLOW_CLIENT_SHM", "").strip().lower() in ("1", "true", "yes")
    state.shm = SystemSharedMemory(allow_client_shm, shm_max_regions, shm_max_bytes)
    state.cuda_shm = CudaSharedMemory(allow_client_shm, gpus_in_use(entries), shm_max_regions, shm_max_bytes,
                                      taken=lambda name: bool(_shm_names(state.shm, name)))
    state.shared = SharedMemory(state.shm, state.cuda_shm)
    # nv_gpu_* families (server/gpu_metrics.py): only with a model on cuda and pynvml importable.
    gpu_metrics = GpuMetrics(gpus_in_use(entries))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for model in state.served():
            metrics.add_model(model.name, model.version)
        state._load_task = asyncio.get_running_loop().create_task(state.load())
        if wait_for_load:  # the host (a Ray Serve replica) counts the replica ready when startup returns
            await state._load_task
            if state.load_error is not None:
                raise state.load_error
        try:
            yield
        finally:
            await state.shutdown()

    app = KilnApp(
        title="kiln serve",
        version=__version__,
        description="The KServe/Triton Open Inference Protocol (V2) for kiln models: health, metadata and "
                    "inference with JSON tensors or the binary tensor extension. Errors are "
                    "`{\"error\": \"...\"}`.",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's pages load their scripts from a CDN: ours (below) are served from here
        redoc_url=None,
    )
    app.state.kiln = state
    app.add_middleware(JsonErrors)  # added last: outermost of the user middleware, around every route

    # -------------------------------------------------------------- errors: always {"error": ...}
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        parts = ["{}: {}".format(".".join(str(p) for p in e.get("loc", ())), e.get("msg", "")) for e in exc.errors()]
        return _error_response(422, "invalid request: " + "; ".join(parts))

    # -------------------------------------------------------------- health and metadata
    @app.get("/v2/health/live", tags=["health"], summary="Server liveness",
             responses={200: {"description": "the server process is serving HTTP"}})
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready", tags=["health"], summary="Server readiness",
             responses={200: {"description": "every model is loaded and the server is not shutting down"},
                        **_error_doc(503)})
    async def ready():
        if state.ready:
            return {"ready": True}
        return _error_response(503, _not_ready_reason(state), {"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/v2", tags=["metadata"], summary="Server metadata")
    async def server_metadata():
        extensions = ["binary_tensor_data", "model_configuration", "statistics", "model_repository"]
        if state.shm.enabled:
            extensions.append("system_shared_memory")
            if state.cuda_shm.devices:
                extensions.append("cuda_shared_memory")
        return {"name": "kiln", "version": __version__, "extensions": extensions}

    async def model_metadata(model_name: str, model_version: Optional[str] = None):
        model = state.resolve(model_name, model_version)
        if not model.loaded:
            raise ApiError(503, _model_not_ready_reason(state, model), {"Retry-After": str(RETRY_AFTER_S)})
        ex = model.executor
        return {
            "name": model.name,
            "versions": sorted(state.models[model.name], key=int),
            "platform": model.entry.config.backend,
            "inputs": [protocol.tensor_metadata(s) for s in ex.inputs],
            "outputs": [protocol.tensor_metadata(s) for s in ex.outputs],
        }

    async def model_ready(model_name: str, model_version: Optional[str] = None):
        model = state.resolve(model_name, model_version)
        if model.ready and not state.draining:
            return {"name": model.name, "version": model.version, "ready": True}
        return _error_response(503, _model_not_ready_reason(state, model), {"Retry-After": str(RETRY_AFTER_S)})

    async def model_config(model_name: str, model_version: Optional[str] = None):
        model = state.resolve(model_name, model_version)
        if not model.loaded:
            raise ApiError(503, _model_not_ready_reason(state, model), {"Retry-After": str(RETRY_AFTER_S)})
        return triton_model_config(model)

    async def model_stats(model_name: Optional[str] = None, model_version: Optional[str] = None):
        if model_name is None:
            chosen = state.served()
        elif model_version is None:
            state.resolve(model_name, None)  # 404 for an unknown model
            chosen = [state.models[model_name][v] for v in sorted(state.models[model_name], key=int)]
        else:
            chosen = [state.resolve(model_name, model_version)]
        return {"model_stats": [metrics.model_stats(m.name, m.version) for m in chosen]}

    async def infer(request: Request, model_name: str, model_version: Optional[str] = None):
        return await _infer(state, request, model_name, model_version)

    meta_doc = dict(tags=["metadata"], summary="Model metadata (inputs and outputs; -1 marks a symbolic dim)",
                    responses=_error_doc(404, 503))
    ready_doc = dict(tags=["health"], summary="Model readiness (200 ready, 503 not ready)",
                     responses=_error_doc(404, 503))
    infer_doc = dict(tags=["inference"], summary="Run inference",
                     description="JSON tensors (`data` flat or nested, row-major) or the binary tensor "
                                 "extension in the request and the response. Requests are batched dynamically "
                                 "with concurrent ones.",
                     openapi_extra=_INFER_DOC,
                     responses={200: {"description": "the outputs (JSON, or JSON header + binary tensors)"},
                                **_error_doc(400, 404, 413, 415, 500, 503, 504)})
    stats_doc = dict(tags=["metadata"], summary="Triton's statistics extension: per model version counts and "
                                                "cumulative durations (ns)", responses=_error_doc(404))
    # Before /v2/models/{model_name}, which would take "stats" for a model name.
    app.add_api_route("/v2/models/stats", model_stats, methods=["GET"], **stats_doc)
    for prefix in ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}"):
        app.add_api_route(prefix, model_metadata, methods=["GET"], **meta_doc)
        app.add_api_route(prefix + "/stats", model_stats, methods=["GET"], **stats_doc)
        app.add_api_route(prefix + "/ready", model_ready, methods=["GET"], **ready_doc)
        app.add_api_route(prefix + "/config", model_config, methods=["GET"], tags=["metadata"],
                          summary="Triton-shaped model configuration; kiln's config and batching decision "
                                  "(whether requests are stacked, and why) under \"kiln\"",
                          responses=_error_doc(404, 503))
        app.add_api_route(prefix + "/infer", infer, methods=["POST"], **infer_doc)

    # -------------------------------------------------------------- repository index
    @app.post("/v2/repository/index", tags=["repository"], summary="Every served model version and its state",
              responses=_error_doc(400))
    async def repository_index(request: Request):
        body = await _small_json(request, "repository index request")
        only_ready = body.get("ready", False)
        if not isinstance(only_ready, bool):
            raise ApiError(400, f"'ready' must be true or false, got {only_ready!r}")
        index = [_index_entry(state, m) for name in sorted(state.models)
                 for m in (state.models[name][v] for v in sorted(state.models[name], key=int))]
        return [e for e in index if e["state"] == "READY"] if only_ready else index

    # -------------------------------------------------------------- shared memory (server/shm.py)
    shm = state.shm

    @app.get("/v2/systemsharedmemory/status", tags=["shared memory"], summary="Registered system shared "
             "memory regions")
    async def shm_status():
        return shm.status()

    @app.get("/v2/systemsharedmemory/region/{region_name}/status", tags=["shared memory"],
             summary="One registered region", responses=_error_doc(400))
    async def shm_region_status(region_name: str):
        return _shm_call(shm.status, region_name)

    @app.post("/v2/systemsharedmemory/region/{region_name}/register", tags=["shared memory"],
              summary="Register a region: {key, offset, byte_size} of /dev/shm/<key>", responses=_error_doc(400))
    async def shm_register(region_name: str, request: Request):
        register_system_region(state, region_name, await _small_json(request, "register request", empty_ok=False))
        return {}

    @app.post("/v2/systemsharedmemory/unregister", tags=["shared memory"], summary="Unregister every region")
    async def shm_unregister_all():
        shm.unregister(None)
        return {}

    @app.post("/v2/systemsharedmemory/region/{region_name}/unregister", tags=["shared memory"],
              summary="Unregister one region (an unknown name is not an error)")
    async def shm_unregister(region_name: str):
        shm.unregister(region_name)
        return {}

    # -------------------------------------------------------------- CUDA shared memory (server/cuda_shm.py)
    cuda_shm = state.cuda_shm

    @app.get("/v2/cudasharedmemory/status", tags=["shared memory"], summary="Registered CUDA shared memory regions")
    async def cuda_shm_status():
        return cuda_shm.status()

    @app.get("/v2/cudasharedmemory/region/{region_name}/status", tags=["shared memory"],
             summary="One registered CUDA region", responses=_error_doc(400))
    async def cuda_shm_region_status(region_name: str):
        return _shm_call(cuda_shm.status, region_name)

    @app.post("/v2/cudasharedmemory/region/{region_name}/register", tags=["shared memory"],
              summary="Register a CUDA region: {raw_handle: {b64}, device_id, byte_size} (a CUDA IPC handle)",
              responses=_error_doc(400))
    async def cuda_shm_register(region_name: str, request: Request):
        register_cuda_region(state, region_name, await _small_json(request, "register request", empty_ok=False))
        return {}

    @app.post("/v2/cudasharedmemory/unregister", tags=["shared memory"], summary="Unregister every CUDA region")
    async def cuda_shm_unregister_all():
        await _close_cuda_regions(state, cuda_shm.unregister(None))
        return {}

    @app.post("/v2/cudasharedmemory/region/{region_name}/unregister", tags=["shared memory"],
              summary="Unregister one CUDA region (an unknown name is not an error)")
    async def cuda_shm_unregister(region_name: str):
        await _close_cuda_regions(state, cuda_shm.unregister(region_name))
        return {}

    @app.get("/metrics", tags=["metrics"], summary="Prometheus metrics (text exposition format 0.0.4)",
             response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus():
        text = metrics.render()
        if state.connections is not None:
            text += state.connections.render_metrics()
        if gpu_metrics.enabled:  # NVML sampled on a thread (at most once per ttl), never on the event loop
            text += gpu_metrics.render() if gpu_metrics.fresh() else await asyncio.to_thread(gpu_metrics.render)
        return Response(text, media_type=None, headers={"content-type": METRICS_CONTENT_TYPE})

    # -------------------------------------------------------------- API docs, offline (module docstring)
    assets = docs_assets_dir()

    def under_root(request: Request, path: str) -> str:  # behind a proxy's prefix (Ray Serve's route_prefix)
        return request.scope.get("root_path", "").rstrip("/") + path

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request):
        if assets is None:
            return _docs_missing(request, "Swagger UI")
        return get_swagger_ui_html(
            openapi_url=under_root(request, app.openapi_url), title=f"{app.title} - Swagger UI",
            swagger_js_url=under_root(request, f"{_DOCS_ASSETS_URL}/swagger-ui-bundle.js"),
            swagger_css_url=under_root(request, f"{_DOCS_ASSETS_URL}/swagger-ui.css"),
            swagger_favicon_url=under_root(request, f"{_DOCS_ASSETS_URL}/favicon.png"),
            # No validator badge: Swagger UI would load it from validator.swagger.io.
            swagger_ui_parameters={"validatorUrl": None})

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        if assets is None:
            return _docs_missing(request, "ReDoc")
        return get_redoc_html(
            openapi_url=under_root(request, app.openapi_url), title=f"{app.title} - ReDoc",
            redoc_js_url=under_root(request, f"{_DOCS_ASSETS_URL}/redoc.standalone.js"),
            redoc_favicon_url=under_root(request, f"{_DOCS_ASSETS_URL}/favicon.png"), with_google_fonts=False)

    @app.get(_DOCS_ASSETS_URL + "/{name}", include_in_schema=False)
    async def docs_asset(name: str):
        media_type = _DOCS_ASSETS.get(name)
        if media_type is None:
            raise ApiError(404, f"no docs asset '{name}' (the assets are {', '.join(sorted(_DOCS_ASSETS))})")
        if assets is None:
            raise ApiError(404, f"no docs assets: the {DOCS_ASSETS_PACKAGE} package is not installed (pip "
                                f"install 'kiln-compiler[serve]')")
        return FileResponse(assets / name, media_type=media_type, headers={"Cache-Control": "public, max-age=3600"})

    return app


def _check_signature(model: ServedModel) -> None:
    """Refuse at load a model whose inputs or outputs the V2 protocol cannot carry (with the reason), so
    that no request can reach an encoder that fails."""
    for kind, specs in (("input", model.executor.inputs), ("output", model.executor.outputs)):
        for spec in specs:
            try:
                protocol.tensor_metadata(spec)
            except protocol.ProtocolError as e:
                raise KilnError(f"model '{model.name}' version {model.version} cannot be served: {kind} "
                                f"{e.message}") from None


# ----------------------------------------------------------------------- Triton's config, index, shm
#: Triton's model-config data types (model_config.proto) by V2 datatype.
_TRITON_TYPES = {"BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16", "UINT32": "TYPE_UINT32",
                 "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8", "INT16": "TYPE_INT16", "INT32": "TYPE_INT32",
                 "INT64": "TYPE_INT64", "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64",
                 "BF16": "TYPE_BF16", "BYTES": "TYPE_STRING"}
_TRITON_PLATFORMS = {"onnxruntime": "onnxruntime_onnx"}


def _triton_version_policy(policy: Any) -> dict:
    if policy == "all":
        return {"all": {}}
    if isinstance(policy, dict) and "latest" in policy:
        return {"latest": {"num_versions": policy["latest"]}}
    if isinstance(policy, dict) and "specific" in policy:
        return {"specific": {"versions": list(policy["specific"])}}
    return {"latest": {"num_versions": 1}}


def triton_model_config(model: ServedModel) -> dict:
    """A loaded model version's configuration in Triton's JSON shape (model_config.proto as JSON, what
    ``tritonclient``'s ``get_model_config`` returns), with kiln's own config and batching decision under
    ``"kiln"``.

    As in Triton, ``max_batch_size > 0`` means the first dim of every input and output is the batch dim
    and is left out of ``dims``; kiln reports it only when it really stacks requests (the batching
    decision), and otherwise ``max_batch_size: 0`` with full dims (-1 for symbolic ones), since then a
    request's first dim is not a batch the server forms. ``dynamic_batching`` is present only then too.
    ``instance_group`` counts the model's parallel executions: worker processes x instances each (kind
    ``KIND_CPU``)."""
    config = model.entry.config
    decision = getattr(model.batcher, "decision", None)
    stacks = bool(decision is not None and decision.stacks)
    batch = config.max_batch_size if stacks else 0

    def tensors(specs) -> list[dict]:
        out = []
        for spec in specs:
            meta = protocol.tensor_metadata(spec)
            dims = meta["shape"][1:] if stacks else meta["shape"]
            out.append({"name": meta["name"], "data_type": _TRITON_TYPES[meta["datatype"]],
                        "format": "FORMAT_NONE", "dims": dims, "optional": False})
        return out

    body: dict[str, Any] = {
        "name": model.name,
        "platform": _TRITON_PLATFORMS.get(config.backend, config.backend),
        "backend": config.backend,
        "version_policy": _triton_version_policy(config.version_policy),
        "max_batch_size": batch,
        "input": tensors(model.executor.inputs),
        "output": tensors(model.executor.outputs),
        "instance_group": _triton_instance_group(model.name, config),
    }
    if stacks:
        preferred = getattr(config, "preferred_batch_size", None) or []
        body["dynamic_batching"] = {
            "preferred_batch_size": list(preferred),
            "max_queue_delay_microseconds": int(round(config.max_queue_delay_ms * 1000)),
            "preserve_ordering": False,
        }
    body["kiln"] = {"version": model.version, "config": config.to_json(),
                    "batching": None if decision is None else decision.to_json()}
    return body


def _triton_instance_group(name: str, config: Any) -> list[dict]:
    groups = getattr(config, "instance_group", None)
    if groups:  # the config's own (Triton's shape, kinds normalized to "cpu"/"gpu")
        return [{"name": f"{name}_{i}", "kind": "KIND_" + str(g.get("kind", "cpu")).upper(),
                 "count": g.get("count", 1), "gpus": list(g.get("gpus") or [])} for i, g in enumerate(groups)]
    device = str(getattr(config, "device", "cpu") or "cpu")
    if device.startswith("cuda"):  # kiln serve --device cuda[:N]: workers on that GPU (server/gpu.py)
        return [{"name": name, "kind": "KIND_GPU", "count": max(config.workers, 1),
                 "gpus": [int(device[5:]) if device.startswith("cuda:") else 0]}]
    return [{"name": name, "kind": "KIND_CPU", "count": max(config.workers, 1) * config.instances, "gpus": []}]


def _index_entry(state: ServerState, model: ServedModel) -> dict:
    """A model version's ``$repository_index_response`` entry (Triton's states)."""
    if state.draining:
        status, reason = "UNLOADING", "server is shutting down"
    elif model.ready:
        status, reason = "READY", ""
    elif model.error is not None or model.loaded:
        status, reason = "UNAVAILABLE", _model_not_ready_reason(state, model)
    else:
        status, reason = "LOADING", ""
    return {"name": model.name, "version": model.version, "state": status, "reason": reason}


async def _small_json(request: Request, what: str, empty_ok: bool = True) -> dict:
    """The JSON object body of a control request (at most 64 KiB; empty means ``{}`` if ``empty_ok``)."""
    body = await _read_body(request, 64 << 10)
    if not body.strip():
        if empty_ok:
            return {}
        raise ApiError(400, f"the {what} needs a JSON body")
    try:
        value = protocol._loads(body)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"malformed JSON in the {what}: {e}") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"the {what} must be a JSON object")
    return value


def _shm_names(shm: SystemSharedMemory, name: str) -> list:
    try:
        return shm.status(name)
    except protocol.ProtocolError:
        return []


def _model_gpus(model: ServedModel) -> set:
    config = model.entry.config
    return set(gpu_slots(config)) if parse_device(getattr(config, "device", "cpu")) is not None else set()


async def _close_cuda_regions(state: ServerState, regions: list) -> None:
    """Have the GPU workers of each region's device close its IPC handle (server/cuda_shm.py)."""
    for region in regions:
        for ex in state.gpu_executors(region.device_id):
            close = getattr(ex, "close_cuda", None)
            if close is None:
                continue
            try:
                await close(region.device_id, region.handle)
            except Exception as e:  # noqa: BLE001 - the region is forgotten either way; workers close at exit
                log.warning("closing CUDA region %s in model workers failed: %s", region.name, e)


def _cuda_use(state: ServerState, model: ServedModel, req: Any) -> list:
    """Refuse CUDA shared memory for a model that cannot take it (400); return ``(requested output, CudaSpan)``
    for the outputs that go to CUDA regions (the worker writes them with the batch)."""
    spans = [(n, a.span) for n, a in req.inputs.items() if isinstance(a, DeviceInput)]
    outs = [(o, state.cuda_shm.span(o.shared_memory, f"output '{o.name}'")) for o in (req.outputs or ())
            if o.shared_memory is not None and o.shared_memory.get("shared_memory_region") in state.cuda_shm]
    if not spans and not outs:
        return outs
    gpus = _model_gpus(model)
    if not gpus:
        raise ApiError(400, f"model '{model.name}' runs on the CPU: CUDA shared memory inputs and outputs need a "
                            "model served on a GPU (--device cuda)")
    where = [(f"input '{n}'", sp.device_id) for n, sp in spans]
    where += [(f"output '{o.name}'", sp.device_id) for o, sp in outs]
    for what, device in where:
        if device not in gpus:
            raise ApiError(400, f"{what} is in a CUDA region on GPU {device}, but model '{model.name}' runs on "
                                f"GPU(s) {sorted(gpus)}")
    if len({device for _, device in where}) > 1:
        raise ApiError(400, "the CUDA shared memory regions of one request must be on one GPU; this request's are "
                            "on " + ", ".join(f"{what} GPU {device}" for what, device in where))
    return outs


def _shm_call(fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except protocol.ProtocolError as e:
        raise ApiError(e.status, e.message) from None


def register_system_region(state: ServerState, name: str, body: Any) -> None:
    """Register system shared memory region ``name`` from its ``{key, offset, byte_size}`` (the HTTP route's
    JSON body, or server/grpc_server.py's SystemSharedMemoryRegisterRequest as a dict); ApiError 400 if
    refused. One namespace with the CUDA regions, as in Triton."""
    if name in state.cuda_shm:
        raise ApiError(400, f"a shared memory region named '{name}' is already registered "
                            "(a CUDA region; unregister it first)")
    _shm_call(state.shm.register, name, body)
    log.info("registered system shared memory region %s: %s", name, state.shm.status(name)[0])


def register_cuda_region(state: ServerState, name: str, body: Any) -> None:
    """Register CUDA shared memory region ``name`` from ``{raw_handle: {b64}, device_id, byte_size}`` (HTTP's
    body, or gRPC's request as a dict); ApiError 400 if refused (also on a server with no model on a GPU)."""
    region = _shm_call(state.cuda_shm.register, name, body)
    log.info("registered CUDA shared memory region %s: %s", name, region.status())


def _not_ready_reason(state: ServerState) -> str:
    if state.draining:
        return "server is shutting down"
    if state.load_error is not None:
        return f"loading models failed: {state.load_error}"
    loading = [f"{m.name}/{m.version}" for m in state.served() if not m.ready]
    return "models are loading: " + ", ".join(loading)


def _model_not_ready_reason(state: ServerState, model: ServedModel) -> str:
    if state.draining:
        return "server is shutting down"
    if model.error is not None:
        return f"model '{model.name}' version {model.version} failed to load: {model.error}"
    if model.loaded:
        return f"model '{model.name}' version {model.version} is not ready (its workers are restarting)"
    return f"model '{model.name}' version {model.version} is loading"


# ---------------------------------------------------------------------------------------------- infer
async def _infer(state: ServerState, request: Request, name: str, version: Optional[str]) -> Response:
    model = state.resolve(name, version)  # 404 before reading anything
    started = time.perf_counter()
    try:
        response = await _infer_model(state, model, request)
    except ApiError as e:
        state.metrics.observe_request(model.name, model.version, e.outcome, time.perf_counter() - started)
        raise
    state.metrics.observe_request(model.name, model.version, "success", time.perf_counter() - started)
    return response


def _unavailable(message: str, retry_after_s: float = RETRY_AFTER_S) -> ApiError:
    return ApiError(503, message, {"Retry-After": str(max(1, math.ceil(retry_after_s)))}, outcome="rejected")


def admit(state: ServerState, model: ServedModel) -> None:
    """Refuse a request before reading it while the server drains or the model is not loaded (503)."""
    if state.draining:
        raise _unavailable("server is shutting down")
    if not model.loaded:
        raise _unavailable(_model_not_ready_reason(state, model))


async def _infer_model(state: ServerState, model: ServedModel, request: Request) -> Response:
    admit(state, model)

    headers = request.headers
    media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type not in _JSON_TYPES and media_type not in _LENIENT_TYPES and not media_type.endswith("+json"):
        raise ApiError(415, f"unsupported content type '{media_type}': {_SEND_THIS}")
    header_length = None
    raw = headers.get("inference-header-content-length")
    if raw is not None:
        try:
            header_length = int(raw)
        except ValueError:
            raise ApiError(400, f"Inference-Header-Content-Length must be an integer, got '{raw}'") from None
        if header_length < 0:
            raise ApiError(400, f"Inference-Header-Content-Length must be >= 0, got {header_length}")
    body = await _read_body(request, state.max_body_bytes)

    decode_started = time.perf_counter()
    try:
        # Only a large JSON part is worth a thread: binary tensor data is a zero-copy view.
        if (header_length if header_length is not None else len(body)) > _OFFLOAD_BYTES:
            req = await asyncio.to_thread(protocol.parse_infer_request, body, header_length,
                                          max_elements=state.max_body_bytes, shared_memory=state.shared)
        else:
            req = protocol.parse_infer_request(body, header_length, max_elements=state.max_body_bytes,
                                               shared_memory=state.shared)
    except protocol.MalformedJson as e:
        if media_type in _LENIENT_TYPES:  # not JSON, and not sent as JSON: say what to send
            default = " (what curl -d sends unless told otherwise)" if "form" in media_type else ""
            raise ApiError(415, f"the body is not a JSON inference request and its content type is "
                                f"'{media_type}'{default}: {_SEND_THIS} ({e.message})") from None
        if media_type == "application/octet-stream" and header_length is None:
            raise ApiError(400, f"{e.message}; an application/octet-stream body without an "
                                "Inference-Header-Content-Length header is read as JSON: for the binary tensor "
                                "extension, send that header with the length of the JSON part") from None
        raise ApiError(e.status, e.message) from None
    except protocol.ProtocolError as e:
        raise ApiError(e.status, e.message) from None
    del body
    decode_seconds = time.perf_counter() - decode_started
    outputs = await run_infer(state, model, req)
    encode = protocol.encode_infer_response
    args = (model.name, model.version, req.id, outputs, req.outputs, req.binary_default, state.shared)
    encode_started = time.perf_counter()
    try:
        if sum(np.asarray(a).nbytes for a in outputs.values()) > _OFFLOAD_BYTES:
            body, extra = await asyncio.to_thread(encode, *args)
        else:
            body, extra = encode(*args)
    except protocol.ProtocolError as e:  # an output the protocol cannot carry: the server's fault (500)
        log.error("encoding the response of model %s version %s failed: %s", model.name, model.version, e)
        raise ApiError(e.status, f"cannot encode the response: {e.message}",
                       outcome="backend" if e.status >= 500 else "invalid_request") from None
    state.metrics.observe_codec(model.name, model.version, decode_seconds, time.perf_counter() - encode_started)
    return Response(content=body, status_code=200, headers=extra)


async def run_infer(state: ServerState, model: ServedModel, req: Any,
                    deadline_ms: Optional[float] = None) -> dict:
    """The part of an inference request every front end shares (HTTP here, gRPC in server/grpc_server.py),
    after the request is parsed into a :class:`protocol.InferRequest`: the checks against the model's
    signature, the deadline (``min`` of the model's, the request's and ``deadline_ms``, the transport's own),
    the batcher, and the error mapping (ApiError with the HTTP status). Returns the outputs to send, in the
    requested order."""

    ex = model.executor
    try:
        cuda_outputs = _cuda_use(state, model, req) if state.cuda_shm.devices else []
    except protocol.ProtocolError as e:
        raise ApiError(e.status, e.message) from None
    try:
        check_inputs(ex.inputs, req.inputs)
    except InputError as e:
        raise ApiError(400, str(e)) from None
    output_names = [s.name for s in ex.outputs]
    if req.outputs is not None:
        unknown = [o.name for o in req.outputs if o.name not in output_names]
        if unknown:
            raise ApiError(400, f"unknown output(s) {unknown}; the model's outputs are {output_names}")

    timeout_ms = model.entry.config.timeout_ms
    if req.timeout_ms is not None:
        if req.timeout_ms <= 0:
            raise ApiError(400, f"timeout_ms must be positive, got {req.timeout_ms}")
        timeout_ms = min(timeout_ms, req.timeout_ms)
    if deadline_ms is not None:
        timeout_ms = min(timeout_ms, max(deadline_ms, 0.001))

    try:
        outputs = await model.batcher.submit(req.inputs, timeout_ms / 1000.0,
                                             device_out={o.name: sp for o, sp in cuda_outputs})
    except RegionTooSmall as e:
        raise ApiError(400, str(e)) from None
    except QueueFull as e:  # also Draining
        raise _unavailable(str(e), e.retry_after_s) from None
    except RequestTimeout as e:
        raise ApiError(504, str(e) or f"request timed out after {timeout_ms:g} ms", outcome="timeout") from None
    except InputError as e:  # also BatchTooLarge
        raise ApiError(400, str(e)) from None
    except ResourceError as e:  # the request's shapes make the run need more than the model's memory budget
        raise ApiError(413, str(e)) from None
    except _REFUSALS as e:  # a kiln.Guard or a scripted assert: the model does not take this input
        raise ApiError(400, f"the model refuses this input: {e}") from None
    except WorkerError as e:
        raise ApiError(500, str(e), outcome="backend") from None
    except KilnError as e:  # ExecutionError: a kernel failed on this request
        raise ApiError(500, f"inference failed: {e}", outcome="backend") from None
    except Exception as e:  # noqa: BLE001 - answered as 500, logged with its traceback
        log.exception("inference on model %s version %s failed", model.name, model.version)
        raise ApiError(500, f"inference failed: {type(e).__name__}: {e}", outcome="backend") from None

    if req.outputs is not None:
        outputs = {o.name: outputs[o.name] for o in req.outputs}
    for o, _ in cuda_outputs:  # the GPU worker wrote them with the batch (the HTTP process never touches CUDA)
        o.written = int(np.asarray(outputs[o.name]).nbytes)
    return outputs


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it (or its declared length) passes ``limit``;
    a gzip/deflate ``Content-Encoding`` is inflated under the same limit."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise ApiError(400, f"invalid Content-Length '{declared}'") from None
        if n > limit:
            raise ApiError(413, _too_large(limit, f"declared {n:,} bytes"))
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "", "gzip", "deflate"):
        raise ApiError(415, f"unsupported Content-Encoding '{encoding}' (use gzip, deflate or none)")
    if declared is not None and encoding in ("identity", "") and n > 0:
        return await _read_exact(request, n)
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise ApiError(413, _too_large(limit, f"more than {limit:,} bytes received"))
            chunks.append(chunk)
    except ClientDisconnect:
        # The client went away, or the connection guard (server/connections.py) ended a body that arrived
        # too slowly and has answered 408 itself; whatever is sent now goes nowhere.
        raise ApiError(408, "the request body did not arrive (the client disconnected or was too slow)") from None
    body = b"".join(chunks)
    if encoding in ("gzip", "deflate") and body:
        # wbits 32+15 accepts zlib and gzip framing; raw deflate (some clients' "deflate") is retried.
        for wbits in (32 + zlib.MAX_WBITS, -zlib.MAX_WBITS):
            inflater = zlib.decompressobj(wbits)
            try:
                out = inflater.decompress(body, limit + 1)
            except zlib.error:
                continue
            if len(out) > limit or inflater.unconsumed_tail:
                raise ApiError(413, _too_large(limit, "after decompression"))
            if not inflater.eof:
                raise ApiError(400, f"truncated {encoding} body")
            return out
        raise ApiError(400, f"the body is not valid {encoding} data")
    return body


async def _read_exact(request: Request, n: int):
    """A body of declared length ``n``, read from the ASGI messages straight into one buffer (no list of
    chunks to join: one copy less of every body byte). A body longer than declared is a 400, a shorter one
    (the client gave up) a 408, as ``request.stream()`` would end."""
    receive = request.receive
    message = await receive()
    if "kiln.declared" in message:  # the protocol read the whole body into one buffer (connections.py)
        got = message["kiln.received"]
        if got != n:
            raise ApiError(400, f"the request body has {got:,} bytes, not its declared {n:,}")
        return message["body"]
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while True:
        kind = message["type"]
        if kind == "http.request":
            chunk = message.get("body", b"")
            end = pos + len(chunk)
            if end > n:
                raise ApiError(400, f"the request body is longer than its Content-Length ({n:,} bytes)")
            view[pos:end] = chunk
            pos = end
            if not message.get("more_body", False):
                break
        elif kind == "http.disconnect":
            raise ApiError(408, "the request body did not arrive (the client disconnected or was too slow)")
        message = await receive()
    if pos != n:
        raise ApiError(400, f"the request body ended after {pos:,} of its {n:,} declared bytes")
    return buf


def _too_large(limit: int, what: str) -> str:
    return (f"request body too large ({what}); this server accepts at most {limit:,} bytes "
            f"(kiln serve --max-body-mb)")
