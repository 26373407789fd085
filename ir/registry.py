"""The op registry: one registration per op gives its schema, its type/shape inference and
its numpy reference implementation (the op's meaning, used by constant folding and as the
oracle that every backend is tested against).

Register with the :func:`op` decorator on the reference implementation::

    @op("Relu", inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
    def relu(x):
        return np.maximum(x, x.dtype.type(0))

The reference receives the inputs positionally (``None`` for an omitted optional input;
a variadic input spreads into the remaining positions) and the attributes as keyword
arguments with defaults filled in. It returns one array or a tuple of arrays.
"""
from __future__ import annotations

import enum
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from kiln.errors import ShapeInferenceError, UnknownOpError
from kiln.ir.dtypes import ALL_TYPES, DType
from kiln.ir.types import Dim, TensorType

if TYPE_CHECKING:
    from kiln.ir.graph import Node

ONNX_DOMAIN = ""
KILN_DOMAIN = "kiln"


class AttrKind(enum.Enum):
    INT = "int"
    FLOAT = "float"
    STRING = "string"
    INTS = "ints"
    FLOATS = "floats"
    STRINGS = "strings"
    TENSOR = "tensor"
    GRAPH = "graph"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class In:
    """An input (or output) parameter of an op: its name, allowed dtypes, and arity.

    ``rank`` (an int or several) is the form the op's kernels rely on, e.g. ``rank=1`` for a
    shape operand, ``rank=0`` for a scalar; ``max_elements`` bounds the element count (``1``:
    a scalar that may come as a 1-element tensor). The verifier enforces both wherever the
    input's rank/shape is known (always for a constant): issue 16, no kernel sees a form its
    schema forbids."""

    name: str
    types: frozenset = ALL_TYPES
    optional: bool = False
    variadic: bool = False
    ranks: Optional[frozenset] = None
    max_elements: Optional[int] = None

    def __init__(self, name: str, types: Iterable[DType] = ALL_TYPES, *, optional: bool = False,
                 variadic: bool = False, rank: "int | Iterable[int] | None" = None,
                 max_elements: Optional[int] = None):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "types", frozenset(types))
        object.__setattr__(self, "optional", optional)
        object.__setattr__(self, "variadic", variadic)
        ranks = None if rank is None else frozenset((rank,) if isinstance(rank, int) else rank)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "max_elements", max_elements)

    def describe_ranks(self) -> str:
        names = {0: "a scalar (rank 0)", 1: "a 1-D tensor"}
        if self.ranks is None:
            return "any rank"
        return " or ".join(names.get(r, f"rank {r}") for r in sorted(self.ranks))


Out = In


@dataclass(frozen=True)
class Attr:
    """An attribute: name, kind and default (``REQUIRED`` when the user must give it)."""

    name: str
    kind: AttrKind
    default: Any = REQUIRED

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


InferFn = Callable[["InferContext"], Union[TensorType, Sequence[Optional[TensorType]]]]
PropagateFn = Callable[["InferContext"], Optional[tuple]]


@dataclass
class OpSchema:
    name: str
    domain: str
    since_version: int
    inputs: tuple
    outputs: tuple
    attrs: dict
    infer: InferFn
    reference: Callable[..., Any]
    foldable: bool = True
    propagate: Optional[PropagateFn] = None
    doc: str = ""
    # A run can observe the op other than through its outputs (a check that fails the run):
    # dead-code elimination keeps it, folding and CSE leave it alone.
    side_effect: bool = False
    # What passes and backends may assume (TRAITS); the op sets they use are derived: ops_with(trait).
    traits: frozenset = frozenset()

    @property
    def qualified_name(self) -> str:
        return f"{self.domain}.{self.name}" if self.domain else self.name

    @property
    def min_inputs(self) -> int:
        return sum(1 for p in self.inputs if not p.optional and not p.variadic) + \
            sum(1 for p in self.inputs if p.variadic and not p.optional)

    @property
    def max_inputs(self) -> Optional[int]:
        return None if any(p.variadic for p in self.inputs) else len(self.inputs)

    @property
    def has_subgraphs(self) -> bool:
        return any(a.kind is AttrKind.GRAPH for a in self.attrs.values())

    def input_param(self, i: int) -> In:
        """The parameter that describes input position ``i`` (variadic ones repeat)."""
        if i < len(self.inputs):
            return self.inputs[i]
        if self.inputs and self.inputs[-1].variadic:
            return self.inputs[-1]
        raise IndexError(i)

    def fill_attrs(self, given: dict) -> dict:
        """Given attributes with the schema's defaults filled in (no validation)."""
        out = {k: a.default for k, a in self.attrs.items() if not a.required}
        out.update(given)
        return out


