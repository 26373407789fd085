"""``kiln serve --device cuda[:N]``: models run as ``CudaProgram``s in GPU worker processes (issue 17).

**One worker process per GPU instance**, never threads of the HTTP process and never one process for
several GPUs:

- *Faults stay in one worker.* A CUDA fault (an illegal address, a launch failure) poisons the CUDA
  context of the process it happens in: every later call on that context fails. In a worker the fault is
  answered (the batch's requests get a 500 naming it) and the worker exits; the executor starts a fresh
  process with a fresh context (the replacement logic of :class:`~kiln.server.workers.ProcessExecutor`),
  and the HTTP process, which never touches CUDA, keeps serving. A worker that dies outright (SIGKILL, a
  segfault in a library) is replaced the same way.
- *Placement by environment.* Each worker gets ``CUDA_VISIBLE_DEVICES=<its GPU>`` in its environment, so
  inside it the GPU is device 0 and nothing it does (CuPy's pools, cuBLAS/cuDNN handles, CUDA graphs) can
  land on another card.
- *No GIL between GPUs*: each worker's Python (plan dispatch, graph launches, pickling) runs on its own core.

Instances: ``instance_group`` ``[{"kind": "gpu", "count": N, "gpus": [0, 1]}]`` is N workers per listed GPU
(``gpus`` left out: the ``--device`` GPU). Without a gpu group, ``workers`` (default 1) workers on the
``--device`` GPU (``cuda`` = ``cuda:0``). Each worker takes two batches at a time (``instances``, at least
2): while one runs on the GPU (one at a time, a lock in the worker) the next is already received and
unpickled.

Batch buckets are on by default for GPU models that the batcher stacks (powers of two up to
``max_batch_size``, plus ``preferred_batch_size``; ``"buckets": false`` turns them off), and warm-up runs
each bucket twice before the model is ready: ``CudaProgram`` captures a CUDA graph for an input-shape
signature on the first run of that signature (the run itself is eager, then the plan is captured), and
the second run replays it, so the first request of every bucket size replays a graph.

Load failures (no GPU, out of memory) fail that model's start with the reason (:func:`describe_load_failure`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional

from kiln.errors import KilnError
from kiln.server.buckets import BucketedExecutor
from kiln.server.errors import WorkerError
from kiln.server.workers import ProcessExecutor, worker_env

log = logging.getLogger("kiln.server")


def parse_device(device: Any) -> Optional[int]:
    """``"cpu"`` -> None; ``"cuda"`` -> 0; ``"cuda:N"`` -> N. Anything else: KilnError."""
    d = str(device or "cpu").strip().lower()
    if d == "cpu":
        return None
    if d == "cuda":
        return 0
    if d.startswith("cuda:") and d[5:].isdigit():
        return int(d[5:])
    raise KilnError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def gpu_slots(config: Any) -> List[int]:
    """The GPU of each worker process, in order: every gpu instance group's ``count`` workers on each of its
    ``gpus`` (default: the config's device GPU); without a gpu group, ``workers`` (at least 1) on it."""
    default = parse_device(getattr(config, "device", "cuda"))
    default = 0 if default is None else default
    groups = [g for g in getattr(config, "instance_group", None) or [] if g.get("kind") == "gpu"]
    if not groups:
        return [default] * max(1, int(getattr(config, "workers", 1) or 1))
    slots: List[int] = []
    for g in groups:
        for gpu in g.get("gpus") or [default]:
            slots += [int(gpu)] * int(g.get("count", 1))
    return slots


def visible_device(index: int, environ: Optional[Dict[str, str]] = None) -> str:
    """What a worker for this process's CUDA device ``index`` gets as its ``CUDA_VISIBLE_DEVICES``: the
    ``index``-th entry of this process's own ``CUDA_VISIBLE_DEVICES`` (an index, ``GPU-<uuid>`` or ``MIG-<uuid>``),
    or ``index`` itself where that is unset. Without the mapping a worker of a process that sees a subset of the
    cards (Ray sets ``CUDA_VISIBLE_DEVICES=3`` for a replica given GPU 3; a user's ``CUDA_VISIBLE_DEVICES=2,3``)
    would run on another card than the one meant: physical 0 instead of 3, possibly one another replica owns."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    entries = [e.strip() for e in visible.split(",")]
    # CUDA ignores the list from its first invalid entry on (e.g. "-1" hides every GPU); so does this.
    usable = []
    for e in entries:
        if not e or (e.lstrip("-").isdigit() and int(e) < 0):
            break
        usable.append(e)
    if not 0 <= index < len(usable):
        raise KilnError(f"CUDA device {index} is not visible to this process (CUDA_VISIBLE_DEVICES={visible!r} "
                        f"shows {len(usable)} GPU(s))")
    return usable[index]


def check_gpus(entries: list, probe=None) -> None:
    """Before a port is bound: every model served on ``cuda`` has CuPy and the GPUs it names. ``probe()``
    returns the number of GPUs (default: CuPy's device count); it raises or returns 0 where there are none.
    A gpu instance group on a model served on the CPU is refused too."""
    cuda = [e for e in entries if parse_device(getattr(e.config, "device", "cpu")) is not None]
    cpu_gpu = [e for e in entries if e not in cuda and e.config.gpu_groups]
    if cpu_gpu:
        names = ", ".join(f"{e.name} (version {e.version})" for e in cpu_gpu)
        raise KilnError(f"model(s) {names}: instance_group asks for kind \"gpu\" but the device is the CPU; "
                        "serve with --device cuda (or set \"device\": \"cuda\" in config.json)")
    if not cuda:
        return
    count = (probe or _device_count)()
    if count <= 0:
        raise KilnError("--device cuda: no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); serve on the CPU without --device")
    for e in cuda:
        wanted = sorted(set(gpu_slots(e.config)))
        missing = [g for g in wanted if g >= count]
        if missing:
            raise KilnError(f"model {e.name} (version {e.version}) asks for GPU(s) {missing}, but this machine "
                            f"has {count} GPU(s) (0..{count - 1})")


def _device_count() -> int:
    try:
        import cupy
    except ImportError as e:
        raise KilnError(f"--device cuda needs CuPy (pip install 'kiln-compiler[gpu]'): {e}") from None
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - no driver, no device: one line
        raise KilnError(f"--device cuda: no usable CUDA GPU ({type(e).__name__}: {e})") from None


# ------------------------------------------------------------------------------------ worker process side

def load_on_gpu(path: str, precision: Optional[str] = None) -> Any:
    """The worker's program: ``kiln.load(path, device="cuda", output="numpy", wait="block")`` on the one GPU
    its CUDA_VISIBLE_DEVICES shows (outputs come back to host memory, into the caller's arena buffers or the
    program's page-locked ones). ``wait="block"``: a batch waits for its replay in cudaEventSynchronize,
    without the GIL, so the worker's other thread receives and uploads the next batch meanwhile (polling
    held the GIL for the whole replay: the next batch's thread got it only at Python's 5 ms switch
    interval)."""
    from kiln.runtime.program import load
    extra = {"precision": precision} if precision not in (None, "", "fp32") else {}
    return load(path, device="cuda", output="numpy", wait="block", **extra)


class GpuRunner:
    """How a GPU worker runs a batch (the worker's ``execute`` threads call :meth:`run`; two at a time).

    - *Page-locked in place.* Inputs and ``out`` buffers that live in the shared arena (server/arena.py)
      are page-locked in this process the first time a block is seen (``cudaHostRegister``; blocks are
      reused batch after batch, so this happens in warm-up), so copies to and from them are DMA.
    - *Copies overlap compute.* A batch's inputs are copied to the device on its thread's own stream
      *before* it takes the GPU lock, while the previous batch runs; under the lock the program's graph
      stream waits for that copy (``CudaProgram.run`` orders its graph after the caller's stream) and
      copies the inputs device to device into the graph's buffers (~10 us for a ResNet-50 batch of 32).
      Outputs go device to host straight into the ``out`` buffers (``CudaProgram.run(out=...)``).
    - *Timings* (:attr:`timings` after :meth:`run`, sent back with the answer): ``h2d`` the device time of
      the input copies, ``d2h`` of the output copies (CUDA events), ``gpu_wait`` the time the batch waited
      for the GPU lock, ``run`` the time under it (seconds).
    """

    def __init__(self, program: Any, arena: Any = None):
        import cupy
        self.cp = cupy
        self.program = program
        self.arena = arena
        self.lock = threading.Lock()
        self._registered: Dict[int, int] = {}
        self._reg_lock = threading.Lock()
        self._local = threading.local()
        # CUDA shared memory (server/cuda_shm.py): handle -> [registration id, device pointer, users, closing]
        self._ipc: Dict[bytes, list] = {}
        self._ipc_lock = threading.Lock()

    # -- CUDA shared memory: IPC handles opened here, device to device copies ----------------------------

    def _acquire(self, span: Any) -> int:
        """The device address of ``span`` (its region's handle opened once per registration), held until
        :meth:`_release`."""
        rt = self.cp.cuda.runtime
        with self._ipc_lock:
            entry = self._ipc.get(span.handle)
            if entry is not None and entry[0] != span.reg_id:  # re-registered since: open it afresh
                if entry[2]:
                    raise KilnError("a CUDA shared memory region was re-registered while a batch still reads it")
                del self._ipc[span.handle]
                rt.ipcCloseMemHandle(entry[1])
                entry = None
            if entry is None:
                ptr = rt.ipcOpenMemHandle(span.handle, 1)  # cudaIpcMemLazyEnablePeerAccess
                entry = self._ipc[span.handle] = [span.reg_id, ptr, 0, False]
            entry[2] += 1
            return entry[1] + span.offset

    def _release(self, span: Any) -> None:
        with self._ipc_lock:
            entry = self._ipc.get(span.handle)
            if entry is None:
                return
            entry[2] -= 1
            if entry[2] <= 0 and entry[3]:
                del self._ipc[span.handle]
                self.cp.cuda.runtime.ipcCloseMemHandle(entry[1])

    def close_cuda(self, handle: bytes) -> None:
        """The region was unregistered: close its mapping now, or when the last batch reading it is done."""
        with self._ipc_lock:
            entry = self._ipc.get(handle)
            if entry is None:
                return
            if entry[2] > 0:
                entry[3] = True
                return
            del self._ipc[handle]
        self.cp.cuda.runtime.ipcCloseMemHandle(entry[1])

    def close_all(self) -> None:
        with self._ipc_lock:
            entries, self._ipc = list(self._ipc.values()), {}
        for entry in entries:
            try:
                self.cp.cuda.runtime.ipcCloseMemHandle(entry[1])
            except Exception:  # noqa: BLE001 - the process is exiting
                pass

    def _patch(self, dev: Dict[str, Any], inputs: Dict[str, Any], device: Dict[str, Any], stream: Any,
               held: list) -> None:
        """Copy the batch's rows that are in CUDA regions into its device inputs (device to device, on
        ``stream``), and pad from the last real row where that row came from a region."""
        import numpy as np
        cp = self.cp
        for name, spec in device.items():
            d = dev.get(name)
            if d is None:
                if name in inputs:
                    d = cp.asarray(inputs[name])
                else:
                    d = cp.empty(tuple(spec["shape"]), np.dtype(spec["dtype"]))
            elif not isinstance(d, cp.ndarray):
                d = cp.asarray(d)
            row_bytes = d.nbytes // d.shape[0] if d.ndim and d.shape[0] else 0
            for row, span in spec["parts"]:
                if row * row_bytes + span.nbytes > d.nbytes:
                    raise KilnError(f"input '{name}': {span.nbytes} bytes of CUDA shared memory at row {row} do "
                                    f"not fit the batch's {d.nbytes} bytes")
                src = self._acquire(span)
                held.append(span)
                if span.nbytes:
                    cp.cuda.runtime.memcpyAsync(d.data.ptr + row * row_bytes, src, span.nbytes, 3, stream.ptr)
            n = spec.get("pad_from")
            if n:
                d[n:] = d[n - 1]
            dev[name] = d

    def _pin(self, a: Any) -> bool:
        """Page-lock ``a``'s arena block in this process (once per block); False if it is not in the arena
        or could not be locked."""
        arena = self.arena
        ref = arena.ref(a) if arena is not None else None
        if ref is None:
            return False
        from kiln.server.arena import PAGE
        start = ref.offset - ref.offset % PAGE
        size = -(-(ref.offset + a.nbytes - start) // PAGE) * PAGE
        with self._reg_lock:
            known = self._registered.get(start)
            if known is not None:
                return known >= size
            try:
                self.cp.cuda.runtime.hostRegister(arena.base + start, size, 0)
                self._registered[start] = size
            except Exception:  # noqa: BLE001 - pageable memory still works, only slower
                log.warning("could not page-lock %d bytes of the staging arena", size, exc_info=True)
                self._registered[start] = -1
                return False
        return True

    def _stream(self):
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = self.cp.cuda.Stream(non_blocking=True)
        return s

    def run(self, inputs: Dict[str, Any], out: Optional[Dict[str, Any]] = None,
            device: Optional[Dict[str, Any]] = None, device_out: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        held: list = []
        try:
            result = self._run(inputs, out, device, held)
            if device_out:
                self._write_outputs(result, device_out, held)
            return result
        finally:
            for span in held:
                self._release(span)

    def _write_outputs(self, result: Dict[str, Any], device_out: Dict[str, Any], held: list) -> None:
        """Copy each request's rows of the outputs it asked for in CUDA regions there (host to device, from the
        batch's host outputs, page-locked when they are arena blocks), then wait for the copies: the client
        reads its region as soon as its response arrives."""
        import numpy as np
        from kiln.server.errors import RegionTooSmall
        stream = self._stream()
        too_small = []
        for name, parts in device_out.items():
            a = np.ascontiguousarray(result[name])
            row_bytes = a.nbytes // a.shape[0] if a.ndim and a.shape[0] else a.nbytes
            for row, rows, span in parts:
                start, size = (0, a.nbytes) if rows is None else (row * row_bytes, rows * row_bytes)
                if size > span.nbytes:
                    too_small.append(f"output '{name}' is {size} bytes but its shared_memory_byte_size is "
                                     f"{span.nbytes}")
                    continue
                if size:
                    dst = self._acquire(span)
                    held.append(span)
                    self.cp.cuda.runtime.memcpyAsync(dst, a.ctypes.data + start, size, 1, stream.ptr)
        stream.synchronize()
        if too_small:
            raise RegionTooSmall("; ".join(too_small))

    def _run(self, inputs: Dict[str, Any], out: Optional[Dict[str, Any]], device: Optional[Dict[str, Any]],
             held: list) -> Dict[str, Any]:
        import numpy as np
        cp = self.cp
        stream = self._stream()
        out = {k: v for k, v in (out or {}).items() if self._pin(v)} or None
        with stream:
            start, copied = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            dev = {}
            for name, a in inputs.items():
                a = np.ascontiguousarray(a)
                if device and name in device and _covered(device[name], a):
                    dev[name] = cp.empty(a.shape, a.dtype)  # every row comes from CUDA regions: no host copy
                elif self._pin(a):
                    d = cp.empty(a.shape, a.dtype)
                    d.data.copy_from_host_async(a.ctypes.data, a.nbytes, stream)
                    dev[name] = d
                else:
                    dev[name] = a  # pageable: the program copies it in on its own stream
            if device:
                self._patch(dev, inputs, device, stream, held)
            copied.record(stream)
            t0 = time.perf_counter()
            with self.lock:
                t1 = time.perf_counter()
                result = self.program.run(dev, out=out)
                d2h = float(getattr(self.program, "last_d2h_seconds", 0.0))
            t2 = time.perf_counter()
        # The program's run waited for its graph, which waited for this stream's copies: both events are done.
        self._local.timings = {"h2d": cp.cuda.get_elapsed_time(start, copied) / 1e3, "d2h": d2h,
                               "gpu_wait": t1 - t0, "run": t2 - t1}
        return result

    @property
    def timings(self) -> Dict[str, float]:
        """The calling thread's last batch timings (see the class docstring)."""
        return getattr(self._local, "timings", {})


def _covered(spec: Dict[str, Any], a: Any) -> bool:
    """Whether a batch input's device patches fill all its rows (the real ones, then the pad from them)."""
    rows = a.shape[0] if a.ndim else 0
    if not rows:
        return False
    real = spec.get("pad_from") or rows
    return sum(span.nbytes for _, span in spec["parts"]) == real * (a.nbytes // rows)


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _is_cuda_error(e: BaseException) -> bool:
    for x in _chain(e):
        mod = type(x).__module__ or ""
        text = f"{type(x).__name__}: {x}"
        if mod.startswith(("cupy", "cupy_backends", "cuda")) or "cudaError" in text or "CUDA_ERROR" in text \
                or "OutOfMemoryError" in text or "CUBLAS_STATUS" in text or "CUDNN_STATUS" in text:
            return True
    return False


def _is_oom(e: BaseException) -> bool:
    return any("OutOfMemory" in type(x).__name__ or "out of memory" in str(x).lower()
               or "MemoryAllocation" in str(x) for x in _chain(e))


def cuda_fault(e: BaseException) -> Optional[BaseException]:
    """A WorkerError naming the CUDA failure if ``e`` came from CUDA (the worker then exits and is
    replaced), else None (an ordinary model error, answered as it is)."""
    if not _is_cuda_error(e):
        return None
    from kiln.server.errors import WorkerError
    what = "out of GPU memory" if _is_oom(e) else "a CUDA error"
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "?")
    return WorkerError(f"the GPU worker (pid {os.getpid()}, GPU {gpu}) hit {what} during this batch "
                       f"({type(e).__name__}: {e}); it is being replaced")


def describe_load_failure(path: str, e: BaseException) -> BaseException:
    """A load error as the server should report it: out of GPU memory and CUDA errors named as such."""
    if isinstance(e, KilnError) and not _is_cuda_error(e):
        return e
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "?")
    if _is_oom(e):
        return KilnError(f"{path}: out of GPU memory loading the model on GPU {gpu} ({type(e).__name__}: {e})")
    if _is_cuda_error(e):
        return KilnError(f"{path}: CUDA error loading the model on GPU {gpu} ({type(e).__name__}: {e})")
    return e


# ------------------------------------------------------------------------------------------- server side

class GpuExecutor(ProcessExecutor):
    """Worker processes on GPUs: the ProcessExecutor (pipes, ids, replacement of dead workers) with the
    model loaded as a CudaProgram and each worker pinned to its GPU (module docstring)."""

    device = "cuda"

    def __init__(self, path: Any, config: Any):
        self.slots = gpu_slots(config)
        super().__init__(path, config, len(self.slots))
        self.instances = max(2, self.instances)

    def _worker_env(self, slot: int) -> Dict[str, str]:
        env = worker_env(self.n_workers)
        env["CUDA_VISIBLE_DEVICES"] = visible_device(self.slots[slot])  # this process's device N, not physical N
        return env

    @property
    def gpus(self) -> List[int]:
        return sorted(set(self.slots))

    def _least_busy_on(self, gpu: int):
        free = [w for w in self._workers if w.alive and len(w.inflight) < self.instances and self.slots[w.slot] == gpu]
        return min(free, key=lambda w: len(w.inflight)) if free else None

    async def run(self, inputs: Dict[str, Any], out: Optional[Dict[str, Any]] = None,
                  device: Optional[Dict[str, Any]] = None, device_out: Any = None) -> Dict[str, Any]:
        """Run one batch. ``device``: rows of inputs in CUDA shared memory (server/cuda_shm.py), as
        StagedBatch.device_patches gives them; an input that is wholly a DeviceInput (an unpadded batch of one
        request) is turned into a patch here. ``device_out``: ``{output: [(row, rows, CudaSpan)]}`` (rows None:
        the whole output), or the batcher's per-request list for a batch of one request. Such a batch goes to a
        worker on the regions' GPU."""
        if isinstance(device_out, (list, tuple)):
            from kiln.server.buckets import whole_outputs
            device_out = whole_outputs(device_out).get("device_out")
        inputs = dict(inputs)
        device = dict(device or {})
        for name, a in list(inputs.items()):
            span = getattr(a, "span", None)
            if span is not None:
                del inputs[name]
                device[name] = {"parts": [(0, span)], "pad_from": None, "shape": tuple(a.shape), "dtype": a.dtype.str}
        if not device and not device_out:
            return await super().run(inputs, out)
        gpus = {span.device_id for d in device.values() for _, span in d["parts"]}
        gpus |= {span.device_id for parts in (device_out or {}).values() for *_, span in parts}
        if len(gpus) != 1:
            raise KilnError(f"a batch reads CUDA shared memory on several GPUs ({sorted(gpus)})")
        gpu = gpus.pop()
        if gpu not in self.slots:
            raise KilnError(f"CUDA shared memory on GPU {gpu}, but this model's workers run on GPU(s) {self.gpus}")
        sent, refs = self._run_payload(inputs, out)
        return await self._submit(lambda: self._least_busy_on(gpu),
                                  lambda rid: ("run", rid, sent, refs, device, device_out or None))

    async def close_cuda(self, device_id: int, handle: bytes) -> None:
        """Have every live worker on GPU ``device_id`` close its IPC mapping of ``handle`` (if it has one)."""
        for w in [w for w in self._workers if w.alive and self.slots[w.slot] == device_id]:
            try:
                await self._submit(lambda w=w: w if w.alive else None, lambda rid: ("cuda_close", rid, handle),
                                   wait=False)
            except WorkerError:
                pass  # gone: its handles went with it


class GpuBucketedExecutor(BucketedExecutor):
    """Buckets whose warm-up runs each bucket twice: the first run of a shape captures its CUDA graph, the
    second replays it (module docstring)."""

    warm_up_rounds = 2

    async def warm_up(self) -> None:
        for _ in range(self.warm_up_rounds):
            await super().warm_up()


def make_gpu_executor(path: Any, config: Any) -> Any:
    """The executor for a model on ``cuda``: GPU worker processes, in batch buckets unless ``buckets`` is
    false (a model the batcher does not stack runs unbatched inside the bucket wrapper, warmed up too)."""
    if getattr(config, "backend", "kiln") not in (None, "kiln"):
        raise KilnError(f"{path}: --device cuda serves the kiln backend (CudaProgram); backend "
                        f"{config.backend!r} is CPU-only in kiln serve")
    inner = GpuExecutor(path, config)
    if getattr(config, "buckets", None) is False:
        return inner
    return GpuBucketedExecutor(inner, config)
