"""Guard cost on the GPU, taken apart (diagnostic for issue 15): ResNet-50 with its guards against
the same model without them, and variants that drop one piece of the guard path at a time.
Host wall time of run() + sync and GPU time between events on the caller's stream; programs
interleaved, 300 runs each; medians and quartiles."""
from __future__ import annotations

import time

import cupy as cp
import numpy as np

import kiln.runtime.cuda_program as cprog
from guard_bench import build, without_guards_keeping_checks
from kiln.runtime.cuda_program import CudaProgram
from kiln.runtime.kernels.cuda.guard import DeviceGuard


def replay_only(p, n=200):
    entry = next(iter(p._graphs.values()))
    graph, stream = entry.graph, entry.stream
    for _ in range(10):
        graph.launch(stream)
    stream.synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(stream)
    for _ in range(n):
        graph.launch(stream)
    b.record(stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / n * 1e3


def main():
    for batch in (1, 32):
        on, x = build(True, batch)
        off, _ = build(False, batch)
        xd = cp.asarray(x)
        progs = {"off": CudaProgram(off), "on": CudaProgram(on), "off numpy": CudaProgram(off.copy(), output="numpy"),
                 "on numpy": CudaProgram(on.copy(), output="numpy")}
        # no read: the same graph, its records never waited for or read
        real_entries = cprog._GuardRecords.first_failure
        progs["on, no wait/read"] = CudaProgram(on.copy())
        # device records: the guard kernels write device memory, not page-locked host memory
        real_init = cprog._GuardRecords.__init__
        cprog._GuardRecords.__init__ = lambda self, mapped: real_init(self, False)
        progs["on, device records"] = CudaProgram(on.copy())
        for p in progs.values():
            for _ in range(20):
                p.run([xd])
        cprog._GuardRecords.__init__ = real_init
        no_read = progs["on, no wait/read"]
        entry = next(iter(no_read._graphs.values()))
        entry.records.entries.clear()  # the replay path then neither waits nor reads
        cp.cuda.Device().synchronize()
        wall = {k: [] for k in progs}
        gpu = {k: [] for k in progs}
        s = cp.cuda.get_current_stream()
        for i in range(300):
            order = list(progs) if i % 2 == 0 else list(reversed(list(progs)))
            for k in order:
                a, b = cp.cuda.Event(), cp.cuda.Event()
                t = time.perf_counter()
                a.record(s)
                progs[k].run([xd])
                b.record(s)
                b.synchronize()
                wall[k].append(time.perf_counter() - t)
                gpu[k].append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
        for k, p in progs.items():
            w, g = np.array(wall[k]) * 1e6, np.array(gpu[k]) * 1e6
            print(f"b{batch} {k:20s}: wall median {np.median(w):8.1f} us (IQR {np.percentile(w, 25):.1f}-"
                  f"{np.percentile(w, 75):.1f}); events {np.median(g):8.1f} us; replay only "
                  f"{replay_only(p):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
