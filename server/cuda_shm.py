"""The V2 CUDA shared memory extension: device memory that a local client allocated (``cudaMalloc``) and
exported as a CUDA IPC handle, named in a request instead of sending tensor bytes (issue 17).

A client (``tritonclient.utils.cuda_shared_memory``) allocates a buffer on a GPU, writes its input there and
registers it: ``POST /v2/cudasharedmemory/region/{name}/register`` with ``{"raw_handle": {"b64": ...},
"device_id", "byte_size"}`` (the 64-byte ``cudaIpcMemHandle_t``, base64). Inputs and requested outputs then
carry ``parameters: {shared_memory_region, shared_memory_byte_size, shared_memory_offset?}`` as for system
shared memory (server/shm.py); region names are one namespace over both kinds, as in Triton.

**The HTTP process never touches CUDA** (server/gpu.py: a CUDA fault must stay in one worker). So here a
CUDA region is bookkeeping only: the handle bytes, the device and the size, checked at registration
(64 bytes of base64; a device that a model of this server runs on; the size and region count inside the
limits) and at each use (offset + size inside the region; an input's byte size exactly its shape x
datatype size). The device memory is opened in the GPU workers:

- *Inputs* become a :class:`DeviceInput`: a zero-strided stand-in of the declared shape and dtype (so the
  shape checks, the batcher's grouping and the bucket planning see an ordinary array of that shape; no
  host memory behind it) that carries the :class:`CudaSpan`. The batcher stacks such requests with each
  other (never with host requests, and only with regions on the same GPU); the bucket staging skips their
  rows, and the batch carries *device patches*: the worker opens the handle (``cudaIpcOpenMemHandle``,
  cached per registration) and copies the rows device to device into the batch's device input, then
  pads from the last real row on the device too.
- *Outputs* into a CUDA region are written by the GPU worker as part of the batch (the batch carries
  ``device_out``: each request's row offset, row count and region): after the run, the request's rows are
  copied host to device from the batch's page-locked host outputs into its region, and the worker waits for
  those copies before answering. (A device-to-device copy from the graph's output buffers would save one
  PCIe trip of those rows; the host copy is made anyway for the batch's other requests.) A region too small
  for its output is found only then: :class:`~kiln.server.errors.RegionTooSmall`, an ExecutionError, so a
  stacked batch is re-run request by request and only that request gets the 400.
- *Unregister* forgets the region at once (new requests naming it get 400) and asks every GPU worker
  on its device to close the handle (``cudaIpcCloseMemHandle``); a worker also closes every handle when
  it exits.

Off unless client shared memory is allowed (``KILN_ALLOW_CLIENT_SHM=1``, as for system regions) *and* the
server runs a model on cuda: otherwise register answers 400 saying which is missing.
"""
from __future__ import annotations

import base64
import binascii
import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, List, NamedTuple, Optional

import numpy as np

from kiln.server.protocol import ProtocolError
from kiln.server.shm import _NAME_RE, _nonneg_int, check_room, region_status

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def _error(message: str) -> ProtocolError:
    return ProtocolError(400, message)


class CudaSpan(NamedTuple):
    """Bytes ``[offset, offset + nbytes)`` of a registered CUDA region, as a worker needs them: the IPC
    handle, the registration's id (a handle re-registered after unregister is opened afresh), its GPU."""

    handle: bytes
    reg_id: int
    device_id: int
    offset: int
    nbytes: int

    def rows(self, start: int, count: int, row_bytes: int) -> "CudaSpan":
        """The span of rows ``[start, start + count)`` of a tensor of ``row_bytes``-byte rows in this span."""
        return self._replace(offset=self.offset + start * row_bytes, nbytes=count * row_bytes)


