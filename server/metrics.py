"""Prometheus metrics for ``kiln serve``, with no third-party dependency.

The server needs a handful of counters, gauges and histograms and one text page at ``GET /metrics``;
``prometheus_client`` would be one more install (and a global default registry that leaks between
tests and apps in one process), so this module is a small registry of its own that renders the text
exposition format 0.0.4 (https://prometheus.io/docs/instrumenting/exposition_formats/): ``# HELP`` and
``# TYPE`` lines, label values escaped (``\\``, ``"`` and newlines), histograms as cumulative
``_bucket{le="..."}`` series ending in ``le="+Inf"`` plus ``_sum`` and ``_count``. Every update and
``render()`` take one lock, so the batcher's threads, worker callbacks and the event loop can all
report at once and a scrape always sees a consistent snapshot.

Metric names (labels ``model`` and ``version`` on all of them). Where Triton has a metric with the same
meaning kiln uses Triton's name, so existing dashboards and alerts work:

=============================================  =========  ===================================================
nv_inference_request_success                   counter    requests answered successfully
nv_inference_request_failure{reason}           counter    requests that failed, by reason (see below)
nv_inference_count                             counter    inferences performed: rows of all executed batches
nv_inference_exec_count                        counter    model executions (batches run)
nv_inference_request_duration_us               counter    total end-to-end time of successful requests, us
nv_inference_queue_duration_us                 counter    total time requests waited in the queue, us
nv_inference_compute_infer_duration_us         counter    total compute time, counted per request as Triton
                                                          does (a batch of 4 requests adds its time 4 times)
nv_inference_compute_input_duration_us         counter    total time decoding successful requests' inputs
                                                          (JSON, binary or shared memory into arrays), us
nv_inference_compute_output_duration_us        counter    total time encoding successful responses, us
nv_inference_pending_request_count             gauge      requests queued, not yet executing
kiln_request_duration_seconds{outcome,         histogram  end-to-end request latency, every outcome, by the
  protocol}                                               transport that carried it: ``http`` or ``grpc``
kiln_queue_duration_seconds                    histogram  time each request waited before its batch ran
kiln_compute_duration_seconds                  histogram  time each batch took to execute
kiln_batch_size                                histogram  rows per executed batch
kiln_batch_requests                            histogram  requests per executed batch
kiln_copy_duration_seconds{direction}          histogram  GPU models: device time of each batch's host-to-device
                                                          (h2d) and device-to-host (d2h) copies
kiln_gpu_wait_duration_seconds                 histogram  GPU models: time a batch, on its worker, waited for
                                                          the batch before it to leave the GPU
=============================================  =========  ===================================================

The same numbers answer Triton's statistics extension (``GET /v2/models[/{m}[/versions/{v}]]/stats``,
what ``tritonclient``'s ``get_inference_statistics`` reads): :meth:`Metrics.model_stats` builds one
``$model_stat`` from them under the registry lock, so it is consistent with a scrape taken at the same
moment. Mapping: ``success`` and ``fail`` are request counts and end-to-end durations by outcome;
``queue`` the per-request queue wait; ``compute_infer`` the batch compute time counted once per request
in the batch (as Triton counts it); ``compute_input``/``compute_output`` the request decode/encode time
(kiln's input preparation happens per request in the HTTP layer, not per batch, so ``batch_stats`` carry
only ``compute_infer`` durations, with ``compute_input``/``compute_output`` counted at 0 ns);
``batch_stats`` one entry per exact batch size executed.

``outcome`` is ``"success"`` or a failure reason. The server reports these reasons: ``invalid_request``
(4xx: bad input), ``rejected`` (503: queue full or shutting down), ``timeout`` (504), ``backend`` (500:
the model or a worker failed); ``reason`` on ``nv_inference_request_failure`` is the same string.

``protocol`` (``"http"`` or ``"grpc"``, server/grpc_server.py) is on ``kiln_request_duration_seconds`` only,
its last label: its ``_count`` and buckets give requests and latency per transport and outcome. Triton's
``nv_inference_*`` families keep Triton's label set (``model``, ``version``[, ``reason``]) and count both
transports together, as Triton's do, so Triton's dashboards and alerts see the series they expect. A query
that aggregates ``kiln_request_duration_seconds`` (``sum by (le) (rate(..._bucket[5m]))``) is unchanged; one
that selects a single series by ``model``/``version``/``outcome`` without aggregating now gets one series per
protocol that served traffic. Each model version's ``outcome="success"`` series is created at zero for each
protocol the server speaks (:meth:`Metrics.add_protocol`; ``http`` always).
"""
from __future__ import annotations

