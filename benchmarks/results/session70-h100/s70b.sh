# Session 70: the qwen3-8b forced grid (D-Cut, K=3, alpha 0 / 0.5 / 0.8, batch 1 / 8 / 64, closed and steady state), this code (issue 12 targets).
. .devsnap/pre.sh > $OUT/card.txt
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,8,64 --q 1,2,4 --context 1024 --alpha 0,0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,8,64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda --steady-requests-per-slot 4"
timeout 450 $G --out $OUT/grid 2>&1 | grep --line-buffered -v Warn | grep --line-buffered -v '^{' | grep --line-buffered -v _warn | tee -a $OUT/grid.log
cp $OUT/grid/bench.json $OUT/grid.json 2>/dev/null
