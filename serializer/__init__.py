"""The .kiln model file (FlatBuffers + aligned data segment): ``save`` and ``load_graph``."""
from kiln.serializer.reader import load_graph, load_graph_from_bytes
from kiln.serializer.writer import save

__all__ = ["save", "load_graph", "load_graph_from_bytes"]
