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
