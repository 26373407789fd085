#!/usr/bin/env bash
# Issue 17 on the GPU machine: bench/gpu_serve_bench.py (kiln serve --device cuda against Triton through
# PyTriton, a FastAPI + torch server and torch.compile behind a batching queue) and the GPU serving tests.
# The machine downloads nothing and one transfer holds at most 64 MiB, so it takes calls in a row:
#   STAGE=triton   carry .whl-triton (the nvidia-pytriton wheel, 53 MB): a venv at /tmp/vt with it
#   STAGE=bench    carry .whl and .whl-triton-deps: the server's wheels into /tmp/site, PyTriton's
#                  dependencies (numpy 1.26 ...) into /tmp/vt, then TESTS=1 runs the GPU serving tests
#                  and MODELS/SERVERS/CLIENTS/MODES select the benchmark cells; PROBE="resnet50 bert" runs
#                  bench/gpu_latency_probe.py (one request's time, layer by layer) for those models.
# Everything it writes goes to $OUT (one JSON per call, logs).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=${STAGE:-bench}
LIBDIR=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
if [ "$STAGE" = triton ]; then
  python3 --version; nvidia-smi -L
  [ -x /tmp/vt/bin/python ] || python3 -m venv /tmp/vt || exit 1
  /tmp/vt/bin/pip install -q --no-index --no-deps .whl-triton/*.whl || exit 1
  /tmp/vt/bin/python -c "import pytriton, os; print('pytriton', pytriton.__file__)"
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kiln
if [ -x /tmp/vt/bin/python ] && [ -d .whl-triton-deps ]; then
  /tmp/vt/bin/pip install -q --no-index --no-deps .whl-triton-deps/*.whl || echo "triton deps failed"
  # torch, torchvision and transformers come from the machine's own environment, after the venv's numpy 1.26
  TORCH_SITE=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
  SITE=$(/tmp/vt/bin/python -c "import site; print(site.getsitepackages()[0])")
  echo "$TORCH_SITE" > "$SITE/zz_machine.pth"
  echo "/tmp/pkg" > "$SITE/zz_kiln.pth"
fi
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/pkg:/tmp/site:$PWD/bench PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$LIBDIR:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
status=0
if [ "${TESTS:-0}" = 1 ]; then
  timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider -rs --durations=5 tests/server/test_gpu_serve.py tests/server/test_cuda_shm.py \
    tests/server/test_buckets.py tests/server/test_workers.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -30 || status=1
fi
for m in ${PROBE:-}; do  # bench/gpu_latency_probe.py: one request's time, layer by layer
  timeout ${PROBE_S:-300} python3 bench/gpu_latency_probe.py --model "$m" --n ${PROBE_N:-300} \
    --json "$OUT/latency_${m}_${TAG:-run}.json" 2>&1 | tail -12 | tee "$OUT/latency_${m}_${TAG:-run}.log" || status=1
done
if [ -n "${MODELS:-}" ]; then
  timeout ${BENCH_S:-480} python3 bench/gpu_serve_bench.py --models "$MODELS" --servers "${SERVERS:-kiln,triton,torch}" \
    --clients "${CLIENTS:-1,8,64,256}" --modes "${MODES:-http,shm}" --seconds "${SECONDS_PER:-5}" --gpus "${GPUS:-}" \
    --json "$OUT/bench_${TAG:-run}.json" 2>&1 | tee "$OUT/bench_${TAG:-run}.log" | grep -v '"lat"' | tail -60 || status=1
  for f in /tmp/gpu_serve_bench/server_*.log; do echo "== $f"; tail -15 "$f"; done > "$OUT/server_logs_${TAG:-run}.txt" 2>/dev/null
fi
exit $status
