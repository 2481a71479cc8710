"""runner/models/fused_layers.py end to end on the CPU, in Triton's interpreter: ``install`` on a
4-layer Qwen3.5 model at hidden 256 (each class's self-check, then the instance forwards), the
model's hidden states with the fused forwards against without, and ``uninstall``. The CUDA-only
guards are patched to take CPU tensors, and the interpreter's two gaps as in
triton_interpreter.py (its bf16 cast; no libdevice, so ``exp`` is numpy's).

    /tmp/tvenv/bin/pip install transformers==5.25.0   # the venv of fused_kernels_interpreter.py
    /tmp/tvenv/bin/python bench/results/gpu/fused_layers_glue_interpreter.py   # from the repository root

2026-12-07 (triton 3.9.0, torch 2.13.0+cpu, transformers 5.25.0):
- installed {'Qwen3_5RMSNorm': 11}, and every hidden state bitwise equal to the model's own.
- The gated norm and the MLP were refused by their self-checks: 196 values (the gated norm, the
  2048-row case that puts every bf16 value through the gate's SiLU) and 983 of the 65,280 finite
  bf16 values (the MLP's SiLU) differed. That is numpy's ``exp`` against torch's CPU one at the
  domain's ends; with random values (fused_kernels_interpreter.py) both match to the bit.
  So the self-check does refuse a SiLU one ulp off. On the GPU the kernels use libdevice's
  ``exp``, which matched ATen's on every finite bf16 value in causal_conv.
"""
import sys

sys.path.insert(0, "bench/results/gpu")
import triton_interpreter  # noqa: E402  (first: it sets TRITON_INTERPRET and patches the interpreter)

import torch  # noqa: E402

from runner.models import fused_layers as fl  # noqa: E402

triton_interpreter.patch(fl)
torch.cuda.get_device_name = lambda d=None: "cpu-interpreter"
_bf = fl._bf16_contiguous
fl._bf16_contiguous = lambda *ts: all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.numel() > 0 for t in ts)
_gen = torch.Generator
from runner.models.tiny import qwen35_shape_config
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM
cfg = qwen35_shape_config(4, 256, 512, 64)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
# rmsnorm_forward's guard also wants the weight on CUDA: patch the check it uses
src = fl.rmsnorm_forward
def rms(self, x):
    if not fl._bf16_contiguous(x):
        return type(self).forward(self, x)
    r = fl._rstd(x, self.eps); w1 = 1.0 + self.weight.float(); out = torch.empty_like(x)
    fl._kernels()["norm_apply"][fl._grid(x.numel())](x, r, w1, out, x.numel(), x.shape[-1], BLOCK=fl.BLOCK)
    return out
key = [k for k, v in fl.FUSED.items() if v is src][0]
fl.FUSED[key] = rms
ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    want = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
counts, why = fl.install(model, "cpu")
print("installed:", counts, "skipped:", why)
with torch.no_grad():
    got = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
for i, (a, b) in enumerate(zip(want, got)):
    print(f"hidden_states[{i}] values differing: {(a.view(torch.int16) != b.view(torch.int16)).sum().item()} of {a.numel()}")
fl.uninstall(model)
print("after uninstall, instance forwards left:", sum("forward" in vars(m) for m in model.modules()))
