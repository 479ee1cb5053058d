# Session 70: A/B of the qwen3-8b forced cells that fell (alpha 0 and 0.5, D-Cut, K=3, batch 1 and 64) between this code and session 65's (.ab65), interleaved.
. .devsnap/pre.sh > $OUT/card.txt
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1 --context 1024 --alpha 0,0.5 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda --steady-requests-per-slot 4"
run() { echo "== $1" | tee -a $OUT/ab2.log
  (cd $2 && PYTHONPATH=/tmp/site:$PWD timeout 140 $G --out $OUT/g 2>&1 | grep --line-buffered "e2e\|steady" | tee -a $OUT/ab2.log); rm -rf $OUT/g; }
run new $PWD; run old $PWD/.ab65; run new $PWD; run old $PWD/.ab65
