"""The golden file written by kiln 0.1.0 (format header 1, IR 1, opset 1) loads in every later
version, with the same graph and the same constants. Never regenerate the fixture."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.ir import evaluate, verify

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_golden_v1_loads_unchanged():
    pytest.importorskip("ml_dtypes")
    g = kiln.load_graph(FIXTURES / "golden_v1.kiln", check_data=True)
    verify(g)
    assert str(g) + "\n" == (FIXTURES / "golden_v1.txt").read_text()
    want = json.loads((FIXTURES / "golden_v1.json").read_text())
    assert g.metadata.props == want["metadata"] and g.metadata.doc_string == want["doc"]
    got = {v.name: [v.const.dtype.name, list(v.const.shape), hashlib.sha256(v.const.tobytes()).hexdigest()]
           for sub in g.all_graphs() for v in sub.initializers.values()}
    assert got == want["initializers"]
    feed = {"x": np.ones((1, 2, 4), np.float32), "y": np.ones((2, 4), np.float32), "z": np.ones(3, np.float32)}
    outs = evaluate(g, feed)
    assert len(outs) == len(g.outputs)
