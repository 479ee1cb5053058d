# Session 76 (b): issue 22's hybrid decode step (batch 1/16/64, q 1/4) and forced alpha 0.8 e2e at batch 1 and 16, both verify variants.
. .devsnap/pre.sh > $OUT/card.txt 2>&1
H="python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --context 1024 --device cuda --forced-acceptance --alpha 0.8 --num-drafts 3 --max-tokens 32"
timeout 200 $H --batch-sizes 1,16,64 --q 1,4 --e2e-batch-sizes 1,16 --out $OUT/h > $OUT/hybrid.log 2>&1
cp $OUT/h/bench.json $OUT/hybrid.json 2>/dev/null; rm -rf $OUT/h
timeout 150 $H --hybrid-verify-state per_row_slots --batch-sizes 1 --q 1,4 --e2e-batch-sizes 1,16 --out $OUT/p > $OUT/hybrid-prs.log 2>&1
cp $OUT/p/bench.json $OUT/hybrid-prs.json 2>/dev/null; rm -rf $OUT/p
