# Session 58: steady-state step traces (256 requests of 32-96 tokens through 64 slots), qwen3-8b forced alpha 0.5 and 0.8, D-Cut, async, no profiler.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for a in 0.5 0.8; do
echo "== steady trace alpha $a B64" | tee -a $OUT/trace.log
timeout 250 python3 benchmarks/step_trace.py replay 64 $OUT/trace-steady64-a$a.json --shape qwen3-8b --alpha $a --max-tokens 64 --requests-per-slot 4 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
python3 .devsnap/trace_summary.py $OUT/trace-steady64-a$a.json | tee -a $OUT/trace.log
done
