# Session 66, one call in priority order (results flushed as they come): record_now's GPU test; issue 13 on this card: the deterministic mode's cost (qwen3-8b, decode and 4-row verify, batch 1 / 64), seeded sampling spec == plain alone and in a batch of 64 (qwen3-8b replay, shipped model MTP + n-gram), the hybrid shape greedy and seeded; then MTP batch 1 A/B of record_now.
. .devsnap/pre.sh
R=$PWD; M=$R/metrale/assets/default-model
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_device_tokens.py 2>&1 | tail -2 | tee $OUT/gpu-tests.log
B="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,64 --q 1,4 --context 1024 --kv-cache-memory-gb 40 --device cuda --e2e-batch-sizes 1 --max-tokens 4"
for d in "" "--deterministic"; do
  echo "== qwen3-8b $d" | tee -a $OUT/det.log
  timeout 100 $B $d --out $OUT/det 2>&1 | grep --line-buffered -v Warn | grep -v _warn_once | grep -v '^{' | head -7 | tee -a $OUT/det.log
  cp $OUT/det/bench.json "$OUT/det$d.json" 2>/dev/null; rm -rf $OUT/det
done
timeout 150 python3 scripts/deterministic_check.py --shape qwen3-8b --modes 1 --drafters replay --sampling --out $OUT/c1 2>&1 | grep '^{' | tee $OUT/check-qwen3-8b-sampling.log
timeout 100 python3 scripts/deterministic_check.py --model $M --drafters mtp,ngram --modes 1 --sampling --out $OUT/c2 2>&1 | grep '^{' | tee $OUT/check-default-sampling.log
for s in "" "--sampling"; do
  timeout 100 python3 scripts/deterministic_check.py --shape qwen3-next-a3b-64e --modes 1 --drafters replay $s --out $OUT/c3 2>&1 | grep '^{' | tee -a $OUT/check-hybrid.log
done
rm -rf $OUT/c1/shape $OUT/c3/shape
B="python3 -m metrale.cli bench --model $M --max-tokens 256 --device cuda --e2e-batch-sizes 1 --e2e-drafter mtp --num-drafts 3"
for v in base new base new; do
  if [ $v = base ]; then D=$R/.devsnap/base3; else D=$R; fi
  echo "== $v" | tee -a $OUT/ab.log
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 60 $B --out $OUT/ab 2>&1 | grep -E "^ +1 " | tee -a $OUT/ab.log); rm -rf $OUT/ab
done
