#!/bin/bash
# device run: bash .gpu/c/dev.sh VERSION... (525 and/or 524); DIGEST_AGAIN=525 reruns that version's digest at the end
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PI="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
$PI --target /tmp/site .gpu/whl/*.whl || exit 3
$PI --target /tmp/t525 .gpu/t525/*.whl || exit 3
$PI --target /tmp/t524 .gpu/t524/*.whl || exit 3
el installed
for v in "$@"; do
  L=$OUT/t$v.log
  export PYTHONPATH=.gpu/c:/tmp/t$v:/tmp/site
  {
  el "=== transformers t$v"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 - <<'PY'
import importlib.metadata as md, sys, transformers, torch, triton, huggingface_hub, fla
print("python", sys.version.split()[0])
print("transformers", transformers.__version__, transformers.__file__)
print("huggingface_hub", huggingface_hub.__version__, huggingface_hub.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("triton", triton.__version__, "fla", md.version("flash-linear-attention"), md.version("fla-core"), fla.__file__)
for d in ("kernels", "tokenizers", "safetensors", "numpy", "typer", "tqdm", "click", "zarr", "crc32c", "xxhash"):
    try: print(d, md.version(d))
    except Exception as e: print(d, "-", type(e).__name__)
PY
  el "pytest"
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider .gpu/c/tests/test_cuda_graphs.py 2>&1 | tail -4
  timeout 120 python3 -m pytest -q -p no:cacheprovider .gpu/c/tests/test_targets.py 2>&1 | tail -8
  el "digest"
  timeout 200 python3 .gpu/c/bench/state_digest.py --out $OUT/digest_t$v.json 2>&1 | grep -v "it/s\]"
  el "extract"
  timeout 200 python3 .gpu/c/bench/gpu_extract.py --out $OUT/x$v.json --skip-torch --skip-naive --skip-packed \
     --samples 64 --mixed 0 --disk-gb 0 --budget-s 120 --label "1.25 B" 2>&1 | grep -v "it/s\]"
  el "done t$v"
  } 2>&1 | tee $L
done
if [ -n "$DIGEST_AGAIN" ]; then
  export PYTHONPATH=.gpu/c:/tmp/t$DIGEST_AGAIN:/tmp/site
  { el "digest again t$DIGEST_AGAIN"; timeout 200 python3 .gpu/c/bench/state_digest.py --out $OUT/digest_t${DIGEST_AGAIN}_again.json 2>&1 | grep -v "it/s\]"; el done; } 2>&1 | tee $OUT/again.log
fi
