python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh
ROOT=$PWD
ln -sfn $ROOT/metrale/assets .devsnap/old/metrale/assets
python3 -m pytest -q -p no:cacheprovider tests/test_ngram_catch_up.py > $OUT/gputests.txt 2>&1
M=metrale/assets/default-model
python3 -m metrale.bench.profile_e2e --model $M --max-tokens 64 --drafter ngram --batch 8 --phases > $OUT/ph-ngram-b8.txt 2>&1
timeout 150 python3 scripts/dcut_gate_trace.py --batch 8 --drafter ngram > $OUT/gt-ngram-b8.jsonl 2>/dev/null
B="bench --e2e-drafter ngram --num-drafts 3 --max-tokens 64 --device cuda"
python3 -m metrale.cli $B --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4 > $OUT/ngram.log 2>&1
python3 -m metrale.cli $B --e2e-batch-sizes 1,4,8 --prompt-tokens 1536 > $OUT/ngram-2k.log 2>&1
(cd .devsnap/old && PYTHONPATH=/tmp/site:$ROOT/.devsnap/old python3 -m metrale.cli $B --e2e-batch-sizes 1,4,8 --prompt-tokens 1536 > $OUT/ngram-2k-old.log 2>&1)
tail -2 $OUT/gputests.txt; grep -h "e2e.*batch" $OUT/ngram*.log | head -30
