"""The one table that maps PyTorch operations to kiln IR: ``TABLE[torch_callable] -> handler``.

Add an op with one decorated function in the family module where it belongs (and a unit test
in tests/frontend/)::

    @maps(torch.relu, torch.Tensor.relu, F.relu)
    def relu(t, res, input, inplace=False):
        return t.emit("Relu", t.value(input))

A handler gets the Tracer ``t``, the eager result ``res`` (for dtypes and sizes torch decided:
type promotion, output shapes) and the call's own arguments; it returns the IR value(s) of the
result's tensors in order. Handlers registered with ``value=True`` return the Python object
the model should see instead of ``res`` (``x.size(0)`` -> a SymInt when the dim is symbolic).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

Handler = Callable[..., object]

TABLE: dict[Callable, tuple[Handler, bool]] = {}

# torch's argument parser also takes NumPy's names for these parameters (``torch.cat(xs, axis=1)``,
# ``x.sum(axis=0, keepdims=True)``, ``torch.add(x1=a, x2=b)``); handlers use torch's own names.
NUMPY_NAMES = {"axis": "dim", "keepdims": "keepdim", "x": "input", "a": "input", "x1": "input", "x2": "other"}


def _numpy_names(handler: Handler) -> Handler:
    """``handler``, or a wrapper renaming NumPy-style keywords to the torch names it takes."""
    params = inspect.signature(handler).parameters
    renames = {a: n for a, n in NUMPY_NAMES.items() if n in params and a not in params}
    if not renames:
        return handler

    @functools.wraps(handler)
    def renamed(*args, **kwargs):
        for alias in renames.keys() & kwargs.keys():
            kwargs[renames[alias]] = kwargs.pop(alias)
        return handler(*args, **kwargs)

    return renamed


def maps(*funcs: Callable, value: bool = False) -> Callable[[Handler], Handler]:
    """Register the decorated handler for every torch callable in ``funcs``."""

    def deco(handler: Handler) -> Handler:
        entry = _numpy_names(handler)
        for f in funcs:
            if f in TABLE:
                raise ValueError(f"{f} is mapped twice ({TABLE[f][0].__name__} and {handler.__name__})")
            TABLE[f] = (entry, value)
        return handler

    return deco


# Reading these from a tensor that depends on the inputs bakes the example's value into the trace:
# the tracer guards each read (Tracer.data_dependent). ``Tensor.__iter__`` is not here: it is
# Python (``iter(self.unbind(0))``), traced through like any Python function, and unbind refuses
# a symbolic dim rather than fix the number of rows.
DATA_DEPENDENT = {
    torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__,
    torch.Tensor.__len__, torch.Tensor.__contains__,
    # Comparisons that answer with a Python bool.
    torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose, torch.is_nonzero,
    torch.Tensor.is_nonzero,
}

# Importing the families fills TABLE.
from kiln.frontend.torch_ops import (  # noqa: E402,F401
    activation, assign, attention, concat, core, creation, elementwise, indexing, linalg, logic, nn, norm, reduce,
    rnn, shape)
from kiln.frontend.torch_ops import resize  # noqa: E402,F401  (F.interpolate, nn.Upsample: issue 15)
