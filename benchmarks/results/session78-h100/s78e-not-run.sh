# Session 78 (e): the verify steps' critical windows on the H100 host (profile_e2e --phases, new window report): qwen3-8b forced D-Cut alpha 0.8 at batch 64 and 1 (bench's engine sizes); the staging path's pieces inside the engine at batch 1.
. .devsnap/pre.sh > $OUT/card.txt
P="python3 -m metrale.bench.profile_e2e --shape qwen3-8b --forced --dcut --max-tokens 128 --phases --max-model-len 1344 --max-num-seqs 64"
timeout 150 $P --batch 64 --alpha 0.8 2>&1 | grep -v Warn > $OUT/window-b64-a08.log
timeout 100 $P --batch 1 --alpha 0.8 2>&1 | grep -v Warn > $OUT/window-b1-a08.log
grep -A30 "verify windows" $OUT/window-*.log
timeout 100 python3 .devsnap/staging_inengine.py --batch 1 --alpha 0.8 2>&1 | grep -v Warn | grep -E "^(stage|load)" > $OUT/staging-inengine-b1.log; cat $OUT/staging-inengine-b1.log
