"""The V2 system shared memory extension: regions of POSIX shared memory (``/dev/shm/<key>``) that local
clients register, then name in a request instead of sending tensor bytes over HTTP.

A client (``tritonclient.utils.shared_memory``) creates ``/dev/shm/<key>``, writes its input there and
registers a *region* of it: ``POST /v2/systemsharedmemory/region/{name}/register`` with ``{"key",
"offset", "byte_size"}``. An input then carries ``parameters: {shared_memory_region, shared_memory_byte_size,
shared_memory_offset?}`` instead of data, and a requested output may carry the same parameters, in which
case the server writes the output there and the response holds no data for it (as Triton does).

Decisions, and why:

- **Off unless asked for** (``KILN_ALLOW_CLIENT_SHM=1 kiln serve ...``, ``create_app(allow_client_shm=True)``),
  as in Triton (``--allow-client-shm``, default false): a client that may register regions may make the server
  read and write any shared memory object the server's user can open, which is fine for a local client of
  one user and not for anyone who can reach the port. Off, the status routes answer ``[]`` and register
  answers 400 saying how to turn it on.
- **Keys name objects in /dev/shm only.** The key is what ``shm_open`` takes (leading slashes are dropped,
  as glibc does); it must be one path component, so ``../etc/passwd`` or ``a/b`` is refused. The file is
  opened with ``O_NOFOLLOW`` and must be a regular file.
- **Bounded.** At most ``max_regions`` regions and ``max_bytes`` registered bytes in all (defaults 1024 and
  16 GiB); only ``[offset, offset + byte_size)`` of the object is mapped (from the page below ``offset``),
  so the address space a client can make the server map is bounded by the registered sizes.
- **Checked.** At registration ``offset + byte_size`` must lie inside the object. At each use
  ``shared_memory_offset + shared_memory_byte_size`` must lie inside the region, an input's byte size must
  be exactly its shape x datatype size, and the object must *still* be that large: a client that shrinks
  the file after registering would otherwise make the server's next read of the mapping die of SIGBUS.
  (The check and the read are not atomic; a client that truncates its own file in that window can still
  crash the server. This is the same trust Triton places in a client it lets register memory.)
- **Zero copy where possible.** Inputs are read-only numpy views of the mapping (copied only when
  misaligned for their dtype, or when the batcher stacks requests, which copies anyway). The client must
  not rewrite an input region before its response arrives.
- **Released** on unregister and at shutdown: the mapping is closed at once, or, if a request still holds a
  view of it, when the last view is dropped (Python refuses to close a mapping with live views; the
  registry forgets it at once either way, so new requests naming it get 400).
- Errors are :class:`kiln.server.protocol.ProtocolError` with status 400, answered as ``{"error": ...}``.
"""
from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from kiln.server.protocol import ProtocolError

SHM_DIR = "/dev/shm"
DEFAULT_MAX_REGIONS = 1024
DEFAULT_MAX_BYTES = 16 << 30
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,255}\Z")
_KEY_RE = re.compile(r"[^/\x00]{1,255}\Z")


def _error(message: str) -> ProtocolError:
    return ProtocolError(400, message)


def _nonneg_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _error(f"{what} must be a non-negative integer, got {value!r}")
    return value


def region_status(regions: dict, name: Optional[str], kind: str) -> list[dict]:
    """The V2 status list of ``regions`` (by name), or of the one named ``name``; ``kind`` ("system",
    "CUDA") names the registry in the error for an unknown name. The caller holds the registry's lock."""
    if name is None:
        return [r.status() for r in sorted(regions.values(), key=lambda r: r.name)]
    region = regions.get(name)
    if region is None:
        raise _error(f"no {kind} shared memory region named '{name}' is registered")
    return [region.status()]


def check_room(regions: dict, name: str, byte_size: int, max_regions: int, max_bytes: int,
               kind: str = "") -> None:
    """Refuse a registration past the region count or byte limits (``kind``: "" or "CUDA ", as the messages
    name the regions). The caller holds the registry's lock."""
    if len(regions) >= max_regions:
        raise _error(f"cannot register '{name}': {len(regions)} {kind}regions are registered, this "
                     f"server's limit is {max_regions}")
    total = sum(r.byte_size for r in regions.values())
    if total + byte_size > max_bytes:
        of = f" of {kind.strip()} regions" if kind else ""
        raise _error(f"cannot register '{name}' ({byte_size:,} bytes): {total:,} bytes{of} are registered "
                     f"and this server's limit is {max_bytes:,}")


