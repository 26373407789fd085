"""The dynamic batcher: one per model version, between the HTTP handlers and an executor.

Why: a batch of B rows costs far less than B single-row runs (one GEMM instead of B GEMVs, one pass
of the instruction loop), so under load the server runs fewer, larger batches. The rules:

* **What can be stacked.** A model is batchable when dim 0 of every input and every output is the
  same symbolic dim (kiln's traced models call it ``"batch"``), that symbol appears nowhere else in
  their shapes, **and** the model's graph is proven row-independent: output row *i* depends only on
  input row *i* (kiln/ir/batch_independence.py; the executor reports the analysis of the graph it
  runs as ``batch_analysis``). A model that mixes rows (``x - x.mean(0)``) stacked with others would
  answer every request wrongly with status 200, so it runs request by request unless the config's
  ``batching`` is ``"force"``; ``"off"`` never stacks. :func:`decide` makes the choice and its
  reason, which the start-up log and the model's config endpoint show. Requests are stacked along
  dim 0 only when all their other dims and dtypes agree (requests of different sequence lengths form
  separate groups). Outputs are split back along dim 0 by each request's own row count. A model
  without such a dim, or ``max_batch_size == 0``, runs request by request, each as it came.
* **When a batch goes (adaptive).** At most ``max_batch_size`` rows, and at most ``executor.capacity``
  batches in flight (``instances`` threads, or workers x instances). Whenever a slot is free:

  - a **full** batch (``max_batch_size`` rows, or the next request of its group would not fit) goes
    at once;
  - if the executor is **idle** (nothing running), whatever is queued goes at once, full or not: a
    lone request on an idle model is never delayed, and after a busy spell everything that queued up
    meanwhile leaves as one batch the moment the executor frees up;
  - if the executor is **partly busy** (some batches running, a slot free), a partial batch waits
    until its oldest request has waited ``max_queue_delay_ms``, or until it is full, or until the
    executor goes idle, whichever comes first.

  Why: waiting only pays when more requests are likely to join before the batch would otherwise
  run. On an idle model it is pure latency (an event-loop timer of 0.5 ms costs ~1 ms in practice).
  While every slot is busy nothing can run anyway, and requests accumulate by themselves into the
  next batch, so a capacity-1 executor (1 worker, 1 instance: the default) never waits out the
  delay: its batches are exactly what arrived while the previous one ran. The delay matters where
  a batch could start now on a spare slot while others are running: there a short wait turns a
  stream of single requests into fewer, larger batches instead of spreading them one by one over
  the slots. The oldest dispatchable group goes first (FIFO within a group).
* **Batch buckets.** An executor with ``run_parts`` (server/buckets.py's BucketedExecutor) is given the
  batch's requests, not their concatenation: it copies their rows into its own bucket-sized staging
  buffers. One with ``max_batch_rows`` (its largest bucket) lowers ``max_batch_size`` to it.
* **A request too big.** A request whose own dim 0 exceeds ``max_batch_size`` is refused with
  :class:`BatchTooLarge` (400); with ``max_batch_size == 0`` nothing is stacked and it runs alone.
* **Backpressure.** The queue holds at most ``queue_size`` requests (0: unbounded, as in Triton);
  beyond that :class:`QueueFull` (503, with a Retry-After hint from recent batch times).
* **Timeouts.** Each request has a deadline: the model's ``timeout_ms``, lowered (never raised) by the
  request's own ``timeout_s``. A request that expires while queued is removed from the queue and never
  runs; one that expires while its batch runs gets :class:`RequestTimeout` at once, and its share of
  the result is dropped. A caller that is cancelled (client gone) is removed the same way.
* **One bad request does not fail its batch.** If a stacked batch fails with ``kiln.ExecutionError``
  (a kernel rejected some request's data, e.g. an out-of-range index), each request of it is re-run
  alone so only the culprit gets the error. A :class:`WorkerError` (a worker died) fails the whole
  batch: re-running a request that may kill workers is not worth it.
* **Drain.** ``await drain()`` stops accepting (:class:`Draining`, a 503), dispatches what is queued
  without waiting for more, and returns when nothing is queued or running (graceful shutdown).

Everything here runs on one asyncio event loop; the only concurrency is the executor's.
Metrics are duck-typed: any object with ``observe_batch(model, version, size, queue_seconds,
compute_seconds)`` and ``set_queue_depth(model, version, n)``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence

import numpy as np

from kiln.errors import ExecutionError
from kiln.runtime.program import check_inputs
from kiln.server.errors import BatchTooLarge, Draining, QueueFull, RequestTimeout, WorkerError

__all__ = ["DynamicBatcher", "batch_dim", "decide", "BatchingDecision", "QueueFull", "Draining", "RequestTimeout",
           "BatchTooLarge", "WorkerError"]

log = logging.getLogger("kiln.server")


def batch_dim(inputs: Sequence[Any], outputs: Sequence[Any]) -> Optional[str]:
    """The symbol that is dim 0 of every input and output spec (and appears in no other dim), or None
    when the model cannot be batched along dim 0."""
    symbol = None
    for spec in [*inputs, *outputs]:
        shape = spec.shape
        if not shape or not isinstance(shape[0], str) or shape[0] in shape[1:]:
            return None
        if symbol is None:
            symbol = shape[0]
        elif shape[0] != symbol:
            return None
    return symbol if inputs else None


@dataclass(frozen=True)
class BatchingDecision:
    """Whether a model version's requests are stacked (``stacks``), and why (``reason``, one line).
    ``analysis`` is the graph's batch-independence verdict as JSON (None when there was none)."""

    stacks: bool
    mode: str
    max_batch_size: int
    reason: str
    analysis: Optional[dict] = None

    def to_json(self) -> dict:
        return {"stacks_requests": self.stacks, "batching": self.mode, "max_batch_size": self.max_batch_size,
                "reason": self.reason, "analysis": self.analysis}


