# device call 1, 2026-12-06 night (H100 or H200: the reply names the card)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 330 python3 bench/gpu_eval.py --target-shape qwen3.6-27b --budgets 16,32,64 --train-steps 300 \
    --layer-output-scale 0.05 --out $OUT/gpu_eval_27b.json > $OUT/gpu_eval_27b.log 2>&1; echo "27b rc=$?"
tail -25 $OUT/gpu_eval_27b.log
timeout 200 python3 bench/gpu_eval.py --family eagle3 --out $OUT/gpu_eval_eagle3.json > $OUT/gpu_eval_eagle3.log 2>&1; echo "eagle3 rc=$?"
tail -25 $OUT/gpu_eval_eagle3.log
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k cuda 2>&1 | tail -3
