# Session 73 (f): test_pdl's GPU test after the review's fixes; where a batch-64 alpha-0.8 speculative run's device idles (held verifies), with the faster trace_gaps.
. .devsnap/pre.sh > $OUT/card.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py 2>&1 | tail -1 > $OUT/gpu-tests.log
timeout 100 python3 -m metrale.bench.profile_e2e --shape qwen3-8b --forced --dcut --max-tokens 32 --alpha 0.8 --batch 64 --trace /tmp/tr 2>&1 | grep "^==" > $OUT/runs.log
timeout 60 python3 benchmarks/trace_gaps.py /tmp/tr/spec.json.gz --top 30 --gaps 6 > $OUT/gaps-b64-a08-spec.txt 2>&1
