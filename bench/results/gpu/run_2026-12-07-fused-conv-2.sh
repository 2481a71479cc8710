# The second call of 2026-12-07's fused-conv pair: the kernel's eligibility narrowed after the first
# (no bias, at least K positions), then its tests and the 4-layer 8B-shaped probe (fused vs fallback
# conv: time and every layer's bits; the eager profile; no compile). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_causal_conv.py > $OUT/test_causal_conv.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/test_causal_conv.log | cut -c1-400
timeout 120 python3 bench/results/gpu/compile_probe.py --layers 4 --reps 30 --reference-conv --profile --skip-compile \
  --out $OUT/compile_probe_fused.json > $OUT/compile_probe_fused.log 2>&1
echo "probe rc=$?"; grep -E "^eager|fused conv" $OUT/compile_probe_fused.log | cut -c1-400
grep -E "Name|aten::mm |aten::copy_|conv|Chunk|aten::mul |Self CUDA time" $OUT/compile_probe_fused.log | cut -c1-200 | head -12
