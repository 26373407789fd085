"""Graph passes: plain functions over a Graph, composed in a named pipeline (see pipeline.py)."""
from kiln.ir.passes.control_flow import inline_constant_branches
from kiln.ir.passes.cse import cse
from kiln.ir.passes.dce import dce
from kiln.ir.passes.fold_batchnorm import fold_batchnorm
from kiln.ir.passes.fold_constants import fold_constants
from kiln.ir.passes.fuse import (ANCHOR_OPS, ELEMENTWISE_OPS, fuse_attention, fuse_elementwise, fuse_epilogues,
                                 fusion_groups)
from kiln.ir.passes.pipeline import OptimizeReport, PassStats, optimize, pipeline
from kiln.ir.passes.shape_inference import infer_shapes
from kiln.ir.passes.simplify import RULES, Rule, simplify

__all__ = ["infer_shapes", "fold_constants", "dce", "cse", "simplify", "Rule", "RULES", "fold_batchnorm",
           "optimize", "pipeline", "OptimizeReport", "PassStats", "fuse_elementwise", "fusion_groups",
           "ELEMENTWISE_OPS", "fuse_epilogues", "ANCHOR_OPS", "fuse_attention", "inline_constant_branches"]
