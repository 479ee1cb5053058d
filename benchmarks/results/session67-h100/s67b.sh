# Session 67 call 2: the hybrid deterministic check again, after the delta rule's tile was fixed for the mode
. .devsnap/pre.sh > $OUT/card.txt; cat $OUT/card.txt
for s in "" "--sampling"; do
  echo "== hybrid $s" >> $OUT/check-hybrid.log
  timeout 170 python3 scripts/deterministic_check.py --shape qwen3-next-a3b-64e --modes 1 --drafters replay $s --out $OUT/c3 2>&1 | grep -E '^\{|Error|error' | tail -5 | tee -a $OUT/check-hybrid.log
  rm -rf $OUT/c3
done