class DeviceInput(np.ndarray):
    """An input whose data is in a CUDA region: a zero-strided array of the declared shape and dtype (it has
    no host data; reading it gives zeros) carrying the region's :class:`CudaSpan` as ``span``."""

    span: Optional[CudaSpan] = None

    def __array_finalize__(self, obj: Any) -> None:
        self.span = getattr(obj, "span", None)

    def __reduce__(self):  # never pickled as data: it has none
        raise TypeError("a DeviceInput (an input in a CUDA shared memory region) cannot be pickled")


def device_input(span: CudaSpan, dtype: np.dtype, shape: tuple) -> DeviceInput:
    a = np.broadcast_to(np.zeros((), dtype), shape).view(DeviceInput)
    a.span = span
    return a


def device_spans(a: Any) -> Optional[CudaSpan]:
    """The CudaSpan of a DeviceInput (None for anything else)."""
    return a.span if isinstance(a, DeviceInput) else None


@dataclass
class CudaRegion:
    name: str
    handle: bytes
    device_id: int
    byte_size: int
    reg_id: int

    def status(self) -> dict:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


class CudaSharedMemory:
    """The registry of CUDA shared memory regions of one server (thread-safe). ``devices``: the GPUs that
    models served on cuda run on (a region must live on one of them); ``enabled``: client shared memory
    allowed. ``taken(name)``: whether the other kind of region uses the name (one namespace)."""

    def __init__(self, enabled: bool, devices: Iterable[int], max_regions: int, max_bytes: int,
                 taken: Any = None):
        self.enabled = enabled
        self.devices = sorted(set(int(d) for d in devices))
        self.max_regions, self.max_bytes = max_regions, max_bytes
        self._taken = taken or (lambda name: False)
        self._regions: dict[str, CudaRegion] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._regions

    def status(self, name: Optional[str] = None) -> list[dict]:
        with self._lock:
            return region_status(self._regions, name, "CUDA")

    def register(self, name: str, request: Any) -> CudaRegion:
        """Register ``name`` from ``{"raw_handle": {"b64"}, "device_id", "byte_size"}`` (parsed JSON)."""
        if not self.enabled:
            raise _error("CUDA shared memory is off in this server (start it with KILN_ALLOW_CLIENT_SHM=1 "
                         "to let local clients register regions)")
        if not self.devices:
            raise _error("CUDA shared memory needs a model served on a GPU (kiln serve --device cuda); this "
                         "server runs every model on the CPU")
        if not _NAME_RE.match(name or ""):
            raise _error(f"invalid region name {name!r}: use 1-255 letters, digits, '_', '.' or '-'")
        if not isinstance(request, dict):
            raise _error('the register request must be a JSON object {"raw_handle": {"b64"}, "device_id", '
                         '"byte_size"}')
        unknown = set(request) - {"raw_handle", "device_id", "byte_size"}
        if unknown:
            raise _error(f"unknown key(s) {sorted(unknown)} in the register request; expected raw_handle, "
                         f"device_id, byte_size")
        raw = request.get("raw_handle")
        b64 = raw.get("b64") if isinstance(raw, dict) else None
        if not isinstance(b64, str):
            raise _error('the register request needs "raw_handle": {"b64": "<the base64 cudaIpcMemHandle_t>"}')
        try:
            handle = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise _error("raw_handle.b64 is not valid base64") from None
        if len(handle) != IPC_HANDLE_BYTES:
            raise _error(f"raw_handle is {len(handle)} bytes; a CUDA IPC memory handle is {IPC_HANDLE_BYTES}")
        device = _nonneg_int(request.get("device_id"), "'device_id'")
        if device not in self.devices:
            raise _error(f"cannot register '{name}' on GPU {device}: this server's models run on GPU(s) "
                         f"{self.devices}")
        byte_size = _nonneg_int(request.get("byte_size"), "'byte_size'")
        if byte_size == 0:
            raise _error("'byte_size' must be positive")
        with self._lock:
            if name in self._regions or self._taken(name):
                raise _error(f"a shared memory region named '{name}' is already registered (unregister it first)")
            check_room(self._regions, name, byte_size, self.max_regions, self.max_bytes, "CUDA ")
            region = CudaRegion(name, handle, device, byte_size, next(self._ids))
            self._regions[name] = region
            return region

    def unregister(self, name: Optional[str] = None) -> List[CudaRegion]:
        """Forget ``name`` (None: every region); returns the regions forgotten (the caller has the workers
        close their handles). An unknown name is not an error."""
        with self._lock:
            if name is None:
                gone, self._regions = list(self._regions.values()), {}
            else:
                region = self._regions.pop(name, None)
                gone = [region] if region is not None else []
        return gone

    def span(self, params: dict, what: str) -> CudaSpan:
        """The CudaSpan that a tensor's shared memory parameters name (bounds checked)."""
        name = params.get("shared_memory_region")
        if "shared_memory_byte_size" not in params:
            raise _error(f"{what} names shared memory region '{name}' but gives no shared_memory_byte_size")
        size = _nonneg_int(params["shared_memory_byte_size"], f"{what} 'shared_memory_byte_size'")
        offset = _nonneg_int(params.get("shared_memory_offset", 0), f"{what} 'shared_memory_offset'")
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise _error(f"{what}: no CUDA shared memory region named '{name}' is registered")
        if offset + size > region.byte_size:
            raise _error(f"{what}: shared_memory_offset {offset} + shared_memory_byte_size {size} = "
                         f"{offset + size} is past the end of region '{name}' ({region.byte_size} bytes)")
        return CudaSpan(region.handle, region.reg_id, region.device_id, offset, size)

    def read(self, params: dict, what: str, dtype: np.dtype, shape: tuple, count: int) -> DeviceInput:
        span = self.span(params, what)
        expected = count * dtype.itemsize
        if span.nbytes != expected:
            raise _error(f"{what} shared_memory_byte_size is {span.nbytes} bytes but shape {list(shape)} of "
                         f"{dtype} needs {expected}")
        if dtype.kind in "OSU":
            raise _error(f"{what}: BYTES tensors cannot come from CUDA shared memory")
        return device_input(span, dtype, shape)


