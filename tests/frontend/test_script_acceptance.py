"""Acceptance (issue 9, the parts landed so far): scripted models with data-dependent control
flow, run through the CPU runtime and ONNX Runtime, against eager PyTorch."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402

END = 7


class GreedyHead(torch.nn.Module):
    """Greedy decoding: append argmax tokens until END or 6 new tokens."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.out = torch.nn.Linear(8, 16)

    def forward(self, ids):
        n = 0
        while n < 6:
            logits = self.out(self.emb(ids).mean(1))
            nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            n = n + 1
            if (nxt == END).all():
                break
        return ids


class Sign(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x * -1


PROMPTS = ([[1, 2]], [[5]], [[3, 3, 7]], [[9, 4]], [[0]])


@pytest.fixture(scope="module")
def greedy():
    torch.manual_seed(0)
    model = GreedyHead().eval()
    graph = kiln.script(model, (torch.tensor([[1, 2]]),), dynamic={"ids": {1: "seq"}})
    return model, graph


def test_greedy_decoding_is_one_graph_matching_eager_including_early_stops(greedy, tmp_path):
    model, graph = greedy
    assert "Loop" in {n.op for n in graph.nodes}
    program = kiln.load(kiln.save(graph, tmp_path / "greedy.kiln"))
    lengths = set()
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        with torch.no_grad():
            want = model(ids).numpy()
        got = program.run([ids.numpy()], as_list=True)[0]
        np.testing.assert_array_equal(got, want, err_msg=f"prompt {prompt}")
        lengths.add(want.shape[1] - ids.shape[1])
    assert min(lengths) < 6 and max(lengths) == 6  # some prompts stop early at END, some run to the limit


def test_scripted_models_export_to_onnx_and_match_onnxruntime(greedy, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    sign = kiln.script(Sign(), (torch.randn(3),))
    for graph, feeds in ((sign, [np.full(3, 1.5, np.float32), np.full(3, -1.5, np.float32)]),
                         (greedy[1], [np.array(p, np.int64) for p in PROMPTS])):
        path = kiln.export_onnx(graph, tmp_path / f"{graph.name}.onnx")
        onnx.checker.check_model(str(path), full_check=True)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        program = kiln.load(graph)
        for x in feeds:
            want = program.run([x], as_list=True)[0]
            got = session.run(None, {graph.inputs[0].name: x})[0]
            np.testing.assert_array_equal(got, want)
