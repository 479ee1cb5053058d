# Session 64: the MoE routing launch's parts at qwen3-next-a3b-64e's shape (router GEMM, routing from logits, routing from hidden).
. .devsnap/pre.sh
timeout 300 python3 benchmarks/moe_kernels.py --batch-sizes 1,16,64 2>&1 | grep -v Warn | tee $OUT/moe.json
