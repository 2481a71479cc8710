# One device call (2026-12-07, the machine goes back 30 s after a call): the fused causal conv
# (runner/models/causal_conv.py) on the GPU: its tests (bits equal to transformers' fallback, the
# fla binding's rows unchanged), the 4-layer 8B-shaped probe (fused vs fallback conv, time and bits;
# torch.compile without the binding's hooks; the eager profile), then the 8B-shaped extraction row.
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_causal_conv.py > $OUT/test_causal_conv.log 2>&1
echo "tests rc=$?"; tail -15 $OUT/test_causal_conv.log | cut -c1-400
timeout 230 python3 bench/results/gpu/compile_probe.py --layers 4 --reps 20 --reference-conv --profile --no-hooks \
  --out $OUT/compile_probe_fused.json > $OUT/compile_probe_fused.log 2>&1
echo "probe rc=$?"; grep -E "^eager|^compiled|hidden_states\[|fused conv|compile failed" $OUT/compile_probe_fused.log | cut -c1-300
timeout 215 python3 bench/gpu_extract.py --out $OUT/gpu_extract_8b_fused.json --skip-torch --skip-naive --skip-packed \
  --hidden 4096 --num-layers 36 --layers 1,9,17,25,33 --vocab 151936 --samples 96 --mixed 0 \
  --disk-gb 2 --budget-s 200 --label "8B-shaped, fused conv" > $OUT/gpu_extract_8b_fused.log 2>&1
echo "extract rc=$?"; grep -E "bare forward to|dfcache extract|store path only|disk:|MFU|bitwise" $OUT/gpu_extract_8b_fused.log | cut -c1-300
