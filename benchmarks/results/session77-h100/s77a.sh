source .devsnap/pre.sh
set -x
P="python3 -m metrale.bench.profile_e2e --shape qwen3-8b --forced --dcut --max-tokens 96"
$P --batch 1 --alpha 0.8 --phases > $OUT/s77a-phases-b1.log 2>&1
$P --batch 64 --alpha 0.5 --phases > $OUT/s77a-phases-b64.log 2>&1
$P --batch 1 --alpha 0.8 --max-tokens 48 --trace /tmp/tr1 > $OUT/s77a-trace-b1.log 2>&1
python3 benchmarks/trace_gaps.py /tmp/tr1/spec.json.gz --top 30 --gaps 6 > $OUT/s77a-gaps-b1-spec.txt 2>&1
python3 benchmarks/trace_gaps.py /tmp/tr1/plain.json.gz --top 15 --gaps 3 > $OUT/s77a-gaps-b1-plain.txt 2>&1
tail -5 $OUT/*.log
