# Session 56: hybrid target (qwen3-next-a3b-64e shape) plain decoding, async against sync, one process, alternated: hybrid targets run ahead since 9951ed7 (never measured on a GPU).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 540 python3 scripts/async_scheduling_ab.py --shape qwen3-next-a3b-64e --batch-sizes 1,16,64 --max-tokens 32 --repeats 3 --out $OUT/ab-hybrid.json 2>&1 | grep -v Warn | tail -5 | tee -a $OUT/ab.log
