# Session 74 (d): the few-row GEMV in the engine: its GPU tests with the kernels', PDL's and the hybrid engine's; the tensor-core kernel at 4 / 8 rows against cuBLAS (measured only); the hybrid decode step and batch-1 forced e2e with the GEMV on / off; the dense qwen3-8b batch-1 forced e2e (alpha 0.8, K 3, D-Cut) on / off.
. .devsnap/pre.sh > $OUT/card.txt
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py 2>&1 | tail -1 > $OUT/gemv-tests.log
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py tests/test_hybrid_kernels_gpu.py tests/test_held_verify.py 2>&1 | grep -v Warn | tail -4 > $OUT/gpu-tests.log
H="python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --batch-sizes 1,16,64 --q 1,4 --context 1024 --e2e-batch-sizes 1 --forced-acceptance --alpha 0.8 --num-drafts 3 --device cuda"
D="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1,4 --context 1024 --kv-cache-memory-gb 40 --e2e-batch-sizes 1 --forced-acceptance --alpha 0.8 --num-drafts 3 --dcut --max-tokens 128 --device cuda"
run() { echo "== $1 $2" >> $OUT/bench.log
  METRALE_NO_GEMV=$3 timeout 85 $4 --out $OUT/h 2>&1 | grep -v Warn | grep -v _warn | grep -v '^{' | tail -9 >> $OUT/bench.log
  cp $OUT/h/bench.json $OUT/$1-$2.json 2>/dev/null; rm -rf $OUT/h; }
run dense gemv 0 "$D"
run dense cublas 1 "$D"
