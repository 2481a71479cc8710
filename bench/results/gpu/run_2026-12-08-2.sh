# The next session's first device call (written 2026-12-07 when the device time was spent): the fused
# Qwen3.5 norms and MLP gate (runner/models/fused_layers.py), never run on a GPU yet: their tests
# (each fused forward's bits against the class's own; the fla binding's rows unchanged), then the
# 4-layer 8B-shaped probe: the binding as it is, without the fused layers, and without the fused
# conv too (time and every layer's bits), with the eager profile. About 3 minutes; carry [".whl"]
# (the wheels of docs/benchmarks.md's GPU section plus pytest, pluggy, iniconfig, pygments).
# If the tests pass, the second call is the 8B-shaped extraction row at 256 samples:
#   python3 bench/gpu_extract.py --out $OUT/gpu_extract_8b_256.json --skip-torch --skip-naive --skip-packed \
#     --hidden 4096 --num-layers 36 --layers 1,9,17,25,33 --vocab 151936 --samples 256 --mixed 0 \
#     --disk-gb 4 --budget-s 420 --label "8B-shaped, 256 samples"
# If a fused forward differs, the binding keeps the original and says why in the provenance
# (fused_layers_skipped); the probe prints it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fused_layers.py tests/test_causal_conv.py > $OUT/test_fused.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|Error|assert" $OUT/test_fused.log | tail -12 | cut -c1-400
timeout 150 python3 bench/results/gpu/compile_probe.py --layers 4 --reps 30 --reference-conv --profile --copy-sites --skip-compile \
  --out $OUT/compile_probe_fused_layers.json > $OUT/compile_probe_fused_layers.log 2>&1
echo "probe rc=$?"; grep -E "^eager|fused conv|fused layers" $OUT/compile_probe_fused_layers.log | cut -c1-400
grep -E "Name|aten::mm |aten::copy_|aten::mul |aten::mean|square|norm_apply|gated_apply|silu_mul|conv_silu|Self CUDA time" \
  $OUT/compile_probe_fused_layers.log | cut -c1-200 | head -14
grep -A 16 "^copy sites" $OUT/compile_probe_fused_layers.log | cut -c1-330
