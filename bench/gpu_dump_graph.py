"""Print the graph kiln's CUDA backend runs for a bench model (after conversion, optimization and the fusion
passes), with the versions of torch and transformers that traced it: a model's trace differs between
library versions, so what the GPU machine runs is looked at there.

    PYTHONPATH=/tmp/pkg:bench python3 bench/gpu_dump_graph.py bert gpt2 --precision fp16 --out DIR
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    import torch

    import kiln
    from gpu_half_bench import build
    from kiln.ir.passes import optimize
    from kiln.ir.passes.fuse import fuse_attention, fuse_elementwise, fuse_epilogues
    from kiln.ir.passes.precision import convert_precision
    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = None
    for name in args.models:
        model, in_name, make = build(name)
        with torch.inference_mode():
            g = kiln.trace(model, {in_name: torch.from_numpy(make(1))}, dynamic={in_name: {0: "batch"}})
        (Path(args.out) / f"graph_{name}_traced.txt").write_text(str(g))
        if args.precision != "fp32":
            convert_precision(g, args.precision)
        optimize(g)
        made = fuse_attention(g), fuse_elementwise(g), fuse_epilogues(g)
        head = (f"# {name}: torch {torch.__version__}, transformers {tv}; fused attention/elementwise/epilogue "
                f"{made}; ops {collections.Counter(n.op for n in g.nodes).most_common()}\n")
        print(head, flush=True)
        (Path(args.out) / f"graph_{name}_{args.precision}.txt").write_text(head + str(g))
    return 0


if __name__ == "__main__":
    sys.exit(main())
