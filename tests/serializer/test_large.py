"""A model with more than 2 GB of constants saves, loads (zero-copy) and checks."""
import numpy as np
import pytest

import kiln
from kiln.ir import Graph, verify
from kiln.serializer.format import parse_header

GiB = 1 << 30


@pytest.mark.slow
def test_constants_over_2gb(tmp_path):
    n = (GiB + (64 << 20)) // 4  # 1.06 GiB of float32 per tensor, two of them: past 2**31 bytes
    g = Graph("big")
    x = g.add_input("x", "float32", (n,))
    a = np.ones(n, np.float32)
    a[-1] = 3.0
    b = np.full(n, 2.0, np.float32)
    b[0] = 5.0
    g.outputs = [g.op("Add", g.op("Mul", x, g.add_initializer("a", a)), g.add_initializer("b", b))]
    path = kiln.save(g, tmp_path / "big.kiln")
    del a, b
    size = path.stat().st_size
    assert size > 2 * GiB
    with open(path, "rb") as f:
        header = parse_header(f.read(64), size)
    assert header.data_size > 2**31
    loaded = kiln.load_graph(path, check_data=True)
    verify(loaded)
    la, lb = loaded.initializers["a"].const, loaded.initializers["b"].const
    assert not la.flags.owndata and not la.flags.writeable
    assert la[-1] == 3.0 and la[0] == 1.0 and lb[0] == 5.0 and lb[-1] == 2.0
