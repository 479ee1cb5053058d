# Session 63: MTP's drafts chained ahead left on the device for a few sequences (AHEAD_ON_DEVICE_SEQS), A/B on the shipped model at batch 1 and 8, alternating.
. .devsnap/pre.sh
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8 --e2e-drafter mtp --num-drafts 3"
for r in 1 2; do for v in 0 4 64; do
  sed -i "s/^AHEAD_ON_DEVICE_SEQS = .*/AHEAD_ON_DEVICE_SEQS = $v/" metrale/speculative/mtp.py
  echo "== run $r AHEAD_ON_DEVICE_SEQS=$v" | tee -a $OUT/ab.log
  timeout 120 $B --out $OUT/b-$v-$r 2>&1 | grep --line-buffered -v Warn | head -6 | tee -a $OUT/ab.log
done; done
sed -i "s/^AHEAD_ON_DEVICE_SEQS = .*/AHEAD_ON_DEVICE_SEQS = 4/" metrale/speculative/mtp.py
timeout 100 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter mtp --batch 1 --max-tokens 128 --phases 2>&1 | grep -v Warn | tail -40 > $OUT/mtp-b1-phases.log
timeout 150 python3 -m pytest -q -m gpu -x tests/test_spec_mtp.py tests/test_mtp_graphs.py tests/test_mtp_verified_catch_up.py 2>&1 | tail -5 | tee $OUT/gpu-mtp.log
