# Session 68 call 1: does the one-binary fix make the hybrid deterministic mode bitwise under speculation?
. .devsnap/pre.sh > $OUT/card.txt; cat $OUT/card.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_deterministic.py tests/test_deterministic_edges.py tests/test_deterministic_compiles.py tests/test_kernels.py -x -k "determin or invariant or one_binary or delta" 2>&1 | tail -8 | tee $OUT/gpu-det-tests.log
for s in "" "--sampling"; do
  echo "== hybrid $s" >> $OUT/check-hybrid.log
  timeout 170 python3 scripts/deterministic_check.py --shape qwen3-next-a3b-64e --modes 1 --drafters replay $s --out $OUT/c3 2>&1 | grep -E '^\{|Error|error' | tail -5 | tee -a $OUT/check-hybrid.log
  rm -rf $OUT/c3
done
timeout 90 python3 .devsnap/det_units2.py 2>&1 | tail -40 > $OUT/det-units2.log
