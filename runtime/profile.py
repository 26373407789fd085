"""Per-op profiling for ``kiln bench --profile``: time every instruction of a program's plan and
add the times up by op.

The timing loop is a copy of ``plan.execute`` with a clock read around each kernel, so the plan
and its run loop stay free of instrumentation. Nested plans (If/Loop bodies) count as their
owning instruction. The wall time of an instrumented run minus the kernel times is what the loop
itself (and the clock) cost.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Union

from kiln.runtime.kernels import cpu
from kiln.runtime.plan import Plan

_CONTROL_OPS = ("If", "Loop")


@dataclass
class OpStat:
    op: str
    kernel: str       # 'fast' (a CPU kernel), 'reference' (the IR reference) or 'control'
    seconds: float    # over all profiled runs
    calls: int        # over all profiled runs


@dataclass
class Profile:
    runs: int
    wall_seconds: float  # all instrumented runs, loop and clock included
    ops: list            # OpStat, most expensive first

    @property
    def kernel_seconds(self) -> float:
        return sum(s.seconds for s in self.ops)


def profile_program(program: Any, inputs: Union[Mapping[str, Any], list], runs: int = 20) -> Profile:
    """Run ``program`` ``runs`` times (after one untimed run) timing every instruction."""
    arrays = program._check_inputs(inputs)
    seconds: dict = {}
    calls: dict = {}
    _timed_run(program, arrays, {}, {})  # warm-up: first-touch costs are not per-op costs
    start = time.perf_counter()
    for _ in range(runs):
        _timed_run(program, arrays, seconds, calls)
    wall = time.perf_counter() - start
    ops = [OpStat(_op_name(key), _kernel_kind(key), t, calls[key]) for key, t in seconds.items()]
    ops.sort(key=lambda s: s.seconds, reverse=True)
    return Profile(runs, wall, ops)


def _timed_run(program: Any, arrays: list, seconds: dict, calls: dict) -> None:
    slots = list(program._template)
    for s, a in zip(program.plan.input_slots, arrays):
        slots[s] = a
    _timed_execute(program.plan, slots, seconds, calls)


def _timed_execute(plan: Plan, slots: list, seconds: dict, calls: dict) -> None:
    """``plan.execute`` with each kernel call timed into ``seconds``/``calls`` by (domain, op)."""
    clock = time.perf_counter
    for ins in plan.instructions:
        args = [None if s < 0 else slots[s] for s in ins.inputs]
        start = clock()
        result = ins.kernel(slots, *args) if ins.with_slots else ins.kernel(*args)
        elapsed = clock() - start
        key = (ins.node.domain, ins.node.op)
        seconds[key] = seconds.get(key, 0.0) + elapsed
        calls[key] = calls.get(key, 0) + 1
        if ins.single:
            slots[ins.outputs[0]] = result
        else:
            for s, r in zip(ins.outputs, result):
                slots[s] = r
        for s in ins.release:
            slots[s] = None


def _op_name(key: tuple) -> str:
    return f"{key[0]}.{key[1]}" if key[0] else key[1]


def _kernel_kind(key: tuple) -> str:
    if key[0] == "" and key[1] in _CONTROL_OPS:
        return "control"
    return "fast" if key in cpu.KERNELS else "reference"


def format_profile(p: Profile) -> str:
    """A table per op, per run: total ms, share of kernel time, calls, mean µs per call."""
    kernel_total = p.kernel_seconds or 1e-12
    width = max([len(s.op) for s in p.ops] + [len("op")])
    lines = [f"per-op time, per run (mean of {p.runs} instrumented runs)",
             f"{'op':<{width}}  {'kernel':<9}  {'total ms':>9}  {'share %':>7}  {'calls':>6}  {'mean µs':>9}"]
    for s in p.ops:
        lines.append(f"{s.op:<{width}}  {s.kernel:<9}  "
                     f"{s.seconds / p.runs * 1e3:>9.4f}  {100 * s.seconds / kernel_total:>7.1f}  "
                     f"{s.calls // p.runs:>6}  {s.seconds / s.calls * 1e6:>9.2f}")
    per_run = p.wall_seconds / p.runs * 1e3
    kernels = p.kernel_seconds / p.runs * 1e3
    lines.append(f"kernels {kernels:.4f} ms of {per_run:.4f} ms per instrumented run; the rest "
                 f"({per_run - kernels:.4f} ms) is the run loop and the clock itself")
    return "\n".join(lines)
