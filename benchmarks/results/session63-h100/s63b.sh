# Session 63: the deterministic mode's cost on the H100 (qwen3-8b shape, decode and 4-row verify steps at batch 1 and 64), and the hybrid's batch-1 kernels (issue 22).
. .devsnap/pre.sh
B="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,64 --q 1,4 --context 1024 --e2e-batch-sizes 1 --max-tokens 8 --device cuda"
for d in "" "--deterministic"; do
  echo "== qwen3-8b $d" | tee -a $OUT/det.log
  timeout 170 $B $d --out $OUT/det$d 2>&1 | grep --line-buffered -v Warn | head -14 | tee -a $OUT/det.log
done
cp "$OUT/det/bench.json" $OUT/det-default.json 2>/dev/null; cp "$OUT/det--deterministic/bench.json" $OUT/det-on.json 2>/dev/null
ls $OUT/det $OUT/det--deterministic >> $OUT/det.log 2>&1
timeout 200 python3 -m metrale.bench.profile_step --shape qwen3-next-a3b-64e --batch-sizes 1 --out $OUT/hyb 2>&1 | grep -v Warn | tail -70 > $OUT/hybrid-b1.log
ls $OUT/hyb >> $OUT/hybrid-b1.log 2>&1
timeout 100 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter mtp --batch 1 --max-tokens 128 2>&1 | grep -v Warn | tail -100 > $OUT/mtp-b1-cprofile.log
