python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh
M=metrale/assets/default-model
P="python3 -m metrale.bench.profile_e2e --model $M --max-tokens 64"
$P --drafter ngram --batch 8 --phases > $OUT/ph-ngram-b8.txt 2>&1
$P --drafter ngram --batch 8 > $OUT/cp-ngram-b8.txt 2>&1
$P --drafter ngram --batch 8 --kernels > $OUT/k-ngram-b8.txt 2>&1
$P --drafter dflash --batch 8 --phases > $OUT/ph-dflash-b8.txt 2>&1
$P --drafter ngram --batch 64 --phases > $OUT/ph-ngram-b64.txt 2>&1
$P --drafter ngram --batch 64 > $OUT/cp-ngram-b64.txt 2>&1
timeout 150 python3 scripts/dcut_gate_trace.py --batch 8 --drafter ngram > $OUT/gt-ngram-b8.jsonl 2>$OUT/gt-err.txt
tail -3 $OUT/*.txt
