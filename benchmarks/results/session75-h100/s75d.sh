# Session 75 (d), lean: GPU tests of the MoE routing (packed-key pick) and the few-row kernels; the split router per launch, packed pick (warps 8/4/2/1) against the one before; the hybrid decode step at batch 1 and 16 (q 1, 4).
. .devsnap/pre.sh > $OUT/card.txt 2>&1
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py tests/test_gemv.py 2>&1 | grep -v Warn | tail -4 > $OUT/gpu-tests.log
timeout 40 python3 .devsnap/route_ab.py packed 8,4,2,1 >> $OUT/route.log 2>&1
PYTHONPATH=/tmp/site:.devsnap/old timeout 20 python3 .devsnap/route_ab.py before 8 >> $OUT/route.log 2>&1
timeout 90 python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --context 1024 --device cuda --batch-sizes 1,16 --q 1,4 --e2e-batch-sizes 1 --forced-acceptance --alpha 0.8 --num-drafts 3 --max-tokens 16 --out $OUT/h > $OUT/hybrid.log 2>&1
cp $OUT/h/bench.json $OUT/hybrid.json 2>/dev/null; rm -rf $OUT/h
