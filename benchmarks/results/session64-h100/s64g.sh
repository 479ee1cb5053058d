# Session 64: the hybrid half of the GPU-marked suite with the split router launch, and the MoE kernel tests natively.
. .devsnap/pre.sh
B="tests/test_hybrid_engine.py tests/test_hybrid_kernels_gpu.py tests/test_hybrid_mixed_verify.py tests/test_hybrid_prefill_graphs.py tests/test_gdn_fused.py tests/test_moe_grouped.py tests/test_next_attention.py tests/test_prefix_cache_hybrid.py tests/test_ssm_state_dtype.py tests/test_deterministic.py"
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider $B 2>&1 | tail -15 | tee $OUT/gpu-b.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py 2>&1 | tail -3 | tee $OUT/moe.log
