# Session 57: the qwen3-8b forced grid (D-Cut, K=3, alpha 0 / 0.5 / 0.8, batch 1 / 8 / 64), closed batches and steady state (4 requests per slot, batch 8 and 64), async (default), with this session's D-Cut changes.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,8,64 --q 1,2,4 --context 1024 --alpha 0,0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,8,64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda --steady-requests-per-slot 4"
timeout 380 $G --out $OUT/grid 2>&1 | grep --line-buffered -v Warn | grep --line-buffered -v '^{' | grep --line-buffered -v _warn | tee -a $OUT/grid.log
