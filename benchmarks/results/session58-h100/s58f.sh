# Session 58: the final code (tiles numbered across the step, quarter-octave dense prefill buckets, every program's hidden states in the workspace): the GPU-marked graph and MTP tests, then the qwen3-8b forced grid as s57c (capture count, time and memory in its table).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu.py tests/test_mtp_graphs.py tests/test_mtp_verified_catch_up.py 2>&1 | tail -3 | tee $OUT/tests.log
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,8,64 --q 1,2,4 --context 1024 --alpha 0,0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,8,64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda --steady-requests-per-slot 4"
timeout 390 $G --out $OUT/grid 2>&1 | grep --line-buffered -v Warn | grep --line-buffered -v '^{' | grep --line-buffered -v _warn | tee -a $OUT/grid.log
