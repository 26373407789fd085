"""The optional native CPU kernels (runtime/kernels/cpu/_native.c); everything else is in pyproject.toml.

``optional=True``: where no C compiler is found the install still succeeds, without the extension, and kiln
runs its numpy kernels (runtime/kernels/cpu/native.py says which ops the extension covers). Wheels built for
release carry it compiled, so installing from a wheel needs no compiler.
"""
import os

from setuptools import Extension, setup

ext_modules = []
if os.name == "posix" and os.environ.get("KILN_BUILD_NATIVE", "1") != "0":
    ext_modules.append(Extension(
        "kiln.runtime.kernels.cpu._native", ["runtime/kernels/cpu/_native.c"], optional=True,
        # -fno-tree-loop-distribute-patterns: short row loops stay loops, not a memset/memcpy call per row
        extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing", "-fno-tree-loop-distribute-patterns", "-Wall"],
        extra_link_args=["-pthread"]))

setup(ext_modules=ext_modules)
