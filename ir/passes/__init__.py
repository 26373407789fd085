"""Graph passes: plain functions over a Graph, composed in a named pipeline (see pipeline.py)."""
from kiln.ir.passes.shape_inference import infer_shapes

__all__ = ["infer_shapes"]
