# Session 60: the invariant (deterministic-mode) paged attention against the default kernel, swept over launch warps and stages (ptxas on sm_90 reports 320 B of spills a thread for the invariant fused kernel at 4 warps, none at 8), qwen3-8b attention, bf16.
. .devsnap/pre.sh
timeout 500 python3 scripts/attention_kernel_bench.py --batch 1,8,64 --context 1024,4096 --q 1,4 --tile-keys 64,128 --warps 4,8 --stages 2,3 --out $OUT/sweep.json 2>&1 | grep -v -i warn | tee $OUT/sweep.txt | tail -5
