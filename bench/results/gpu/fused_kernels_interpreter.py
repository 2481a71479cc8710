"""The fused kernels' arithmetic (runner/models/causal_conv.py, runner/models/fused_layers.py)
against transformers' PyTorch expressions, on the CPU, in Triton's interpreter: the check that the
fused Qwen3.5 layers got before any GPU ran them (2026-12-07), and a quick one for later changes.
Not a test (CI has no triton) and not the bits' proof: the GPU's kernels are compiled, the
interpreter runs numpy. Two interpreter gaps are patched (triton_interpreter.py): its float32 -> bf16 cast truncates
(and its RTNE mode is wrong), where the GPU rounds to nearest even; and it has no libdevice, so
``exp`` is numpy's (the SiLU then may differ from torch's CPU one by an ulp; on the GPU the
kernels' SiLU matched ATen's on every finite bf16 value).

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch==2.13.0 numpy triton
    /tmp/tvenv/bin/python bench/results/gpu/fused_kernels_interpreter.py   # from the repository root

2026-12-07 (triton 3.9.0, torch 2.13.0+cpu): every line "(0, n)": no value differs.
"""
import sys

sys.path.insert(0, "bench/results/gpu")
import triton_interpreter  # noqa: E402  (first: it sets TRITON_INTERPRET and patches the interpreter)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runner.models import causal_conv as cc, fused_layers as fl  # noqa: E402

triton_interpreter.patch(cc, fl)


def bits_eq(a, b):
    a = a.contiguous().view(torch.int16); b = b.contiguous().view(torch.int16)
    return (a != b).sum().item(), a.numel()


torch.manual_seed(0)
K = fl._kernels()
# RMSNorm (zero-centred)
H = 256; x = (torch.randn(7, 5, H) * 3).bfloat16(); w = (torch.randn(H) * 0.5).bfloat16(); eps = 1e-6
ref = (lambda xf: (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * (1.0 + w.float()))(x.float()).type_as(x)
sq = torch.empty(x.shape, dtype=torch.float32)
K["square"][fl._grid(x.numel())](x, sq, x.numel(), BLOCK=fl.BLOCK)
print("square exact:", torch.equal(sq, x.float().pow(2)))
r = torch.rsqrt(sq.mean(-1, keepdim=True) + eps)
out = torch.empty_like(x)
K["norm_apply"][fl._grid(x.numel())](x, r, 1.0 + w.float(), out, x.numel(), H, BLOCK=fl.BLOCK)
print("rmsnorm diff:", bits_eq(ref, out))
# gated
D = 128; xg = (torch.randn(300, D) * 3).bfloat16(); gt = (torch.randn(300, D) * 3).bfloat16(); wg = (torch.randn(D) * .5).bfloat16()
h = xg.float(); v = h.pow(2).mean(-1, keepdim=True); h = h * torch.rsqrt(v + eps); h = wg * h.to(torch.bfloat16); refg = (h * F.silu(gt.float())).to(torch.bfloat16)
sq = torch.empty(xg.shape, dtype=torch.float32); K["square"][fl._grid(xg.numel())](xg, sq, xg.numel(), BLOCK=fl.BLOCK)
r = torch.rsqrt(sq.mean(-1, keepdim=True) + eps); outg = torch.empty_like(xg)
K["gated_apply"][fl._grid(xg.numel())](xg, r, wg, gt, outg, xg.numel(), D, BLOCK=fl.BLOCK)
print("gated diff (CPU silu vs libdevice-ish exp):", bits_eq(refg, outg))
# silu_mul
g = (torch.randn(64, 300) * 3).bfloat16(); u = torch.randn(64, 300).bfloat16()
refm = F.silu(g) * u; y = torch.empty_like(g)
K["silu_mul"][fl._grid(g.numel())](g, u, y, g.numel(), BLOCK=fl.BLOCK)
print("silu_mul diff:", bits_eq(refm, y))
# conv
ref_conv = lambda x, w, act: (F.silu if act else (lambda t: t))(F.conv1d(x, w.unsqueeze(1), None, padding=w.shape[1]-1, groups=x.shape[1])[:, :, :x.shape[2]])
xc = (torch.randn(2, 37, 96) * 4).bfloat16().transpose(1, 2); wc = torch.randn(96, 4).bfloat16()
for act in ("silu", None):
    got = cc.fused(xc, wc, act, "fma")
    print("conv", act, "diff:", bits_eq(ref_conv(xc, wc, act), got), "layout ok:", got.transpose(1, 2).is_contiguous())
