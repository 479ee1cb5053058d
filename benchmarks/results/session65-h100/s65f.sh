# Session 65: cProfile of MTP at batch 1 on the shipped model (the speculative run's host work, by function).
. .devsnap/pre.sh
timeout 150 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter mtp --batch 1 --max-tokens 128 2>&1 | grep -v Warn | grep -v _warn_once > $OUT/mtp-b1-cprofile.log
sed -n '/== spec/,$p' $OUT/mtp-b1-cprofile.log | head -120
