# The next session's second device call (after run_2026-12-08-2.sh shows the fused layers' bits equal):
# the 8B-shaped extraction row at 256 samples with the binding as it is (fused conv, fused layers),
# for issue 36 item 2's figure against the physical limit (extraction tok/s x 18.8 GFLOP over the
# measured bf16 peak; 0.46 on 2026-12-07 with the fused conv alone, 64 samples). About 8 minutes;
# carry [".whl"]. The 27B-shaped row with the same binding is the call after:
#   python3 bench/gpu_extract.py --preset qwen3.6-27b --out $OUT/gpu_extract_27b.json --samples 128 --mixed 0 \
#     --skip-packed --disk-gb 4 --budget-s 470
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 python3 bench/gpu_extract.py --out $OUT/gpu_extract_8b_256.json --skip-torch --skip-naive --skip-packed \
  --hidden 4096 --num-layers 36 --layers 1,9,17,25,33 --vocab 151936 --samples 256 --mixed 0 \
  --disk-gb 4 --budget-s 520 --label "8B-shaped, 256 samples" > $OUT/gpu_extract_8b_256.log 2>&1
echo "extract rc=$?"; grep -E "bare forward to|dfcache extract|store path only|disk:|MFU|exactness|fused" $OUT/gpu_extract_8b_256.log | cut -c1-300
