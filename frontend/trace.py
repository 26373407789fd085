"""``kiln.trace``: run an eager PyTorch model once on example inputs and record it as a Graph."""
from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

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
                    torch.nn.modules.instancenorm._InstanceNorm, torch.nn.MultiheadAttention,
                    torch.nn.RNNBase)  # dropout between layers


def trace(model: Union[torch.nn.Module, Callable], example_inputs: Any, *, dynamic: Optional[Dynamic] = None,
          dynamic_batch: bool = False, check: bool = True, optimize: bool = True, name: Optional[str] = None,
          rtol: float = 1e-4, atol: float = 1e-5, guards: bool = True, ranges: Optional[Ranges] = None) -> Graph:
    """Trace ``model`` on ``example_inputs`` (a tensor, a tuple of tensors, or a dict by argument name).

    ``dynamic`` names symbolic dims per input (``{"x": {0: "batch"}}``); ``dynamic_batch=True``
    makes dim 0 of every input the symbol ``batch``.

    Where the model reads a Python value from tensor data (``bool(t)``, ``t.item()``, a symbolic
    size compared in Python, ...), the trace keeps the example's value, warns (TraceWarning) and,
    with ``guards``, leaves a ``kiln.Guard`` that makes the graph refuse inputs giving another value
    instead of answering wrong. While tracing, ``torch.jit.is_tracing()`` answers True, as under
    torch.jit.trace, so libraries take their trace-friendly paths (transformers keeps an attention
    mask it would otherwise drop when it holds no padding).

    With ``check``, the graph is compared with the model on the example inputs and on fresh ones
    drawn from the range the model accepts (ids up to the size of the table they index, 0/1 masks
    with both values, other batch sizes when the batch is dynamic; ``ranges`` gives an input's
    ``(low, high)`` instead); a mismatch, or a guard refusing such an input, raises
    TraceCheckError. Float outputs match when ``max|graph - model| <= atol + rtol * max|model|``.
    ``optimize`` runs the pass pipeline.
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
    tracer = Tracer(graph, _param_names(module), _module_names(module), guards=guards)
    outputs = _record(model, module, tracer, names, tensors, dims)
    _set_outputs(graph, tracer, outputs)
    infer_shapes(graph)
    verify(graph)
    if check:
        check_trace(graph, model, names, tensors, dims, rtol=rtol, atol=atol, ranges=ranges)
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
    is_tracing = torch.jit.is_tracing
    # Libraries test torch.jit.is_tracing() to avoid data-dependent shortcuts (transformers drops an
    # all-ones attention mask, torchvision skips checks); kiln records a trace, so it answers True.
    torch.jit.is_tracing = _is_tracing
    # Code written for torch.jit.trace, where sizes are 0-dim tensors, rounds them with torch.ceil /
    # torch.floor (transformers' MobileViT: ``torch.ceil(orig_height / patch_height)``); kiln's sizes
    # are Python ints, so these two accept a Python number while kiln records, as the jit sees it.
    rounding = {name: getattr(torch, name) for name in _SIZE_ROUNDING}
    import kiln.frontend.torch_ops  # noqa: F401  (the mapping table keys the real functions: fill it first)

    for name, func in rounding.items():
        setattr(torch, name, _numbers_as_tensors(func))
    try:
        with torch.no_grad():
            yield
    finally:
        pre.remove()
        post.remove()
        torch.backends.mha.set_fastpath_enabled(fastpath)
        torch.jit.is_tracing = is_tracing
        for name, func in rounding.items():
            setattr(torch, name, func)


_SIZE_ROUNDING = ("ceil", "floor")


def _numbers_as_tensors(func: Callable) -> Callable:
    @functools.wraps(func)
    def wrapper(input: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(input, (int, float)) and not isinstance(input, bool):
            input = torch.tensor(float(input))  # what a traced size divided by an int is under the jit
        return func(input, *args, **kwargs)

    return wrapper


def _is_tracing() -> bool:
    """``torch.jit.is_tracing`` while kiln records: True for the code being traced."""
    from kiln.frontend.tracer import active_tracer
    return active_tracer() is not None


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
            return call_model(model, names, tensors)


def call_model(model: Callable, names: list[str], tensors: Sequence[torch.Tensor]) -> Any:
    """Call the model with its inputs bound to the parameters they were named for: positionally
    when the names are the leading positional parameters in order (or a ``*args`` tail), else by
    keyword (a dict of example inputs that skips a parameter: ``input_ids`` and ``attention_mask``
    of a GPT-2 whose ``past_key_values`` sits between them)."""
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if all(i >= len(params) or params[i].name == n for i, n in enumerate(names)):
        return model(*tensors)
    pos = 0
    while pos < len(names) and pos < len(params) and params[pos].name == names[pos]:
        pos += 1
    return model(*tensors[:pos], **dict(zip(names[pos:], tensors[pos:])))


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
Ranges = Mapping[str, tuple]


def check_trace(graph: Graph, model: Callable, names: list[str], examples: list[torch.Tensor],
                dims: list[dict[int, str]], *, rtol: float, atol: float, trials: int = 3,
                ranges: Optional[Ranges] = None,
                on_trial: Optional[Callable[[int, int, str], None]] = None) -> None:
    """Compare the graph with the model on the examples and on fresh inputs; TraceCheckError if
    they differ or if the graph refuses an input the model takes (a kiln.Guard failed).

    Fresh inputs are drawn from the range the model accepts, not around the example, so a
    trace that only holds for the example's values shows (see :func:`input_domains`). Each float
    output is compared with a scale-aware bound, ``max|graph - model| <= atol + rtol * max|model|``:
    float32 summation order moves a large output by far more than ``rtol`` of its small
    elements, while a wrong constant or axis moves it by a sizeable share of its largest.

    ``on_trial(k, total, label)`` is told before each of the ``total`` input sets runs (``kiln export``
    shows it: on a large model each set takes many seconds).
    """
    domains = input_domains(graph, names, examples, ranges or {})
    for k, (label, inputs, fallback) in enumerate(_trial_inputs(examples, dims, trials, domains), 1):
        if on_trial is not None:
            on_trial(k, trials + 1, label)
        outcome = _run_both(graph, model, names, inputs, label, fallback)
        if outcome is None:
            continue  # both refused the input (the model's assert, the graph's Assert/Guard): they agree
        want, got, label = outcome
        for out_value, w, g in zip(graph.outputs, want, got):
            problem = mismatch(np.asarray(g), w, rtol=rtol, atol=atol)
            if problem:
                raise TraceCheckError(f"the traced graph disagrees with the model on {label}: output "
                                      f"'{out_value.name}' differs ({problem}); the trace is specific to the "
                                      "example inputs (see the TraceWarnings) or a mapping is wrong")


def mismatch(got: np.ndarray, want: np.ndarray, *, rtol: float, atol: float) -> str:
    """Why ``got`` does not match the reference ``want`` ('' when it does): shapes, exact values
    for ints and bools, NaN/inf placement, then ``max|got - want| <= atol + rtol * max|want|``
    over the finite elements (tolerances widened to the format's precision for half types)."""
    if got.shape != want.shape:
        return f"shape {got.shape} vs {want.shape}"
    if want.dtype.kind not in "fc":
        bad = int(np.count_nonzero(got != want))
        return f"{bad} of {want.size} elements differ" if bad else ""
    a, b = got.astype(np.float64), want.astype(np.float64)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return "NaN in different places"
    inf = np.isinf(a) | np.isinf(b)
    if np.any(a[inf] != b[inf]):
        return "infinities in different places"
    finite = ~(np.isnan(a) | inf)
    if not finite.any():
        return ""
    rtol, atol = max(rtol, _HALF_RTOL.get(want.dtype.name, 0.0)), max(atol, _HALF_RTOL.get(want.dtype.name, 0.0))
    scale = float(np.max(np.abs(b[finite])))
    err = float(np.max(np.abs(a[finite] - b[finite])))
    bound = atol + rtol * scale
    if err <= bound:
        return ""
    return f"max abs difference {err:.3g} > {bound:.3g} = atol {atol:g} + rtol {rtol:g} * max|reference| {scale:.3g}"


_HALF_RTOL = {"float16": 1e-2, "bfloat16": 4e-2}


def _run_both(graph: Graph, model: Callable, names: list[str], inputs: list, label: str,
              fallback: Optional[list]) -> Optional[tuple]:
    """(model outputs, graph outputs, label) on ``inputs``; None when both refuse them (the model
    fails an ``assert``, the graph an Assert or a Guard). Inputs the model itself cannot take (it
    raises otherwise: an index out of its range) are replaced by ``fallback``, drawn around the
    example, once."""
    from kiln.checks import GuardFailed
    from kiln.ir.ops.assertion import AssertionFailed

    try:
        with torch.no_grad():
            want = [to_numpy(t) for _, t in _flatten_outputs(call_model(model, names, inputs), "output")]
    except AssertionError as eager_error:
        try:
            evaluate(graph, {n: to_numpy(t) for n, t in zip(names, inputs)})
        except (AssertionFailed, GuardFailed):
            return None
        raise TraceCheckError(f"the model fails an assert on {label} ({eager_error}) but the graph does not: "
                              "the check is missing from the graph") from eager_error
    except Exception:  # noqa: BLE001 - the draw is outside what the model takes
        if fallback is None:
            raise
        return _run_both(graph, model, names, fallback, f"{label} (drawn around the example: the model "
                                                         "raised on the wider draw)", None)
    feeds = {n: to_numpy(t) for n, t in zip(names, inputs)}
    while True:
        try:
            return want, evaluate(graph, feeds), label
        except GuardFailed as e:
            if not _drop_flipped_size_guards(graph, feeds, want, label):
                raise TraceCheckError(f"the traced graph refuses {label}, which the model takes: {e}") from None


def _drop_flipped_size_guards(graph: Graph, feeds: dict, want: list, label: str) -> bool:
    """Sizes flip a guard on a size comparison (``batch_size != position_ids.shape[0]``, ``q_length >
    1``: libraries specialize on size 1): if, with those guards out, the graph gives the model's
    outputs on these inputs, the path the trace took serves these sizes too, and the guards that
    failed go (with a TraceWarning). Guards that read tensor data never go. Returns whether any went."""
    from kiln.checks import holds, read_value

    sized = [n for n in graph.nodes if n.domain == "kiln" and n.op == "Guard" and _only_sizes(n.inputs[0])]
    if not sized:
        return False
    trial = graph.copy()
    guards = [n for n in trial.nodes if n.domain == "kiln" and n.op == "Guard" and _only_sizes(n.inputs[0])]
    checked = [n.inputs[0] for n in guards]
    for node in guards:
        trial.remove_node(node, force=True)
    trial.outputs = list(trial.outputs) + [trial.op("Identity", v) for v in checked]
    try:
        got = evaluate(trial, feeds)
    except Exception:  # noqa: BLE001 - another guard (one on data) refuses these inputs as well
        return False
    k = len(graph.outputs)
    if any(mismatch(np.asarray(g), w, rtol=1e-4, atol=1e-5) for g, w in zip(got[:k], want)):
        return False
    dropped = []
    for node, value in zip(sized, got[k:]):
        a = node.schema.fill_attrs(node.attrs)
        now = read_value(np.asarray(value), a["read"])
        if now is None or not holds(now, np.asarray(a["expected"]), a["rtol"]):
            graph.remove_node(node, force=True)
            dropped.append(f"{a['location']} ({a['what']})")
    for d in dropped:
        warnings.warn(f"the check dropped the guard at {d}: {label} flips it, and the traced graph still "
                      "gives the model's outputs there", TraceWarning, stacklevel=4)
    return bool(dropped)


def _only_sizes(v) -> bool:
    """Whether ``v`` is computed from the graph's constants and input sizes only (Shape, Size),
    never from tensor data."""
    seen, stack = set(), [v]
    while stack:
        x = stack.pop()
        if x in seen or x.const is not None:
            continue
        seen.add(x)
        node = x.producer
        if node is None:
            return False  # a graph input read as data
        if node.domain == "" and node.op in ("Shape", "Size"):
            continue
        stack.extend(i for i in node.inputs if i is not None)
    return True


# ---------------------------------------------------------------------------- what the check draws
class Domain:
    """Where the check draws one input's values from.

    ``kind``: 'float' (normal values; the negated example on one trial), 'binary' (0/1 with both
    present: the example held only 0s and 1s, a mask or a flag), 'index' (ints in [0, high): they
    index an Embedding/Gather of that size), 'range' (a user's LOW:HIGH), 'scalar' (a 0-d int: a
    different value each trial), 'int' (wider than the example's [min, max]), 'bool'.
    """

    def __init__(self, kind: str, low: float = 0, high: float = 0):
        self.kind, self.low, self.high = kind, low, high

    def __repr__(self) -> str:
        return f"Domain({self.kind}, {self.low}, {self.high})"


def input_domains(graph: Graph, names: list[str], examples: list[torch.Tensor], ranges: Ranges) -> list[Domain]:
    bounds = index_bounds(graph)
    return [_domain(n, t, bounds.get(n), ranges.get(n)) for n, t in zip(names, examples)]


def _domain(name: str, t: torch.Tensor, bound: Optional[int], user: Optional[tuple]) -> Domain:
    if user is not None:
        return Domain("range", float(user[0]), float(user[1]))
    if t.dtype is torch.bool:
        return Domain("bool")
    if bound is not None and bound > 2 and not t.dtype.is_floating_point:
        return Domain("index", 0, bound)
    if t.numel() and bool(((t == 0) | (t == 1)).all()):
        return Domain("binary")  # masks and flags: all ones (or zeros) as the example says nothing
    if t.dtype.is_floating_point:
        return Domain("float")
    lo, hi = (int(t.min()), int(t.max())) if t.numel() else (0, 1)
    if t.dim() == 0:
        return Domain("scalar", lo, hi)
    span = hi - lo + 1
    return Domain("int", min(lo, 0) if lo >= 0 else lo - span, hi + span + 1)


# Ops that pass index values through unchanged (an input reaching a Gather through them still
# holds the gathered positions).
_INDEX_PASS = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Transpose", "Expand",
                         "Slice", "Concat", "Tile"})


