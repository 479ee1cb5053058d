# Session 57: D-Cut wide batches before (12bb592: dcut.py and planning.py) and after (52145e4, 1562381 and the ragged row pricing), same machine: the qwen3-8b forced grid at batch 64, alpha 0.5 and 0.8, closed and steady state (4 requests per slot), async.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,64 --q 1,2,4 --context 1024 --alpha 0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda --steady-requests-per-slot 4"
cp metrale/speculative/dcut.py /tmp/dcut_new.py; cp metrale/speculative/planning.py /tmp/planning_new.py
for v in before after; do
  if [ $v = before ]; then cp .devsnap/dcut_old.py metrale/speculative/dcut.py; cp .devsnap/planning_old.py metrale/speculative/planning.py; else cp /tmp/dcut_new.py metrale/speculative/dcut.py; cp /tmp/planning_new.py metrale/speculative/planning.py; fi
  echo "== $v" | tee -a $OUT/grid.log
  timeout 200 $G --out $OUT/grid-$v 2>&1 | grep -v Warn | grep -v '^{' | grep -v _warn | grep -A1 "^e2e" | tee -a $OUT/grid.log
done
