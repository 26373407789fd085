"""kiln.frontend: capture eager PyTorch models as kiln graphs (``trace``). Needs torch, imported
on first use (``kiln --help`` imports this package's CLI pieces without torch)."""
from typing import Any

__all__ = ["trace"]


def __getattr__(name: str) -> Any:
    if name == "trace":
        from kiln.frontend.trace import trace
        return trace
    raise AttributeError(f"module 'kiln.frontend' has no attribute {name!r}")