_REGISTRY: dict[tuple[str, str], list[OpSchema]] = {}
_ALL_LOADED: list = []  # [True] once every built-in op module is imported (load_all_ops)


def load_all_ops() -> None:
    """Import every built-in op module. The common families come with ``kiln.ir``; the rest
    (``kiln.ir.ops.EXTRA``) on the first lookup the registry cannot answer, or here, before
    anything lists the registered ops."""
    if not _ALL_LOADED:
        from kiln.ir.ops import load_extra
        load_extra()
        _ALL_LOADED.append(True)


def _as_param(p: "In | str") -> In:
    return In(p) if isinstance(p, str) else p


#: The traits an op can declare (``@op(..., traits=(...))``):
#: - ``elementwise``: output element i depends only on element i of each (broadcast) input, one output,
#:   shape = the inputs' broadcast shape: elementwise fusion may put it in a generated kernel;
#: - ``commutative``: two inputs that may be swapped (CSE treats ``Add(a, b)`` and ``Add(b, a)`` as one);
#: - ``anchor``: a GPU library applies an elementwise epilogue inside its kernel (FusedEpilogue's first node).
TRAITS = frozenset({"elementwise", "commutative", "anchor"})


def op(name: str, *, inputs: Sequence["In | str"], outputs: Sequence["In | str"] = ("Y",),
       attrs: Sequence[Attr] = (), infer: InferFn, domain: str = ONNX_DOMAIN, since_version: int = 1,
       foldable: bool = True, propagate: Optional[PropagateFn] = None, side_effect: bool = False,
       traits: Sequence[str] = ()) -> Callable:
    """Decorator registering the decorated reference implementation as op ``name``."""
    unknown = set(traits) - TRAITS
    if unknown:
        raise ValueError(f"op {name}: unknown trait(s) {sorted(unknown)}; traits: {sorted(TRAITS)}")

    def deco(fn: Callable) -> Callable:
        schema = OpSchema(
            name=name, domain=domain, since_version=since_version,
            inputs=tuple(_as_param(p) for p in inputs), outputs=tuple(_as_param(p) for p in outputs),
            attrs={a.name: a for a in attrs}, infer=infer, reference=fn, foldable=foldable and not side_effect,
            propagate=propagate, doc=(fn.__doc__ or "").strip(), side_effect=side_effect,
            traits=frozenset(traits))
        register(schema)
        return fn

    return deco


class OpsWith(AbstractSet):
    """The names of the default-domain ops registered with ``trait`` (any version), read from the registry
    on first use, so that a module-level ``ELEMENTWISE_OPS = ops_with("elementwise")`` does not depend on
    the order the op modules were imported in; registering an op refreshes it. A read-only set."""

    _instances: "list[OpsWith]" = []

    def __init__(self, trait: str):
        if trait not in TRAITS:
            raise ValueError(f"unknown trait {trait!r}; traits: {sorted(TRAITS)}")
        self.trait = trait
        self._names: Optional[frozenset] = None
        OpsWith._instances.append(self)

    def _get(self) -> frozenset:
        if self._names is None:
            # The common op families only: no op of kiln.ir.ops.EXTRA declares a trait (tested), so
            # these sets are whole without importing them.
            import kiln.ir.ops  # noqa: F401
            self._names = frozenset(name for (domain, name), versions in _REGISTRY.items()
                                    if domain == ONNX_DOMAIN and any(self.trait in s.traits for s in versions))
        return self._names

    def __contains__(self, name: object) -> bool:
        return name in self._get()

    def __iter__(self):
        return iter(sorted(self._get()))

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return f"ops_with({self.trait!r}): {sorted(self._get())}"

    @classmethod
    def _from_iterable(cls, it):  # set operators (a - b, a & b) give plain frozensets
        return frozenset(it)


def ops_with(trait: str) -> OpsWith:
    """The set of default-domain op names declaring ``trait`` (see :data:`TRAITS`)."""
    return OpsWith(trait)


def register(schema: OpSchema) -> OpSchema:
    versions = _REGISTRY.setdefault((schema.domain, schema.name), [])
    if any(s.since_version == schema.since_version for s in versions):
        raise ValueError(f"op {schema.qualified_name} version {schema.since_version} registered twice")
    versions.append(schema)
    versions.sort(key=lambda s: s.since_version)
    for derived in OpsWith._instances:
        derived._names = None
    return schema


