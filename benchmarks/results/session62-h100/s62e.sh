# Session 62: where an MTP verify step's host time goes on the shipped model at batch 1 (phases, then cProfile), and n-gram at batch 8 (phases).
. .devsnap/pre.sh
timeout 100 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter mtp --batch 1 --max-tokens 128 --phases 2>&1 | grep -v Warn | tail -40 | tee $OUT/mtp-b1-phases.log
timeout 100 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter mtp --batch 1 --max-tokens 128 2>&1 | grep -v Warn | tail -100 > $OUT/mtp-b1-cprofile.log
timeout 100 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter ngram --batch 8 --max-tokens 64 --phases 2>&1 | grep -v Warn | tail -40 | tee $OUT/ngram-b8-phases.log
