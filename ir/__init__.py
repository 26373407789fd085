"""kiln's intermediate representation: typed SSA graphs over a closed, versioned op set."""
from kiln.ir import ops as _ops  # noqa: F401  (registers every op)
from kiln.ir.dtypes import DType, dtype
from kiln.ir.evaluator import evaluate
from kiln.ir.graph import Graph, Metadata, Node, Value
from kiln.ir.printer import format_graph
from kiln.ir.registry import KILN_DOMAIN, ONNX_DOMAIN, all_op_names, all_schemas, get_schema
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify
from kiln.ir.versions import IR_VERSION, ONNX_OPSET_BASE, OPSET_VERSION, register_upgrader, upgrade_graph

__all__ = ["DType", "dtype", "evaluate", "Graph", "Metadata", "Node", "Value", "format_graph",
           "KILN_DOMAIN", "ONNX_DOMAIN", "all_op_names", "all_schemas", "get_schema", "TensorType",
           "verify", "IR_VERSION", "ONNX_OPSET_BASE", "OPSET_VERSION", "register_upgrader", "upgrade_graph"]
