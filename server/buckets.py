"""Batch-size buckets: a batch of n rows runs at the smallest bucket size >= n, padded, and the answers are
sliced back to n rows (issue 17, "Batching that fits a GPU").

Why buckets: a CUDA graph (and most compiled GPU plans) is captured for one shape. With a bucket per
batch size the GPU executor captures one graph per bucket at load (:meth:`BucketedExecutor.warm_up`), and
every batch replays one of them instead of being planned, allocated and launched kernel by kernel. On
the CPU runtime buckets bring no speed (padding is wasted work there); they are correct, so a
configuration can be tried on a CPU box and served unchanged on a GPU.

* :func:`plan_buckets` -- the sizes: powers of two up to ``max_batch_size``, ``max_batch_size`` itself,
  and any ``preferred_batch_size`` sizes (Triton's name). ``plan_buckets(12, [6]) == (1, 2, 4, 6, 8, 12)``.
* :func:`bucket_for` -- the bucket a batch of n rows runs at.
* :func:`pad_batch` / :func:`unpad` -- pure numpy padding of dim 0 and slicing back.
* :class:`Staging` -- host buffers preallocated per bucket and input (by an ``allocator``: ``np.empty`` on
  the CPU, a pinned-memory allocator on a GPU) that request rows are copied or decoded straight into,
  with no intermediate ``np.concatenate``.
* :class:`BucketedExecutor` -- wraps any executor of server/workers.py: pads each batch to its bucket
  through :class:`Staging`, runs it, unpads; ``start()`` runs :meth:`~BucketedExecutor.warm_up`, so the
  model is not ready (``/v2/health/ready`` is 503) until every bucket has run once.

**What pad rows hold: copies of the last real row, not zeros.** Pad rows are computed and thrown away,
so their values never reach an answer (the model must be row-independent for stacking anyway; the
batcher only stacks such models), but they are *run*. Zeros can be out of the model's domain: an
all-zero attention mask gives a softmax over nothing (NaN), an id of 0 may be a padding id that a
model's own ``ids - 1`` turns into an index of -1, a zero divisor or ``log(0)`` can trip a finiteness
guard. With kiln's bounds-checked gathers such a row fails the whole batch with an ExecutionError; the
batcher then re-runs each request alone, each padded with zeros again, and every request of the batch
fails because of rows nobody sent. A copy of a real row is in the model's domain by construction (the
request it comes from was accepted and runs in the same batch) and costs exactly what zeros cost.

**Outputs never alias a staging buffer.** A model may return an input unchanged (Identity, a
reshape view); the staging buffer is reused by the next batch of that bucket, so an output that shares
memory with it is copied before the buffer is released.

**Models that are not stacked** (no symbolic dim 0 shared by every input and output, ``max_batch_size``
0 or 1, ``batching`` "off", or not proven row-independent) run unbatched: requests go to the inner
executor exactly as they came, never padded (padding a model that mixes rows would change its answers).

Warm-up inputs are zeros of each input's static shape with dim 0 set to the bucket (zeros are fine
here: the outputs are discarded, and a model that refuses them only logs a warning). Inputs with a
symbolic dim other than the batch dim (sequence length) have no shape to warm up with: warm-up is then
skipped with a log line (a GPU executor captures such shapes on first use).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from kiln.errors import ExecutionError, InputError, KilnError

log = logging.getLogger("kiln.server")

__all__ = ["plan_buckets", "bucket_for", "pad_batch", "unpad", "Staging", "StagedBatch", "BucketedExecutor",
           "uses_buckets"]

Allocator = Callable[[Tuple[int, ...], np.dtype], np.ndarray]


# --------------------------------------------------------------------------------------------- planning

def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise KilnError(f"{what} must be an integer, got {type(value).__name__} ({value!r})")
    value = int(value)
    if value < 1:
        raise KilnError(f"{what} must be at least 1, got {value}")
    return value


def plan_buckets(max_batch_size: int, preferred: Optional[Iterable[int]] = None) -> Tuple[int, ...]:
    """The bucket sizes, ascending: 1, 2, 4, ... up to ``max_batch_size``, ``max_batch_size`` itself (also
    when it is not a power of two) and every size in ``preferred``. Raises KilnError for a
    ``max_batch_size`` below 1, or a preferred size that is not an integer in 1..max_batch_size."""
    top = _positive_int(max_batch_size, "max_batch_size (for batch buckets)")
    sizes = {top}
    p = 1
    while p <= top:
        sizes.add(p)
        p *= 2
    if preferred is not None:
        if isinstance(preferred, (str, bytes)) or not isinstance(preferred, Iterable):
            raise KilnError(f"preferred_batch_size must be a list of integers, got {preferred!r}")
        for size in preferred:
            size = _positive_int(size, "a preferred_batch_size")
            if size > top:
                raise KilnError(f"preferred_batch_size {size} is larger than max_batch_size {top}")
            sizes.add(size)
    return tuple(sorted(sizes))


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``n`` rows. KilnError if ``n`` < 1 or more than the largest."""
    if not buckets:
        raise KilnError("no batch buckets")
    if n < 1:
        raise KilnError(f"a batch has at least 1 row, got {n}")
    for b in buckets:  # a handful of sizes: a scan beats bisect's bookkeeping
        if b >= n:
            return b
    raise KilnError(f"a batch of {n} rows is larger than the largest batch bucket ({max(buckets)})")


