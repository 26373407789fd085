"""Executors: where a model's batches run, in threads of the server process or in worker processes.

Both implement one small protocol (:class:`Executor`) that the batcher drives: ``start()`` loads the
model (blocking; call it before serving), ``await run(inputs)`` runs one batch, ``await close()`` stops,
``inputs``/``outputs`` are the program's TensorSpecs, ``ready`` says whether a run can be served now and
``capacity`` how many runs are worth having in flight at once (the batcher never exceeds it).

:class:`ThreadExecutor` (``--workers 0``) loads the model in the server process and runs batches on a
thread pool of ``instances`` threads: ``Program.run`` is thread-safe and numpy releases the GIL in its
kernels, so this is the cheapest path for small models.

:class:`ProcessExecutor` runs N worker processes, each of which does ``kiln.load(path)`` itself. Why
processes: Python-level work in the runtime (the instruction loop, small kernels) holds the GIL, so one
process cannot use more than one core for it; and a crash in a kernel takes down a worker, not the
server. Why this costs little memory: a .kiln file is memory-mapped and its weights are used in place,
so N workers share the same page-cache pages.

Workers are fresh interpreters (``python -c "...kiln.server.workers._worker_entry..."``), never a
``fork`` of the threaded server, and import only kiln and numpy, never torch or onnx (unless
``backend='onnxruntime'`` asks for ONNX Runtime). Not multiprocessing's ``spawn`` context: spawn
re-runs the parent's ``__main__`` script in every child, so a user's serving script would re-import
whatever it imports (torch, say) in each worker, or start servers recursively without a
``__main__`` guard. The child gets its end of a socketpair by fd and wraps it in
``multiprocessing.connection.Connection``, which gives the same framed pickle messages as a Pipe.
BLAS threads: unless the environment sets any of the thread variables (``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, ``VECLIB_MAXIMUM_THREADS``; then all are left as the user
set them), each worker gets ``max(1, (cpu_count - 1) // workers)`` in all of them (:func:`blas_threads`).
One core is left to the HTTP process, which parses, batches and encodes every request: with 1 worker
on 2 cores and OpenBLAS's default of one thread per core, the worker's BLAS threads spun on both cores
while the server process waited for CPU, and an MLP batch of 18 rows took 28.6 ms instead of 0.5 ms
(throughput with batching: 343 requests/s, against 929 with one BLAS thread). N workers share what is
left, so they do not oversubscribe the cores N times over.

Each worker talks to the server over its own duplex connection: the server sends
``("run", id, {name: array})`` (numpy arrays pickled, protocol 5), the worker answers
``("ok", id, outputs)`` or ``("err", id, exception)``. A worker has ``instances`` threads, so up to that
many batches are in flight per worker. One reader thread per worker receives the answers and resolves
the asyncio futures through ``loop.call_soon_threadsafe``. Requests carry ids, so answers may come back
in any order.

A worker that dies (a crash, an OOM kill, SIGKILL) closes its end of the pipe: the reader thread gets
EOF at once, fails every batch that worker had in flight with :class:`WorkerError` (so no caller hangs)
and starts a replacement (retrying with back-off if the replacement cannot load the model). Workers
ignore SIGINT/SIGTERM, so a Ctrl-C sent to the whole process group does not kill batches the server is
draining; a worker lives exactly as long as its pipe to the server, and exits on EOF if the server dies.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from kiln.errors import ExecutionError, KilnError
from kiln.server.errors import WorkerError

log = logging.getLogger("kiln.server")

# Payloads larger than this are pickled and written to the pipe on a helper thread, so one big request
# never stalls the event loop while the worker reads it.
_BIG_PAYLOAD = 1 << 20

# The shared staging arena's size (server/arena.py; only the pages used are backed): config "staging_mib".
DEFAULT_STAGING_MIB = 1024


@runtime_checkable
class Executor(Protocol):
    """What the batcher needs from a place that runs batches."""

    inputs: Sequence[Any]   # runtime.program.TensorSpec, known after start()
    outputs: Sequence[Any]

    @property
    def ready(self) -> bool: ...

    @property
    def capacity(self) -> int: ...

    def start(self) -> None: ...

    async def run(self, inputs: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]: ...

    async def close(self) -> None: ...


def _instances(config: Any) -> int:
    n = int(getattr(config, "instances", 1) or 1)
    if n < 1:
        raise KilnError(f"instances must be at least 1, got {n}")
    return n


class ThreadExecutor:
    """The model loaded in this process; batches run on a pool of ``config.instances`` threads.

    ``path`` is anything ``kiln.load`` takes (a .kiln/.onnx path or a Graph)."""

    def __init__(self, path: Any, config: Any):
        self.path = path
        self.backend = getattr(config, "backend", "kiln") or "kiln"
        self.memory_budget = getattr(config, "memory_budget", None)
        self.precision = getattr(config, "precision", None)
        self.instances = _instances(config)
        self.program = None
        self.inputs: List[Any] = []
        self.outputs: List[Any] = []
        self.batch_analysis: Any = None  # kiln.ir.batch_independence.BatchAnalysis, after start()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._closed = False

    def start(self) -> None:
        from kiln.runtime.program import load
        self.program = load(self.path, backend=self.backend, **_budget(self.backend, self.memory_budget),
                            **_precision(self.precision))
        self.inputs, self.outputs = list(self.program.inputs), list(self.program.outputs)
        check_servable(self.path, self.inputs + self.outputs)
        self.batch_analysis = batch_analysis(self.program)
        self._pool = ThreadPoolExecutor(self.instances, thread_name_prefix="kiln-run")

    @property
    def ready(self) -> bool:
        return self._pool is not None and not self._closed

    @property
    def capacity(self) -> int:
        return self.instances

    async def run(self, inputs: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        if not self.ready:
            raise WorkerError("the executor is not running (not started, or closed)")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.program.run, inputs)

    async def close(self) -> None:
        """Finish the batches already running, then release the threads."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown, True)


