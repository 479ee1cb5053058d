# Session 68 call 6 (the budget left: the e2e alone): qwen3-8b replay e2e at batch 8 / 64 (D-Cut, K=3, alpha 0.8) with the mode on
. .devsnap/pre.sh > $OUT/card.txt; cat $OUT/card.txt
echo "== replay e2e --deterministic" >> $OUT/e2e.log
timeout 150 python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 8,64 --q 1,4 --context 256 --kv-cache-memory-gb 40 --device cuda --deterministic --alpha 0.8 --dcut --e2e-batch-sizes 8,64 --max-tokens 48 --out $OUT/e 2>&1 | grep -v Warn | grep -v _warn_once | grep -v '^{' | tail -7 | tee -a $OUT/e2e.log
cp $OUT/e/bench.json $OUT/e2e-deterministic.json 2>/dev/null; rm -rf $OUT/e