def decide(mode: str, max_batch_size: int, symbol: Optional[str], analysis: Any) -> BatchingDecision:
    """The batching decision for a model (see the module docstring). ``analysis`` is a
    :class:`kiln.ir.batch_independence.BatchAnalysis` or None (the executor could not analyse)."""
    facts = analysis.to_json() if analysis is not None else None
    if mode not in ("auto", "force", "off"):
        raise ValueError(f"batching must be 'auto', 'force' or 'off', got {mode!r}")

    def no(reason: str) -> BatchingDecision:
        return BatchingDecision(False, mode, max_batch_size, reason + "; requests run one at a time", facts)

    if mode == "off":
        return no('batching is "off" in the model config')
    if max_batch_size <= 1:
        return no(f"max_batch_size is {max_batch_size}")
    if symbol is None:
        return no("the inputs and outputs do not share a symbolic dim 0")
    if mode == "force":
        if analysis is None:
            verdict = ""
        elif analysis.batchable:
            verdict = " (kiln proved it row-independent)"
        else:
            verdict = f" (kiln could not prove it: {analysis.reason})"
        return BatchingDecision(True, mode, max_batch_size, f'stacked along \'{symbol}\' because batching is '
                                f'"force" in the model config{verdict}', facts)
    if analysis is None:
        return no("the executor reported no batch-independence analysis of the model's graph")
    if not analysis.batchable:
        return no(f"not proven row-independent: {analysis.reason} (set \"batching\": \"force\" to stack anyway)")
    return BatchingDecision(True, mode, max_batch_size, f"stacked along '{symbol}' up to {max_batch_size} rows: "
                            f"{analysis.reason}", facts)


def executor_analysis(executor: Any) -> Any:
    """The batch-independence analysis an executor reports (``batch_analysis``), or, for one that holds
    its program (``executor.program.graph``), the analysis of that graph; None if neither."""
    analysis = getattr(executor, "batch_analysis", None)
    if analysis is not None:
        return analysis
    graph = getattr(getattr(executor, "program", None), "graph", None)
    if graph is None:
        return None
    from kiln.ir.batch_independence import analyze_batching
    return analyze_batching(graph)


class _Request:
    __slots__ = ("inputs", "rows", "key", "future", "enqueued", "seq", "queued", "timer", "device_out")

    def __init__(self, inputs, rows, key, future, enqueued, seq):
        self.inputs: Dict[str, np.ndarray] = inputs
        self.rows: int = rows
        self.key = key
        self.future: asyncio.Future = future
        self.enqueued: float = enqueued  # loop.time()
        self.seq: int = seq
        self.queued = True
        self.timer: Optional[asyncio.TimerHandle] = None
        self.device_out: Optional[Dict[str, Any]] = None  # outputs the GPU worker writes to CUDA regions


