# Session 63: the dense half of the GPU-marked suite (the code this session changed: MTP, staging, the detokenizer).
. .devsnap/pre.sh
A="tests/test_gpu.py tests/test_kernels.py tests/test_deterministic.py tests/test_deterministic_compiles.py tests/test_deterministic_edges.py tests/test_sampler.py tests/test_device_tokens.py tests/test_async_scheduling.py tests/test_spec_dflash.py tests/test_ngram_ahead.py tests/test_ngram_catch_up.py tests/test_ngram_device.py tests/test_prefix_cache.py tests/test_program_shapes.py tests/test_bench.py tests/test_cli_config.py"
B="tests/test_hybrid_engine.py tests/test_hybrid_kernels_gpu.py tests/test_hybrid_mixed_verify.py tests/test_hybrid_prefill_graphs.py tests/test_gdn_fused.py tests/test_moe_grouped.py tests/test_moe_kernels.py tests/test_next_attention.py tests/test_prefix_cache_hybrid.py tests/test_ssm_state_dtype.py tests/test_train_dflash.py"
timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider $A 2>&1 | tail -25 | tee $OUT/gpu-a.log

