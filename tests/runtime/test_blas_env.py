"""kiln/blas_env.py: OpenBLAS's kernel set chosen at ``import kiln``, before numpy loads (CPUs OpenBLAS does not know)."""
import os
import subprocess
import sys

import pytest

from kiln import blas_env

ZEN5 = {"vendor_id": "AuthenticAMD", "cpu family": "26",
        "flags": "fpu sse avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16"}


def test_zen5_with_avx512_gets_skylakex_kernels():
    assert blas_env.wanted_coretype(ZEN5) == "SkylakeX"


@pytest.mark.parametrize("change", [
    {"cpu family": "25"},                                            # Zen 4: OpenBLAS maps it itself
    {"vendor_id": "GenuineIntel"},                                   # Intel: OpenBLAS knows its CPUs
    {"flags": "fpu sse avx2 fma avx512f"},                           # AVX-512 without the subsets SkylakeX uses
    {"cpu family": "not a number"},
])
def test_other_cpus_keep_openblas_choice(change):
    assert blas_env.wanted_coretype({**ZEN5, **change}) is None
    assert blas_env.wanted_coretype({}) is None


def test_first_cpu_reads_the_first_processor_only(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n\n"
                    "processor\t: 1\nvendor_id\t: GenuineIntel\n\n")
    assert blas_env.first_cpu(str(path)) == {"processor": "0", "vendor_id": "AuthenticAMD", "cpu family": "26"}
    assert blas_env.first_cpu(str(tmp_path / "missing")) == {}


def _cpuinfo(tmp_path, fields: dict) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text("".join(f"{k}\t: {v}\n" for k, v in fields.items()) + "\n")
    return str(path)


def test_choose_sets_the_variable_only_when_nothing_decided_yet(tmp_path):
    zen5 = _cpuinfo(tmp_path, ZEN5)
    env: dict = {}
    assert blas_env.choose(env, modules={}, cpuinfo=zen5) == "SkylakeX"
    assert env == {"OPENBLAS_CORETYPE": "SkylakeX"}
    # numpy already loaded: its BLAS has chosen, nothing to change
    env = {}
    assert blas_env.choose(env, modules={"numpy": object()}, cpuinfo=zen5) is None and env == {}
    # the user's own setting wins
    env = {"OPENBLAS_CORETYPE": "Haswell"}
    assert blas_env.choose(env, modules={}, cpuinfo=zen5) is None and env == {"OPENBLAS_CORETYPE": "Haswell"}
    # KILN_BLAS_CORETYPE: keep (leave OpenBLAS to choose), or a kernel set of the user's
    env = {"KILN_BLAS_CORETYPE": "keep"}
    assert blas_env.choose(env, modules={}, cpuinfo=zen5) is None and "OPENBLAS_CORETYPE" not in env
    env = {"KILN_BLAS_CORETYPE": "Zen"}
    assert blas_env.choose(env, modules={}, cpuinfo=_cpuinfo(tmp_path, {})) == "Zen"
    assert env["OPENBLAS_CORETYPE"] == "Zen"
    # a CPU OpenBLAS knows: nothing set
    env = {}
    assert blas_env.choose(env, modules={}, cpuinfo=_cpuinfo(tmp_path, {**ZEN5, "cpu family": "25"})) is None
    assert env == {}


def test_import_kiln_sets_the_kernels_before_numpy_loads():
    """End to end in a fresh process: what ``import kiln`` sets is what numpy's OpenBLAS then runs."""
    pytest.importorskip("numpy")
    from kiln.runtime import threads
    if threads.blas_kernels() is None:
        pytest.skip("numpy's BLAS here is not an OpenBLAS that names its kernels")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env["KILN_BLAS_CORETYPE"] = "Nehalem"   # SSE4.2 kernels: any x86-64 CPU of the last 15 years runs them
    code = ("import os, kiln; set_ = os.environ.get('OPENBLAS_CORETYPE'); import numpy; "
            "from kiln.runtime import threads; print(set_, threads.blas_kernels())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("the kernel names are x86's")
    assert out.stdout.split() == ["Nehalem", "Nehalem"]