# ---------------------------------------------------------------------------------------------- padding

def _rows(arrays: Mapping[str, np.ndarray]) -> int:
    counts = {name: (np.shape(a)[0] if np.ndim(a) else None) for name, a in arrays.items()}
    if not counts:
        raise KilnError("a batch needs at least one input")
    if None in counts.values():
        raise KilnError(f"cannot pad inputs without a batch dim: {[n for n, c in counts.items() if c is None]}")
    if len(set(counts.values())) != 1:
        raise KilnError(f"the inputs of a batch disagree on dim 0: {counts}")
    return next(iter(counts.values()))


def pad_batch(arrays_by_input: Mapping[str, np.ndarray], bucket: int) -> Dict[str, np.ndarray]:
    """Every input padded along dim 0 to ``bucket`` rows; pad rows are copies of the last real row (see the
    module docstring for why not zeros). Inputs already ``bucket`` rows long are returned as they are."""
    n = _rows(arrays_by_input)
    if n < 1:
        raise KilnError("cannot pad an empty batch (0 rows): there is no real row to copy")
    if n > bucket:
        raise KilnError(f"a batch of {n} rows does not fit bucket {bucket}")
    if n == bucket:
        return dict(arrays_by_input)
    out = {}
    for name, a in arrays_by_input.items():
        a = np.asarray(a)
        padded = np.empty((bucket, *a.shape[1:]), a.dtype)
        padded[:n] = a
        padded[n:] = a[n - 1]
        out[name] = padded
    return out


def unpad(outputs: Mapping[str, np.ndarray], n: int, bucket: Optional[int] = None) -> Dict[str, np.ndarray]:
    """Every output sliced back to its first ``n`` rows. ``bucket`` is the padded size (default: dim 0 of
    the outputs). When padding happened (bucket > n), an output without a batch dim of ``bucket`` rows
    (a scalar, a sum over rows) is refused with ExecutionError: it may mix the pad rows in."""
    out = {}
    for name, a in outputs.items():
        shape = np.shape(a)
        size = bucket if bucket is not None else (shape[0] if shape else n)
        if size == n:  # no padding happened: nothing to slice, nothing to refuse
            out[name] = a
            continue
        if not shape or shape[0] != size:
            raise ExecutionError(f"output '{name}' has shape {list(shape)}, but a batch padded to {size} rows "
                                 f"(from {n}) needs dim 0 of {size} to slice back; a model whose outputs "
                                 "have no batch dim cannot run in batch buckets")
        out[name] = a[:n]
    return out


# ---------------------------------------------------------------------------------------------- staging

def _np_dtype(spec: Any) -> np.dtype:
    dt = getattr(getattr(getattr(spec, "type", None), "dtype", None), "numpy", None)
    try:
        return np.dtype(dt if dt is not None else spec.dtype)
    except TypeError:
        return np.dtype(spec.dtype)


def _static_row_shape(spec: Any) -> Optional[Tuple[int, ...]]:
    """The shape of one row (dims after dim 0) if every one is a known int, else None."""
    shape = getattr(spec, "shape", None)
    if not shape:
        return None
    rest = shape[1:]
    return tuple(rest) if all(isinstance(d, int) for d in rest) else None


