# device call 4, 2026-12-06 late session: the store-path experiment alone (device time nearly spent)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 bench/results/gpu/store_variants.py --tokens 131072 --reps 2 --out $OUT/store_variants.json \
    > $OUT/store_variants.log 2>&1; echo "variants rc=$?"
grep -v "^ " $OUT/store_variants.log | head -12
