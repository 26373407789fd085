#!/usr/bin/env bash
# Issue 19 on the GPU machine (16 cores, one GPU): bench/ray_scale_bench.py and the Ray Serve tests (their GPU
# one included). Ray's wheel (79 MB) is over one call's 64 MiB, so it travels in two calls on a warm machine:
#   STAGE=part1  carry .ray1: the wheel's first 58 MiB (split -b 58M), kept in /tmp/raystash
#   STAGE=run    carry .ray2: the rest of the wheel (ray.part.ab) and Ray Serve's dependency wheels for
#                cp312 but numpy, grpcio and protobuf (the image's), installed into /tmp/site; then the tests
#                (TESTS=1) and the bench (BENCH_ARGS)
# Everything it writes goes to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${STAGE:-run}" = part1 ]; then
  mkdir -p /tmp/raystash && cp .ray1/ray.part.* /tmp/raystash/ && ls -la /tmp/raystash && nproc && python3 --version
  exit $?
fi
cp .ray2/ray.part.* /tmp/raystash/ && cat /tmp/raystash/ray.part.* > /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl .ray2/*.whl 2>&1 | tail -3
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kiln
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/device.txt"
python3 -c "import ray, kiln; from ray import serve; print('ray', ray.__version__)" || exit 1
status=0
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -rs tests/server/test_ray_serve.py \
    tests/server/test_gpu_serve.py -k "ray or visible" 2>&1 | tail -15 | tee "$OUT/ray_tests.log" || status=1
fi
timeout ${BENCH_S:-400} python3 bench/ray_scale_bench.py --work /tmp/rs --json "$OUT/ray_scale.json" ${BENCH_ARGS:---gpu} \
  2>&1 | grep -v '^\(.*pid=\|WARNING\|INFO\)' | tee "$OUT/ray_scale.log" | tail -30 || status=1
exit $status
