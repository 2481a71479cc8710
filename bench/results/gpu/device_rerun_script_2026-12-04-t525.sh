#!/bin/bash
# device rerun of the 1.25 B extraction only: 5.25, 5.24, 5.25 in turn on one machine
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
PI="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
$PI --target /tmp/site .gpu/whl/*.whl && $PI --target /tmp/t525 .gpu/t525/*.whl && $PI --target /tmp/t524 .gpu/t524/*.whl || exit 3
i=0
for v in 525 524 525; do
  i=$((i+1)); export PYTHONPATH=.gpu/c:/tmp/t$v:/tmp/site
  echo "=== run $i transformers t$v $(date -u +%T)"
  timeout 150 python3 .gpu/c/bench/gpu_extract.py --out $OUT/x${v}_r$i.json --skip-torch --skip-naive --skip-packed \
     --samples 64 --mixed 0 --disk-gb 0 --budget-s 120 --label "1.25 B" 2>&1 | grep -E "tok/s|after_compute|exactness|transformers'"
done 2>&1 | tee $OUT/rerun.log
