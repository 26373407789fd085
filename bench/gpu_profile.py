"""Where a model's GPU time goes in kiln's CUDA backend: per-op (and per-strategy) device time.

    PYTHONPATH=/tmp/pkg:bench python3 bench/gpu_profile.py --model bert --batch 32

Each instruction of an eager ``CudaProgram`` (``cuda_graphs=False``) is bracketed by CUDA
events; after warm-up, ``--runs`` runs are recorded and the time between each instruction's
events is summed per op type (a ``kiln.FusedEpilogue`` is listed by its strategy, a
``kiln.FusedElementwise`` by its body's ops). At large batches the GPU is the bottleneck, so an
instruction's interval is its kernels' time; at batch 1 the intervals include the host's launch
gaps, and the total is the eager wall time, not the CUDA-graph time. Prints a table and writes
``$OUT/profile_<model>_b<batch>.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def label(node, kernel) -> str:
    from kiln.runtime.cuda_program import _is_fallback, _strategy
    if _is_fallback(kernel):
        return f"{node.qualified_op} (host fallback)"
    if node.op == "FusedEpilogue":
        return f"{node.attrs['body'].nodes[0].op} epilogue: {_strategy(kernel)}"
    if node.op == "FusedElementwise":
        return "fused[" + ",".join(n.op for n in node.attrs["body"].nodes) + "]"
    return node.qualified_op


def profile(program, feeds, runs: int) -> dict:
    import cupy as cp

    from kiln.runtime.plan import Plan
    plan = program.plan
    records = []
    originals = [ins.kernel for ins in plan.instructions]
    labels = [label(ins.node, ins.kernel) for ins in plan.instructions]

    def wrap(i, k):
        def run(*args):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            r = k(*args)
            b.record()
            records.append((i, a, b))
            return r
        return run
    plan.instructions = [dataclasses.replace(ins, kernel=wrap(i, ins.kernel))
                         for i, ins in enumerate(plan.instructions)]
    Plan.__post_init__(plan)
    try:
        for _ in range(3):
            program.run(feeds, as_list=True)
        cp.cuda.Device().synchronize()
        records.clear()
        total_a, total_b = cp.cuda.Event(), cp.cuda.Event()
        total_a.record()
        for _ in range(runs):
            program.run(feeds, as_list=True)
        total_b.record()
        total_b.synchronize()
        total = cp.cuda.get_elapsed_time(total_a, total_b) / runs
        per: dict = {}
        for i, a, b in records:
            ms = cp.cuda.get_elapsed_time(a, b)
            e = per.setdefault(labels[i], {"ms": 0.0, "calls": 0})
            e["ms"] += ms / runs
            e["calls"] += 1
        for e in per.values():
            e["calls"] //= runs
    finally:
        plan.instructions = [dataclasses.replace(ins, kernel=k) for ins, k in zip(plan.instructions, originals)]
        Plan.__post_init__(plan)
    return {"total_ms": total, "ops": dict(sorted(per.items(), key=lambda kv: -kv[1]["ms"]))}


def memory(program, feeds) -> dict:
    """Peak bytes in use in CuPy's pools during one eager run (pool blocks, by a memory hook),
    the instruction running at the peak, and the library workspaces held."""
    import cupy as cp
    from cupy.cuda import memory_hook

    from kiln.runtime.kernels.cuda import cudnn, linalg
    from kiln.runtime.plan import Plan
    plan = program.plan
    state = {"now": 0, "peak": 0, "at": None, "current": None}

    class Hook(memory_hook.MemoryHook):
        name = "kiln_profile"

        def malloc_postprocess(self, **kw):
            state["now"] += kw["mem_size"]
            if state["now"] > state["peak"]:
                state["peak"], state["at"] = state["now"], state["current"]

        def free_postprocess(self, **kw):
            state["now"] -= kw["mem_size"]
    originals = list(plan.instructions)

    def wrap(i, k):
        def run(*args):
            state["current"] = i
            return k(*args)
        return run
    plan.instructions = [dataclasses.replace(ins, kernel=wrap(i, ins.kernel)) for i, ins in enumerate(originals)]
    Plan.__post_init__(plan)
    pool = cp.get_default_memory_pool()
    try:
        program.run(feeds, as_list=True)  # warm: plans, workspaces
        cp.cuda.Device().synchronize()
        base = pool.used_bytes()
        with Hook():
            program.run(feeds, as_list=True)
        cp.cuda.Device().synchronize()
    finally:
        plan.instructions = originals
        Plan.__post_init__(plan)
    at = state["at"]
    mib = 1 << 20
    return {"held_before_run_MiB": base / mib, "peak_during_run_MiB": (base + state["peak"]) / mib,
            "peak_at": None if at is None else label(originals[at].node, originals[at].kernel) + f" (#{at})",
            "cudnn_workspaces_MiB": sum(w.mem.size for w in cudnn._WORKSPACES.values()) / mib,
            "cublas_handles": len(linalg._STATE["handles"]), "cublas_workspace_MiB_each": linalg.WORKSPACE_BYTES / mib}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["bert", "resnet50"], default="bert")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--no-fuse-epilogues", action="store_true", help="fuse elementwise chains only")
    ap.add_argument("--precision", choices=["fp32", "fp16"], default="fp32", help="convert the model first (issue 18)")
    args = ap.parse_args(argv)
    import cupy as cp
    import numpy as np

    import gpu_models
    import kiln
    from kiln.frontend.tracer import to_numpy
    from kiln.runtime.cuda_program import CudaProgram
    model, inputs, spec = (gpu_models.bert if args.model == "bert" else gpu_models.resnet50)(batch=args.batch)
    graph = kiln.trace(model, inputs, dynamic=spec, check=False)
    from kiln.ir.passes import optimize
    if args.precision != "fp32":
        from kiln.ir.passes.precision import convert_precision
        convert_precision(graph, args.precision)
    optimize(graph)
    if args.no_fuse_epilogues:
        from kiln.ir.passes.fuse import fuse_elementwise
        fuse_elementwise(graph)
        p = CudaProgram(graph, cuda_graphs=False, fuse=False)
    else:
        p = CudaProgram(graph, cuda_graphs=False)
    feeds = [cp.asarray(np.ascontiguousarray(to_numpy(t))) for t in inputs]
    res = profile(p, feeds, args.runs)
    from kiln.runtime.kernels.cuda import cudnn, nn
    fused: dict = {}
    for e in nn.CONV_CHOICES.values():
        k = f"{e['path']}: cuDNN fused {'+'.join(e.get('fused', ())) or 'nothing'}"
        fused[k] = fused.get(k, 0) + 1
    res.update(model=args.model, batch=args.batch, epilogues=p.epilogues, fallback_ops=p.fallback_ops,
               conv_shapes=fused, cudnn_epilogue_fusion=cudnn.FUSE_EPILOGUE,
               device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    print(f"{args.model} batch {args.batch} {args.precision} on {res['device']}: {res['total_ms']:.3f} ms per eager run")
    res["memory"] = memory(p, feeds)
    print(f"  epilogues: {res['epilogues']}; conv shapes: {fused}")
    print(f"  memory: {res['memory']}")
    summed = sum(e["ms"] for e in res["ops"].values())
    for name, e in res["ops"].items():
        print(f"  {e['ms']:8.3f} ms {100 * e['ms'] / summed:5.1f}%  x{e['calls']:<4d} {name}")
    out = Path(os.environ.get("OUT") or "gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    tag = ("_noepi" if args.no_fuse_epilogues else "") + ("" if cudnn.FUSE_EPILOGUE else "_cudnnbias") + \
        ("" if args.precision == "fp32" else f"_{args.precision}")
    (out / f"profile_{args.model}_b{args.batch}{tag}.json").write_text(
        json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
