#!/usr/bin/env bash
# Issue 17 (per-program CUDA options) on the GPU machine, in one call: the options tests (two
# programs in one process, interleaved, eager / CUDA graphs / two threads), the cost of the
# per-program TF32 switch (bench/cuda_options_bench.py), then the rest of the CUDA suite for
# regressions. Wheels the machine lacks (cudnn frontend, pytest, hypothesis, flatbuffers) come in
# .whl/ (see the device tool's README); logs and the RESULTS line go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kiln
export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD/bench PYTHONUNBUFFERED=1
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, torch.cuda.get_device_name())"
status=0
timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_cuda_options.py 2>&1 | tee "$OUT/options.log" | tail -25 || status=1
: > "$OUT/RESULTS-line.md"
timeout 60 python3 bench/cuda_options_bench.py --results "$OUT/RESULTS-line.md" 2>&1 | tee "$OUT/bench.log" || status=1
timeout ${SUITE_S:-200} python3 -m pytest -q -p no:cacheprovider --durations=10 tests/runtime/test_cuda.py \
  tests/runtime/test_cuda_attention.py tests/runtime/test_cuda_epilogue.py tests/runtime/test_cuda_control_flow.py \
  tests/runtime/test_cuda_guards.py tests/runtime/test_cuda_reduce_all.py tests/runtime/test_cuda_resize.py \
  tests/runtime/test_cuda_resize_nvrtc.py tests/runtime/test_cuda_rnn.py 2>&1 | tee "$OUT/suite.log" | tail -30 || status=1
exit $status
