import numpy as np
from op_harness import check_op


def test_add_broadcast_symbolic():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones(3, np.float32)
    check_op("Add", [a, b], a + b, symbolic_batch=True)
