# device call 2, 2026-12-06 night
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 60 python3 bench/results/gpu/fp8_cuda_diag.py 2>&1 | tee $OUT/fp8_cuda_diag.log
timeout 300 python3 bench/gpu_eval.py --target-shape qwen3.6-27b --budgets 16,32,64 --train-steps 300 \
    --layer-output-scale 0.005 --out $OUT/gpu_eval_27b.json > $OUT/gpu_eval_27b.log 2>&1; echo "27b rc=$?"
grep -v Warning $OUT/gpu_eval_27b.log | grep -v forward_call | tail -8
python3 -c "import json;d=json.load(open('$OUT/gpu_eval_27b.json'));print(d['acceptance'])"
timeout 230 python3 bench/gpu_extract.py --out $OUT/gpu_extract_1p25b_fp8.json --skip-torch --skip-naive \
    --samples 256 --mixed 96 --budget-s 200 --label "1.25 B" --fp8 > $OUT/gpu_extract_1p25b_fp8.log 2>&1; echo "fp8 rc=$?"
grep -E "PASS|FAIL|INFO" $OUT/gpu_extract_1p25b_fp8.log | tail -20
