"""The .kiln model file (FlatBuffers + aligned data segment): ``save`` and ``load_graph``.

The writer (and the flatbuffers builder it needs) is imported on the first ``save``, so a
process that only loads and runs models does not pay for it at start-up."""
from kiln.serializer.reader import LoadLimits, load_graph, load_graph_from_bytes

__all__ = ["save", "load_graph", "load_graph_from_bytes", "LoadLimits"]


def save(graph, path):
    """Write ``graph`` to a .kiln file (see :func:`kiln.serializer.writer.save`)."""
    from kiln.serializer.writer import save as _save
    return _save(graph, path)