@dataclass
class Region:
    """One registered region: ``byte_size`` bytes at ``offset`` of ``/dev/shm/<key>``."""

    name: str
    key: str
    offset: int
    byte_size: int
    _map: Optional[mmap.mmap]
    _start: int  # where the region starts inside the mapping (the mapping begins on a page boundary)

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def close(self) -> None:
        m, self._map = self._map, None
        if m is None:
            return
        try:
            m.close()
        except BufferError:
            # A request still holds a view: the mapping is unmapped when the last view is collected.
            pass


class SystemSharedMemory:
    """The registry of system shared memory regions of one server (thread-safe)."""

    def __init__(self, enabled: bool = True, max_regions: int = DEFAULT_MAX_REGIONS,
                 max_bytes: int = DEFAULT_MAX_BYTES, shm_dir: str = SHM_DIR):
        if max_regions < 0 or max_bytes < 0:
            raise ValueError("max_regions and max_bytes must be >= 0")
        self.enabled, self.max_regions, self.max_bytes, self.shm_dir = enabled, max_regions, max_bytes, shm_dir
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ registration
    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(r.byte_size for r in self._regions.values())

    def status(self, name: Optional[str] = None) -> list[dict]:
        with self._lock:
            return region_status(self._regions, name, "system")

    def register(self, name: str, request: Any) -> None:
        """Register ``name`` from a ``{"key", "offset", "byte_size"}`` request body (parsed JSON)."""
        if not self.enabled:
            raise _error("system shared memory is off in this server (start it with KILN_ALLOW_CLIENT_SHM=1 "
                         "to let local clients register regions)")
        if not _NAME_RE.match(name or ""):
            raise _error(f"invalid region name {name!r}: use 1-255 letters, digits, '_', '.' or '-'")
        if not isinstance(request, dict):
            raise _error("the register request must be a JSON object {\"key\", \"offset\", \"byte_size\"}")
        unknown = set(request) - {"key", "offset", "byte_size"}
        if unknown:
            raise _error(f"unknown key(s) {sorted(unknown)} in the register request; expected key, offset, "
                         f"byte_size")
        key = request.get("key")
        if not isinstance(key, str):
            raise _error("the register request needs a string 'key' (the shared memory object's name)")
        offset = _nonneg_int(request.get("offset", 0), "'offset'")
        byte_size = _nonneg_int(request.get("byte_size"), "'byte_size'")
        if byte_size == 0:
            raise _error("'byte_size' must be positive")
        stripped = key.lstrip("/")
        if not _KEY_RE.match(stripped) or stripped in (".", ".."):
            raise _error(f"invalid shared memory key {key!r}: it must name one object in {self.shm_dir}")

        with self._lock:  # held across the open: two registrations of one name cannot both pass the check
            if name in self._regions:
                raise _error(f"a system shared memory region named '{name}' is already registered "
                             f"(unregister it first)")
            check_room(self._regions, name, byte_size, self.max_regions, self.max_bytes)
            self._regions[name] = self._map(name, key, stripped, offset, byte_size)

    def _map(self, name: str, key: str, stripped: str, offset: int, byte_size: int) -> Region:
        path = os.path.join(self.shm_dir, stripped)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise _error(f"cannot register '{name}': no shared memory object with key '{key}'") from None
        except OSError as e:
            raise _error(f"cannot register '{name}': cannot open shared memory key '{key}': "
                         f"{e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _error(f"cannot register '{name}': '{key}' is not a shared memory object")
            if offset + byte_size > st.st_size:
                raise _error(f"cannot register '{name}': offset {offset} + byte_size {byte_size} = "
                             f"{offset + byte_size} is past the end of shared memory key '{key}' "
                             f"({st.st_size} bytes)")
            base = offset - offset % mmap.ALLOCATIONGRANULARITY
            try:
                m = mmap.mmap(fd, offset - base + byte_size, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
            except (OSError, ValueError) as e:
                raise _error(f"cannot register '{name}': cannot map shared memory key '{key}': {e}") from None
        finally:
            os.close(fd)  # the mapping keeps its own descriptor (mmap.size() reads the object's size)
        return Region(name, key, offset, byte_size, m, offset - base)

    def unregister(self, name: Optional[str] = None) -> None:
        """Forget ``name`` (None: every region) and release its mapping. An unknown name is not an error
        (as in Triton: unregistering is idempotent)."""
        with self._lock:
            if name is None:
                regions, self._regions = list(self._regions.values()), {}
            else:
                region = self._regions.pop(name, None)
                regions = [region] if region is not None else []
            for region in regions:
                region.close()

    def close(self) -> None:
        """Release every region (the server is shutting down)."""
        self.unregister(None)

    # ------------------------------------------------------------------ use
    def _span(self, params: dict, what: str) -> tuple[Region, int, int]:
        """(region, start in its mapping, byte size) of a tensor's shared memory parameters; caller holds
        the lock."""
        name = params.get("shared_memory_region")
        if not isinstance(name, str):
            raise _error(f"{what} 'shared_memory_region' must be a string, got {name!r}")
        if "shared_memory_byte_size" not in params:
            raise _error(f"{what} names shared memory region '{name}' but gives no shared_memory_byte_size")
        size = _nonneg_int(params["shared_memory_byte_size"], f"{what} 'shared_memory_byte_size'")
        offset = _nonneg_int(params.get("shared_memory_offset", 0), f"{what} 'shared_memory_offset'")
        region = self._regions.get(name)
        if region is None or region._map is None:
            raise _error(f"{what}: no system shared memory region named '{name}' is registered")
        if offset + size > region.byte_size:
            raise _error(f"{what}: shared_memory_offset {offset} + shared_memory_byte_size {size} = "
                         f"{offset + size} is past the end of region '{name}' ({region.byte_size} bytes)")
        try:
            file_size = region._map.size()
        except OSError as e:
            raise _error(f"{what}: shared memory key '{region.key}' of region '{name}' is gone: {e}") from None
        if region.offset + offset + size > file_size:
            raise _error(f"{what}: shared memory key '{region.key}' of region '{name}' shrank to {file_size} "
                         f"bytes since it was registered")
        return region, region._start + offset, size

    def read(self, params: dict, what: str, dtype: np.dtype, shape: tuple, count: int) -> np.ndarray:
        """An input's array: a read-only view of its region (copied if misaligned for ``dtype``)."""
        expected = count * dtype.itemsize
        with self._lock:
            region, start, size = self._span(params, what)
            if size != expected:
                raise _error(f"{what} shared_memory_byte_size is {size} bytes but shape {list(shape)} of "
                             f"{dtype} needs {expected}")
            raw = np.frombuffer(region._map, dtype=np.uint8, count=size, offset=start)
        if dtype.kind == "b" and count and raw.max() > 1:
            raise _error(f"{what} BOOL data in shared memory must be bytes 0 or 1")
        arr = raw.view(dtype).reshape(shape) if size else np.empty(shape, dtype)
        if not arr.flags.aligned or not arr.dtype.isnative:
            arr = arr.astype(dtype.newbyteorder("="))
        arr.flags.writeable = False
        return arr

    def check(self, params: dict, what: str) -> None:
        """Refuse an output's shared memory parameters before inference (unknown region, out of bounds)."""
        with self._lock:
            self._span(params, what)

    def write(self, params: dict, what: str, arr: np.ndarray) -> int:
        """Write ``arr``'s bytes (the caller gives it in wire order, little-endian) row major into an
        output's region; returns the byte size written."""
        data = np.ascontiguousarray(arr)
        with self._lock:
            region, start, size = self._span(params, what)
            if data.nbytes > size:
                raise _error(f"{what} is {data.nbytes} bytes (shape {list(data.shape)}) but its "
                             f"shared_memory_byte_size is {size}")
            target = np.frombuffer(region._map, dtype=np.uint8, count=data.nbytes, offset=start)
        if data.nbytes:
            target[:] = data.reshape(-1).view(np.uint8)
        return data.nbytes
