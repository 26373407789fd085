#!/usr/bin/env bash
# Issue 18 on the GPU machine: the float16 tests, then bench/gpu_half_bench.py. Carry .whl (kiln's wheels for
# the machine's Python, nvidia-cudnn-frontend among them). Everything it writes goes to $OUT.
#   TESTS=1       tests/runtime/test_cuda_half.py (+ the CUDA test modules in TEST_MORE)
#   MODELS=...    the bench's models (resnet50,bert,gpt2); PREC=fp16|bf16; COMPILE=1 adds torch.compile reduce-overhead;
#                 ATTN=auto,kernel,ops also times kiln fp16 with those attention paths
#   PROFILE="bert:32 gpt2:16"  bench/gpu_kernel_profile.py per model:batch (CUPTI kernels, kiln vs torch.compile)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kiln
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/pkg:/tmp/site:$PWD/bench PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
status=0
if [ "${TESTS:-0}" = 1 ]; then
  timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider -rs -x --durations=5 tests/runtime/test_cuda_half.py \
    ${TEST_MORE:-} 2>&1 | tee "$OUT/half_tests.log" | tail -40 || status=1
fi
if [ -n "${MODELS:-}" ]; then
  timeout ${BENCH_S:-400} python3 bench/gpu_half_bench.py --models "$MODELS" --precision ${PREC:-fp16} ${WEIGHTS:+--weights $WEIGHTS} ${COMPILE:+--compile} ${TOP1:+--top1 $TOP1} \
    ${ATTN:+--attention $ATTN} --deadline ${DEADLINE:-300} --json "$OUT/half_${TAG:-run}.json" 2>&1 | tee "$OUT/half_${TAG:-run}.log" | tail -30 || status=1
fi
for mb in ${PROFILE:-}; do
  timeout ${PROFILE_S:-200} python3 bench/gpu_kernel_profile.py --model ${mb%%:*} --batch ${mb##*:} \
    ${PROFILE_NO_COMPILE:+--no-compile} --json "$OUT/kernels_${mb%%:*}_b${mb##*:}.json" 2>&1 | tee "$OUT/kernels_${mb%%:*}_b${mb##*:}.log" | tail -60 || status=1
done
exit $status
