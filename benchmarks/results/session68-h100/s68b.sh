# Session 68 call 2: issue 13's dense and shipped-model checks after the one-binary change (mode on)
. .devsnap/pre.sh > $OUT/card.txt; cat $OUT/card.txt
M=metrale/assets/default-model
for s in "" "--sampling"; do
  echo "== qwen3-8b $s" >> $OUT/check-dense.log
  timeout 150 python3 scripts/deterministic_check.py --shape qwen3-8b --modes 1 $s --out $OUT/c1 2>&1 | grep -E '^\{|Error|error' | tail -5 | tee -a $OUT/check-dense.log
  rm -rf $OUT/c1
  echo "== default mtp $s" >> $OUT/check-default.log
  timeout 120 python3 scripts/deterministic_check.py --model $M --modes 1 --drafters mtp,ngram $s --out $OUT/c2 2>&1 | grep -E '^\{|Error|error' | tail -5 | tee -a $OUT/check-default.log
  rm -rf $OUT/c2
done
