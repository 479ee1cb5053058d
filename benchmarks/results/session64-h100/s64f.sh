# Session 64: the split router launch's float32 failure on CUDA: which field, how often.
. .devsnap/pre.sh
timeout 200 python3 .devsnap/split_stress.py 2>&1 | grep -v Warn | tee $OUT/stress.log
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_moe_kernels.py -k "split_across and dtype0 and 2048" 2>&1 | grep -v Warn | grep -E "Error|assert|^E " | head -30 | tee $OUT/fail.log
