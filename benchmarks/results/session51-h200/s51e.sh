# Step traces of DFlash at batch 8 (gate decisions), calibrated gate (new) against uncalibrated (old), alternating.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
i=0
for v in new old new old new old; do i=$((i+1))
  cp .devsnap/cal-$v/*.py metrale/speculative/
  echo "== dflash b8 $v ($i)"
  timeout 60 python3 benchmarks/step_trace.py dflash 8 $OUT/trace-cal-dflash-b8-$v-$i.json 2>&1 | grep -v Warn | tail -4
done
