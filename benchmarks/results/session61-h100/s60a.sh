# Session 60: the GPU tests of session 59's unmeasured commits (snapshot queue, mixed-step review), then the hybrid steady state at batch 64 (qwen3-next-a3b-64e, 256 requests through 64 slots, forced alpha 0.8): e063a0d (two programs) against HEAD, one machine.
. .devsnap/pre.sh
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefix_cache_hybrid.py tests/test_hybrid_prefill_graphs.py tests/test_hybrid_mixed_verify.py tests/test_state_snapshots.py 2>&1 | tail -15 | tee $OUT/tests.log
for code in old new; do
  if [ $code = old ]; then root=$PWD/.devsnap/old59; else root=$PWD; fi
  echo "== $code" | tee -a $OUT/trace.log
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 150 python3 benchmarks/step_trace.py replay 64 $OUT/trace-$code.json --shape qwen3-next-a3b-64e --alpha 0.8 --max-tokens 48 --requests-per-slot 4 2>&1 | grep -v Warn | tail -4 | tee -a $OUT/trace.log)
done
