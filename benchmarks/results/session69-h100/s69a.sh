# Session 69: where issue 12 stands on the current code (the shipped model's drafters, n-gram K=3 and MTP K=3, closed batches 1 / 8 / 64 and steady state) and the hybrid's batch-1 kernels (issue 22).
. .devsnap/pre.sh > $OUT/card.txt
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
for a in "mtp 3" "ngram 3"; do set -- $a
  echo "== $1 K=$2 (default: async)" | tee -a $OUT/drafters.log
  timeout 170 $B --e2e-drafter $1 --num-drafts $2 --out $OUT/bench-$1 2>&1 | grep --line-buffered -v Warn | grep -v _warn_once | head -16 | tee -a $OUT/drafters.log
  cp $OUT/bench-$1/drafter_e2e.json $OUT/drafter-$1.json 2>/dev/null
  rm -rf $OUT/bench-$1
done
timeout 200 python3 -m metrale.bench.profile_step --shape qwen3-next-a3b-64e --batch-sizes 1 --out $OUT/hyb 2>&1 | grep -v Warn | tail -80 > $OUT/hybrid-b1.log
rm -rf $OUT/hyb
P="python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --max-tokens 128"
timeout 100 $P --drafter mtp --batch 1 --kernels 2>&1 | grep -v Warn | tail -40 > $OUT/mtp-b1-kernels.log
timeout 100 $P --drafter mtp --batch 1 --phases 2>&1 | grep -v Warn | tail -50 > $OUT/mtp-b1-phases.log
timeout 100 $P --drafter mtp --batch 1 2>&1 | grep -v Warn > $OUT/mtp-b1-cprofile.log
timeout 100 $P --drafter ngram --batch 8 2>&1 | grep -v Warn > $OUT/ngram-b8-cprofile.log
