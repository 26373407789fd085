"""The registered op set. Importing this package registers every op (one module per family)."""
from kiln.ir.ops import elementwise  # noqa: F401
