# Session 65: GPU-marked tests of the files this session touched, natively; then MTP at batch 1 on the shipped model: phases of the plain and speculative runs.
. .devsnap/pre.sh
timeout 240 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_sampler.py tests/test_async_scheduling.py tests/test_spec_verify.py tests/test_deterministic.py 2>&1 | tail -4 | tee $OUT/gpu-tests.log
timeout 150 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter mtp --batch 1 --max-tokens 128 --phases 2>&1 | grep -v Warn | grep -v _warn_once | tail -40 | tee $OUT/mtp-b1-phases.log
