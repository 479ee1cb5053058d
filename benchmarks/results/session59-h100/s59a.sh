# Session 59: where the closed batch-64 alpha-0 cell loses its 3% (qwen3-8b), and what a hybrid target's mixed (verify + prompt) steps cost in steady state.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
echo "== closed trace alpha 0 B64 qwen3-8b" | tee -a $OUT/trace.log
timeout 200 python3 benchmarks/step_trace.py replay 64 $OUT/trace-closed64-a0.json --shape qwen3-8b --alpha 0 --max-tokens 64 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
python3 .devsnap/trace_summary.py $OUT/trace-closed64-a0.json | tee -a $OUT/trace.log
echo "== steady trace alpha 0.8 B16 qwen3-next-a3b-64e" | tee -a $OUT/trace.log
timeout 330 python3 benchmarks/step_trace.py replay 16 $OUT/trace-steady16-hybrid-a0.8.json --shape qwen3-next-a3b-64e --alpha 0.8 --max-tokens 64 --requests-per-slot 4 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
python3 .devsnap/trace_summary.py $OUT/trace-steady16-hybrid-a0.8.json | tee -a $OUT/trace.log