import math
import re
import threading
import time
from bisect import bisect_left
from typing import Iterable, Optional, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

#: Latency buckets in seconds: 100 us (a tiny model's whole request) up to the default 30 s timeout.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Batch-size buckets: powers of two, since max_batch_size usually is one.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it: integers without a fraction, ``+Inf``/``-Inf``/``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return repr(float(value))


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


class _Metric:
    """A metric family: a name, help text, label names, and one child per label-value tuple."""

    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str], lock: threading.RLock):
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labelnames:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} for metric {name}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"duplicate label names for metric {name}: {labelnames}")
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = lock
        self._children: dict[tuple[str, ...], object] = {}

    def _key(self, labels: dict) -> tuple[str, ...]:
        names = self.labelnames
        try:
            values = [labels[n] for n in names]
        except KeyError:
            values = None
        if values is None or len(labels) != len(names):
            raise ValueError(f"metric {self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple([v if type(v) is str else str(v) for v in values])

    def _child(self, key: tuple[str, ...]):  # caller holds the lock
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def touch(self, **labels) -> None:
        """Create the series for ``labels`` at zero, so it is scraped before its first event."""
        key = self._key(labels)
        with self._lock:
            self._child(key)

    def _label_text(self, key: tuple[str, ...], extra: Optional[tuple[str, str]] = None) -> str:
        pairs = [f'{n}="{escape_label_value(v)}"' for n, v in zip(self.labelnames, key)]
        if extra:
            pairs.append(f'{extra[0]}="{extra[1]}"')
        return "{" + ",".join(pairs) + "}" if pairs else ""

    def _render(self, out: list[str]) -> None:  # caller holds the lock
        out.append(f"# HELP {self.name} {escape_help(self.help)}")
        out.append(f"# TYPE {self.name} {self.kind}")
        for key in sorted(self._children):
            self._render_child(out, key, self._children[key])


class Counter(_Metric):
    """A monotonically increasing total."""

    kind = "counter"

    def _new_child(self) -> list:
        return [0.0]

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} can only increase (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._child(key)[0] += amount

    def value(self, **labels) -> float:
        with self._lock:
            child = self._children.get(self._key(labels))
            return child[0] if child else 0.0

    def _render_child(self, out, key, child) -> None:
        out.append(f"{self.name}{self._label_text(key)} {format_value(child[0])}")


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._child(key)[0] = float(value)

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._child(key)[0] += amount

    def dec(self, amount: float = 1.0, **labels) -> None:
        self.inc(-amount, **labels)


class _HistogramChild:
    __slots__ = ("counts", "sum", "count")

    def __init__(self, n_buckets: int):
        self.counts = [0] * n_buckets  # per bucket, not cumulative; rendered cumulatively
        self.sum = 0.0
        self.count = 0


class Histogram(_Metric):
    """Observations counted into fixed buckets (upper bounds, inclusive), plus their sum and count."""

    kind = "histogram"

    def __init__(self, name, help, labelnames, lock, buckets: Iterable[float]):
        if "le" in labelnames:
            raise ValueError(f"histogram {name} cannot have a label named 'le'")
        super().__init__(name, help, labelnames, lock)
        bounds = [float(b) for b in buckets]
        if bounds and math.isinf(bounds[-1]):
            bounds.pop()
        if not bounds or any(a >= b for a, b in zip(bounds, bounds[1:])) or any(map(math.isnan, bounds)):
            raise ValueError(f"histogram {name} needs strictly increasing finite buckets, got {buckets}")
        self.buckets = tuple(bounds)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(len(self.buckets) + 1)  # last: above every bound (+Inf only)

    def observe(self, value: float, **labels) -> None:
        self.observe_many((value,), **labels)

    def observe_many(self, values: Iterable[float], **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._observe_locked(key, values)

    def _observe_locked(self, key: tuple, values: Iterable[float]) -> None:
        """``observe_many`` for a key already built (its label values in ``labelnames`` order); the caller
        holds the lock (Metrics' hot paths: one key per model version, no keyword dicts)."""
        child = self._child(key)
        for v in values:
            v = float(v)
            if v != v:
                continue  # NaN: no bucket holds it, and it would poison _sum forever
            child.counts[bisect_left(self.buckets, v)] += 1  # le is inclusive: v == bound counts in it
            child.sum += v
            child.count += 1

    def snapshot(self, **labels) -> tuple[list[int], float, int]:
        """(cumulative bucket counts including +Inf, sum, count) for one series."""
        with self._lock:
            child = self._children.get(self._key(labels)) or self._new_child()
            return _cumulative(child.counts), child.sum, child.count

    def _render_child(self, out, key, child) -> None:
        for bound, total in zip(self.buckets + (math.inf,), _cumulative(child.counts)):
            out.append(f"{self.name}_bucket{self._label_text(key, ('le', _format_le(bound)))} {total}")
        labels = self._label_text(key)
        out.append(f"{self.name}_sum{labels} {format_value(child.sum)}")
        out.append(f"{self.name}_count{labels} {child.count}")


def _cumulative(counts: list[int]) -> list[int]:
    total, out = 0, []
    for c in counts:
        total += c
        out.append(total)
    return out


def _format_le(bound: float) -> str:
    # Like the official clients: "+Inf", and floats always with a fraction or exponent ("1.0", "0.005").
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class Registry:
    """Metric families in registration order; :meth:`render` writes them all under one lock."""

    def __init__(self):
        # Re-entrant so Metrics can hold it across the several updates of one event (a scrape never sees
        # a batch counted in nv_inference_exec_count but not yet in kiln_batch_size).
        self._lock = threading.RLock()
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help, labelnames, self._lock))

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, help, labelnames, self._lock))

    def histogram(self, name: str, help: str, labelnames: Sequence[str] = (),
                  buckets: Iterable[float] = LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help, labelnames, self._lock, buckets))

    @property
    def lock(self) -> threading.RLock:
        """The lock every metric of this registry updates under; hold it to make several updates atomic."""
        return self._lock

    def get(self, name: str) -> _Metric:
        return self._metrics[name]

    def render(self) -> str:
        out: list[str] = []
        with self._lock:
            for metric in self._metrics.values():
                metric._render(out)
        return "\n".join(out) + "\n"


