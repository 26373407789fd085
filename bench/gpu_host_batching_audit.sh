#!/usr/bin/env bash
# The batching audit (bench/batching_audit.py, issue 16) over the test zoo and the whole public model
# suite, sharded over the GPU machine's 16 CPU cores (the 2-core box here needs hours for it). CPU only
# (CUDA_VISIBLE_DEVICES empty): the audit checks kiln's CPU runtime. Wheels the machine lacks come in
# .whl/ (pytest, flatbuffers, ...) and .whl-hf/ (transformers, timm and their dependencies, for Python
# 3.12); they go at the END of sys.path, so the machine's own torch and its dependencies win.
# Output: $OUT/audit.jsonl (one record a model), $OUT/machine.txt, $OUT/shards.log; the report is
# written here from audit.jsonl by `python bench/batching_audit.py --from-jsonl FILE`.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHARDS=${SHARDS:-15}
BUDGET_S=${BUDGET_S:-520}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-hf/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
mkdir -p /tmp/pkg /tmp/front && ln -sfn "$PWD" /tmp/pkg/kiln
echo "import sys; sys.path.append('/tmp/site')" > /tmp/front/sitecustomize.py
export PYTHONPATH=/tmp/front:/tmp/pkg:$PWD/bench:$PWD/tests PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
{ lscpu | grep 'Model name'; echo "nproc $(nproc)"; free -g | head -2; python3 -c "import sys, torch, torchvision, timm, transformers, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"; } 2>&1 | tee "$OUT/machine.txt"
python3 - "$SHARDS" > /tmp/shards.txt <<'PY'
import sys, importlib.util
import zoo, suite_models
names = [f"zoo/{e.name}" for e in zoo.ZOO if e.needs is None or importlib.util.find_spec(e.needs) is not None]
names += [c.name for c in suite_models.all_cases()]
n = int(sys.argv[1])
for i in range(n):
    print(",".join(names[i::n]))
PY
echo "$(tr ',' '\n' < /tmp/shards.txt | wc -l) models in $SHARDS shards"
i=0
while read -r models; do
  timeout "$BUDGET_S" python3 bench/batching_audit.py --no-zoo --models "$models" --timeout-per-model 400 \
    --jsonl "/tmp/shard_$i.jsonl" --out "/tmp/shard_$i.md" --logs "/tmp/blogs_$i" > "/tmp/shard_$i.log" 2>&1 &
  i=$((i + 1))
done < /tmp/shards.txt
wait
cat /tmp/shard_*.log | grep -v "^\s*$" | tail -n 400 > "$OUT/shards.log"
cat /tmp/shard_*.jsonl > "$OUT/audit.jsonl" 2>/dev/null  # one file: the device tool brings back few files
echo "records: $(wc -l < "$OUT/audit.jsonl")"
