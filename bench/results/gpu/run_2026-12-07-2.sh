# device call 2, 2026-12-07, on an H100: the 27B-shaped extraction at 128 samples (issue 36 item 1), then
# packed mixed lengths (issue 36 item 2, >= 0.8x of equal lengths)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 290 python3 bench/gpu_extract.py --preset qwen3.6-27b --out $OUT/gpu_extract_27b_128_h100.json --samples 128 \
    --mixed 0 --skip-packed --disk-gb 2 --budget-s 270 > $OUT/gpu_extract_27b_128_h100.log 2>&1; echo "27b rc=$?"
grep -E "^(PASS|FAIL|INFO)" $OUT/gpu_extract_27b_128_h100.log | cut -c1-300
timeout 270 python3 bench/gpu_extract.py --out $OUT/gpu_extract_1p25b_packed_h100.json --skip-torch --skip-naive \
    --samples 128 --mixed 96 --budget-s 250 --label "1.25 B" --write-threads "" --disk-gb 1 \
    > $OUT/gpu_extract_1p25b_packed_h100.log 2>&1; echo "packed rc=$?"
grep -E "^(PASS|FAIL|INFO)" $OUT/gpu_extract_1p25b_packed_h100.log | cut -c1-300
