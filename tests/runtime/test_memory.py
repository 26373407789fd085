"""The runtime releases values after their last use: the peak of live intermediates stays well
below what keeping every intermediate would hold.

``live_bytes`` runs a Program's plan through a copy of ``kiln.runtime.plan.execute`` that, after
each instruction, adds up the bytes of the distinct buffers its live slots hold (a view counts
its owner once; constants from the file and the caller's inputs are not intermediates). The
benchmark (bench/runtime_bench.py --memory) uses it on the full-size ResNet-50.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import kiln
from kiln.runtime import Program


def _owner(a: Any) -> Any:
    """The object that owns an array's memory (a view's base chain ends there)."""
    while isinstance(a, np.ndarray) and isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _nbytes(owners: dict) -> int:
    return sum(o.nbytes for o in owners.values() if isinstance(o, np.ndarray))


def live_bytes(program: Program, inputs: list) -> tuple[int, int]:
    """(peak bytes of live intermediates during one run, bytes of every intermediate kept)."""
    plan = program.plan
    slots = list(program._template)
    for s, a in zip(plan.input_slots, inputs):
        slots[s] = np.asarray(a)
    outside = {id(_owner(v)) for v in slots if v is not None}  # constants and inputs
    every: dict[int, Any] = {}  # holds each intermediate's owner, so ids stay unique
    peak = 0
    for ins in plan.instructions:
        args = [None if s < 0 else slots[s] for s in ins.inputs]
        result = ins.kernel(slots, *args) if ins.with_slots else ins.kernel(*args)
        results = (result,) if ins.single else tuple(result)
        for s, r in zip(ins.outputs, results):
            slots[s] = r
        # Measured before the release: this instruction's inputs and outputs are live together.
        live = {id(o): o for o in map(_owner, slots) if o is not None and id(o) not in outside}
        peak = max(peak, _nbytes(live))
        for r in results:
            o = _owner(r)
            if id(o) not in outside:
                every[id(o)] = o
        for s in ins.release:
            slots[s] = None
    return peak, _nbytes(every)


def without_release(program: Program) -> Program:
    """A shallow copy of ``program`` whose plan releases nothing (every intermediate kept)."""
    keeper = Program.__new__(Program)
    keeper.__dict__.update(program.__dict__)
    keeper.plan = dataclasses.replace(program.plan, instructions=[
        dataclasses.replace(i, release=()) for i in program.plan.instructions])
    keeper._specializer = None  # its runs take this plan, never one specialized from the original's
    return keeper


@pytest.fixture(scope="module")
def resnet():
    torch = pytest.importorskip("torch")
    import zoo

    model, inputs, _ = zoo.resnet50(batch=1, width=8, image=64)
    graph = kiln.trace(model, inputs, check=False)
    with torch.inference_mode():
        want = model(*inputs).numpy()
    return Program(graph), inputs[0].numpy(), want


def test_values_are_released_after_their_last_use(resnet):
    program, x, want = resnet
    peak, keep_all = live_bytes(program, [x])
    print(f"\nResNet-50 (width 8, 1x3x64x64): peak live intermediates {peak / 2 ** 20:.2f} MiB, "
          f"every intermediate kept {keep_all / 2 ** 20:.2f} MiB ({peak / keep_all:.0%})")
    assert keep_all > 0
    assert peak < 0.5 * keep_all
    # The instrumented loop ran the real plan: same answer as a plain run.
    np.testing.assert_allclose(program.run([x], as_list=True)[0], want, rtol=1e-4, atol=1e-5)


def test_without_release_lists_everything_stays(resnet):
    # The measurement itself must see the difference: a plan with no releases peaks at keep-all.
    program, x, _ = resnet
    peak, keep_all = live_bytes(without_release(program), [x])
    assert peak == keep_all
