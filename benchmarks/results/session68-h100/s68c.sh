# Session 68 call 3: the deterministic mode's decode-step cost on qwen3-8b (A/B/A/B), then the replay e2e at batch 8 / 64 with the mode on
. .devsnap/pre.sh > $OUT/card.txt; cat $OUT/card.txt
B="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,64 --q 1,4 --context 1024 --kv-cache-memory-gb 40 --device cuda --e2e-batch-sizes 1 --max-tokens 4"
i=0
for d in "" "--deterministic" "" "--deterministic"; do
  i=$((i+1)); echo "== cost $i $d" >> $OUT/cost.log
  timeout 80 $B $d --out $OUT/b 2>&1 | grep -v Warn | grep -v _warn_once | grep -v '^{' | head -6 | tee -a $OUT/cost.log
  cp $OUT/b/bench.json "$OUT/cost$i.json" 2>/dev/null; rm -rf $OUT/b
done
echo "== replay e2e deterministic" >> $OUT/e2e.log
timeout 200 python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1 --context 256 --kv-cache-memory-gb 40 --device cuda --deterministic --alpha 0.8 --dcut --e2e-batch-sizes 8,64 --max-tokens 64 --out $OUT/e 2>&1 | grep -v Warn | grep -v _warn_once | grep -v '^{' | tail -8 | tee -a $OUT/e2e.log
cp $OUT/e/bench.json $OUT/e2e-det.json 2>/dev/null
