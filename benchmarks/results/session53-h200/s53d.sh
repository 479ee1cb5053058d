# Session 53: the delta-rule state in the model's dtype (mamba_ssm_cache_dtype auto = bf16) on the H200: GPU tests, then the hybrid bench with a float32 state against bf16, alternated.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q tests/test_ssm_state_dtype.py -k "not engine" 2>&1 | tail -3 | tee $OUT/gpu-tests.log
timeout 150 python3 -m pytest -q tests/test_hybrid_kernels_gpu.py 2>&1 | tail -3 | tee -a $OUT/gpu-tests.log
timeout 100 python3 -m pytest -q tests/test_kernels.py -k "delta or conv" 2>&1 | tail -3 | tee -a $OUT/gpu-tests.log
timeout 200 python3 -m pytest -q -m gpu tests/test_deterministic.py -k hybrid tests/test_hybrid_engine.py 2>&1 | tail -3 | tee -a $OUT/gpu-tests.log
H="python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --batch-sizes 1,16,64 --q 1 --context 1024 --alpha 0.8 --num-drafts 3 --forced-acceptance --e2e-batch-sizes 1,16 --max-tokens 32 --kv-cache-memory-gb 16 --hybrid-verify-state write_on_accept --device cuda"
for s in float32 auto; do
  echo "== ssm $s" | tee -a $OUT/hybrid.log
  timeout 170 $H --mamba-ssm-cache-dtype $s --out $OUT/hybrid-$s 2>&1 | grep -v Warn | grep -v '^{' | tail -25 | tee -a $OUT/hybrid.log
done
