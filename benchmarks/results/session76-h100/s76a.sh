# Session 76 (a): issue 12's grid on the qwen3-8b shape (D-Cut, forced alpha 0/0.5/0.8, K 3, batch 1/8/64, 128 tokens), tensor-core verify kernel in; then GPU tests of the few-row kernels.
. .devsnap/pre.sh > $OUT/card.txt 2>&1
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,8,64 --q 1,4 --context 1024 --forced-acceptance --dcut --num-drafts 3 --kv-cache-memory-gb 60 --max-tokens 128 --device cuda"
timeout 330 $G --alpha 0,0.5,0.8 --e2e-batch-sizes 1,8,64 --out $OUT/g > $OUT/grid.log 2>&1
cp $OUT/g/bench.json $OUT/grid.json 2>/dev/null; rm -rf $OUT/g
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_pdl.py tests/test_held_verify.py 2>&1 | grep -v Warn | tail -4 > $OUT/gpu-tests.log
