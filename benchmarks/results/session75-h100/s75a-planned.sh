# Session 75 (a): GPU tests of the few-row kernels in the engine (tensor-core verify kernel included); issue 12's grid on the qwen3-8b shape (D-Cut, forced alpha 0/0.5/0.8, K 3, batch 1/8/64, 128 tokens) with the decode-step table; the batch-1 alpha-0.8 cell again with cuBLAS (METRALE_NO_GEMV=1).
. .devsnap/pre.sh > $OUT/card.txt 2>&1
for i in 1 2; do timeout 60 python3 .devsnap/route_ab.py packed >> $OUT/route.log 2>&1; PYTHONPATH=/tmp/site:.devsnap/old timeout 60 python3 .devsnap/route_ab.py before >> $OUT/route.log 2>&1; done
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_pdl.py tests/test_held_verify.py tests/test_moe_kernels.py 2>&1 | grep -v Warn | tail -4 > $OUT/gpu-tests.log
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,8,64 --q 1,4 --context 1024 --forced-acceptance --dcut --num-drafts 3 --kv-cache-memory-gb 60 --max-tokens 128 --device cuda"
timeout 300 $G --alpha 0,0.5,0.8 --e2e-batch-sizes 1,8,64 --out $OUT/g > $OUT/grid.log 2>&1
cp $OUT/g/bench.json $OUT/grid.json 2>/dev/null; rm -rf $OUT/g
METRALE_NO_GEMV=1 timeout 60 python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1,4 --context 1024 --forced-acceptance --dcut --num-drafts 3 --kv-cache-memory-gb 60 --max-tokens 128 --device cuda --alpha 0.8 --e2e-batch-sizes 1 --out $OUT/c > $OUT/b1-cublas.log 2>&1
cp $OUT/c/bench.json $OUT/b1-cublas.json 2>/dev/null; rm -rf $OUT/c
