# Session 59: GPU tests of the one-forward hybrid mixed step (eager CUDA, fused Triton path) and the hybrid/graph suites around it.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_hybrid_mixed_verify.py tests/test_hybrid_engine.py tests/test_hybrid_prefill_graphs.py tests/test_hybrid_graphs.py tests/test_prefix_cache_hybrid.py tests/test_spec_dflash.py 2>&1 | tail -15 | tee $OUT/gpu-tests.log
