"""The registered op set. Importing this package registers every op, one module per family."""
from kiln.ir.ops import (  # noqa: F401
    activation, control, elementwise, indexing, layout, linalg, logic, nn, normalization, pool, reduce, shape,
    tensor)
from kiln.ir.ops import fused  # noqa: F401,E402  (kiln.FusedElementwise: the fusion pass's op)
