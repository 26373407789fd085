"""The glibc malloc tuning applied when a CPU program is built (runtime/allocator.py)."""
import subprocess
import sys
import textwrap

import pytest

CODE = textwrap.dedent("""
    import numpy as np
    from kiln.ir import Graph
    import kiln
    from kiln.runtime import allocator
    g = Graph("g")
    x = g.add_input("x", "float32", (2,))
    g.outputs = [g.op("Relu", x)]
    p = kiln.load(g)
    print(allocator._state.get("applied"), allocator.tune_allocator())
""")


def _run(env_value):
    import os

    env = dict(os.environ)
    env.pop("KILN_MALLOC_TUNING", None)
    if env_value is not None:
        env["KILN_MALLOC_TUNING"] = env_value
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def _glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _glibc(), reason="the tuning applies to glibc only")
def test_applied_once_when_a_program_is_built():
    assert _run(None) == ["True", "True"]


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_turned_off_by_the_environment(value):
    assert _run(value) == ["False", "False"]
