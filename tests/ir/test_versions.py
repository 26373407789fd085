"""Opset versioning: newest schema <= the graph's opset, upgraders, and too-new graphs."""
import numpy as np
import pytest

from kiln import KilnError
from kiln.ir import Graph, evaluate, get_schema
from kiln.ir import versions
from kiln.ir.ops._common import infer_same
from kiln.ir.registry import Attr, AttrKind, In, op

DOMAIN = "kiln.test_versions"


# A test op whose meaning changes at version 2: v1 multiplies by `factor`, v2 takes `divisor`.
@op("Scale", domain=DOMAIN, since_version=1, inputs=[In("X")], attrs=[Attr("factor", AttrKind.FLOAT, 1.0)],
    infer=infer_same)
def _scale_v1(x, factor):
    return (x * factor).astype(x.dtype)


@op("Scale", domain=DOMAIN, since_version=2, inputs=[In("X")], attrs=[Attr("divisor", AttrKind.FLOAT, 1.0)],
    infer=infer_same)
def _scale_v2(x, divisor):
    return (x / divisor).astype(x.dtype)


@versions.register_upgrader("Scale", domain=DOMAIN, from_version=1)
def _upgrade_scale(graph, node):
    node.attrs = {"divisor": 1.0 / node.attrs.get("factor", 1.0)}


def test_schema_lookup_picks_newest_not_after_version():
    assert get_schema("Scale", DOMAIN, 1).attrs.keys() == {"factor"}
    assert get_schema("Scale", DOMAIN, 5).attrs.keys() == {"divisor"}


def test_upgrade_rewrites_old_nodes(monkeypatch):
    monkeypatch.setattr(versions, "OPSET_VERSION", 2)
    g = Graph(opset_version=1)
    x = g.add_input("x", "float32", (3,))
    g.outputs = [g.op("Scale", x, domain=DOMAIN, factor=4.0)]
    feed = [np.array([1, 2, 3], np.float32)]
    before = evaluate(g, feed)[0]
    assert versions.upgrade_graph(g, 2)
    assert g.opset_version == 2 and g.nodes[0].attrs == {"divisor": 0.25}
    np.testing.assert_allclose(evaluate(g, feed)[0], before)


def test_newer_graph_is_refused_with_both_versions():
    g = Graph(opset_version=versions.OPSET_VERSION + 1)
    with pytest.raises(KilnError, match=rf"opset {versions.OPSET_VERSION + 1}.*supports opset <= {versions.OPSET_VERSION}"):
        versions.upgrade_graph(g)
