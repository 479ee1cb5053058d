# Session 65: (1) penalised sampling on the shipped model, device counts vs the history rebuild (parent commit), async == sync on CUDA; (2) issue 13: the deterministic mode's cost and e2e identical outputs, qwen3-8b shape.
. .devsnap/pre.sh
PYTHONPATH=/tmp/site:$PWD/.devsnap/base timeout 150 python3 .devsnap/pen_gpu.py base $OUT 2>&1 | grep -v Warn | tail -5 | tee $OUT/penalties.log
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 .devsnap/pen_gpu.py new $OUT 2>&1 | grep -v Warn | tail -6 | tee -a $OUT/penalties.log
B="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,64 --q 1,4 --context 1024 --e2e-batch-sizes 8,64 --max-tokens 48 --kv-cache-memory-gb 40 --device cuda --dcut"
for d in "" "--deterministic"; do
  echo "== qwen3-8b $d" | tee -a $OUT/det.log
  timeout 170 $B $d --out $OUT/det$d 2>&1 | grep --line-buffered -v Warn | grep --line-buffered -v '^{' | grep -v _warn_once | head -24 | tee -a $OUT/det.log
done
cp "$OUT/det/bench.json" $OUT/det-default.json 2>/dev/null; cp "$OUT/det--deterministic/bench.json" $OUT/det-on.json 2>/dev/null
rm -rf $OUT/det $OUT/det--deterministic
