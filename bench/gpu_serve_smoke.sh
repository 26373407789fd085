#!/usr/bin/env bash
# Issue 17, kiln serve --device cuda on the GPU machine, in one call: the GPU serving tests
# (tests/server/test_gpu_serve.py: 64 concurrent clients equal to CudaProgram.run, a SIGKILLed
# worker replaced), then a first throughput probe (bench/gpu_serve_smoke.py: ResNet-50, buckets up
# to 32, 1 and 64 clients from separate processes, binary tensors). The machine lacks the server's
# packages (fastapi, starlette, pydantic, uvicorn, httptools) and pytest: they come as wheels in
# .whl/ (see the device tool's README). Logs and smoke.json go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kiln
export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD/bench PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, cupy, fastapi, uvicorn; print('torch', torch.__version__, 'cupy', cupy.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)" | tee -a "$OUT/device.txt"
status=0
timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -rs --durations=5 tests/server/test_gpu_serve.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1
timeout ${BENCH_S:-150} python3 bench/gpu_serve_smoke.py --model ${MODEL:-resnet50} --clients ${CLIENTS:-1,64} \
  --seconds ${SECONDS_PER:-10} --max-batch-size 32 --json "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.log" | tail -40 || status=1
exit $status
