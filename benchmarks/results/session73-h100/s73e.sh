# Session 73 (e): issue 22's end-to-end speculative cells (hybrid shape, forced alpha 0.8, K=3, batch 1 / 16) under both verify variants, with PDL; then the qwen3-8b batch-64 forced cells over 128 tokens (a 32-token closed batch is mostly its tail).
. .devsnap/pre.sh > $OUT/card.txt
H="python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --batch-sizes 1 --q 1 --context 1024 --forced-acceptance --alpha 0.8 --num-drafts 3 --e2e-batch-sizes 1,16 --max-tokens 32 --device cuda"
for v in write_on_accept per_row_slots; do echo "== $v" >> $OUT/hybrid-e2e.log
  timeout 125 $H --hybrid-verify-state $v --out $OUT/h 2>&1 | grep --line-buffered "e2e\|CUDA graphs\|state pool" >> $OUT/hybrid-e2e.log
  cp $OUT/h/bench.json $OUT/hybrid-e2e-$v.json 2>/dev/null; rm -rf $OUT/h; done
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1 --context 1024 --forced-acceptance --dcut --num-drafts 3 --kv-cache-memory-gb 40 --device cuda"
timeout 110 $G --alpha 0.5,0.8 --e2e-batch-sizes 64 --max-tokens 128 --out $OUT/g 2>&1 | grep --line-buffered "e2e\|CUDA graphs" > $OUT/grid-b64-128.log
cp $OUT/g/bench.json $OUT/grid-b64-128.json 2>/dev/null; rm -rf $OUT/g