def index_bounds(graph: Graph) -> dict[str, int]:
    """Input name -> exclusive upper bound of its values, for integer inputs that reach the
    indices of a Gather (an Embedding) whose indexed dim is static: the model takes nothing
    above it, and ids up to the table's size are what it will see."""
    origin: dict = {v: v.name for v in graph.inputs}
    bounds: dict[str, int] = {}
    for g in graph.all_graphs():
        for node in g.nodes:
            if node.domain == "" and node.op in _INDEX_PASS and node.inputs and node.inputs[0] in origin:
                origin[node.outputs[0]] = origin[node.inputs[0]]
            if node.domain == "" and node.op == "Gather" and len(node.inputs) > 1 and node.inputs[1] in origin:
                data = node.inputs[0].type.shape if node.inputs[0].type is not None else None
                axis = node.attr("axis")
                if data is not None and len(data) > axis % max(len(data), 1) and isinstance(data[axis], int):
                    name = origin[node.inputs[1]]
                    bounds[name] = min(bounds.get(name, data[axis]), data[axis])
    return bounds


def _trial_inputs(examples: list[torch.Tensor], dims: list[dict[int, str]], trials: int,
                  domains: Optional[list[Domain]] = None):
    """(label, inputs, fallback inputs drawn around the example or None) per trial."""
    yield "the example inputs", examples, None
    domains = domains or [Domain("float") if t.dtype.is_floating_point else Domain("int", int(t.min()) if
                          t.numel() else 0, int(t.max()) + 1 if t.numel() else 2) for t in examples]
    gen = torch.Generator().manual_seed(0)
    batch = next((t.shape[0] for t, d in zip(examples, dims) if 0 in d), None)
    sizes = {}
    for k in range(trials):
        inputs, fallback = [], []
        for t, d, dom in zip(examples, dims, domains):
            shape = list(t.shape)
            for i, sym in d.items():
                base = shape[i]
                sizes.setdefault((sym, k), base + 1 + k if k % 2 == 0 else max(1, base - 1) if base > 1 else base + 2)
                shape[i] = sizes[(sym, k)]
            x = _draw(t, shape, dom, k, gen)
            inputs.append(x)
            fallback.append(_draw_near(t, shape, gen) if dom.kind in ("int", "scalar", "index") else x)
        label = f"fresh random inputs #{k + 1}" + (f" (batch {inputs[0].shape[0]})" if batch is not None else "")
        yield label, inputs, fallback


