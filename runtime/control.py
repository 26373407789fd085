"""If and Loop as nested plans sharing the run's slot list (bodies read outer values by slot)."""
from __future__ import annotations

from typing import Any

import numpy as np

from kiln.ir.graph import Node
from kiln.runtime.plan import PlanBuilder, execute


def if_kernel(node: Node, builder: PlanBuilder):
    then_plan = builder.build(node.attrs["then_branch"], liveness=False)
    else_plan = builder.build(node.attrs["else_branch"], liveness=False)

    def run(slots: list, cond: np.ndarray) -> Any:
        plan = then_plan if bool(np.asarray(cond).reshape(-1)[0]) else else_plan
        execute(plan, slots)
        outs = tuple(slots[s] for s in plan.output_slots)
        return outs[0] if len(outs) == 1 else outs

    run.with_slots = True
    return run


def loop_kernel(node: Node, builder: PlanBuilder):
    body = node.attrs["body"]
    plan = builder.build(body, liveness=False)
    n_carried = len(body.inputs) - 2
    n_scan = len(body.outputs) - 1 - n_carried
    scan_types = [v.type for v in body.outputs[1 + n_carried:]]

    def run(slots: list, m=None, cond=None, *carried) -> Any:
        if m is None and cond is None:
            raise ValueError("a Loop with neither a trip count M nor a cond input never ends")
        trips = None if m is None else int(np.asarray(m).reshape(-1)[0])
        go = True if cond is None else bool(np.asarray(cond).reshape(-1)[0])
        values = list(carried)
        scans: list[list] = [[] for _ in range(n_scan)]
        i = 0
        while go and (trips is None or i < trips):
            args = [np.array(i, np.int64), np.array(go), *values]
            for s, a in zip(plan.input_slots, args):
                slots[s] = a
            execute(plan, slots)
            outs = [slots[s] for s in plan.output_slots]
            if cond is not None:
                go = bool(np.asarray(outs[0]).reshape(-1)[0])
            values = outs[1:1 + n_carried]
            for k, v in enumerate(outs[1 + n_carried:]):
                scans[k].append(v)
            i += 1
        stacked = [np.stack(s) if s else _empty_scan(t) for s, t in zip(scans, scan_types)]
        results = (*values, *stacked)
        return results[0] if len(results) == 1 else results

    run.with_slots = True
    return run


def _empty_scan(t) -> np.ndarray:
    """The scan output of a loop that ran zero times: a leading 0 dim before the body's shape."""
    dims = [d if isinstance(d, int) else 0 for d in (t.shape or ())]
    return np.zeros((0, *dims), t.dtype.numpy)