def make_executor(path: Any, config: Any) -> Any:
    """The executor ``kiln serve`` runs a model on: worker processes (``config.workers``), or threads in the
    server with ``workers=0``; wrapped in a BucketedExecutor (server/buckets.py) when the config asks for
    batch buckets (``buckets``, ``preferred_batch_size``). ``config.device`` ``cuda[:N]``: GPU worker
    processes (server/gpu.py), buckets on unless ``buckets`` is false. A ``gpu`` instance group on the
    CPU device is refused."""
    from kiln.server.buckets import BucketedExecutor, uses_buckets
    device = str(getattr(config, "device", "cpu") or "cpu")
    if device.startswith("cuda"):
        from kiln.server.gpu import make_gpu_executor
        return make_gpu_executor(path, config)
    if any(g.get("kind") == "gpu" for g in getattr(config, "instance_group", None) or []):
        raise KilnError(f"{path}: instance_group asks for kind \"gpu\", but the model is served on the CPU only "
                        "(its device is cpu); serve it with kiln serve --device cuda, or use kind \"cpu\"")
    workers = int(getattr(config, "workers", 1))
    inner = ThreadExecutor(path, config) if workers == 0 else ProcessExecutor(path, config, workers)
    return BucketedExecutor(inner, config) if uses_buckets(config) else inner


def batch_analysis(program: Any) -> Any:
    """The batch-independence analysis of the graph a loaded program runs (None if it has no graph):
    whether the batcher may stack requests for it (server/batcher.py)."""
    graph = getattr(program, "graph", None)
    if graph is None:
        return None
    from kiln.ir.batch_independence import BatchAnalysis, analyze_batching
    try:
        return analyze_batching(graph)
    except Exception as e:  # noqa: BLE001 - a bug in the analysis must not stop serving; it stops batching
        log.exception("the batch-independence analysis failed")
        return BatchAnalysis(False, None, f"the batch-independence analysis failed: {type(e).__name__}: {e}")


# ----------------------------------------------------------------------------------------------------
# Worker process side. Runs in the spawned child: keep it to kiln + numpy.

