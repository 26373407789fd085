"""``kiln.trace``: run an eager PyTorch model once on example inputs and record it as a Graph."""
from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np
import torch

from kiln.errors import KilnError, TraceCheckError, TraceWarning
from kiln.frontend.tracer import Tracer, kiln_dtype, to_numpy
from kiln.ir.evaluator import evaluate
from kiln.ir.graph import Graph
from kiln.ir.passes import infer_shapes, optimize as run_optimize
from kiln.ir.verifier import verify

Dynamic = Mapping[str, Mapping[int, str]]
# Modules that behave differently in training mode (a model left in training mode gets a warning).
_TRAIN_SENSITIVE = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm,
                    torch.nn.modules.instancenorm._InstanceNorm, torch.nn.MultiheadAttention)


def trace(model: Union[torch.nn.Module, Callable], example_inputs: Any, *, dynamic: Optional[Dynamic] = None,
          dynamic_batch: bool = False, check: bool = True, optimize: bool = True, name: Optional[str] = None,
          rtol: float = 1e-4, atol: float = 1e-5) -> Graph:
    """Trace ``model`` on ``example_inputs`` (a tensor, a tuple of tensors, or a dict by argument name).

    ``dynamic`` names symbolic dims per input (``{"x": {0: "batch"}}``); ``dynamic_batch=True``
    makes dim 0 of every input the symbol ``batch``. With ``check``, the graph is compared with
    the model on the example inputs and on fresh random ones (at other batch sizes when the batch
    is dynamic), and a mismatch raises TraceCheckError. ``optimize`` runs the pass pipeline.
    """
    module = model if isinstance(model, torch.nn.Module) else None
    names, tensors = _bind_inputs(model, example_inputs)
    dims = _dynamic_dims(names, tensors, dynamic, dynamic_batch)
    if module is not None and module.training:
        if any(isinstance(m, _TRAIN_SENSITIVE) for m in module.modules()):
            warnings.warn(f"{type(module).__name__} is in training mode; tracing it in eval mode "
                          "(dropout off, BatchNorm running statistics)", TraceWarning, stacklevel=3)
        module.eval()
    graph = Graph(name or (type(model).__name__ if module is not None else getattr(model, "__name__", "main")))
    tracer = Tracer(graph, _param_names(module), _module_names(module))
    outputs = _record(model, module, tracer, names, tensors, dims)
    _set_outputs(graph, tracer, outputs)
    infer_shapes(graph)
    verify(graph)
    if check:
        check_trace(graph, model, names, tensors, dims, rtol=rtol, atol=atol)
    if optimize:
        run_optimize(graph)
        verify(graph)
    return graph


# ---------------------------------------------------------------------------- inputs
def _bind_inputs(model: Callable, example_inputs: Any) -> tuple[list[str], list[torch.Tensor]]:
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping):
        known = {p.name for p in params}
        unknown = sorted(set(example_inputs) - known)
        if unknown:
            raise KilnError(f"example inputs {unknown} are not parameters of {fn.__qualname__}{inspect.signature(fn)}")
        names = [p.name for p in params if p.name in example_inputs]
        values = [example_inputs[n] for n in names]
    else:
        values = list(example_inputs)
        if len(values) > len(params) and not any(p.kind == p.VAR_POSITIONAL for p in
                                                  inspect.signature(fn).parameters.values()):
            raise KilnError(f"{len(values)} example inputs for {fn.__qualname__}{inspect.signature(fn)}")
        names = [p.name for p in params[:len(values)]] + [f"input_{i}" for i in range(len(params), len(values))]
    for n, v in zip(names, values):
        if not isinstance(v, torch.Tensor):
            raise KilnError(f"example input '{n}' must be a torch.Tensor, got {type(v).__name__}")
    return names, values


def _dynamic_dims(names: list[str], tensors: list[torch.Tensor], dynamic: Optional[Dynamic],
                  dynamic_batch: bool) -> list[dict[int, str]]:
    dims: list[dict[int, str]] = [{0: "batch"} if dynamic_batch and t.dim() > 0 else {} for t in tensors]
    for key, spec in (dynamic or {}).items():
        if key not in names:
            raise KilnError(f"dynamic dims given for '{key}', which is not an input ({', '.join(names)})")
        i = names.index(key)
        for d, sym in spec.items():
            if not -tensors[i].dim() <= d < tensors[i].dim():
                raise KilnError(f"dynamic dim {d} of input '{key}' is out of range for shape {tuple(tensors[i].shape)}")
            dims[i][d % tensors[i].dim()] = sym
    return dims


def _param_names(module: Optional[torch.nn.Module]) -> dict[int, str]:
    names: dict[int, str] = {}
    if module is None:
        return names
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    for n, b in module.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), n)
    return names


def _module_names(module: Optional[torch.nn.Module]) -> dict[int, str]:
    if module is None:
        return {}
    return {id(m): n for n, m in reversed(list(module.named_modules(remove_duplicate=False)))}


