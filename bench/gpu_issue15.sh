#!/usr/bin/env bash
# Issue 15 on the GPU machine, in one call: the GPU tests of guards, Resize and recurrent layers plus
# the rest of the CUDA suite (regressions), the torch-version tests with the machine's torch, the
# guard cost on the GPU, and real models traced with the machine's torch and run on its GPU.
# Wheels it needs and the machine lacks (cudnn frontend, pytest, hypothesis, flatbuffers) come in
# .whl/ (see the device tool's README); results go to $OUT (tests.log, RESULTS.md with the sections).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kiln
export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD/bench PYTHONUNBUFFERED=1
python3 -c "import torch, cupy, torchvision; print('torch', torch.__version__, 'cupy', cupy.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name())"
cp bench/RESULTS.md "$OUT/RESULTS.md"
status=0
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_cuda_guards.py tests/runtime/test_cuda_resize.py \
  tests/runtime/test_cuda_resize_nvrtc.py tests/runtime/test_cuda_rnn.py tests/runtime/test_cuda.py \
  tests/runtime/test_cuda_control_flow.py tests/runtime/test_cuda_epilogue.py tests/runtime/test_cuda_attention.py \
  tests/runtime/test_cuda_reduce_all.py \
  tests/frontend/test_torch_versions.py tests/frontend/test_guards.py 2>&1 | tee "$OUT/tests.log" | tail -15 || status=1
timeout 240 python3 bench/guard_bench.py --device cuda --batch 1,32 --repeat 200 --outputs cupy,numpy --results "$OUT/RESULTS.md" || status=1
timeout 300 python3 bench/gpu_trace_check.py --results "$OUT/RESULTS.md" || status=1
exit $status