class SharedMemory:
    """Both registries behind the one interface protocol.py uses (``read``/``check``/``write``/``max_bytes``):
    a region name is looked up among CUDA regions first, then system ones."""

    def __init__(self, system: Any, cuda: CudaSharedMemory):
        self.system, self.cuda = system, cuda

    @property
    def max_bytes(self) -> int:
        return max(self.system.max_bytes, self.cuda.max_bytes)

    @property
    def enabled(self) -> bool:
        return self.system.enabled

    def _is_cuda(self, params: dict) -> bool:
        name = params.get("shared_memory_region")
        return isinstance(name, str) and name in self.cuda

    def read(self, params: dict, what: str, dtype: np.dtype, shape: tuple, count: int) -> np.ndarray:
        if self._is_cuda(params):
            return self.cuda.read(params, what, dtype, shape, count)
        with self._unknown():
            return self.system.read(params, what, dtype, shape, count)

    def check(self, params: dict, what: str) -> None:
        if self._is_cuda(params):
            self.cuda.span(params, what)
        else:
            with self._unknown():
                self.system.check(params, what)

    @contextmanager
    def _unknown(self):
        """Where CUDA regions can exist, an unknown region name is "no system or CUDA ... region"."""
        try:
            yield
        except ProtocolError as e:
            if self.cuda.devices and "no system shared memory region named" in e.message:
                raise ProtocolError(e.status, e.message.replace("no system shared memory region",
                                                                "no system or CUDA shared memory region")) from None
            raise

    def write(self, params: dict, what: str, arr: np.ndarray) -> int:
        if self._is_cuda(params):  # the app has a GPU worker write CUDA outputs before encoding
            raise ProtocolError(500, f"{what}: a CUDA shared memory output was not written by a GPU worker")
        return self.system.write(params, what, arr)

    def close(self) -> None:
        self.system.close()
        self.cuda.unregister(None)
