# device call 2, 2026-12-06 late session (H100 or H200: the reply names the card)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
timeout 100 python3 bench/gpu_eval.py --family eagle3 --train-steps 300 --lr 3e-3 --out $OUT/gpu_eval_eagle3.json \
    > $OUT/gpu_eval_eagle3.log 2>&1; echo "eagle3 rc=$?"
grep -E "^(PASS|FAIL|INFO)|training" $OUT/gpu_eval_eagle3.log | cut -c1-300
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k final_state 2>&1 | tail -3
timeout 185 python3 bench/gpu_extract.py --out $OUT/gpu_extract_1p25b_fp8.json --skip-torch --skip-naive --skip-packed \
    --samples 128 --mixed 0 --budget-s 170 --label "1.25 B" --fp8 --write-threads 1,2,4,8 --write-threads-reps 2 \
    > $OUT/gpu_extract_1p25b_fp8.log 2>&1; echo "fp8 rc=$?"
grep -E "^(PASS|FAIL|INFO)|store path|DFCACHE_WRITE" $OUT/gpu_extract_1p25b_fp8.log | cut -c1-300
timeout 215 python3 bench/gpu_extract.py --preset qwen3.6-27b --out $OUT/gpu_extract_27b.json --samples 128 --mixed 0 \
    --skip-packed --disk-gb 2 --budget-s 200 --write-threads 8 --write-threads-reps 1 > $OUT/gpu_extract_27b.log 2>&1; echo "27b rc=$?"
grep -E "^(PASS|FAIL|INFO)" $OUT/gpu_extract_27b.log | cut -c1-300