class _BufferSet(dict):
    """One preallocated set of a bucket's input buffers (by input name), with its ``outputs`` buffers."""

    outputs: Dict[str, np.ndarray] = {}


class StagedBatch:
    """One bucket's buffers, held by one batch between :meth:`Staging.acquire` and :meth:`release`.
    ``arrays[name]`` has ``bucket`` rows; rows ``[0, rows)`` are written by :meth:`write` or
    :meth:`write_bytes`, :meth:`pad` fills the rest."""

    def __init__(self, staging: "Staging", bucket: int, arrays: Dict[str, np.ndarray],
                 pooled_set: Optional[Dict[str, np.ndarray]]):
        self.staging = staging
        self.bucket = bucket
        self.arrays = arrays
        self._set = pooled_set  # the preallocated set this batch holds (None: buffers made for it alone)
        self._next = {name: 0 for name in arrays}
        self.released = False
        self.outputs: Dict[str, np.ndarray] = {}  # where the executor may write the outputs (bucket rows)
        self._alone: List[np.ndarray] = []        # buffers made for this batch only
        # Rows in CUDA shared memory (server/cuda_shm.py): not copied here; the GPU worker patches them in.
        self._device: Dict[str, List[Tuple[int, Any]]] = {}
        self._device_end: Dict[str, int] = {}

    @property
    def rows(self) -> int:
        """Rows written so far (the same for every input once a batch is complete)."""
        return max(self._next.values(), default=0)

    def write(self, name: str, rows: np.ndarray, start: Optional[int] = None) -> int:
        """Copy ``rows`` (dim 0 = rows) into input ``name`` at row ``start`` (default: after the last
        write); returns the row after them."""
        buf = self.arrays[name]
        start = self._next[name] if start is None else start
        span = getattr(rows, "span", None)
        rows = np.asanyarray(rows)
        if rows.ndim == 0 or rows.shape[1:] != buf.shape[1:]:
            raise InputError(f"input '{name}': rows of shape {list(rows.shape)} do not fit a staging buffer of "
                             f"rows {list(buf.shape[1:])}")
        end = start + rows.shape[0]
        if end > self.bucket:
            raise KilnError(f"input '{name}': rows {start}..{end} do not fit bucket {self.bucket}")
        if span is not None:  # rows in a CUDA region: the GPU worker copies them in, device to device
            if rows.dtype != buf.dtype:
                raise InputError(f"input '{name}': {rows.dtype} rows in CUDA shared memory cannot go into a "
                                 f"{buf.dtype} batch")
            self._device.setdefault(name, []).append((start, span))
            self._device_end[name] = end
        else:
            np.copyto(buf[start:end], rows, casting="same_kind")
            if self._device_end.get(name) == end:
                del self._device_end[name]
        self._next[name] = max(self._next[name], end)
        return end

    def device_patches(self) -> Dict[str, Dict[str, Any]]:
        """The rows that are in CUDA regions, by input: ``{"parts": [(row, CudaSpan)], "pad_from": n or None}``
        (``pad_from``: rows ``[n, bucket)`` are to be copied from row n - 1 on the device, because that row is
        a device row and the host pad copied a stand-in)."""
        n = self.rows
        return {name: {"parts": parts, "pad_from": n if n < self.bucket and self._device_end.get(name) == n else None}
                for name, parts in self._device.items()}

    def write_bytes(self, name: str, data: Any, start: Optional[int] = None) -> int:
        """Decode raw little-endian tensor bytes (the binary tensor data of a request, any buffer) for whole
        rows of input ``name`` straight into the buffer at row ``start``; returns the row after them."""
        buf = self.arrays[name]
        row_bytes = buf[0].nbytes
        mv = memoryview(data).cast("B")
        if row_bytes == 0 or len(mv) % row_bytes:
            raise InputError(f"input '{name}': {len(mv)} bytes is not a whole number of rows of {row_bytes} bytes")
        rows = np.frombuffer(mv, dtype=buf.dtype.newbyteorder("<")).reshape((len(mv) // row_bytes, *buf.shape[1:]))
        return self.write(name, rows, start)  # frombuffer is a view: one copy, into the staging buffer

    def pad(self) -> Dict[str, np.ndarray]:
        """Fill rows ``[rows, bucket)`` of every input with copies of its last real row; return the buffers."""
        counts = set(self._next.values())
        if len(counts) != 1:
            raise KilnError(f"the inputs of a staged batch have different row counts: {self._next}")
        n = counts.pop()
        if n < 1:
            raise KilnError("cannot pad an empty batch (0 rows): there is no real row to copy")
        if n < self.bucket:
            for buf in self.arrays.values():
                buf[n:] = buf[n - 1]
        return self.arrays

    def release(self) -> None:
        """Give the buffers back for the next batch of this bucket (idempotent)."""
        if not self.released:
            self.released = True
            self.staging._give_back(self, reuse=True)

    def discard(self) -> None:
        """Never reuse these buffers (someone may still read them: a cancelled batch whose run goes on in
        a thread, or an asynchronous copy); the pool gets a fresh set instead."""
        if not self.released:
            self.released = True
            self.staging._give_back(self, reuse=False)

    def retire(self) -> None:
        """After :meth:`discard`, once nothing reads the buffers any more: give every one of them back to the
        allocator (an arena's ``free``; nothing without one). Idempotent."""
        if getattr(self, "_retired", False) or self.staging.free is None:
            return
        self._retired = True
        for buf in list(self.arrays.values()) + list(self.outputs.values()):
            self.staging.free(buf)

    def __enter__(self) -> "StagedBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Staging:
    """Host buffers for batches, preallocated per bucket and input by ``allocator(shape, dtype)`` (default
    ``np.empty``; a GPU executor passes a pinned-memory allocator so that host-to-device copies can be
    asynchronous). ``copies`` sets of buffers per bucket are made up front (one per batch that can be in
    flight at once: the executor's capacity). When all are busy, or an input has a dynamic non-batch dim
    (sequence length) so its row shape is only known per batch, that batch gets buffers made for it
    alone by the same allocator, which are not kept.

    ``specs`` are TensorSpecs (``name``, ``dtype``, ``shape``) of the model's inputs, dim 0 the batch."""

    def __init__(self, specs: Sequence[Any], buckets: Sequence[int], allocator: Allocator = np.empty,
                 copies: int = 1, outputs: Sequence[Any] = (), free: Optional[Callable[[np.ndarray], None]] = None):
        self.buckets = tuple(buckets)
        self.allocator = allocator
        self.free = free  # gives a buffer made for one batch alone back to the allocator (an arena's free)
        self._specs = {s.name: (_np_dtype(s), _static_row_shape(s)) for s in specs}
        # Output buffers (``outputs``: the model's output specs) for executors that write their answers into
        # memory the caller gives (a worker process writing into the shared arena): static row shapes only.
        self._out_specs = {s.name: (_np_dtype(s), _static_row_shape(s)) for s in outputs}
        self._free: Dict[int, List[_BufferSet]] = {b: [] for b in self.buckets}
        self._lock = threading.Lock()
        self.allocations = 0  # buffers the allocator has made so far
        for b in self.buckets:
            for _ in range(max(1, int(copies))):
                self._free[b].append(self._new_set(b))

    def _new_set(self, bucket: int) -> "_BufferSet":
        bufs = _BufferSet((name, self._alloc(bucket, row, dtype)) for name, (dtype, row) in self._specs.items()
                          if row is not None)
        bufs.outputs = {name: self._alloc(bucket, row, dtype) for name, (dtype, row) in self._out_specs.items()
                        if row is not None}
        return bufs

    def _alloc(self, bucket: int, row: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.allocations += 1
        return self.allocator((bucket, *row), dtype)

    def acquire(self, bucket: int, row_shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> StagedBatch:
        """Buffers for one batch at ``bucket`` rows. ``row_shapes`` gives the row shape of inputs whose
        non-batch dims are dynamic (taken from the batch's requests)."""
        if bucket not in self._free:
            raise KilnError(f"{bucket} is not a batch bucket ({list(self.buckets)})")
        with self._lock:
            pool = self._free[bucket]
            pooled = pool.pop() if pool else None
        arrays, alone = {}, []
        for name, (dtype, row) in self._specs.items():
            want = tuple(row_shapes[name]) if row_shapes and name in row_shapes else row
            if want is None:
                raise KilnError(f"input '{name}' has dynamic dims: acquire() needs its row shape")
            buf = pooled.get(name) if pooled is not None else None
            if buf is None or tuple(buf.shape[1:]) != want:
                buf = self._alloc(bucket, want, dtype)
                alone.append(buf)
            arrays[name] = buf
        if pooled is not None:
            outputs = dict(pooled.outputs)
        else:
            outputs = {name: self._alloc(bucket, row, dtype) for name, (dtype, row) in self._out_specs.items()
                       if row is not None}
            alone += outputs.values()
        batch = StagedBatch(self, bucket, arrays, pooled)
        batch.outputs = outputs
        batch._alone = alone
        return batch

    def _give_back(self, batch: StagedBatch, reuse: bool) -> None:
        if reuse and self.free is not None:
            for buf in batch._alone:  # buffers made for that batch alone: back to the allocator
                self.free(buf)
        if batch._set is None:
            return  # buffers made for that batch alone: dropped
        replacement = batch._set if reuse else self._new_set(batch.bucket)
        with self._lock:
            self._free[batch.bucket].append(replacement)

    def free_sets(self, bucket: int) -> List[Dict[str, np.ndarray]]:
        """The free preallocated buffer sets of ``bucket`` (for tests and diagnostics)."""
        with self._lock:
            return list(self._free[bucket])

    def stage(self, parts: Sequence[Mapping[str, np.ndarray]], bucket: int) -> StagedBatch:
        """Acquire ``bucket``'s buffers and copy every request's rows in, in order, then pad. ``parts`` are
        the requests' inputs (each with the same non-batch shapes and dtypes)."""
        first = parts[0]
        row_shapes = {name: tuple(np.shape(first[name])[1:]) for name in self._specs}
        batch = self.acquire(bucket, row_shapes)
        try:
            for part in parts:
                for name in self._specs:
                    batch.write(name, part[name])
            batch.pad()
        except BaseException:
            batch.release()
            raise
        return batch


# ---------------------------------------------------------------------------------------------- executor

#: Batches with at least this many input bytes are copied into their staging buffers on a thread; 0 (the
#: default): never. Measured on the H100 machine (ResNet-50, 602 KB requests, two interleaved A/B rounds in
#: one call): with a 1 MiB threshold kiln served 1,454/1,513 requests/s at 64 HTTP clients against
#: 1,776/2,065 copying on the event loop, and 1,918/2,538 against 2,666/2,686 over shared memory at 256:
#: the thread hop and the GIL hand-offs cost more than the copy they move off the loop.
_STAGE_IN_THREAD_BYTES = int(os.environ.get("KILN_STAGE_THREAD_BYTES", "0") or 0)


def _settle(job) -> None:
    """Retrieve a finished job's exception (nobody awaits a cancelled batch's inner run)."""
    if not job.cancelled():
        job.exception()


def _release_when_done(job) -> None:
    """A staging job whose batch was cancelled while it copied: give its buffers back once it is done."""
    if not job.cancelled() and job.exception() is None:
        job.result().release()


def _output_patches(parts: Sequence[Mapping[str, Any]], first: str,
                    device_out: Sequence[Optional[Mapping[str, Any]]]) -> Dict[str, List[Tuple[int, int, Any]]]:
    """``{output: [(row, rows, CudaSpan)]}``: where each part's rows of an output go (its row offset in the
    batch, its row count, its region)."""
    patches: Dict[str, List[Tuple[int, int, Any]]] = {}
    row = 0
    for part, spans in zip(parts, device_out):
        rows = int(np.shape(part[first])[0])
        for name, span in (spans or {}).items():
            patches.setdefault(name, []).append((row, rows, span))
        row += rows
    return patches


def whole_outputs(device_out: Optional[Sequence[Optional[Mapping[str, Any]]]]) -> Dict[str, Any]:
    """The ``device_out=`` keyword for a batch of one request run as it came: each output written whole
    (``rows`` None) to its region; {} when there is nothing to write."""
    spans = device_out[0] if device_out else None
    return {"device_out": {name: [(0, None, span)] for name, span in spans.items()}} if spans else {}


def uses_buckets(config: Any) -> bool:
    """Whether ``kiln serve`` wraps a model's executor in a :class:`BucketedExecutor`: ``buckets`` true, or
    ``buckets`` unset (None) and ``preferred_batch_size`` set."""
    flag = getattr(config, "buckets", None)
    if flag is not None:
        return bool(flag)
    return bool(getattr(config, "preferred_batch_size", None))


class BucketedExecutor:
    """Any executor (server/workers.py's protocol: ``start``/``run``/``close``, ``inputs``/``outputs``,
    ``ready``/``capacity``, ``batch_analysis``) behind batch buckets: each batch is padded to its bucket in
    :class:`Staging` buffers, run, and sliced back. ``start()`` (a coroutine) starts the inner executor and
    runs :meth:`warm_up`; ``ready`` is false until both are done.

    Which models are padded is decided like the batcher decides what it stacks
    (:func:`kiln.server.batcher.decide`), from ``config.batching``, ``config.max_batch_size``, the specs
    and the inner executor's ``batch_analysis``: a model the batcher does not stack runs unbatched.
    Other attributes (``pids``, ``restarts``, ``program`` ...) are the inner executor's."""

    def __init__(self, inner: Any, config: Any, allocator: Allocator = np.empty):
        self.inner = inner
        self.config = config
        self.allocator = allocator
        self.max_batch_size = int(getattr(config, "max_batch_size", 0) or 0)
        self.preferred = list(getattr(config, "preferred_batch_size", None) or [])
        self.buckets: Tuple[int, ...] = ()
        self.padded = False      # whether batches are padded (the model is stacked); known after start()
        self.reason = ""         # why not, when not
        self.staging: Optional[Staging] = None
        self.warmed = False
        self.warm_up_runs: Dict[int, int] = {}  # bucket -> warm-up runs (1 each after start())
        self.batches: Dict[int, int] = {}       # bucket -> batches served at that size

    # -- the executor protocol -------------------------------------------------------------------------

    @property
    def inputs(self):
        return self.inner.inputs

    @property
    def outputs(self):
        return self.inner.outputs

    @property
    def batch_analysis(self):
        return getattr(self.inner, "batch_analysis", None)

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def ready(self) -> bool:
        return self.warmed and bool(self.inner.ready)

    @property
    def max_batch_rows(self) -> int:
        """The largest bucket: the batcher never sends more rows in one batch."""
        return self.buckets[-1] if self.buckets else self.max_batch_size

    def __getattr__(self, name: str) -> Any:  # pids, restarts, worker_info, program ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def start(self) -> None:
        start = self.inner.start
        if inspect.iscoroutinefunction(start):
            await start()
        else:
            await asyncio.to_thread(start)
        self._plan()
        await self.warm_up()

    def _plan(self) -> None:
        from kiln.server.batcher import batch_dim, decide, executor_analysis
        symbol = batch_dim(list(self.inputs), list(self.outputs))
        mode = str(getattr(self.config, "batching", "auto") or "auto")
        analysis = executor_analysis(self.inner) if symbol is not None and mode != "off" else None
        decision = decide(mode, self.max_batch_size, symbol, analysis)
        self.padded = decision.stacks
        self.reason = decision.reason
        if self.padded:
            self.buckets = plan_buckets(self.max_batch_size, self.preferred)
            # An inner executor with a shared arena (worker processes, server/arena.py) gets its batches in
            # arena buffers and writes its answers into arena buffers too: nothing is pickled.
            arena = getattr(self.inner, "arena", None)
            allocator, free = (arena.allocator, arena.free) if arena is not None else (self.allocator, None)
            outputs = self.outputs if getattr(self.inner, "writes_out", False) else ()
            self.staging = Staging(self.inputs, self.buckets, allocator, copies=self.capacity, outputs=outputs,
                                   free=free)
        else:
            self.buckets = ()

    async def warm_up(self) -> None:
        """Run every bucket once (an unbatched model: once), on zeros of the inputs' static shapes, so that
        a compiling or graph-capturing executor does that work now and not on the first request. A model
        that rejects zeros (ExecutionError, InputError) is logged, not failed; other errors (a dead
        worker, out of memory) fail the start."""
        sizes: List[Optional[int]] = list(self.buckets) if self.padded else [None]
        shapes = []
        for spec in self.inputs:
            shape = list(spec.shape or ())
            if self.padded:
                shape = shape[1:]
            if not all(isinstance(d, int) for d in shape):
                log.info("batch buckets: input '%s' has dynamic dims %s; warm-up skipped", spec.name, spec.shape)
                self.warmed = True
                return
            shapes.append((spec.name, tuple(shape), _np_dtype(spec)))
        for size in sizes:
            inputs = {name: np.zeros(((size,) if size is not None else ()) + shape, dtype)
                      for name, shape, dtype in shapes}
            key = size if size is not None else 0
            self.warm_up_runs[key] = self.warm_up_runs.get(key, 0) + 1
            try:
                await self.inner.run(inputs)
            except (ExecutionError, InputError) as e:
                log.warning("batch buckets: warm-up of bucket %s failed on zero inputs (%s); continuing", size, e)
        self.warmed = True

    async def run(self, inputs: Dict[str, np.ndarray], device_out: Any = None) -> Dict[str, np.ndarray]:
        """Run one batch (already stacked)."""
        return await self.run_parts([inputs], [device_out[0]] if device_out else None)

    async def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]],
                        device_out: Optional[Sequence[Optional[Mapping[str, Any]]]] = None) -> Dict[str, np.ndarray]:
        """Run the requests ``parts`` as one batch: their rows are copied straight into the bucket's staging
        buffers (no concatenate), padded, run, and the outputs sliced back to the real rows (the batcher
        splits them per request). ``device_out``: per part, ``{output: CudaSpan}`` that the GPU worker writes
        the part's rows to (server/cuda_shm.py)."""
        names = [s.name for s in self.inputs]
        if not self.padded:
            if len(parts) == 1:
                return await self.inner.run(dict(parts[0]), **whole_outputs(device_out))
            names = list(parts[0])
            return await self.inner.run({n: np.concatenate([p[n] for p in parts]) for n in names})
        n = sum(int(np.shape(p[names[0]])[0]) for p in parts)
        patches_out = _output_patches(parts, names[0], device_out) if device_out else None
        extra = {"device_out": patches_out} if patches_out else {}
        if n > self.max_batch_rows:
            raise KilnError(f"a batch of {n} rows is more than the largest batch bucket ({self.max_batch_rows})")
        bucket = bucket_for(n, self.buckets)
        if _STAGE_IN_THREAD_BYTES and \
                sum(int(np.asarray(p[k]).nbytes) for p in parts for k in names) >= _STAGE_IN_THREAD_BYTES:
            # A big batch's copy (a ResNet-50 batch of 32 is 19 MB, ~3 ms) on a thread, so that the event loop
            # reads requests meanwhile: off by default, measured slower (see _STAGE_IN_THREAD_BYTES).
            job = asyncio.get_running_loop().run_in_executor(None, self.staging.stage, parts, bucket)
            try:
                staged = await asyncio.shield(job)
            except asyncio.CancelledError:
                job.add_done_callback(_release_when_done)
                raise
        else:
            staged = self.staging.stage(parts, bucket)
        run = None
        try:
            self.batches[bucket] = self.batches.get(bucket, 0) + 1
            kwargs: Dict[str, Any] = dict(extra)
            if staged.outputs:
                kwargs["out"] = staged.outputs
            device = staged.device_patches()
            if device:
                kwargs["device"] = device
            run = asyncio.ensure_future(self.inner.run(dict(staged.arrays), **kwargs))
            # Shielded: a cancelled batch's inner run goes on (a worker may be reading these buffers), and
            # when it is over its buffers go back to their allocator (an arena block is not leaked).
            outputs = await asyncio.shield(run)
            result = unpad(outputs, n, bucket)
            bufs = list(staged.arrays.values()) + list(staged.outputs.values())
            # An output that is (a view of) a staging buffer would change under the next batch: copy it.
            result = {name: (np.array(a) if any(np.may_share_memory(a, b) for b in bufs) else a)
                      for name, a in result.items()}
        except asyncio.CancelledError:
            staged.discard()  # the inner run may still be reading these buffers: the pool gets a fresh set
            if run is not None and self.staging.free is not None:
                run.add_done_callback(lambda job, s=staged: (_settle(job), s.retire()))
            elif run is not None:
                run.add_done_callback(_settle)
            raise
        except BaseException:
            staged.release()
            raise
        staged.release()
        return result

    async def close(self) -> None:
        await self.inner.close()
