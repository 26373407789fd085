"""Per-GPU utilization and memory on ``GET /metrics``, through NVML, named as Triton names them (issue 17).

=============================  =====  ==========================================================
nv_gpu_utilization{gpu_uuid}   gauge  GPU utilization rate [0.0 - 1.0) (NVML's percent / 100)
nv_gpu_memory_total_bytes      gauge  GPU total memory, in bytes
nv_gpu_memory_used_bytes       gauge  GPU used memory, in bytes (all processes on the card)
=============================  =====  ==========================================================

Only when the server serves at least one model on ``cuda`` and ``pynvml`` (the ``nvidia-ml-py``
package, in the ``gpu`` extra) imports; the GPUs sampled are those the served models' workers use
(:func:`kiln.server.gpu.gpu_slots`; an index is a CUDA index of the server process, mapped through its
own ``CUDA_VISIBLE_DEVICES`` as the workers' is (:func:`kiln.server.gpu.visible_device`), because NVML
ignores that variable: a UUID entry is looked up with ``nvmlDeviceGetHandleByUUID``, a number with
``nvmlDeviceGetHandleByIndex``: the same card where CUDA and NVML order devices alike, i.e. by PCI bus id,
which they do on machines of identical GPUs).

Otherwise the three families are absent from the page (as in Triton started with
``--allow-gpu-metrics=false`` or without GPUs), and the reason is logged once. Sampling happens at
scrape time and is cached for ``ttl`` seconds (1 s, NVML's own utilization window), so scrapes stay
cheap; the app samples on a thread, never on the event loop. An NVML error (at init or at a scrape)
drops the three families from that page, with a warning logged once; the scrape still answers 200.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Callable, Iterable, Optional, Sequence

from kiln.server.metrics import escape_help, escape_label_value, format_value

log = logging.getLogger("kiln.server")

FAMILIES = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)"),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes"),
)


def gpus_in_use(entries: Iterable) -> list[int]:
    """The sorted GPU indices that models served on ``cuda`` use (empty: none on a GPU)."""
    from kiln.server.gpu import gpu_slots, parse_device
    gpus: set[int] = set()
    for e in entries:
        config = getattr(e, "config", None)
        try:
            if parse_device(getattr(config, "device", "cpu")) is None:
                continue
            gpus.update(gpu_slots(config))
        except Exception:  # noqa: BLE001 - a bad device is refused elsewhere (check_gpus); no metrics for it
            continue
    return sorted(gpus)


def _import_pynvml():
    return importlib.import_module("pynvml")


class GpuMetrics:
    """NVML samples of ``gpus`` rendered as Triton's three GPU families; see the module docstring."""

    def __init__(self, gpus: Sequence[int], *, ttl: float = 1.0,
                 importer: Callable[[], object] = _import_pynvml, clock: Callable[[], float] = time.monotonic):
        self.gpus = sorted(set(int(g) for g in gpus))
        self.ttl = float(ttl)
        self._clock = clock
        self._lock = threading.Lock()  # one sampler at a time; concurrent scrapes share its result
        self._cache: Optional[tuple[float, str]] = None
        self._nvml = None
        self._initialized = False
        self._warned = False
        self.disabled_reason: Optional[str] = None
        if not self.gpus:
            self.disabled_reason = "no model is served on a GPU"
            return
        try:
            self._nvml = importer()
        except ImportError as e:
            self.disabled_reason = (f"pynvml is not installed ({e}); install nvidia-ml-py "
                                    "(pip install 'kiln-compiler[gpu]') for nv_gpu_* metrics")
            log.warning("GPU metrics off: %s", self.disabled_reason)

    @property
    def enabled(self) -> bool:
        return self._nvml is not None

    def fresh(self) -> bool:
        """True when :meth:`render` would answer from the cache, without calling NVML."""
        cache = self._cache
        return not self.enabled or (cache is not None and self._clock() - cache[0] < self.ttl)

    def render(self) -> str:
        """The three families' text (ending in a newline), or ``""`` when off or NVML failed."""
        if not self.enabled:
            return ""
        with self._lock:
            now = self._clock()
            if self._cache is not None and now - self._cache[0] < self.ttl:
                return self._cache[1]
            try:
                text = self._sample()
            except Exception as e:  # noqa: BLE001 - NVMLError or anything else: omit, never a 500
                if not self._warned:
                    self._warned = True
                    log.warning("GPU metrics omitted: NVML failed: %s: %s (logged once)", type(e).__name__, e)
                text = ""
            self._cache = (now, text)
            return text

    def _sample(self) -> str:
        nv = self._nvml
        if not self._initialized:
            nv.nvmlInit()
            self._initialized = True
        rows = []
        from kiln.server.gpu import visible_device
        for index in self.gpus:
            device = visible_device(index)  # e.g. Ray gave this replica GPU 3: CUDA's 0 is NVML's 3
            handle = (nv.nvmlDeviceGetHandleByIndex(int(device)) if device.isdigit()
                      else nv.nvmlDeviceGetHandleByUUID(device))
            uuid = nv.nvmlDeviceGetUUID(handle)
            if isinstance(uuid, bytes):  # older pynvml returns bytes
                uuid = uuid.decode("utf-8", "replace")
            util = nv.nvmlDeviceGetUtilizationRates(handle)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            rows.append((str(uuid), float(util.gpu) / 100.0, float(mem.total), float(mem.used)))
        out: list[str] = []
        for column, (name, help) in enumerate(FAMILIES):
            out.append(f"# HELP {name} {escape_help(help)}")
            out.append(f"# TYPE {name} gauge")
            for row in rows:
                value = row[1 + column]
                out.append(f'{name}{{gpu_uuid="{escape_label_value(row[0])}"}} {format_value(value)}')
        return "\n".join(out) + "\n"

    def close(self) -> None:
        with self._lock:
            if self._initialized:
                self._initialized = False
                try:
                    self._nvml.nvmlShutdown()
                except Exception:  # noqa: BLE001
                    pass
