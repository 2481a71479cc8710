"""The gated-DeltaNet layers' causal depthwise convolution + SiLU on CUDA, bit for bit what
transformers' PyTorch fallback computes, in one Triton pass (issue 36 item 2: a faster exact
forward, stored rows unchanged, so no key changes).

Why: without the ``causal_conv1d`` package transformers runs ``F.conv1d`` (ATen's
``conv_depthwise2d`` kernel for bf16) on a [B, C, T] copy of the projection, slices off the right
padding and applies SiLU in a second pass. On an H100 the 8B-shaped target's four-layer forward
(2,048 tokens) spent 1.8 ms of its 13.6 ms there: the depthwise kernel 353 us a layer, the copy
into its layout 110 us, the SiLU 55 us (``bench/results/gpu/compile_probe_profile_4l_h100_2026-12-07.json``).
Here one kernel reads the projection where it lies ([B, T, C], through strides) and writes [B, T,
C], returned as the [B, C, T] view the layer expects; its transpose back is then free.

Bits: per output (b, c, t), ATen's depthwise kernel starts a float32 accumulator at the bias (or
0) and adds ``w[c, k] * x[b, c, t - K + 1 + k]`` for k = 0..K-1 in order, skipping positions left
of the sequence, as fused multiply-adds, and rounds once to bf16; SiLU reads that bf16 value as
float32 and computes ``x / (1 + exp(-x))`` (accurate ``expf``, IEEE division), rounded to bf16.
This kernel does the same operations in the same order (``fma``, libdevice ``exp``,
``div_rn``). That it gives the same bits is measured, not assumed: :func:`self_check` compares
it with the fallback on the device before the first use (every finite bf16 value through the
SiLU, random convolutions with edges and a batch) and the binding keeps the fallback if a single
bit differs. Only bf16 inputs and weights, K <= 8, no bias (the Qwen3.5/3.6 layers have none),
SiLU or no activation, at least K positions; anything else goes to the fallback. (On an H100 a
convolution with a bias over one position differed from the fallback in 19 of 64 values, which
fits ATen adding the bias after rounding for that shape; not traced further, 2026-12-07.)
"""

from __future__ import annotations

from typing import Callable

_KERNEL = None
# (device name, reference function) -> (the variant that gives the fallback's bits, or None; why
# not). Variants: "fma" (what nvcc makes of ATen's ``value += w * x``) first, then "mul-add"
# (product rounded first). Each modeling module (Qwen3.5, Qwen3-Next) has its own fallback.
_CHECKED: dict[tuple[str, str], tuple[str | None, str | None]] = {}
VARIANTS = ("fma", "mul-add")


def _kernel():
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def conv_silu(x_ptr, w_ptr, y_ptr, T, C, sxb, sxc, sxt, swc, swk, syb, syt,
                  K: tl.constexpr, SILU: tl.constexpr, FMA: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        pt = tl.program_id(0)
        pc = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        t = pt * BT + tl.arange(0, BT)
        c = pc * BC + tl.arange(0, BC)
        cm = c < C
        tm = t < T
        acc = tl.zeros((BT, BC), tl.float32)
        for k in tl.static_range(K):
            tin = t - (K - 1) + k
            m = (tin >= 0)[:, None] & tm[:, None] & cm[None, :]
            xv = tl.load(x_ptr + b * sxb + tin[:, None].to(tl.int64) * sxt + c[None, :] * sxc,
                         mask=m, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + c * swc + k * swk, mask=cm, other=0.0).to(tl.float32)
            if FMA:
                step = tl.fma(wv[None, :], xv, acc)
            else:  # a rounded product, then the sum (launched without fp fusion)
                step = acc + wv[None, :] * xv
            acc = tl.where(m, step, acc)  # left of the sequence: skipped, as ATen does
        y = acc.to(tl.bfloat16)
        if SILU:
            yf = y.to(tl.float32)
            y = tl.math.div_rn(yf, 1.0 + libdevice.exp(-yf)).to(tl.bfloat16)
        tl.store(y_ptr + b * syb + t[:, None].to(tl.int64) * syt + c[None, :], y, mask=tm[:, None] & cm[None, :])

    _KERNEL = conv_silu
    return _KERNEL


def _eligible(x, weight, bias, activation) -> bool:
    import torch

    return (x.is_cuda and x.dim() == 3 and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[0] == x.shape[1] and weight.shape[1] <= 8
            and bias is None and activation in (None, "silu") and x.shape[2] >= weight.shape[1])


def fused(x, weight, activation=None, variant: str = "fma"):
    """Convolution (+ SiLU) of ``x`` [B, C, T] by ``weight`` [C, K], no bias: a [B, C, T] view
    of a contiguous [B, T, C] result. Callers check :func:`_eligible` first."""
    import torch
    import triton

    bsz, chans, seq = x.shape
    out = torch.empty((bsz, seq, chans), dtype=x.dtype, device=x.device)
    BT, BC = 32, 128
    grid = (triton.cdiv(seq, BT), triton.cdiv(chans, BC), bsz)
    _kernel()[grid](x, weight, out, seq, chans,
                    x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1),
                    out.stride(0), out.stride(1),
                    K=weight.shape[1], SILU=activation == "silu", FMA=variant == "fma", BT=BT, BC=BC, **({} if variant == "fma" else {"enable_fp_fusion": False}))
    return out.transpose(1, 2)


