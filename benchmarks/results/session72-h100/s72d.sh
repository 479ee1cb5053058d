# Session 72 (d): the qwen3-8b forced cells again, held verifies off first then on (the reverse order of s72c); then the hybrid shape's decode step against its batch roofline (issue 22).
. .devsnap/pre.sh > $OUT/card.txt
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1 --context 1024 --alpha 0,0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda"
grid() { # $1 label, $2 METRALE_NO_HELD_VERIFY
  echo "== $1" | tee -a $OUT/grid-ab.log
  METRALE_NO_HELD_VERIFY=$2 timeout 110 $G --out $OUT/g-$1 2>&1 | grep --line-buffered "^e2e\|CUDA graphs" | tee -a $OUT/grid-ab.log
  cp $OUT/g-$1/bench.json $OUT/grid-$1.json 2>/dev/null; rm -rf $OUT/g-$1
}
grid off 1
grid held 0
timeout 150 python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --batch-sizes 1,16,64 --q 1,4 --context 1024 --device cuda --out $OUT/hyb 2>&1 | grep -v Warn | grep -v _warn | grep -v '^{' | tail -12 > $OUT/hybrid-bench.log
cp $OUT/hyb/bench.json $OUT/hybrid-bench.json 2>/dev/null; rm -rf $OUT/hyb