class DynamicBatcher:
    """Queue, stack, run and split requests for one model version (see the module docstring).

    ``config`` is any object with ``max_batch_size``, ``max_queue_delay_ms``, ``queue_size``,
    ``timeout_ms`` and ``instances``. The executor must be started before the first ``submit``."""

    def __init__(self, executor: Any, config: Any, metrics: Any = None, model: str = "", version: str = ""):
        self.executor = executor
        self.metrics = metrics
        self.model, self.version = model, str(version)
        self.max_batch_size = int(getattr(config, "max_batch_size", 0) or 0)
        self.max_delay_s = max(0.0, float(getattr(config, "max_queue_delay_ms", 0) or 0)) / 1000.0
        self.queue_size = int(getattr(config, "queue_size", 0) or 0)
        timeout_ms = getattr(config, "timeout_ms", None)
        self.timeout_s: Optional[float] = float(timeout_ms) / 1000.0 if timeout_ms else None
        self._instances = int(getattr(config, "instances", 1) or 1)
        self._names: Optional[List[str]] = None  # filled from the executor's specs on first use
        self._groups: Dict[Any, Deque[_Request]] = {}
        self._depth = 0
        self._running = 0
        self._seq = 0
        self._accepting = True
        self._waiters: List[asyncio.Future] = []
        self._tasks: set = set()
        self._scheduler: Optional[asyncio.Task] = None
        self._compute_ema: Optional[float] = None  # seconds per batch, for Retry-After
        self._requests_ema: float = 1.0            # requests per batch
        self._mode = str(getattr(config, "batching", "auto") or "auto")
        self.decision: Optional[BatchingDecision] = None
        if list(getattr(executor, "inputs", None) or []):  # a started executor: decide (and log) now
            self._layout()

    # -- state -----------------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Requests waiting (not yet dispatched to the executor)."""
        return self._depth

    @property
    def running(self) -> int:
        """Batches in flight in the executor."""
        return self._running

    @property
    def accepting(self) -> bool:
        return self._accepting

    def _layout(self) -> None:
        cap = getattr(self.executor, "max_batch_rows", None)  # the largest batch bucket (server/buckets.py)
        if isinstance(cap, int) and 0 < cap < self.max_batch_size:
            self.max_batch_size = cap
        specs = list(self.executor.inputs)
        self._specs = specs
        self.symbol = batch_dim(specs, list(self.executor.outputs))
        analysis = executor_analysis(self.executor) if self.symbol is not None and self._mode != "off" else None
        self.decision = decide(self._mode, self.max_batch_size, self.symbol, analysis)
        self.batching = self.decision.stacks
        self.capacity = max(1, int(getattr(self.executor, "capacity", 0) or self._instances))
        self._names = [s.name for s in specs]
        refused = self._mode == "auto" and self.max_batch_size > 1 and self.symbol is not None and not self.batching
        log.log(logging.WARNING if refused else logging.INFO, "model %s version %s: %s", self.model, self.version,
                self.decision.reason)

    # -- the caller's side -----------------------------------------------------------------------------

    async def submit(self, inputs: Dict[str, np.ndarray], timeout_s: Optional[float] = None,
                     device_out: Optional[Dict[str, Any]] = None) -> Dict[str, np.ndarray]:
        """Queue one request and return its outputs. Raises kiln.InputError (incl. BatchTooLarge),
        QueueFull (incl. Draining), RequestTimeout, WorkerError, or the model's ExecutionError.
        ``device_out``: ``{output: CudaSpan}``, outputs that the GPU worker also writes into CUDA shared
        memory regions as part of the batch (server/cuda_shm.py)."""
        if not self._accepting:
            raise Draining(f"model '{self.model}' is shutting down and takes no new requests")
        if self._names is None:
            self._layout()
        arrays = check_inputs(self._specs, inputs)
        named = dict(zip(self._names, arrays))
        device = None
        for name in self._names:  # inputs in CUDA shared memory (server/cuda_shm.py) keep their region span
            span = getattr(inputs[name], "span", None) if isinstance(inputs, dict) else None
            if span is not None:
                named[name] = inputs[name]
                device = span.device_id
        if device_out:
            device = next(iter(device_out.values())).device_id
        if self.batching:
            rows = int(arrays[0].shape[0])
            if rows > self.max_batch_size:
                raise BatchTooLarge(f"model '{self.model}': this request's batch dim '{self.symbol}' is {rows}, "
                                    f"more than the model's max_batch_size {self.max_batch_size}; "
                                    "split it into smaller requests")
            key = tuple((a.dtype.str, a.shape[1:]) for a in arrays)
            if device is not None:
                # Device rows stack only with device rows of the same GPU, and only where the executor
                # stages parts itself (it turns them into device patches); a concatenation would read the
                # stand-in's zeros.
                key = (key, "cuda", device) if getattr(self.executor, "run_parts", None) is not None \
                    else (key, "cuda", device, self._seq)
        else:
            rows, key = 1, None
        if self.queue_size > 0 and self._depth >= self.queue_size:
            raise QueueFull(f"model '{self.model}' has {self._depth} requests queued (queue_size "
                            f"{self.queue_size}); retry later", retry_after_s=self._retry_after())
        timeout = self.timeout_s if timeout_s is None else (
            timeout_s if self.timeout_s is None else min(timeout_s, self.timeout_s))
        if timeout is not None and timeout <= 0:
            raise RequestTimeout(f"model '{self.model}': the request's timeout ({timeout * 1000:g} ms) had "
                                 "passed before it was queued")
        loop = asyncio.get_running_loop()
        if self._scheduler is None:
            self._scheduler = loop.create_task(self._schedule(), name=f"kiln-batcher-{self.model}")
            self._scheduler.add_done_callback(self._scheduler_done)
        self._seq += 1
        req = _Request(named, rows, key, loop.create_future(), loop.time(), self._seq)
        req.device_out = device_out or None
        self._groups.setdefault(key, deque()).append(req)
        self._set_depth(self._depth + 1)
        if timeout is not None:
            req.timer = loop.call_later(timeout, self._expire, req, timeout)
        self._notify()
        try:
            return await req.future
        except asyncio.CancelledError:
            if req.queued:  # the caller went away before its request ran
                self._unqueue(req)
                self._notify()
            raise
        finally:
            if req.timer is not None:
                req.timer.cancel()

    def _expire(self, req: _Request, timeout: float) -> None:
        if req.future.done():
            return
        where = "while queued" if req.queued else "while running"
        if req.queued:
            self._unqueue(req)
            self._notify()
        req.future.set_exception(RequestTimeout(
            f"model '{self.model}': no answer within the request's timeout of {timeout * 1000:g} ms ({where})"))

    def _unqueue(self, req: _Request) -> None:
        q = self._groups[req.key]
        q.remove(req)
        if not q:
            del self._groups[req.key]
        req.queued = False
        self._set_depth(self._depth - 1)

    def _set_depth(self, n: int) -> None:
        self._depth = n
        if self.metrics is not None:
            self._metric("set_queue_depth", self.model, self.version, n)

    def _metric(self, method: str, *args) -> None:
        try:
            getattr(self.metrics, method)(*args)
        except Exception:  # noqa: BLE001 - a metrics bug must not fail requests; it is logged
            log.exception("metrics.%s failed", method)

    def _retry_after(self) -> float:
        """Seconds until the queue has likely drained, from recent batch times (at least 1)."""
        if self._compute_ema is None:
            return 1.0
        batches = self._depth / max(self._requests_ema, 1.0) / self.capacity
        return float(max(1, math.ceil(batches * self._compute_ema)))

    # -- scheduling ------------------------------------------------------------------------------------

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wait(self, until: Optional[float] = None) -> None:
        """Sleep until some state changes (``_notify``) or the loop time ``until``."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append(fut)
        timer = None if until is None else loop.call_at(until, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            wake = None
            if self._running < self.capacity and self._groups:
                batch, wake = self._next_batch(loop.time())
                if batch:
                    self._dispatch(batch)
                    continue
            await self._wait(wake)

    def _next_batch(self, now: float):
        """The batch to dispatch now (the oldest group that is full or due, or simply the oldest when the
        executor is idle), or None and the loop time at which the earliest group becomes due."""
        best: Optional[List[_Request]] = None
        wake: Optional[float] = None
        for q in self._groups.values():
            head = q[0]
            take, full = self._form(q)
            due = head.enqueued + self.max_delay_s
            if full or not self._running or now >= due or not self._accepting:
                if best is None or head.seq < best[0].seq:
                    best = take
            elif wake is None or due < wake:
                wake = due
        return best, wake

    def _form(self, q: Deque[_Request]):
        """Requests from the head of ``q`` that fit in one batch, and whether that batch is full."""
        if not self.batching:
            return [q[0]], True
        take, rows = [], 0
        for r in q:
            if rows + r.rows > self.max_batch_size:
                return take, True
            take.append(r)
            rows += r.rows
            if rows == self.max_batch_size:
                return take, True
        return take, False

    def _dispatch(self, batch: List[_Request]) -> None:
        for r in batch:
            self._unqueue(r)
        self._running += 1
        task = asyncio.get_running_loop().create_task(self._run_batch(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _scheduler_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # a bug: fail what waits, loudly
            log.error("kiln batcher for model '%s' stopped", self.model, exc_info=task.exception())
            err = WorkerError(f"model '{self.model}': the batcher stopped ({task.exception()!r})")
            for q in list(self._groups.values()):
                for r in list(q):
                    self._unqueue(r)
                    if not r.future.done():
                        r.future.set_exception(err)
            self._notify()

    # -- running ---------------------------------------------------------------------------------------

    async def _run_batch(self, batch: List[_Request]) -> None:
        loop = asyncio.get_running_loop()
        try:
            live = [r for r in batch if not r.future.done()]  # callers cancelled after dispatch drop out
            if not live:
                return
            started = loop.time()
            queue_s = [started - r.enqueued for r in live]
            t0 = time.perf_counter()
            try:
                await self._execute(live)
            finally:
                compute = time.perf_counter() - t0
                self._compute_ema = compute if self._compute_ema is None else 0.8 * self._compute_ema + 0.2 * compute
                self._requests_ema = 0.8 * self._requests_ema + 0.2 * len(live)
                if self.metrics is not None:
                    self._metric("observe_batch", self.model, self.version, sum(r.rows for r in live),
                                 queue_s, compute)
        finally:
            self._running -= 1
            self._notify()

    async def _execute(self, reqs: List[_Request]) -> None:
        # An executor with run_parts (server/buckets.py) copies the requests' rows straight into its own
        # (bucket-sized) buffers: no concatenate here.
        run_parts = getattr(self.executor, "run_parts", None) if self.batching else None
        try:
            device_out = [r.device_out for r in reqs] if any(r.device_out for r in reqs) else None
            extra = {"device_out": device_out} if device_out else {}
            if run_parts is not None:
                outputs = await run_parts([r.inputs for r in reqs], **extra)
            else:
                if len(reqs) == 1:
                    inputs = reqs[0].inputs
                else:
                    inputs = {n: np.concatenate([r.inputs[n] for r in reqs]) for n in self._names}
                outputs = await self.executor.run(inputs, **extra)
        except ExecutionError as e:
            if len(reqs) == 1:
                _fail(reqs, e)
            else:  # find the culprit: each request alone
                for r in reqs:
                    if not r.future.done():
                        await self._execute([r])
            return
        except asyncio.CancelledError:
            _fail(reqs, WorkerError(f"model '{self.model}': the batcher was closed while this request ran"))
            raise
        except Exception as e:  # noqa: BLE001 - every caller of the batch gets the error
            _fail(reqs, e)
            return
        if len(reqs) == 1:
            _settle(reqs[0], outputs)
            return
        total = sum(r.rows for r in reqs)
        for name, a in outputs.items():
            if np.ndim(a) == 0 or np.shape(a)[0] != total:
                _fail(reqs, ExecutionError(f"model '{self.model}': output '{name}' has shape {list(np.shape(a))}, "
                                           f"but its dim 0 should be the batch's {total} rows"))
                return
        lo = 0
        for r in reqs:
            hi = lo + r.rows
            _settle(r, {name: a[lo:hi] for name, a in outputs.items()})
            lo = hi

    # -- shutdown --------------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop accepting new requests, run everything queued (without waiting for fuller batches), and
        return once nothing is queued or running."""
        self._accepting = False
        self._notify()
        while self._depth or self._running:
            await self._wait()

    async def close(self) -> None:
        """Drain, stop the scheduler, and close the executor."""
        await self.drain()
        if self._scheduler is not None:
            self._scheduler.cancel()
            try:
                await self._scheduler
            except asyncio.CancelledError:
                pass
        await self.executor.close()


def _settle(r: _Request, outputs: Dict[str, np.ndarray]) -> None:
    if not r.future.done():
        r.future.set_result(outputs)


def _fail(reqs: List[_Request], e: BaseException) -> None:
    for r in reqs:
        if not r.future.done():
            r.future.set_exception(e)