def _draw(t: torch.Tensor, shape: list[int], dom: Domain, k: int, gen: torch.Generator) -> torch.Tensor:
    if t.dtype.is_floating_point and k == 1 and list(t.shape) == shape and dom.kind in ("float", "binary"):
        return -t  # flips the sign of sums and means: the classic data-dependent branch
    if dom.kind == "float":
        return torch.randn(shape, generator=gen).to(t.dtype)
    if dom.kind == "bool":
        return _both_present(torch.rand(shape, generator=gen) > 0.5, gen)
    if dom.kind == "binary" and not (t.dtype.is_floating_point and k >= 2):
        return _binary(shape, k, gen).to(t.dtype)
    if dom.kind == "binary":
        return torch.randn(shape, generator=gen).to(t.dtype)  # a float 0/1 example: normal values too
    if dom.kind == "range":
        if t.dtype.is_floating_point:
            return (torch.rand(shape, generator=gen, dtype=torch.float64) * (dom.high - dom.low) + dom.low).to(t.dtype)
        return torch.randint(int(dom.low), max(int(dom.high), int(dom.low) + 1), shape, generator=gen).to(t.dtype)
    if dom.kind == "scalar":
        v = int(t)
        picks = [2 * abs(v) + 1, 1 if v != 1 else 0, v + 1, abs(v) // 2]
        return torch.full(shape, picks[k % len(picks)], dtype=t.dtype)
    return torch.randint(int(dom.low), max(int(dom.high), int(dom.low) + 1), shape, generator=gen).to(t.dtype)


def _draw_near(t: torch.Tensor, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    """Ints in the example's own [min, max] (what the check drew before it knew better)."""
    low, high = (int(t.min()), int(t.max()) + 1) if t.numel() else (0, 2)
    return torch.randint(low, max(high, low + 1), shape, generator=gen).to(t.dtype)


def _binary(shape: list[int], k: int, gen: torch.Generator) -> torch.Tensor:
    """0/1 with both values present: on even trials at random, on odd ones as padding masks
    are (each row ones, then zeros after a random length of at least one)."""
    if k % 2 == 1 and len(shape) >= 1 and shape[-1] > 1:
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        lengths = torch.randint(1, shape[-1], (rows, 1), generator=gen)
        mask = (torch.arange(shape[-1])[None, :] < lengths).to(torch.int64)
        return mask.reshape(shape)
    return _both_present((torch.rand(shape, generator=gen) > 0.5).to(torch.int64), gen)


def _both_present(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    flat = x.reshape(-1)
    if flat.numel() >= 2 and bool((flat == flat[0]).all()):
        i = int(torch.randint(0, flat.numel(), (1,), generator=gen))
        flat[i] = 1 - flat[i] if flat.dtype is not torch.bool else ~flat[i]
    return x
