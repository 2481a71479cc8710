# device call 1, 2026-12-07: the store-path experiment, then the FP8 extraction row (issue 33)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; df -h /tmp | tail -1
timeout 200 python3 bench/results/gpu/store_variants.py --tokens 131072 --reps 2 --out $OUT/store_variants.json \
    > $OUT/store_variants.log 2>&1; echo "variants rc=$?"
grep -v "^ " $OUT/store_variants.log | head -20
timeout 330 python3 bench/gpu_extract.py --out $OUT/gpu_extract_1p25b_fp8.json --skip-torch --skip-naive --skip-packed \
    --samples 128 --mixed 0 --budget-s 280 --label "1.25 B" --fp8 --write-threads "" --disk-gb 2 \
    > $OUT/gpu_extract_1p25b_fp8.log 2>&1; echo "fp8 rc=$?"
grep -E "^(PASS|FAIL|INFO)|store path|vs the cached" $OUT/gpu_extract_1p25b_fp8.log | cut -c1-300