def exact_conv_fn(reference: Callable, variant: str = "fma") -> Callable:
    """transformers' ``causal_conv1d_fn`` signature: the fused kernel (``variant``, the one
    :func:`self_check` found equal) where it applies, else ``reference`` (the PyTorch fallback it
    replaces)."""

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        if _eligible(hidden_states, weight, bias, activation):
            return fused(hidden_states, weight, activation, variant)
        return reference(hidden_states, weight, bias, activation=activation, **kwargs)

    return causal_conv1d_fn


def finite_bf16(device):
    """Every finite bf16 value (65,280), on ``device``: the SiLU checks' inputs."""
    import torch

    bits = torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16)
    return bits[torch.isfinite(bits.float())]


def self_check(reference: Callable, device) -> tuple[str | None, str | None]:
    """(variant, None) for the first of :data:`VARIANTS` whose fused kernel gives ``reference``'s
    bits on ``device`` for: every finite bf16 value through the SiLU (as a one-tap convolution of
    weight 1), random convolutions (K = 4, lengths from K to not a multiple of the block, a
    batch, the model's transposed input layout and a contiguous one); (None, what differed)
    when none does. Run once per device and process."""
    import torch

    name = torch.cuda.get_device_name(device)
    memo = (name, f"{reference.__module__}.{reference.__qualname__}")
    if memo in _CHECKED:
        return _CHECKED[memo]
    g = torch.Generator(device).manual_seed(0)
    allv = finite_bf16(device)
    cases = [(allv.view(1, -1, 1).contiguous(), torch.ones(allv.numel(), 1, dtype=torch.bfloat16, device=device))]
    for bsz, chans, seq, layout in ((1, 256, 2048, "btc"), (3, 300, 37, "btc"), (2, 129, 5, "bct"), (1, 64, 4, "btc")):
        x = torch.randn(bsz, seq, chans, generator=g, device=device).mul_(4).to(torch.bfloat16)
        x = x.transpose(1, 2) if layout == "btc" else x.transpose(1, 2).contiguous()
        w = torch.randn(chans, 4, generator=g, device=device).to(torch.bfloat16)
        cases.append((x, w))
    whys = []
    for variant in VARIANTS:
        why = None
        try:
            for x, w in cases:
                for act in ("silu", None):
                    want = reference(x, w, None, activation=act).contiguous().view(torch.int16)
                    got = fused(x, w, act, variant).contiguous().view(torch.int16)
                    if want.shape != got.shape or not torch.equal(want, got):
                        n = (want != got).sum().item() if want.shape == got.shape else -1
                        why = f"{variant}: shape {tuple(x.shape)}, activation {act}: {n} values differ"
                        break
                if why:
                    break
        except Exception as e:  # a kernel that cannot compile here is a reason to keep the fallback
            why = f"{variant}: did not run: {type(e).__name__}: {str(e)[:300]}"
        if why is None:
            _CHECKED[memo] = (variant, None)
            return _CHECKED[memo]
        whys.append(why)
    _CHECKED[memo] = (None, f"the fused causal conv differs from transformers' fallback on {name} ({'; '.join(whys)})")
    return _CHECKED[memo]
