"""kiln.frontend: capture eager PyTorch models as kiln graphs (``trace``). Needs torch."""
from kiln.frontend.trace import trace

__all__ = ["trace"]
