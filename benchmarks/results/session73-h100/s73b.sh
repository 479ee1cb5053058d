# Session 73 (b): the qwen3-8b batch-64 cells step by step (D-Cut's widths, depths and step times at alpha 0.5 and 0.8, forced), and batch 1 / 8 at alpha 0.8 over 128 tokens (the ideal's tail effect of 32-token runs).
. .devsnap/pre.sh > $OUT/card.txt
for a in 0.5 0.8; do
  timeout 120 python3 benchmarks/step_trace.py replay 64 $OUT/trace-b64-a$a.json --shape qwen3-8b --alpha $a --max-tokens 32 > $OUT/trace-b64-a$a.log 2>&1
done
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1 --context 1024 --forced-acceptance --dcut --num-drafts 3 --kv-cache-memory-gb 40 --device cuda"
timeout 150 $G --alpha 0.8 --e2e-batch-sizes 1,8 --max-tokens 128 --out $OUT/g128 2>&1 | grep --line-buffered "e2e\|CUDA graphs\|anchor" > $OUT/grid128.log
cp $OUT/g128/bench.json $OUT/grid128.json; rm -rf $OUT/g128
timeout 120 $G --alpha 0,0.5 --e2e-batch-sizes 8 --max-tokens 32 --out $OUT/g8 2>&1 | grep --line-buffered "e2e\|CUDA graphs\|anchor" > $OUT/grid8.log
cp $OUT/g8/bench.json $OUT/grid8.json; rm -rf $OUT/g8
