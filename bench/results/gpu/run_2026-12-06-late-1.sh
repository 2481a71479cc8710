# device call 1, 2026-12-06 late session (H100 or H200: the reply names the card)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 340 python3 bench/gpu_eval.py --target-shape qwen3.6-27b --budgets 16,32,64 --train-steps 300 \
    --layer-output-scale 0.05 --head successor --out $OUT/gpu_eval_27b.json > $OUT/gpu_eval_27b.log 2>&1; echo "27b rc=$?"
grep -v Warning $OUT/gpu_eval_27b.log | grep -v forward_call | tail -12 | cut -c1-400
timeout 215 python3 bench/gpu_eval.py --family eagle3 --train-steps 300 --lr 3e-3 --out $OUT/gpu_eval_eagle3.json \
    > $OUT/gpu_eval_eagle3.log 2>&1; echo "eagle3 rc=$?"
grep -v Warning $OUT/gpu_eval_eagle3.log | grep -v forward_call | tail -10 | cut -c1-400
