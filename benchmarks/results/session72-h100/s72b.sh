# Session 72 (b): the shipped model's n-gram drafter (K=3, closed batches 8 / 64) with held verifies on / off alternated; then the hybrid shape's decode-step kernels at batch 1 / 16 / 64 (issue 22).
. .devsnap/pre.sh > $OUT/card.txt
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 8,64 --e2e-drafter ngram --num-drafts 3"
run() { # $1 label, $2 METRALE_NO_HELD_VERIFY
  echo "== $1" | tee -a $OUT/ngram-ab.log
  METRALE_NO_HELD_VERIFY=$2 timeout 70 $B --out $OUT/b-$1 2>&1 | grep --line-buffered "e2e\|steady" | tee -a $OUT/ngram-ab.log
  cp $OUT/b-$1/drafter_e2e.json $OUT/ngram-$1.json 2>/dev/null; rm -rf $OUT/b-$1
}
run held1 0
run off1 1
run held2 0
run off2 1
timeout 150 python3 -m metrale.bench.profile_step --shape qwen3-next-a3b-64e --batch-sizes 1,16,64 --out $OUT/hyb 2>&1 | grep -v Warn | grep -v _warn | tail -5 > $OUT/hybrid-step.log
