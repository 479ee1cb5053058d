# Session 64: the routing launch planned from registers (PHASE 3) against PHASE 2, H100.
. .devsnap/pre.sh
timeout 200 python3 .devsnap/route_ab.py 2>&1 | grep -v Warn | tee $OUT/route_ab.json
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_kernels.py tests/test_moe_grouped.py 2>&1 | tail -3 | tee $OUT/gpu.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py 2>&1 | tail -3 | tee -a $OUT/gpu.log
