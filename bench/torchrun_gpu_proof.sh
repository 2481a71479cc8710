#!/bin/bash
# The GPU proof of the torchrun rank mapping (docs/distributed.md; logs in bench/results/gpu/torchrun_proof_*.log).
# Run on a GPU machine from a copy of the tree whose code is on PYTHONPATH (with a
# dfcache-*.dist-info beside it when dfcache is not pip-installed, so `run` is registered), and
# fla/transformers installed; writes its log to ${OUT:-.}/torchrun_proof.log.
#   bash bench/torchrun_gpu_proof.sh
set -o pipefail
export PYTHONUNBUFFERED=1 DFCACHE_HOME=${DFCACHE_HOME:-/tmp/dfh} DFCACHE_STORE=${DFCACHE_STORE:-/tmp/st}
L=${OUT:-.}/torchrun_proof.log
say() { echo "=== $*" | tee -a "$L"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$L"
python3 -c "from runner.models.tiny import build_tiny_target; build_tiny_target('/tmp/T')" >/dev/null 2>&1 || exit 1
# A few prompts and short completions: local greedy completions decode one token a forward, and
# the default set (22 prompts x 256 tokens) outlasted a 120 s step on the first try.
A="--num-prompts 4 --max-new-tokens 16"
say "1. torchrun --standalone --nproc-per-node 1 -m dfcache run hidden-states --target /tmp/T --layer 1 --device cuda --no-progress $A"
t0=$(date +%s.%N)
timeout 150 torchrun --standalone --nproc-per-node 1 -m dfcache run hidden-states --target /tmp/T --layer 1 \
    --device cuda --no-progress $A 2>&1 | grep -v "Loading weights" | tee -a "$L"
echo "rc=$? wall $(python3 -c "import time; print(round(time.time()-$t0, 1))") s" | tee -a "$L"
say "provenance of the committed hidden-states segments (device, kernels bound)"
python3 - <<'PY' 2>&1 | tee -a "$L"
import json, os
from dfcache.store import open_store
for m in open_store(os.environ["DFCACHE_STORE"], create=False).list_manifests(stage="hidden_states"):
    p = m.provenance
    print(json.dumps({"segment": m.key[:12], "backend": m.inputs.get("backend"), "layer": m.inputs.get("layer"),
                      "device": p.get("device"), "gpu": p.get("gpu"),
                      "bound": sorted(set(p.get("bound", {}).values()))}))
PY
say "2. two ranks on a one-GPU host: rank 1 has no cuda:1 (expect exit 6 before any work)"
timeout 60 torchrun --standalone --nproc-per-node 2 -m dfcache run hidden-states --target /tmp/T --layer 2 \
    --device cuda --no-progress --debug $A 2>&1 | grep -v "Loading weights" | tail -40 | tee -a "$L"
say done
