"""Random inputs for a graph's inputs, shared by the pass tests: symbolic dims take the sizes given
by name (``batch`` by default for any other name), floats are standard normal, other dtypes 0/1."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph


def feeds_for(g: Graph, batch: int = 3, seed: int = 0, **sizes: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for v in g.inputs:
        shape = [sizes.get(d, batch) if isinstance(d, str) else d for d in v.type.shape]
        out[v.name] = (rng.standard_normal(shape).astype(v.type.dtype.numpy) if v.type.dtype.is_float
                       else rng.integers(0, 2, shape).astype(v.type.dtype.numpy))
    return out
