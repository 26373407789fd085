"""``kiln inspect`` says whether ``kiln serve`` may stack requests for a model, and why (issue 16)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import kiln
from kiln.ir import Graph
from kiln.serializer.inspect import format_summary, read_summary


def save(tmp_path: Path, centered: bool) -> Path:
    g = Graph("centered" if centered else "scaled")
    x = g.add_input("x", "float32", ("batch", 4))
    if centered:
        mean = g.op("ReduceMean", x, g.add_initializer("axes", np.array([0], np.int64)), keepdims=1)
        mean.producer.meta.update({"scope": "head.center", "source": "model.py:7"})
        y = g.op("Sub", x, mean)
    else:
        y = g.op("Mul", x, g.add_initializer("scale", np.full(4, 2.0, np.float32)))
    g.outputs = [y]
    return kiln.save(g, tmp_path / f"{g.name}.kiln")


def test_summary_reports_the_verdict_and_the_reason(tmp_path):
    s = read_summary(save(tmp_path, centered=True))
    b = s["batching"]
    assert b["batchable"] is False and b["op"] == "ReduceMean" and b["module"] == "head.center"
    text = format_summary(s)
    assert "batching: not batchable" in text and "head.center" in text and "batch axis" in text

    s = read_summary(save(tmp_path, centered=False))
    assert s["batching"]["batchable"] is True and s["batching"]["symbol"] == "batch"
    assert "batching: batchable along 'batch'" in format_summary(s)


def test_cli_text_and_json(tmp_path):
    path = save(tmp_path, centered=True)
    r = subprocess.run([sys.executable, "-m", "kiln", "inspect", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "batching: not batchable" in r.stdout and "ReduceMean" in r.stdout
    r = subprocess.run([sys.executable, "-m", "kiln", "inspect", str(path), "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["batching"]["op"] == "ReduceMean"
