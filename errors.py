"""The exceptions kiln raises for failures a user can cause.

Every one of them is a :class:`KilnError`, so ``except kiln.KilnError`` catches them all,
and each message names what was wrong and where (the node, the input, the file offset).
"""
from __future__ import annotations


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""


class VerifyError(KilnError):
    """A graph breaks an IR invariant (SSA, types, order, schema)."""


class ShapeInferenceError(KilnError):
    """Shape/type inference found inputs an op cannot accept."""


class UnknownOpError(KilnError):
    """An op name (or version) that the registry does not know."""


class FormatError(KilnError):
    """A model file is malformed, truncated, corrupt or of an unsupported version."""


class InputError(KilnError):
    """Inputs given to a program do not match its signature."""


class UnsupportedOpError(KilnError):
    """The tracer met a framework operation that has no mapping to kiln's IR."""


class TraceCheckError(KilnError):
    """A traced graph disagrees with the original model on fresh inputs."""


class TraceWarning(UserWarning):
    """A trace may only be valid for the example inputs (a Python value was read from tensor data)."""


class ResourceError(KilnError):
    """A request would take more memory than a limit allows (``kiln.load(..., memory_budget=)``):
    refused before any buffer is allocated; the message gives the estimate and the budget."""


class ExecutionError(KilnError):
    """A kernel failed while running a program; the message names the node and its inputs."""


class ScriptError(KilnError):
    """kiln.script met Python it cannot keep as control flow; the message names file:line:col,
    shows the source line with a caret under the construct, and says what to write instead."""


def optional_module(name: str, purpose: str):
    """Import ``name`` (onnxruntime, onnx or a kiln module built on them); a missing onnx/onnxruntime
    package becomes a KilnError naming ``purpose`` and the extra to install (``pip install 'kiln-compiler[onnx]'``).
    Here, at the bottom layer, so that any layer can use it (tests/test_layers.py)."""
    import importlib
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing in ("onnx", "onnxruntime"):
            raise KilnError(f"{purpose} needs the '{missing}' package: pip install 'kiln-compiler[onnx]'") from None
        raise


def run_command(name, run, args) -> int:
    """Run a sub-command the way every kiln entry point does: a KilnError becomes one
    ``kiln NAME: error: ...`` line and exit 1, never a traceback (kept here, at the bottom layer, so that
    ``python -m kiln.runtime`` uses it without importing the CLI)."""
    import os
    import sys
    try:
        code = run(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (``kiln inspect m.kiln --graph | head``): exit quietly. Point
        # stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KilnError as e:
        print(f"kiln {name}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