# ---------------------------------------------------------------------------- recording
@contextlib.contextmanager
def _tracing_context(tracer: Tracer):
    pre = torch.nn.modules.module.register_module_forward_pre_hook(tracer.push_module)
    post = torch.nn.modules.module.register_module_forward_hook(tracer.pop_module)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # the fused fast path is one opaque op
    try:
        with torch.no_grad():
            yield
    finally:
        pre.remove()
        post.remove()
        torch.backends.mha.set_fastpath_enabled(fastpath)


def _record(model: Callable, module, tracer: Tracer, names: list[str], tensors: list[torch.Tensor],
            dims: list[dict[int, str]]) -> Any:
    graph = tracer.graph
    for n, t, d in zip(names, tensors, dims):
        shape = [d.get(i, s) for i, s in enumerate(t.shape)]
        v = graph.add_input(n, kiln_dtype(t.dtype), shape)
        tracer.values[id(t)] = v
        tracer.dependent.add(v)
    with _tracing_context(tracer):
        with tracer:
            return model(*tensors)


def _flatten_outputs(out: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, Mapping):
        return [item for k, v in out.items() for item in _flatten_outputs(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(out, (tuple, list)):
        return [item for i, v in enumerate(out) for item in _flatten_outputs(v, f"{prefix or 'output'}_{i}")]
    raise KilnError(f"model output {prefix or 'output'} is a {type(out).__name__}; outputs must be tensors, "
                    "tuples/lists or dicts of them")


def _set_outputs(graph: Graph, tracer: Tracer, out: Any) -> None:
    outputs = []
    for name, t in _flatten_outputs(out, "" if isinstance(out, Mapping) else "output"):
        v = tracer.value(t)
        if name in graph._value_names.used:
            name = graph.fresh_name(name)
            graph._value_names.used.discard(name)
        node = graph.add_node("Identity", [v], output_names=[name], meta={"scope": "", "source": "output"})
        node.outputs[0].type = v.type
        outputs.append(node.outputs[0])
    graph.outputs = outputs


# ---------------------------------------------------------------------------- checking
def check_trace(graph: Graph, model: Callable, names: list[str], examples: list[torch.Tensor],
                dims: list[dict[int, str]], *, rtol: float, atol: float, trials: int = 3) -> None:
    """Compare the graph with the model on the examples and on fresh inputs; TraceCheckError if they differ."""
    for label, inputs in _trial_inputs(examples, dims, trials):
        want, got = _run_both(graph, model, names, inputs, label)
        if want is None:
            continue  # both refused the input with a failed assert: they agree
        for out_value, w, g in zip(graph.outputs, want, got):
            if w.shape != g.shape or not np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol,
                                                     atol=atol, equal_nan=True):
                detail = (f"shape {g.shape} vs {w.shape}" if w.shape != g.shape else
                          f"max abs difference {np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))):.3g}")
                raise TraceCheckError(f"the traced graph disagrees with the model on {label}: output "
                                      f"'{out_value.name}' differs ({detail}); the trace is specific to the "
                                      "example inputs (see the TraceWarnings) or a mapping is wrong")


def _run_both(graph: Graph, model: Callable, names: list[str], inputs: list, label: str) -> tuple:
    """(model outputs, graph outputs) on ``inputs``, or (None, None) when the model fails an
    ``assert`` and the graph's Assert fails too (a scripted check doing its job)."""
    from kiln.ir.ops.assertion import AssertionFailed

    try:
        with torch.no_grad():
            want = [to_numpy(t) for _, t in _flatten_outputs(model(*inputs), "output")]
    except AssertionError as eager_error:
        try:
            evaluate(graph, {n: to_numpy(t) for n, t in zip(names, inputs)})
        except AssertionFailed:
            return None, None
        raise TraceCheckError(f"the model fails an assert on {label} ({eager_error}) but the graph does not: "
                              "the check is missing from the graph") from eager_error
    return want, evaluate(graph, {n: to_numpy(t) for n, t in zip(names, inputs)})


def _trial_inputs(examples: list[torch.Tensor], dims: list[dict[int, str]], trials: int):
    yield "the example inputs", examples
    gen = torch.Generator().manual_seed(0)
    batch = next((t.shape[0] for t, d in zip(examples, dims) if 0 in d), None)
    sizes = {}
    for k in range(trials):
        inputs = []
        for t, d in zip(examples, dims):
            shape = list(t.shape)
            for i, sym in d.items():
                base = shape[i]
                sizes.setdefault((sym, k), base + 1 + k if k % 2 == 0 else max(1, base - 1) if base > 1 else base + 2)
                shape[i] = sizes[(sym, k)]
            inputs.append(_fresh_like(t, shape, gen, negate=(k == 1)))
        label = f"fresh random inputs #{k + 1}" + (f" (batch {inputs[0].shape[0]})" if batch is not None else "")
        yield label, inputs


def _fresh_like(t: torch.Tensor, shape: list[int], gen: torch.Generator, negate: bool) -> torch.Tensor:
    if t.dtype.is_floating_point:
        if negate and list(t.shape) == shape:
            return -t  # flips the sign of sums and means: the classic data-dependent branch
        return torch.randn(shape, generator=gen).to(t.dtype)
    if t.dtype is torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    low, high = (int(t.min()), int(t.max()) + 1) if t.numel() else (0, 2)
    return torch.randint(low, max(high, low + 1), shape, generator=gen).to(t.dtype)
