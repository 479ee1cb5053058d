# Session 76 (c): where the steps wait for the device (profile_e2e --syncs): qwen3-8b forced alpha 0.8 D-Cut at batch 64 and 1, and the shipped model with n-gram at batch 8; then GPU tests.
. .devsnap/pre.sh > $OUT/card.txt 2>&1
P="python3 -m metrale.bench.profile_e2e --syncs"
timeout 120 $P --shape qwen3-8b --batch 64 --forced --dcut --alpha 0.8 --max-tokens 48 > $OUT/syncs-b64.log 2>&1
timeout 90 $P --shape qwen3-8b --batch 1 --forced --dcut --alpha 0.8 --max-tokens 48 > $OUT/syncs-b1.log 2>&1
timeout 60 $P --model metrale/assets/default-model --drafter ngram --batch 8 --max-tokens 64 > $OUT/syncs-ngram-b8.log 2>&1
timeout 60 $P --model metrale/assets/default-model --drafter mtp --batch 1 --max-tokens 64 > $OUT/syncs-mtp-b1.log 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_pdl.py tests/test_held_verify.py 2>&1 | grep -v Warn | tail -4 > $OUT/gpu-tests.log
