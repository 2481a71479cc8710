# Next session's first device call (written 2026-12-07, when the device time ran out in refused
# starts): issue 36 item 2's probe, torch.compile against eager on the 8B-shaped target's first 8
# layers (time and bits), then the FP8 and bf16 1.25 B rows of the current stage (192 samples),
# which the H200 measured on 2026-12-07 and an H100 has not since the fixes of that day.
# Ask for nvidia-h100-x1 for the FP8 confirmation; carry [".whl", "bench/out/old"]; about 6 minutes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 220 python3 bench/results/gpu/compile_probe.py --out $OUT/compile_probe.json > $OUT/compile_probe.log 2>&1
echo "probe rc=$?"; grep -v "^bound" $OUT/compile_probe.log | tail -14 | cut -c1-300
ONLY_NEW=1 bash bench/results/gpu/run_2026-12-07-4.sh
