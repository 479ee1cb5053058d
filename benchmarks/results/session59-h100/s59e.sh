# Session 59: the hybrid steady state at batch 64 with mixed programs (256 requests of 24-72 tokens through 64 slots, forced alpha 0.8).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
echo "== steady trace alpha 0.8 B64 qwen3-next-a3b-64e" | tee -a $OUT/trace.log
timeout 500 python3 benchmarks/step_trace.py replay 64 $OUT/trace-steady64-hybrid-a0.8.json --shape qwen3-next-a3b-64e --alpha 0.8 --max-tokens 48 --requests-per-slot 4 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
python3 .devsnap/trace_summary.py $OUT/trace-steady64-hybrid-a0.8.json | tee -a $OUT/trace.log
