# Session 58: prefill tiles numbered across the step (paged attention) + quarter-octave dense prefill buckets: the kernel tests on CUDA, single-program replay times (mixed_probe.py), steady traces at batch 64.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "paged_attention or prefill_tiles or num_splits" 2>&1 | tail -2 | tee $OUT/tests.log
timeout 150 python3 .devsnap/mixed_probe.py 2>&1 | grep --line-buffered -v Warn | tail -12 | tee $OUT/probe.log
for a in 0.5 0.8; do
echo "== steady trace alpha $a B64" | tee -a $OUT/trace.log
timeout 150 python3 benchmarks/step_trace.py replay 64 $OUT/trace-steady64-a$a.json --shape qwen3-8b --alpha $a --max-tokens 64 --requests-per-slot 4 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
python3 .devsnap/trace_summary.py $OUT/trace-steady64-a$a.json | tee -a $OUT/trace.log
done