def get_schema(name: str, domain: str = ONNX_DOMAIN, version: Optional[int] = None) -> OpSchema:
    """The schema of ``name`` in effect at opset ``version`` (newest registered <= version)."""
    versions = _REGISTRY.get((domain, name))
    if not versions and not _ALL_LOADED:
        load_all_ops()
        versions = _REGISTRY.get((domain, name))
    if not versions:
        qual = f"{domain}.{name}" if domain else name
        import difflib  # the error path only
        known = all_op_names()
        close = difflib.get_close_matches(qual, known, n=3, cutoff=0.75)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        # A command rather than a list of every op: the message stays one readable line.
        raise UnknownOpError(f"op '{qual}' is not registered{hint}; `kiln info --ops` lists the {len(known)} "
                             "registered ops (`kiln info --ops NAME` searches them)")
    if version is None:
        return versions[-1]
    for s in reversed(versions):
        if s.since_version <= version:
            return s
    raise UnknownOpError(f"op '{name}' has no definition at opset {version} "
                         f"(first defined at {versions[0].since_version})")


def has_op(name: str, domain: str = ONNX_DOMAIN) -> bool:
    if (domain, name) in _REGISTRY:
        return True
    load_all_ops()
    return (domain, name) in _REGISTRY


def all_schemas() -> list[OpSchema]:
    """The newest schema of every registered op, sorted by qualified name."""
    load_all_ops()
    return sorted((v[-1] for v in _REGISTRY.values()), key=lambda s: s.qualified_name)


def all_op_names() -> list[str]:
    return [s.qualified_name for s in all_schemas()]


# --------------------------------------------------------------------------- inference context


class InferContext:
    """What an op's inference function sees: input types, attributes, constants.

    ``inputs[i]`` is the TensorType of input i, or None when an optional input is omitted
    (or its type is unknown). ``const(i)`` gives the value of a constant input (an
    initializer, or a value the shape pass has already computed); ``symbolic(i)`` gives the
    element values of a small 1-D integer input as dims, symbols included (the result of
    ``Shape`` flowing through ``Gather``/``Concat``/...), so ``Reshape(x, Concat(Shape(x)[0], -1))``
    keeps ``batch``.
    """

    def __init__(self, node: "Node", schema: OpSchema, inputs: Sequence[Optional[TensorType]],
                 consts: Sequence[Optional[np.ndarray]] = (), symbolic: Sequence[Optional[tuple]] = ()):
        self.node = node
        self.schema = schema
        self.inputs = list(inputs)
        self.attrs = schema.fill_attrs(node.attrs)
        self._consts = list(consts) + [None] * (len(self.inputs) - len(consts))
        self._symbolic = list(symbolic) + [None] * (len(self.inputs) - len(symbolic))

    @property
    def num_outputs(self) -> int:
        return len(self.node.outputs)

    def has_input(self, i: int) -> bool:
        return i < len(self.node.inputs) and self.node.inputs[i] is not None

    def input(self, i: int) -> TensorType:
        t = self.inputs[i] if i < len(self.inputs) else None
        if t is None:
            self.fail(f"input {i} has no known type")
        return t

    def const(self, i: int) -> Optional[np.ndarray]:
        return self._consts[i] if i < len(self._consts) else None

    def symbolic(self, i: int) -> Optional[tuple]:
        """Values of input i as a tuple of dims (int/str/None), if known; else None."""
        if i >= len(self._symbolic):
            return None
        if self._symbolic[i] is not None:
            return self._symbolic[i]
        c = self.const(i)
        if c is not None and c.dtype.kind in "iu" and c.ndim <= 1:
            return tuple(int(v) for v in c.reshape(-1))
        return None

    def fail(self, msg: str) -> "NoReturn":  # noqa: F821
        raise ShapeInferenceError(f"{self.node.describe()}: {msg}")


def normalize_inferred(ctx: InferContext, result: Any) -> list[Optional[TensorType]]:
    out = [result] if isinstance(result, TensorType) or result is None else list(result)
    if len(out) != ctx.num_outputs:
        ctx.fail(f"inference produced {len(out)} outputs, node has {ctx.num_outputs}")
    return out


Dims = tuple  # tuple[Dim, ...]: used in inference helper signatures
__all__ = ["AttrKind", "Attr", "In", "Out", "REQUIRED", "OpSchema", "op", "register", "get_schema",
           "has_op", "all_schemas", "all_op_names", "load_all_ops", "InferContext", "ONNX_DOMAIN", "KILN_DOMAIN", "Dim"]
