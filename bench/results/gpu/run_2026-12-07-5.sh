# device calls 5-7, 2026-12-07 (third session), after run_2026-12-07-4.sh (WITH256=0) on the same
# H200 machine: the new stage at 256 samples (bf16 and fp8-e4m3), again with the disk probed over
# 8 GB (bf16 only), then where the store path's time goes (bench/results/gpu/store_variants.py).
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 230 python3 bench/gpu_extract.py --out $OUT/gpu_extract_1p25b_256_fp8.json --skip-torch --skip-naive --skip-packed \
  --samples 256 --mixed 0 --budget-s 210 --label "1.25 B" --fp8 --write-threads "" --disk-gb 1 > $OUT/gpu_extract_1p25b_256_fp8.log 2>&1
timeout 280 python3 bench/gpu_extract.py --out $OUT/gpu_extract_1p25b_256_disk8.json --skip-torch --skip-naive --skip-packed \
  --samples 256 --mixed 0 --budget-s 260 --label "1.25 B" --write-threads "" --disk-gb 8 > $OUT/gpu_extract_1p25b_256_disk8.log 2>&1
timeout 250 python3 bench/results/gpu/store_variants.py --tokens 262144 --reps 2 --out $OUT/store_variants_h200.json > $OUT/store_variants_h200.log 2>&1
grep -E "bare forward to|dfcache extract|store path only|disk:" $OUT/*.log | cut -c1-200
