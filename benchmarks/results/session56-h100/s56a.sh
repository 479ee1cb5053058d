# Session 56: GPU-marked tests of the async engine (hybrid now runs ahead), then the qwen3-8b forced grid (D-Cut, K=3) under the default (async).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_async_scheduling.py tests/test_hybrid_engine.py tests/test_prefix_cache_hybrid.py tests/test_ngram_ahead.py tests/test_device_tokens.py tests/test_gpu.py 2>&1 | tail -15 | tee $OUT/tests.log
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 64 --q 1 --context 1024 --alpha 0,0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,8,64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda"
echo "== grid async" | tee -a $OUT/grid.log
timeout 300 $G --out $OUT/grid-async 2>&1 | grep -v Warn | grep -v '^{' | grep -v _warn | tail -22 | tee -a $OUT/grid.log
