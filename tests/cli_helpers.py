"""``kiln ...`` in the test process: the CLI's ``main`` with its output captured, instead of a ``python -m
kiln`` subprocess that imports torch again (about 1.5 s a call on 2 cores). Tests that check the process
itself (exit codes of the interpreter, signals, what a fresh interpreter imports) keep a subprocess."""
from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """Run ``kiln ARGS`` in-process; returns what ``subprocess.run(..., capture_output=True, text=True)``
    would. What a command leaves in the process is undone: the working directory, ``sys.path`` entries (the
    export command adds the model file's folder) and the modules imported from those folders, so the next
    call imports a file of the same name afresh."""
    from kiln.cli import main
    argv = [str(a) for a in args]
    saved_path, saved_modules, saved_cwd = list(sys.path), set(sys.modules), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")  # as a fresh interpreter: each warning shown (once per place)
            _reset_warning_registries()
            try:
                code = main(argv)
            except SystemExit as e:  # argparse errors and --help
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(saved_cwd)
        added = [p for p in sys.path if p not in saved_path]
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            mod = sys.modules.get(name)
            path = getattr(mod, "__file__", None) or ""
            if name.startswith("_kiln_export_") or any(path.startswith(a) for a in added if a):
                del sys.modules[name]
    return subprocess.CompletedProcess(["kiln", *argv], code, out.getvalue(), err.getvalue())


def _reset_warning_registries() -> None:
    """Forget which warnings were already shown (a fresh interpreter has shown none)."""
    for mod in list(sys.modules.values()):
        registry = getattr(mod, "__warningregistry__", None)
        if isinstance(registry, dict):
            registry.clear()


def load_script(path, name: str):
    """A repository script (bench/, examples/) imported as module ``name``, without leaving it in sys.modules:
    registered only while it runs, because dataclasses look their module up while a class is made."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module
