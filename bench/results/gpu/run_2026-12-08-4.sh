# The next session's device calls (written 2026-12-07 after the fused layers' runs): the 8B- and
# 27B-shaped extraction rows again with the split the bench now measures (the bare forward one
# sample per forward, again after the extraction, and the card's clocks by pass), to tell how much
# of the 0.89-0.90x to the batched bare forward is the exactness constraint (one-sample forwards),
# the card's clocks, or the pipeline beside the forwards. One call each (about 5 minutes each):
#   bash bench/results/gpu/run_2026-12-08-4.sh 8b     then     bash bench/results/gpu/run_2026-12-08-4.sh 27b
# carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$1" = 27b ]; then
  timeout 560 python3 bench/gpu_extract.py --preset qwen3.6-27b --out $OUT/gpu_extract_27b_split.json --samples 128 \
    --mixed 0 --skip-packed --disk-gb 4 --budget-s 470 > $OUT/gpu_extract_27b_split.log 2>&1
  echo "27b rc=$?"; log=$OUT/gpu_extract_27b_split.log
else
  timeout 560 python3 bench/gpu_extract.py --out $OUT/gpu_extract_8b_256_split.json --skip-torch --skip-naive --skip-packed \
    --hidden 4096 --num-layers 36 --layers 1,9,17,25,33 --vocab 151936 --samples 256 --mixed 0 \
    --disk-gb 4 --budget-s 470 --label "8B-shaped, 256 samples" > $OUT/gpu_extract_8b_256_split.log 2>&1
  echo "8b rc=$?"; log=$OUT/gpu_extract_8b_256_split.log
fi
grep -E "bare forward to|dfcache extract \(|store path only|MFU|exactness|clocks by pass" $log | cut -c1-600
