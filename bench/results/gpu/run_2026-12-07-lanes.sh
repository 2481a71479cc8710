# Device calls of 2026-12-07 (evening): the extraction's forwards on two CUDA streams side by side
# (runner/models/lanes.py). First the GPU tests (tests/test_cuda_graphs.py: lanes store the eager
# one-sample bits, pair check passed, forwards side by side), then the 27B- or 8B-shaped extraction
# row with the new rows: one-sample CUDA-graph replays on two lanes (nothing else running), and the
# extraction with DFCACHE_CUDA_LANES=1 and =2 in turns (two each, order rotating). The judged row
# ("dfcache extract (equal)") runs with 2 lanes (DFCACHE_CUDA_LANES=2 below). carry [".whl"].
#   bash bench/results/gpu/run_2026-12-07-lanes.sh 27b     (about 6 minutes)
#   bash bench/results/gpu/run_2026-12-07-lanes.sh 8b      (about 6 minutes)
# Ran 2026-12-07 late on an H100 as `27b notest` and `8b notest` (the bench without the tests; 6.5
# and 8 minutes): gpu_extract_{27b_128,8b_256}_lanes_h100_2026-12-07.*; lanes are the default since.
# .whl needs google_crc32c too (zarr 3.1.6 imports it): the first call of that session failed without it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# the judged row with lanes on (the candidate default); the A/B sets 1 and 2 itself
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DFCACHE_CUDA_LANES=2
nvidia-smi --query-gpu=name --format=csv,noheader
# "lean" (when little device time is left): only the lanes tests, one A/B run each way, 3/4 of the 8B samples.
reps=2; sel=tests/test_cuda_graphs.py; n27=128; n8=256
[ "$2" = lean ] && { reps=1; sel="tests/test_cuda_graphs.py -k lanes"; n8=192; }
# "min" (the last few minutes of device time): no tests, 64 samples, one A/B run each way.
disk=2; budget=400; [ "$2" = min ] && { reps=1; n27=64; n8=128; disk=0.5; budget=280; }
# "probe" (under 5 minutes left): 32 samples, no tests; the pair check and the two-lane replay row come before the budget.
bt=470; [ "$2" = probe ] && { reps=1; n27=32; n8=64; disk=0.5; budget=120; bt=240; }
# "testonly": the GPU tests of lanes alone (about a minute).
if [ "$2" = testonly ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_extract_memory.py > $OUT/test_lanes.log 2>&1
  echo "tests rc=$?"; grep -E "passed|failed|Error|assert" $OUT/test_lanes.log | tail -12 | cut -c1-400; exit 0
fi
if [ "$2" != notest ] && [ "$2" != min ] && [ "$2" != probe ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider $sel > $OUT/test_lanes.log 2>&1
  echo "tests rc=$?"; grep -E "passed|failed|Error|assert" $OUT/test_lanes.log | tail -12 | cut -c1-400
fi
if [ "$1" = 27b ]; then
  name=gpu_extract_27b_${n27}_lanes
  timeout $bt python3 bench/gpu_extract.py --preset qwen3.6-27b --out $OUT/$name.json --samples $n27 \
    --mixed 0 --skip-packed --disk-gb $disk --write-threads "" --lanes-reps $reps --budget-s $budget > $OUT/$name.log 2>&1
else
  name=gpu_extract_8b_${n8}_lanes
  timeout $bt python3 bench/gpu_extract.py --out $OUT/$name.json --skip-torch --skip-naive --skip-packed \
    --hidden 4096 --num-layers 36 --layers 1,9,17,25,33 --vocab 151936 --samples $n8 --mixed 0 \
    --disk-gb $disk --write-threads "" --lanes-reps $reps --budget-s $budget --label "8B-shaped, $n8 samples" > $OUT/$name.log 2>&1
fi
echo "$1 rc=$?"
grep -E "bare forward to|dfcache extract|lanes|store path only|exactness|Traceback|Error" $OUT/$name.log | cut -c1-500 | tail -30