def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (kiln's errors do), else an ExecutionError that says what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any unpicklable exception becomes a plain message
        return ExecutionError(f"{type(e).__name__}: {e}")


def check_servable(path: Any, specs: Sequence[Any]) -> None:
    """Refuse, at load, a model whose inputs or outputs have no V2 datatype (float8, int4... : the protocol has
    none), rather than answering 500 to every metadata and inference request."""
    from kiln.server.protocol import ProtocolError, v2_datatype
    for s in specs:
        try:
            v2_datatype(s.dtype)
        except ProtocolError:
            raise KilnError(f"{path}: {s.name} is {s.dtype}, which the V2 inference protocol has no "
                            f"datatype for; serve a model that takes and returns it as another type (a Cast "
                            f"inside the model)") from None


def _budget(backend: str, memory_budget: Any) -> dict:
    """kiln.load's memory_budget= where one is set (the CPU runtime's option; none: KILN_MEMORY_BUDGET)."""
    return {"memory_budget": memory_budget} if memory_budget is not None and backend == "kiln" else {}


def _precision(precision: Optional[str]) -> dict:
    """kiln.load's precision= where the config sets one (issue 18: converted at load)."""
    return {"precision": precision} if precision not in (None, "", "fp32") else {}


def _worker_main(conn, path: str, backend: str, threads: int, memory_budget: Optional[str] = None,
                 device: str = "cpu", arena: Any = None, precision: Optional[str] = None) -> None:
    """The worker process: load the model, report its signature, then serve ``run`` messages until the
    server says ``stop`` or its end of the pipe closes. ``device`` ``cuda``: a CudaProgram on the one GPU
    CUDA_VISIBLE_DEVICES shows this process (server/gpu.py); a CUDA fault during a batch is answered,
    then the worker exits so that the server replaces it (the context may be poisoned). ``arena``: the
    server's shared staging arena (server/arena.py) mapped here; inputs that arrive as ArenaRefs are read
    in place and outputs asked for with ``out`` refs are written there, answered as refs."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the server decides when workers stop (see module docstring)
    gpu = device.startswith("cuda")
    try:
        if gpu:
            from kiln.server.gpu import load_on_gpu
            program = load_on_gpu(path, precision)
        else:
            from kiln.runtime.program import load
            program = load(path, backend=backend, **_budget(backend, memory_budget), **_precision(precision))
    except BaseException as e:  # noqa: BLE001 - reported to the server, which raises it from start()
        if gpu:
            from kiln.server.gpu import describe_load_failure
            e = describe_load_failure(path, e)
        conn.send(("failed", _portable(e)))
        return
    conn.send(("ready", os.getpid(), list(program.inputs), list(program.outputs), batch_analysis(program)))
    send_lock = threading.Lock()

    def answer(msg) -> None:
        with send_lock:
            conn.send(msg)

    if gpu:
        from kiln.server.gpu import GpuRunner
        runner = GpuRunner(program, arena)
    else:
        runner = CpuRunner(program)

    def execute(rid: int, inputs: dict, out: Optional[dict] = None, device: Optional[dict] = None,
                device_out: Optional[dict] = None) -> None:
        fault = None
        try:
            if arena is not None:
                inputs = arena.decode(inputs)
                out = arena.decode(out) if out else None
            outputs = runner.run(inputs, out, device, device_out) if device or device_out else runner.run(inputs, out)
            msg = ("ok", rid, arena.encode(outputs) if arena is not None else outputs,
                   getattr(runner, "timings", None))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            if gpu:
                from kiln.server.gpu import cuda_fault
                fault = cuda_fault(e)
            msg = ("err", rid, _portable(fault or e))
        try:
            answer(msg)
        except (OSError, ValueError):
            pass  # the server is gone; the main loop sees EOF and exits
        if fault is not None:  # the CUDA context may be poisoned: leave, the server starts a fresh worker
            os._exit(70)

    def cuda_call(kind: str, rid: int, *args) -> None:
        try:
            runner.close_cuda(*args)
            msg = ("ok", rid, None, None)
        except BaseException as e:  # noqa: BLE001 - answered (the region is forgotten either way)
            msg = ("err", rid, _portable(e))
        try:
            answer(msg)
        except (OSError, ValueError):
            pass

    pool = ThreadPoolExecutor(threads, thread_name_prefix="kiln-worker") if threads > 1 else None
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "run":
                if pool is None:
                    execute(*msg[1:])
                else:
                    pool.submit(execute, *msg[1:])
            elif kind == "cuda_close" and gpu:  # CUDA shared memory (server/cuda_shm.py)
                (pool.submit if pool is not None else (lambda f, *a: f(*a)))(cuda_call, *msg)
            elif kind == "info":
                answer(("ok", msg[1], {"pid": os.getpid(), "modules": sorted(sys.modules),
                                       "env": {v: os.environ.get(v) for v in _THREAD_VARS}}))
            elif kind == "stop":
                break
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        close_all = getattr(runner, "close_all", None)
        if close_all is not None:
            close_all()


class CpuRunner:
    """How a CPU worker runs a batch: ``program.run``, the outputs copied into the ``out`` buffers the server
    gave (arena memory) where they fit, else returned as they are."""

    def __init__(self, program: Any):
        self.program = program

    def run(self, inputs: dict, out: Optional[dict] = None) -> dict:
        outputs = self.program.run(inputs)
        return fill_out(outputs, out)


def fill_out(outputs: dict, out: Optional[dict]) -> dict:
    """``outputs`` with each one that matches its ``out`` buffer (shape and dtype) copied into it and
    replaced by it."""
    if not out:
        return outputs
    result = {}
    for name, a in outputs.items():
        dst = out.get(name)
        a = np.asarray(a)
        if dst is not None and dst.shape == a.shape and dst.dtype == a.dtype:
            np.copyto(dst, a)
            a = dst
        result[name] = a
    return result


def _worker_entry(argv: Sequence[str]) -> None:
    """``python -c`` entry point of a worker: argv is [fd, path, backend, threads, memory budget or "",
    device, arena fd or "", arena size or "", precision or ""]."""
    from multiprocessing.connection import Connection
    fd, path, backend, threads, budget, *rest = argv
    device = rest[0] if rest else "cpu"
    arena = None
    if len(rest) >= 3 and rest[1]:
        from kiln.server.arena import Arena
        arena = Arena(int(rest[2]), fd=int(rest[1]))
    precision = rest[3] if len(rest) >= 4 and rest[3] else None
    _worker_main(Connection(int(fd)), path, backend, int(threads), budget or None, device, arena, precision)


# ----------------------------------------------------------------------------------------------------
# Server side.

_ENTRY = "import sys; from kiln.server.workers import _worker_entry; _worker_entry(sys.argv[1:])"
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def blas_threads(n_workers: int, cpu_count: Optional[int] = None) -> int:
    """BLAS/OpenMP threads per worker process: the cores but one (left to the HTTP process), shared by
    the workers, at least 1 (see the module docstring)."""
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, (cpus - 1) // max(1, n_workers))


def worker_env(n_workers: int, environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a worker process: ``environ`` (default ``os.environ``) with this process's
    ``sys.path`` as PYTHONPATH and, unless ``environ`` sets any of them, the BLAS thread variables."""
    env = dict(os.environ if environ is None else environ)
    # The child imports kiln the way this process did (an editable install, PYTHONPATH, sys.path edits).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
    if not any(env.get(var) for var in _THREAD_VARS):
        threads = str(blas_threads(n_workers))
        for var in _THREAD_VARS:
            env[var] = threads
    return env


class _Proc:
    """A worker's subprocess.Popen with the few verbs the executor needs."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        try:
            self.popen.kill()
        except OSError:
            pass

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> Optional[int]:
        return self.popen.poll()


def _resolve(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if not fut.done():
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


def _resolve_threadsafe(fut: asyncio.Future, ok: bool, value: Any) -> None:
    try:
        fut.get_loop().call_soon_threadsafe(_resolve, fut, ok, value)
    except RuntimeError:
        pass  # that event loop is closed: nobody is waiting any more


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "its pipe closed"
    if code < 0:
        try:
            return f"it was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"it was killed by signal {-code}"
    return f"it exited with code {code}"


class _Worker:
    def __init__(self, process, conn, pid: int):
        self.process = process
        self.conn = conn
        self.pid = pid
        self.inflight: Dict[int, asyncio.Future] = {}
        self.alive = True
        self.slot = 0  # which of the executor's worker slots it fills (a GPU executor: which GPU)
        self.send_lock = threading.Lock()


class ProcessExecutor:
    """``n_workers`` worker processes (default ``config.workers``), each loading ``path`` itself.

    Every worker runs up to ``config.instances`` batches at once, so ``capacity`` is workers x instances;
    a batch goes to the live worker with the fewest in flight."""

    start_timeout_s = 300.0   # how long a worker may take to load the model
    stop_timeout_s = 10.0     # how long close() waits for a worker to exit before killing it
    respawn_delays_s = (0.0, 0.5, 1.0, 2.0, 5.0)  # back-off between attempts to replace a dead worker

    def __init__(self, path: Any, config: Any, n_workers: Optional[int] = None):
        self.path = os.fspath(path)
        self.backend = getattr(config, "backend", "kiln") or "kiln"
        self.memory_budget = getattr(config, "memory_budget", None)
        self.precision = getattr(config, "precision", None)
        self.instances = _instances(config)
        self.n_workers = int(n_workers if n_workers is not None else getattr(config, "workers", 1))
        if self.n_workers < 1:
            raise KilnError(f"a ProcessExecutor needs at least 1 worker, got {self.n_workers} "
                            "(workers=0 means threads: use ThreadExecutor)")
        self.inputs: List[Any] = []
        self.outputs: List[Any] = []
        self.batch_analysis: Any = None  # what the first worker's analysis of its graph said
        self.restarts = 0  # workers replaced after dying
        self._lock = threading.Lock()
        self._workers: List[_Worker] = []
        self._waiters: List[asyncio.Future] = []  # run() calls waiting for a free worker slot
        self._ids = itertools.count()
        self._started = False
        self._closed = False
        self._stop = threading.Event()  # set by close(): no more replacements
        # The staging arena shared with the workers (server/arena.py): made at start(), mapped by each worker.
        mib = getattr(config, "staging_mib", DEFAULT_STAGING_MIB)
        self.arena_bytes = int(float(DEFAULT_STAGING_MIB if mib is None else mib) * (1 << 20))
        self.arena: Any = None
        # Called (on a reader thread) with a GPU worker's per-batch timings ({"h2d", "d2h", "gpu_wait", "run"},
        # seconds): the app points it at Metrics.observe_device.
        self.timing_sink: Any = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the workers and wait until every one has loaded the model (they load in parallel).
        Raises the worker's error (e.g. a FormatError) if the model cannot be loaded."""
        if self._started:
            return
        if self.arena is None and self.arena_bytes > 0:
            from kiln.server.arena import Arena
            self.arena = Arena(self.arena_bytes)
        pending = [self._spawn(slot) for slot in range(self.n_workers)]
        workers, error = [], None
        for slot, (process, conn) in enumerate(pending):
            try:
                w = self._handshake(process, conn)
                w.slot = slot
                workers.append(w)
            except BaseException as e:  # noqa: BLE001 - stop the others, then raise the first error
                error = error or e
        if error is not None:
            for w in workers:
                self._kill(w)
            raise error
        self._started = True
        for w in workers:
            self._adopt(w)

    device = "cpu"  # what the workers load the model on (GpuExecutor: "cuda")

    def _worker_env(self, slot: int) -> Dict[str, str]:
        """The environment of the worker filling ``slot`` (GpuExecutor adds CUDA_VISIBLE_DEVICES)."""
        return worker_env(self.n_workers)

    def _spawn(self, slot: int = 0):
        ours, theirs = socket.socketpair()
        env = self._worker_env(slot)
        arena = self.arena
        fds = (theirs.fileno(),) + ((arena.fd,) if arena is not None else ())
        try:
            popen = subprocess.Popen([sys.executable, "-c", _ENTRY, str(theirs.fileno()), self.path, self.backend,
                                      str(self.instances), "" if self.memory_budget is None else str(self.memory_budget),
                                      self.device, str(arena.fd) if arena is not None else "",
                                      str(arena.size) if arena is not None else "",
                                      getattr(self, "precision", None) or ""], pass_fds=fds, env=env,
                                     stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # only the worker holds that end now: its death gives us EOF
        from multiprocessing.connection import Connection
        return _Proc(popen), Connection(ours.detach())

    def _handshake(self, process, conn) -> _Worker:
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while not conn.poll(0.1):
                if not process.is_alive():
                    break
                if time.monotonic() > deadline:
                    raise KilnError(f"a worker did not load {self.path} within {self.start_timeout_s:.0f} s")
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                process.join(1.0)
                raise KilnError(f"a worker failed while loading {self.path}: "
                                f"{_describe_exit(process.exitcode)}") from None
            if msg[0] == "failed":
                raise msg[1]
            _, pid, inputs, outputs, *rest = msg
            if not self.inputs and not self.outputs:
                check_servable(self.path, inputs + outputs)
                self.inputs, self.outputs = inputs, outputs
                self.batch_analysis = rest[0] if rest else None
            return _Worker(process, conn, pid)
        except BaseException:
            conn.close()
            if process.is_alive():
                process.kill()
            process.join(5.0)
            raise

    def _adopt(self, w: _Worker) -> None:
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._workers.append(w)
        if closed:
            self._kill(w)
            return
        threading.Thread(target=self._read, args=(w,), name=f"kiln-worker-{w.pid}-reader", daemon=True).start()
        self._wake()

    def _read(self, w: _Worker) -> None:
        """Reader thread of one worker: resolve answers; on EOF, fail what it had and replace it."""
        while True:
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # noqa: BLE001 - an answer that cannot be unpickled: treat as a dead pipe
                log.error("worker %d sent an unreadable message (%s); replacing it", w.pid, e)
                w.process.kill()
                break
            with self._lock:
                fut = w.inflight.pop(msg[1], None)
            value = msg[2]
            if msg[0] == "ok" and self.arena is not None and isinstance(value, dict):
                try:
                    value = self.arena.decode(value)
                except (ValueError, TypeError) as e:  # a reference outside the arena: a broken worker
                    log.error("worker %d answered with a bad arena reference (%s); replacing it", w.pid, e)
                    w.process.kill()
                    if fut is not None:
                        _resolve_threadsafe(fut, False, WorkerError(f"worker {w.pid} sent a bad answer: {e}"))
                    break
            if fut is not None:
                _resolve_threadsafe(fut, msg[0] == "ok", value)
            if len(msg) > 3 and msg[3] and self.timing_sink is not None:
                try:
                    self.timing_sink(msg[3])
                except Exception:  # noqa: BLE001 - metrics must not break serving
                    log.exception("recording a worker's timings failed")
            self._wake()
        self._on_exit(w)

    def _on_exit(self, w: _Worker) -> None:
        with self._lock:
            w.alive = False
            if w in self._workers:
                self._workers.remove(w)
            lost, w.inflight = w.inflight, {}
            closing = self._closed
        w.process.join(1.0)  # the pipe closes as the process dies, so this is quick
        reason = _describe_exit(w.process.exitcode)
        w.conn.close()
        if closing:
            err = WorkerError(f"worker {w.pid} stopped: the executor was closed")
        else:
            err = WorkerError(f"worker process {w.pid} died while running this request ({reason}); "
                              "it is being replaced")
            log.error("kiln worker %d for %s died (%s) with %d batch(es) in flight; replacing it",
                      w.pid, self.path, reason, len(lost))
        for fut in lost.values():
            _resolve_threadsafe(fut, False, err)
        if not closing:
            self._replace(w.slot)

    def _replace(self, slot: int = 0) -> None:
        """Start a new worker in place of a dead one (runs on the dead worker's reader thread)."""
        delays = itertools.chain(self.respawn_delays_s, itertools.repeat(self.respawn_delays_s[-1]))
        for attempt, delay in enumerate(delays):
            if self._stop.wait(delay):
                return
            try:
                w = self._handshake(*self._spawn(slot))
                w.slot = slot
            except BaseException as e:  # noqa: BLE001 - keep trying: the server stays up on its other workers
                if attempt < 3 or attempt % 20 == 0:
                    log.error("could not replace a kiln worker for %s (attempt %d): %s", self.path, attempt + 1, e)
                continue
            self.restarts += 1
            self._adopt(w)
            return

    def _kill(self, w: _Worker) -> None:
        try:
            w.conn.close()
        except OSError:
            pass
        if w.process.is_alive():
            w.process.kill()
        w.process.join(5.0)

    async def close(self) -> None:
        """Ask every worker to stop, wait for them (killing any that hang), and fail whatever is still
        waiting with WorkerError. Drain the batcher first to let running batches finish."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
            waiters, self._waiters = self._waiters, []
        self._stop.set()
        for fut in waiters:
            _resolve_threadsafe(fut, True, None)  # they wake, see closed and raise
        await asyncio.to_thread(self._stop_workers, workers)
        if self.arena is not None:
            self.arena.close()

    def _stop_workers(self, workers: List[_Worker]) -> None:
        for w in workers:
            try:
                with w.send_lock:
                    w.conn.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + self.stop_timeout_s
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                log.warning("kiln worker %d did not stop within %.0f s; killing it", w.pid, self.stop_timeout_s)
                w.process.kill()
                w.process.join(5.0)

    # -- state -----------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._started and not self._closed and any(w.alive for w in self._workers)

    @property
    def capacity(self) -> int:
        return self.n_workers * self.instances

    @property
    def pids(self) -> List[int]:
        """Process ids of the live workers."""
        with self._lock:
            return [w.pid for w in self._workers if w.alive]

    # -- running ---------------------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for fut in waiters:
            _resolve_threadsafe(fut, True, None)

    async def _submit(self, worker_pick, message_of, wait: bool = True) -> Any:
        """Reserve a slot on a worker (waiting for one if all are busy or being replaced, unless not
        ``wait``), send it ``message_of(id)`` and await the answer. A message that cannot be written
        (the worker died since it was picked) provably never ran, so it goes to another worker."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._closed or not self._started:
                    raise WorkerError("the executor is not running (not started, or closed)")
                w = worker_pick()
                if w is None:
                    if not wait:
                        raise WorkerError("that worker is no longer running")
                    waiter = loop.create_future()
                    self._waiters.append(waiter)
                else:
                    rid = next(self._ids)
                    fut = loop.create_future()
                    w.inflight[rid] = fut
            if w is None:
                await waiter
                continue
            try:
                payload = pickle.dumps(message_of(rid), protocol=5)
                if len(payload) > _BIG_PAYLOAD:
                    await asyncio.to_thread(self._send, w, payload)
                else:
                    self._send(w, payload)
            except (OSError, ValueError):
                with self._lock:  # the worker is gone (its reader thread replaces it): try another one
                    w.inflight.pop(rid, None)
                    w.alive = False
                fut.cancel()
                continue
            except BaseException:
                with self._lock:
                    w.inflight.pop(rid, None)
                self._wake()
                raise
            break
        try:
            return await fut
        finally:
            if not fut.done():  # our caller was cancelled: forget the slot's future (the answer is dropped)
                fut.cancel()

    @staticmethod
    def _send(w: _Worker, payload: bytes) -> None:
        with w.send_lock:
            w.conn.send_bytes(payload)

    def _least_busy(self) -> Optional[_Worker]:
        free = [w for w in self._workers if w.alive and len(w.inflight) < self.instances]
        return min(free, key=lambda w: len(w.inflight)) if free else None

    writes_out = True  # run(out=...): the workers write the outputs into the caller's (arena) buffers

    async def run(self, inputs: Dict[str, np.ndarray], out: Optional[Dict[str, np.ndarray]] = None
                  ) -> Dict[str, np.ndarray]:
        """Run one batch on the least busy worker. Inputs in the arena go as references (read in place by
        the worker); ``out`` (arena buffers, by output name): where the worker writes outputs that fit."""
        if self.arena is None:
            return await self._submit(self._least_busy, lambda rid: ("run", rid, dict(inputs)))
        sent, refs = self._run_payload(inputs, out)
        return await self._submit(self._least_busy, lambda rid: ("run", rid, sent, refs))

    def _run_payload(self, inputs: Dict[str, Any], out: Optional[Dict[str, Any]]) -> tuple:
        """(inputs as sent: arena arrays as ArenaRefs, the rest as they are; ``out`` as ArenaRefs, or None
        without an arena)."""
        arena = self.arena
        if arena is None:
            return dict(inputs), None
        return arena.encode(inputs), {k: r for k, r in ((k, arena.ref(v)) for k, v in (out or {}).items())
                                      if r is not None}

    async def worker_info(self) -> List[Dict[str, Any]]:
        """Ask each live worker for its pid, the modules it has imported (``sys.modules``) and its BLAS
        thread variables (``env``): a diagnostic, used by the tests to check that workers never import
        torch or onnx and get the thread counts they should."""
        infos = []
        for pid in self.pids:
            def pick(pid=pid):
                return next((w for w in self._workers if w.pid == pid and w.alive), None)
            infos.append(await self._submit(pick, lambda rid: ("info", rid), wait=False))
        return infos
