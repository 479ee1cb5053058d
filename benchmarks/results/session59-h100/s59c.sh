# Session 59: the mixed programs on the GPU (tests with real graphs), then the hybrid steady-state trace again (compare s59a).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_hybrid_prefill_graphs.py tests/test_hybrid_engine.py tests/test_hybrid_mixed_verify.py 2>&1 | tail -4 | tee $OUT/gpu-tests.log
echo "== steady trace alpha 0.8 B16 qwen3-next-a3b-64e" | tee -a $OUT/trace.log
timeout 330 python3 benchmarks/step_trace.py replay 16 $OUT/trace-steady16-hybrid-a0.8.json --shape qwen3-next-a3b-64e --alpha 0.8 --max-tokens 64 --requests-per-slot 4 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
python3 .devsnap/trace_summary.py $OUT/trace-steady16-hybrid-a0.8.json | tee -a $OUT/trace.log
