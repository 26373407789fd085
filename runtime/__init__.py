"""kiln.runtime: load a .kiln file and run it with numpy (``kiln.load(path).run(inputs)``)."""
from kiln.runtime.program import Program, TensorSpec, load

__all__ = ["Program", "TensorSpec", "load"]
