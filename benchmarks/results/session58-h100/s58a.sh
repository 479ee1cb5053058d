# Session 58: where a synchronous verify step's time goes on the qwen3-8b shape at batch 64, forced alpha 0.5, D-Cut, async: closed-batch step trace, then a steady-state trace under cProfile (host hot spots).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
echo "== closed trace alpha 0.5 B64" | tee -a $OUT/trace.log
timeout 220 python3 benchmarks/step_trace.py replay 64 $OUT/trace-closed-a0.5.json --shape qwen3-8b --alpha 0.5 --max-tokens 64 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
python3 .devsnap/trace_summary.py $OUT/trace-closed-a0.5.json | tee -a $OUT/trace.log
echo "== steady trace alpha 0.5 B64 under cProfile" | tee -a $OUT/trace.log
timeout 260 python3 -m cProfile -o $OUT/prof-steady.out benchmarks/step_trace.py replay 64 $OUT/trace-steady-a0.5.json --shape qwen3-8b --alpha 0.5 --max-tokens 32 --requests-per-slot 4 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
python3 .devsnap/trace_summary.py $OUT/trace-steady-a0.5.json | tee -a $OUT/trace.log
python3 -c "
import pstats; p = pstats.Stats('$OUT/prof-steady.out'); p.sort_stats('tottime').print_stats(45)" 2>&1 | tail -60 | tee $OUT/prof-tottime.txt
python3 -c "
import pstats; p = pstats.Stats('$OUT/prof-steady.out'); p.sort_stats('cumulative').print_stats('metrale', 70)" 2>&1 | tail -85 | tee $OUT/prof-cum.txt
