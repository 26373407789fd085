"""A shared-memory arena between the HTTP process and its worker processes (issue 17, "data path").

Without it, a batch crosses the pipe to its worker pickled: the HTTP process copies the stacked batch into a
pickle, the kernel copies it through the socket, the worker copies it out again, and the outputs make the
same trip back. For a ResNet-50 request (602 KB of float32) that is four copies of every byte in each
direction, on the one core that also parses HTTP for every client.

With the arena, the batch's staging buffers (server/buckets.py's :class:`~kiln.server.buckets.Staging`,
one set per bucket and batch in flight) and the buffers its outputs are written into are allocated here,
in one ``memfd`` both sides map. A request's rows are copied once, from the HTTP body into the bucket's
buffer; the worker gets ``("run", id, {name: ArenaRef})``, a few dozen bytes, and reads the rows in place:
on a GPU worker the arena blocks it uses are page-locked in its process (``cudaHostRegister``, once per
block), so its host-to-device copies are DMA straight from the buffers the HTTP process filled, and the
outputs come back by DMA into the output buffers. The answer is again a few dozen bytes.

Why a ``memfd`` and not ``multiprocessing.shared_memory``: a memfd has no name (nothing in /dev/shm to
leak if a process dies), is freed when the last process unmaps it, and passes to a worker as an inherited
file descriptor, also to a replacement worker started later. ``SharedMemory`` on Python 3.11 registers the
segment with a resource tracker in every process that attaches and unlinks it when any of them exits.

The arena is sized up front (``staging_mib``, default 1024) but only the pages written are backed: a
ResNet-50 server with buckets 1..32 and two batches in flight touches about 80 MB of it. Allocation is
page-aligned blocks with a free list per block size (staging sets are reused, so blocks of one size come
and go together); when a block does not fit, :meth:`Arena.alloc` raises :class:`ArenaFull` and the caller
falls back to ordinary memory (that batch is then pickled, as before: slower, never wrong).
"""
from __future__ import annotations

import math
import mmap
import os
import threading
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

PAGE = mmap.PAGESIZE


class ArenaFull(MemoryError):
    """No free block of that size is left in the arena."""


class ArenaRef(NamedTuple):
    """An array that lives in the arena, as it crosses the pipe: byte offset, shape and dtype string."""

    offset: int
    shape: Tuple[int, ...]
    dtype: str


class Arena:
    """``size`` bytes of shared memory mapped in this process. The HTTP process makes one
    (``Arena(size)``: a new memfd); a worker maps the same one from the inherited descriptor
    (``Arena(size, fd=...)``)."""

    def __init__(self, size: int, fd: Optional[int] = None):
        size = int(size)
        if size <= 0:
            raise ValueError(f"an arena needs a positive size, got {size}")
        self.size = -(-size // PAGE) * PAGE
        self.owner = fd is None
        if fd is None:
            fd = os.memfd_create("kiln-staging", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.size)
            except BaseException:
                os.close(fd)
                raise
        self.fd = fd
        self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self._buf.ctypes.data
        self._lock = threading.Lock()
        self._top = 0
        self._free: Dict[int, List[int]] = {}
        self.in_use = 0   # bytes of live blocks

    # -- allocation (the HTTP process) ----------------------------------------------------------------

    def alloc(self, shape, dtype) -> np.ndarray:
        """An uninitialised array of ``shape``/``dtype`` in its own page-aligned block; ArenaFull if none fits."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        block = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            free = self._free.get(block)
            if free:
                offset = free.pop()
            elif self._top + block <= self.size:
                offset, self._top = self._top, self._top + block
            else:
                raise ArenaFull(f"the staging arena ({self.size >> 20} MiB) has no free block of {block:,} bytes "
                                f"({self.in_use:,} bytes in use)")
            self.in_use += block
        return self.view(ArenaRef(offset, shape, dtype.str))

    def free(self, a: np.ndarray) -> None:
        """Give back a block :meth:`alloc` returned (``a`` itself, not a slice of it)."""
        ref = self.ref(a)
        if ref is None:
            return
        nbytes = a.nbytes
        block = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            self._free.setdefault(block, []).append(ref.offset)
            self.in_use -= block

    def allocator(self, shape, dtype) -> np.ndarray:
        """A Staging allocator: arena memory where it fits, ordinary memory where it does not."""
        try:
            return self.alloc(shape, dtype)
        except ArenaFull:
            return np.empty(shape, dtype)

    # -- references (both sides) ----------------------------------------------------------------------

    def ref(self, a) -> Optional[ArenaRef]:
        """The ArenaRef of ``a`` if it is a C-contiguous array inside this arena, else None."""
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            return None
        start = a.ctypes.data - self.base
        if start < 0 or start + a.nbytes > self.size:
            return None
        return ArenaRef(start, tuple(a.shape), a.dtype.str)

    def view(self, ref: ArenaRef) -> np.ndarray:
        """The array ``ref`` names, a view of this process's mapping (writable)."""
        dtype = np.dtype(ref.dtype)
        end = ref.offset + math.prod(ref.shape) * dtype.itemsize  # math.prod: np.prod costs ~5 us a call
        if ref.offset < 0 or end > self.size:
            raise ValueError(f"arena reference {ref} is outside the arena ({self.size} bytes)")
        return self._buf[ref.offset:end].view(dtype).reshape(ref.shape)

    def encode(self, arrays: Dict[str, np.ndarray]) -> Dict[str, object]:
        """``arrays`` with those that live in the arena replaced by their ArenaRef (the others as they are)."""
        return {k: (self.ref(v) or v) for k, v in arrays.items()}

    def decode(self, arrays: Dict[str, object]) -> Dict[str, np.ndarray]:
        """The inverse of :meth:`encode` in the process that receives them."""
        return {k: (self.view(v) if isinstance(v, ArenaRef) else v) for k, v in arrays.items()}

    def close(self) -> None:
        """Unmap (views still held keep the pages alive until they go) and close the descriptor."""
        self._buf = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still exported: the mapping goes with the last view
        try:
            os.close(self.fd)
        except OSError:
            pass
