"""Per-program settings of the CUDA backend (issue 17): ``CudaOptions``.

Before this, ``CudaProgram(tf32=...)`` changed CuPy's process-wide float32 compute type and the
math mode of every cuBLAS handle, and the conv path (``KILN_CUDA_CONV``), the attention path
(``KILN_ATTENTION``), the cuDNN workspace cap (``KILN_CUDNN_WORKSPACE_MIB``) and the cuDNN
epilogue fusion (``KILN_CUDNN_EPILOGUE``) were module globals read from the environment at import:
two models in one process could not differ, and the last one loaded decided for both.

Now each ``CudaProgram`` holds one frozen ``CudaOptions``. Its kernels are bound with it at load
(runtime/kernels/cuda: ``bound(options)`` around each factory), and its runs execute under it
(``bound`` again, for what reads the setting at run time: the cuBLAS handle of the right math
mode, the cuDNN plan cache key). The environment is read once, when an options object is made
without an explicit value for a field; nothing is read from it afterwards.

Precedence for a field left out: the deprecated process-wide setters (``set_tf32``,
``cudnn.set_mode``, ``attention.MODE["mode"] = ...``) where one was called, then the environment
variable, then the built-in default. This module imports no CuPy (CI checks it without a GPU).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Union

from kiln.errors import KilnError

CONV_MODES = ("auto", "cudnn", "im2col")
ATTENTION_MODES = ("auto", "cudnn", "kernel", "ops")
OUTPUTS = ("cupy", "numpy")
GRAPH_MODES = (True, False, "auto")
DEFAULT_WORKSPACE_MIB = 32.0

ENV = {"conv": "KILN_CUDA_CONV", "attention": "KILN_ATTENTION",
       "cudnn_workspace_mib": "KILN_CUDNN_WORKSPACE_MIB", "cudnn_epilogue": "KILN_CUDNN_EPILOGUE"}

# The deprecated process-wide defaults (set_tf32, cudnn.set_mode, attention.MODE): None = not set.
# attention.MODE and cudnn's mode are these very dicts, so old code writing them still works.
PROCESS_DEFAULTS: dict = {"tf32": None}
CONV_DEFAULT: dict = {"mode": None}
ATTENTION_DEFAULT: dict = {"mode": None}

_UNSET: Any = object()
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise KilnError(f"{name}={value!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def _workspace(value: Any, what: str) -> Optional[float]:
    """A workspace cap in MiB (None: no cap) from a number or a string ('none' = no cap)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == "none":
            return None
        try:
            value = float(value)
        except ValueError:
            raise KilnError(f"{what}={value!r}: expected a number of MiB or 'none'") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KilnError(f"{what} must be a number of MiB or None, not {value!r}")
    value = float(value)
    if not value >= 0 or value == float("inf"):
        raise KilnError(f"{what} must be a finite number of MiB >= 0, not {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CudaOptions:
    """The settings of one CUDA program. Fields left out come from the (deprecated) process
    defaults, then the environment (read here, once), then the defaults below.

    - ``tf32``: let float32 products and convolutions use TF32 (cuBLAS math mode, cuBLASLt's
      compute type, cuDNN engines with tensor-core notes). Default False.
    - ``conv``: "auto" (cuDNN from nn.CUDNN_MIN_BATCH samples up, im2col below), "cudnn" or
      "im2col" (``KILN_CUDA_CONV``).
    - ``attention``: "auto" (float16: cuDNN's fused attention where it has an engine; else the fused
      kernel where it fills the GPU), "cudnn" (the same, and the kernel even below a full GPU),
      "kernel" (kiln's kernel only) or "ops" (``KILN_ATTENTION``).
    - ``cudnn_workspace_mib``: engines needing more workspace are passed over while another
      takes the graph; None = no cap (``KILN_CUDNN_WORKSPACE_MIB``, "none"; default 32).
    - ``cudnn_epilogue``: residual add and ReLU inside the cuDNN graph (``KILN_CUDNN_EPILOGUE``,
      0/1; default on).
    - ``cuda_graphs``: True, False or "auto"; ``fuse``: the fusion passes at load; ``output``:
      "cupy" or "numpy".
    - ``wait``: how a run with host outputs waits for its graph replay: "poll" (query the event in a
      loop, holding the GIL: the lowest latency for one thread, as torch's default sync) or "block"
      (``cudaEventSynchronize`` without the GIL, so other threads of the process run meanwhile: what
      a server worker that receives the next batch during this one needs).
    """

    tf32: bool = _UNSET
    conv: str = _UNSET
    attention: str = _UNSET
    cudnn_workspace_mib: Optional[float] = _UNSET
    cudnn_epilogue: bool = _UNSET
    cuda_graphs: Union[bool, str] = "auto"
    fuse: bool = True
    output: str = "cupy"
    wait: str = "poll"

    def __post_init__(self) -> None:
        env = os.environ

        def set_(name: str, value: Any) -> None:  # frozen: the defaults are resolved once, here
            object.__setattr__(self, name, value)

        def pick(field: str, process: Optional[Any]):
            value = getattr(self, field)
            if value is not _UNSET:
                return value, field
            if process is not None:
                return process, field
            var = ENV.get(field)
            if var is not None and env.get(var, "").strip():
                return env[var].strip(), var
            return _UNSET, field

        tf32, _ = pick("tf32", PROCESS_DEFAULTS["tf32"])
        tf32 = False if tf32 is _UNSET else tf32
        if not isinstance(tf32, bool):
            raise KilnError(f"tf32 must be True or False, not {tf32!r}")
        set_("tf32", tf32)

        conv, what = pick("conv", CONV_DEFAULT["mode"])
        conv = "auto" if conv is _UNSET else (conv.lower() if what != "conv" else conv)
        if conv not in CONV_MODES:
            raise KilnError(f"{what}={conv!r}: conv must be one of {', '.join(map(repr, CONV_MODES))}")
        set_("conv", conv)

        att, what = pick("attention", ATTENTION_DEFAULT["mode"])
        att = "auto" if att is _UNSET else (att.lower() if what != "attention" else att)
        if att not in ATTENTION_MODES:
            raise KilnError(f"{what}={att!r}: attention must be one of {', '.join(map(repr, ATTENTION_MODES))}")
        set_("attention", att)

        ws, what = pick("cudnn_workspace_mib", None)
        set_("cudnn_workspace_mib", DEFAULT_WORKSPACE_MIB if ws is _UNSET else _workspace(ws, what))

        epi, what = pick("cudnn_epilogue", None)
        if epi is _UNSET:
            epi = True
        elif isinstance(epi, str) and what != "cudnn_epilogue":
            epi = _env_bool(what, epi)
        if not isinstance(epi, bool):
            raise KilnError(f"cudnn_epilogue must be True or False, not {epi!r}")
        set_("cudnn_epilogue", epi)

        if not any(self.cuda_graphs is m or (isinstance(m, str) and self.cuda_graphs == m) for m in GRAPH_MODES):
            raise KilnError(f"cuda_graphs must be True, False or 'auto', not {self.cuda_graphs!r}")
        if not isinstance(self.fuse, bool):
            raise KilnError(f"fuse must be True or False, not {self.fuse!r}")
        if self.output not in OUTPUTS:
            raise KilnError(f"output must be one of {', '.join(map(repr, OUTPUTS))}, not {self.output!r}")
        if self.wait not in ("poll", "block"):
            raise KilnError(f"wait must be 'poll' or 'block', not {self.wait!r}")

    # ------------------------------------------------------------------ derived

    @property
    def workspace_cap_bytes(self) -> Optional[int]:
        """The cuDNN workspace cap in bytes (None: no cap)."""
        mib = self.cudnn_workspace_mib
        return None if mib is None else int(mib * (1 << 20))

    def replace(self, **changes) -> "CudaOptions":
        """A copy with ``changes`` (validated like a new object)."""
        unknown = set(changes) - set(FIELDS)
        if unknown:
            raise KilnError(f"unknown CUDA option(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(cls, options: Optional["CudaOptions"] = None, **given) -> "CudaOptions":
        """``options`` (or fresh defaults) with the keyword arguments that are not None applied:
        what ``CudaProgram(graph, options=..., tf32=..., ...)`` and ``kiln.load`` call."""
        if options is not None and not isinstance(options, CudaOptions):
            raise KilnError(f"options must be a CudaOptions, not {type(options).__name__}")
        given = {k: v for k, v in given.items() if v is not None}
        unknown = set(given) - set(FIELDS)
        if unknown:
            raise KilnError(f"unknown CUDA option(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
        if options is None:
            return cls(**given)
        return options.replace(**given) if given else options

    def as_dict(self) -> Mapping[str, Any]:
        return {f: getattr(self, f) for f in FIELDS}


FIELDS = tuple(f.name for f in dataclasses.fields(CudaOptions))


def set_process_tf32(allowed: Optional[bool]) -> None:
    """The deprecated process default for ``tf32`` (``cuda_program.set_tf32``): options made
    afterwards without an explicit ``tf32`` take it; None forgets it. Programs already loaded keep theirs."""
    if allowed is not None and not isinstance(allowed, bool):
        allowed = bool(allowed)
    PROCESS_DEFAULTS["tf32"] = allowed


__all__ = ["CudaOptions", "FIELDS", "CONV_MODES", "ATTENTION_MODES", "ENV", "set_process_tf32"]
