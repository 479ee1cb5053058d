# Session 64: device idle gaps and the host frames behind them: MTP at batch 1 (shipped model), replay alpha 0.8 at batch 64 (qwen3-8b shape, D-Cut on, forced acceptance).
. .devsnap/pre.sh
T=$OUT
timeout 200 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter mtp --batch 1 --max-tokens 64 --trace $T/mtp1 2>&1 | grep -v Warn | tail -5
for f in $T/mtp1/*.json.gz; do python3 benchmarks/trace_gaps.py $f > ${f%.json.gz}.gaps.txt 2>&1; head -40 ${f%.json.gz}.gaps.txt; done
timeout 300 python3 -m metrale.bench.profile_e2e --shape qwen3-8b --batch 64 --alpha 0.8 --forced --dcut --max-tokens 16 --trace $T/q64 2>&1 | grep -v Warn | tail -5
for f in $T/q64/*.json.gz; do python3 benchmarks/trace_gaps.py $f > ${f%.json.gz}.gaps.txt 2>&1; head -30 ${f%.json.gz}.gaps.txt; done
ls -la $T/*/
