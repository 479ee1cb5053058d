# Session 67 call 1, priority order: the deterministic tile fit on the GPU (Qwen3-Next's 256-wide heads), then issue 13's hybrid and dense checks, then the mode's cost and the hybrid bench (issue 22)
. .devsnap/pre.sh > $OUT/card.txt; cat $OUT/card.txt
R=$PWD; M=$R/metrale/assets/default-model
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_deterministic.py tests/test_deterministic_edges.py tests/test_deterministic_compiles.py -x 2>&1 | tail -15 | tee $OUT/gpu-det-tests.log
for s in "" "--sampling"; do
  echo "== hybrid $s" >> $OUT/check-hybrid.log
  timeout 120 python3 scripts/deterministic_check.py --shape qwen3-next-a3b-64e --modes 1 --drafters replay $s --out $OUT/c3 2>&1 | grep -E '^\{|Error|error' | tail -5 | tee -a $OUT/check-hybrid.log
  rm -rf $OUT/c3
done
B="python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --batch-sizes 1,16,64 --q 1,4 --context 512 --device cuda --e2e-batch-sizes 1 --max-tokens 4"
for d in "" "--deterministic"; do
  echo "== hybrid bench $d" >> $OUT/hybrid.log
  timeout 100 $B $d --out $OUT/hb 2>&1 | grep --line-buffered -v Warn | grep -v _warn_once | grep -v '^{' | head -9 | tee -a $OUT/hybrid.log
  cp $OUT/hb/bench.json "$OUT/hybrid$d.json" 2>/dev/null; rm -rf $OUT/hb
done
