# Session 63: the deterministic mode's cost on the H100 (qwen3-8b shape, decode and 4-row verify steps at batch 1 and 64; issue 13).
. .devsnap/pre.sh
B="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,64 --q 1,4 --context 1024 --e2e-batch-sizes 1 --max-tokens 8 --kv-cache-memory-gb 40 --device cuda"
for d in "" "--deterministic"; do
  echo "== qwen3-8b $d" | tee -a $OUT/det.log
  timeout 200 $B $d --out $OUT/det$d 2>&1 | grep --line-buffered -v Warn | grep --line-buffered -v '^{' | head -24 | tee -a $OUT/det.log
done
cp "$OUT/det/bench.json" $OUT/det-default.json 2>/dev/null; cp "$OUT/det--deterministic/bench.json" $OUT/det-on.json 2>/dev/null
rm -rf $OUT/det $OUT/det--deterministic
