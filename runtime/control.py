"""If and Loop as nested plans sharing the run's slot list (bodies read outer values by slot)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kiln.ir.graph import Node
from kiln.runtime.plan import PlanBuilder, nested_executor


def if_kernel(node: Node, builder: PlanBuilder):
    then_plan = builder.build(node.attrs["then_branch"], liveness=False)
    else_plan = builder.build(node.attrs["else_branch"], liveness=False)

    def run(slots: list, cond: np.ndarray) -> Any:
        plan = then_plan if bool(np.asarray(cond).reshape(-1)[0]) else else_plan
        nested_executor()(plan, slots)  # execute, or the profiler's timed loop (plan.NESTED_EXECUTOR)
        outs = tuple(slots[s] for s in plan.output_slots)
        return outs[0] if len(outs) == 1 else outs

    run.with_slots = True
    return run


def loop_kernel(node: Node, builder: PlanBuilder):
    """The body's plan run once per iteration over the shared slots.

    Per iteration the loop only moves slots: the counter (a read-only 0-d array, made once per
    process), the carried values from the body's output slots to its input slots, the scan
    values onto lists. A recurrent layer runs a body of about a dozen small ops per time step,
    so this bookkeeping is part of its cost (an RNN step of 4 tiny ops: 11.2 -> 10.5 us)."""
    body = node.attrs["body"]
    plan = builder.build(body, liveness=False)
    n_carried = len(body.inputs) - 2
    n_scan = len(body.outputs) - 1 - n_carried
    scan_types = [v.type for v in body.outputs[1 + n_carried:]]
    it_slot, cond_slot, carried_in = plan.input_slots[0], plan.input_slots[1], plan.input_slots[2:]
    cond_out, carried_out = plan.output_slots[0], plan.output_slots[1:1 + n_carried]
    scan_out = plan.output_slots[1 + n_carried:]

    def run(slots: list, m=None, cond=None, *carried) -> Any:
        if m is None and cond is None:
            raise ValueError("a Loop with neither a trip count M nor a cond input never ends")
        trips = None if m is None else int(np.asarray(m).reshape(-1)[0])
        go = True if cond is None else bool(np.asarray(cond).reshape(-1)[0])
        counters = _counters(trips)
        for s, v in zip(carried_in, carried):
            slots[s] = v
        slots[cond_slot] = _TRUE if go else _FALSE
        scans: list[list] = [[] for _ in range(n_scan)]
        i = 0
        execute = nested_executor()  # plan.execute, or the profiler's timed loop (plan.NESTED_EXECUTOR)
        while go and (trips is None or i < trips):
            slots[it_slot] = counters[i] if i < len(counters) else np.array(i, np.int64)
            execute(plan, slots)
            # Every output is read before any input slot is written: a body may pass an input
            # through (as a scan value, or swapped with another carried value).
            new = [slots[s] for s in carried_out]
            for k, s in enumerate(scan_out):
                scans[k].append(slots[s])
            if cond is not None:
                go = bool(np.asarray(slots[cond_out]).reshape(-1)[0])
                slots[cond_slot] = _TRUE if go else _FALSE
            for s, v in zip(carried_in, new):
                slots[s] = v
            i += 1
        values = [slots[s] for s in carried_in]
        stacked = [np.stack(s) if s else _empty_scan(t) for s, t in zip(scans, scan_types)]
        results = (*values, *stacked)
        return results[0] if len(results) == 1 else results

    run.with_slots = True
    return run


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


_TRUE, _FALSE = _read_only(np.array(True)), _read_only(np.array(False))
# Iteration counters 0..n-1 as read-only 0-d arrays, shared by every loop and thread (a tuple,
# replaced whole when a longer one is needed, so a reader never sees it half built).
_COUNTER_CAP = 1 << 12
_COUNTERS: tuple = ()


def _counters(trips: Optional[int]) -> tuple:
    global _COUNTERS
    want = min(_COUNTER_CAP, 64 if trips is None else max(trips, 0))
    if len(_COUNTERS) < want:
        _COUNTERS = tuple(_read_only(np.array(i, np.int64)) for i in range(max(want, 2 * len(_COUNTERS))))
    return _COUNTERS


def _empty_scan(t) -> np.ndarray:
    """The scan output of a loop that ran zero times: a leading 0 dim before the body's shape."""
    dims = [d if isinstance(d, int) else 0 for d in (t.shape or ())]
    return np.zeros((0, *dims), t.dtype.numpy)