_MV = ("model", "version")


class Metrics:
    """The server's metrics (see the module docstring for names and meanings).

    The batcher calls :meth:`observe_batch` once per executed batch and :meth:`set_queue_depth` when its
    queue changes; the HTTP and gRPC layers call :meth:`observe_request` once per inference request with
    its outcome and protocol; ``GET /metrics`` returns :meth:`render` with :data:`CONTENT_TYPE`.
    """

    def __init__(self):
        r = self.registry = Registry()
        self.request_success = r.counter("nv_inference_request_success",
                                         "Number of successful inference requests", _MV)
        self.request_failure = r.counter("nv_inference_request_failure",
                                         "Number of failed inference requests, by reason", _MV + ("reason",))
        self.inference_count = r.counter("nv_inference_count",
                                         "Number of inferences performed (rows of executed batches)", _MV)
        self.exec_count = r.counter("nv_inference_exec_count",
                                    "Number of model executions (batches) performed", _MV)
        self.request_duration_us = r.counter("nv_inference_request_duration_us",
                                             "Cumulative end-to-end duration of successful inference "
                                             "requests, in microseconds", _MV)
        self.queue_duration_us = r.counter("nv_inference_queue_duration_us",
                                           "Cumulative time requests spent waiting in the queue, in microseconds",
                                           _MV)
        self.compute_duration_us = r.counter("nv_inference_compute_infer_duration_us",
                                             "Cumulative compute time of inference requests, in microseconds "
                                             "(a batch's time counted once per request in it)", _MV)
        self.compute_input_us = r.counter("nv_inference_compute_input_duration_us",
                                          "Cumulative time decoding the inputs of successful inference "
                                          "requests, in microseconds", _MV)
        self.compute_output_us = r.counter("nv_inference_compute_output_duration_us",
                                           "Cumulative time encoding the outputs of successful inference "
                                           "requests, in microseconds", _MV)
        self.pending = r.gauge("nv_inference_pending_request_count",
                               "Number of inference requests queued and not yet executing", _MV)
        self.request_seconds = r.histogram("kiln_request_duration_seconds",
                                           "End-to-end inference request latency in seconds, by outcome "
                                           "and protocol (http, grpc)",
                                           _MV + ("outcome", "protocol"), LATENCY_BUCKETS)
        self.queue_seconds = r.histogram("kiln_queue_duration_seconds",
                                         "Time each request waited in the queue before its batch ran, in seconds",
                                         _MV, LATENCY_BUCKETS)
        self.compute_seconds = r.histogram("kiln_compute_duration_seconds",
                                           "Time each batch took to execute, in seconds", _MV, LATENCY_BUCKETS)
        self.batch_size = r.histogram("kiln_batch_size", "Rows per executed batch", _MV, BATCH_BUCKETS)
        # GPU workers only (server/gpu.py's GpuRunner): device time of each batch's host-to-device and
        # device-to-host copies (CUDA events), and how long a batch waited for its GPU to be free.
        self.copy_seconds = r.histogram("kiln_copy_duration_seconds",
                                        "Device time of each batch's copies between host and GPU, in seconds, "
                                        "by direction (h2d, d2h)", _MV + ("direction",), LATENCY_BUCKETS)
        self.gpu_wait_seconds = r.histogram("kiln_gpu_wait_duration_seconds",
                                            "Time each batch, already on its GPU worker, waited for the GPU to "
                                            "finish the batch before it, in seconds", _MV, LATENCY_BUCKETS)
        self.batch_requests = r.histogram("kiln_batch_requests", "Requests per executed batch", _MV,
                                          BATCH_BUCKETS)
        # For the statistics extension, what the series above do not keep: per (model, version), the time of
        # the last successful request (ms since the epoch), the number of decoded/encoded requests, and
        # {exact batch size: [executions, total compute ns]}.
        self._stats: dict[tuple[str, str], dict] = {}
        #: The transports whose request series :meth:`add_model` creates at zero (:meth:`add_protocol`).
        self.protocols: tuple[str, ...] = ("http",)

    def _model_stats(self, labels: dict) -> dict:  # caller holds the lock
        key = (labels["model"], labels["version"])
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = {"last_inference": 0, "codec_count": 0, "batches": {}}
        return stats

    def add_model(self, model: str, version: str) -> None:
        """Create a model version's series at zero, so a scrape shows it (and rates work) before traffic."""
        labels = {"model": model, "version": str(version)}
        with self.registry.lock:
            for metric in (self.request_success, self.inference_count, self.exec_count, self.request_duration_us,
                           self.queue_duration_us, self.compute_duration_us, self.compute_input_us,
                           self.compute_output_us, self.pending, self.queue_seconds,
                           self.compute_seconds, self.batch_size, self.batch_requests):
                metric.touch(**labels)
            for protocol in self.protocols:
                self.request_seconds.touch(outcome="success", protocol=protocol, **labels)
            self._model_stats(labels)

    def add_protocol(self, protocol: str) -> None:
        """The server also answers over ``protocol`` (``"grpc"``): create each known model version's
        ``kiln_request_duration_seconds{outcome="success",protocol=...}`` series at zero, and those of models
        added later."""
        with self.registry.lock:
            if protocol in self.protocols:
                return
            self.protocols += (protocol,)
            for model, version in self._stats:
                self.request_seconds.touch(model=model, version=version, outcome="success", protocol=protocol)

    # The hot paths below (every request and batch) build each series key once, as a tuple in the metrics'
    # labelnames order (model, version[, extra]), and update the children under the one registry lock:
    # keyword dicts and per-metric key building were 9% of the HTTP process under load (py-spy, BERT).

    def observe_request(self, model: str, version: str, outcome: str, seconds: float,
                        protocol: str = "http") -> None:
        """One inference request finished: ``outcome`` is ``"success"`` or a failure reason; ``protocol``
        the transport that carried it (``"http"``, ``"grpc"``)."""
        mv = (model, str(version))
        with self.registry.lock:
            if outcome == "success":
                self.request_success._child(mv)[0] += 1
                self.request_duration_us._child(mv)[0] += max(seconds, 0.0) * 1e6
                self._model_stats({"model": mv[0], "version": mv[1]})["last_inference"] = int(time.time() * 1000)
            else:
                self.request_failure.inc(reason=outcome, model=model, version=mv[1])
            self.request_seconds._observe_locked(mv + (str(outcome), protocol), (seconds,))

    def observe_batch(self, model: str, version: str, size: int, queue_seconds: Sequence[float],
                      compute_seconds: float) -> None:
        """One batch executed: ``size`` rows stacked from ``len(queue_seconds)`` requests, each of which
        waited ``queue_seconds[i]`` in the queue; the execution took ``compute_seconds``."""
        mv = (model, str(version))
        n_requests = len(queue_seconds)
        with self.registry.lock:
            self.inference_count._child(mv)[0] += max(size, 0)
            self.exec_count._child(mv)[0] += 1
            self.queue_duration_us._child(mv)[0] += sum(max(q, 0.0) for q in queue_seconds) * 1e6
            self.compute_duration_us._child(mv)[0] += max(compute_seconds, 0.0) * 1e6 * n_requests
            self.queue_seconds._observe_locked(mv, queue_seconds)
            self.compute_seconds._observe_locked(mv, (compute_seconds,))
            self.batch_size._observe_locked(mv, (size,))
            self.batch_requests._observe_locked(mv, (n_requests,))
            entry = self._model_stats({"model": mv[0], "version": mv[1]})["batches"].setdefault(int(size), [0, 0])
            entry[0] += 1
            entry[1] += int(max(compute_seconds, 0.0) * 1e9)

    def observe_device(self, model: str, version: str, timings: dict) -> None:
        """A GPU worker's timings of one batch: ``h2d``/``d2h`` copy seconds, ``gpu_wait`` seconds."""
        labels = {"model": model, "version": str(version)}
        with self.registry.lock:
            for direction in ("h2d", "d2h"):
                value = timings.get(direction)
                if value is not None:
                    self.copy_seconds.observe(max(float(value), 0.0), direction=direction, **labels)
            if timings.get("gpu_wait") is not None:
                self.gpu_wait_seconds.observe(max(float(timings["gpu_wait"]), 0.0), **labels)

    def observe_codec(self, model: str, version: str, input_seconds: float, output_seconds: float) -> None:
        """A successful request's inputs took ``input_seconds`` to decode and its outputs ``output_seconds``
        to encode (Triton's compute_input / compute_output)."""
        mv = (model, str(version))
        with self.registry.lock:
            self.compute_input_us._child(mv)[0] += max(input_seconds, 0.0) * 1e6
            self.compute_output_us._child(mv)[0] += max(output_seconds, 0.0) * 1e6
            self._model_stats({"model": mv[0], "version": mv[1]})["codec_count"] += 1

    def model_stats(self, model: str, version: str) -> dict:
        """One ``$model_stat`` of Triton's statistics extension (see the module docstring)."""
        labels = {"model": model, "version": str(version)}
        mv = (labels["model"], labels["version"])

        def ns(counter: Counter) -> int:  # a counter of microseconds, in nanoseconds
            return int(round(counter.value(**labels) * 1000))

        with self.registry.lock:
            stats = self._model_stats(labels)
            fail_count = sum(int(c[0]) for k, c in self.request_failure._children.items() if k[:2] == mv)
            fail_s = sum(c.sum for k, c in self.request_seconds._children.items()
                         if k[:2] == mv and k[2] != "success")
            _, queue_s, queue_n = self.queue_seconds.snapshot(**labels)
            codec_n = stats["codec_count"]
            return {
                "name": model,
                "version": str(version),
                "last_inference": stats["last_inference"],
                "inference_count": int(self.inference_count.value(**labels)),
                "execution_count": int(self.exec_count.value(**labels)),
                "inference_stats": {
                    "success": {"count": int(self.request_success.value(**labels)), "ns": ns(self.request_duration_us)},
                    "fail": {"count": fail_count, "ns": int(round(fail_s * 1e9))},
                    "queue": {"count": queue_n, "ns": int(round(queue_s * 1e9))},
                    "compute_input": {"count": codec_n, "ns": ns(self.compute_input_us)},
                    "compute_infer": {"count": queue_n, "ns": ns(self.compute_duration_us)},
                    "compute_output": {"count": codec_n, "ns": ns(self.compute_output_us)},
                    "cache_hit": {"count": 0, "ns": 0},
                    "cache_miss": {"count": 0, "ns": 0},
                },
                "batch_stats": [
                    {"batch_size": size,
                     "compute_input": {"count": n, "ns": 0},
                     "compute_infer": {"count": n, "ns": total_ns},
                     "compute_output": {"count": n, "ns": 0}}
                    for size, (n, total_ns) in sorted(stats["batches"].items())
                ],
            }

    def set_queue_depth(self, model: str, version: str, n: int) -> None:
        with self.registry.lock:
            self.pending._child((model, str(version)))[0] = float(n)

    def render(self) -> str:
        return self.registry.render()
