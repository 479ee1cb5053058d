# Session 62: where a verify step's host time goes now (qwen3-8b shape, batch 64, forced alpha 0.8, D-Cut, async): phases, then cProfile.
. .devsnap/pre.sh
timeout 270 python3 -m metrale.bench.profile_e2e --shape qwen3-8b --forced --alpha 0.8 --dcut --batch 64 --max-tokens 64 --phases 2>&1 | grep -v Warn | tail -60 | tee $OUT/phases.log
timeout 280 python3 -m metrale.bench.profile_e2e --shape qwen3-8b --forced --alpha 0.8 --dcut --batch 64 --max-tokens 64 2>&1 | grep -v Warn | tail -120 > $OUT/cprofile.log
