"""The root package's lazy wrappers (kiln.trace, kiln.script, kiln.export_onnx, kiln.import_onnx) show the real
functions' signatures, forward every argument, and still import nothing heavy until called."""
import importlib
import inspect
import subprocess
import sys

import pytest

import kiln

# wrapper name -> (module of the real function, the package the module needs)
WRAPPED = {
    "trace": ("kiln.frontend.trace", "torch"),
    "script": ("kiln.frontend.script", "torch"),
    "export_onnx": ("kiln.serializer.onnx", "onnx"),
    "import_onnx": ("kiln.serializer.onnx_import", "onnx"),
}


def real_function(name: str):
    module, needs = WRAPPED[name]
    pytest.importorskip(needs)
    return getattr(importlib.import_module(module), name)


def test_every_function_of_the_root_package_is_checked():
    """A new wrapper defined in kiln/__init__.py must be added to WRAPPED (or be a lazy re-export)."""
    defined_here = {n for n, v in vars(kiln).items()
                    if inspect.isfunction(v) and v.__module__ == "kiln" and not n.startswith("_")}
    assert defined_here == set(WRAPPED)


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_wrapper_signature_is_the_real_one(name):
    wrapper, real = getattr(kiln, name), real_function(name)
    assert inspect.signature(wrapper) == inspect.signature(real), (
        f"kiln.{name}'s signature in kiln/__init__.py is out of date: copy the one of "
        f"{real.__module__}.{name}")


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_wrapper_forwards_every_argument(name, monkeypatch):
    """Each parameter gets its own sentinel; the real function must receive all of them, bound to the same
    names (a parameter the wrapper declares but drops, or passes under another name, fails here)."""
    real = real_function(name)
    module = sys.modules[real.__module__]
    sig = inspect.signature(real)
    received = {}

    def spy(*args, **kwargs):
        received.update(sig.bind(*args, **kwargs).arguments)
        return "result"

    monkeypatch.setattr(module, name, spy)
    sentinels = {p: object() for p in sig.parameters}
    positional = [sentinels[p.name] for p in sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = {p.name: sentinels[p.name] for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert getattr(kiln, name)(*positional, **keywords) == "result"
    assert received.keys() == sentinels.keys()
    assert all(received[p] is sentinels[p] for p in sentinels)


def test_signatures_do_not_import_torch_or_onnx():
    code = ("import inspect, sys, kiln\n"
            "assert inspect.signature(kiln.trace).parameters['dynamic_batch'].default is False\n"
            "for f in (kiln.script, kiln.export_onnx, kiln.import_onnx):\n"
            "    inspect.signature(f)\n"
            "print(sorted(m for m in ('torch', 'onnx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
