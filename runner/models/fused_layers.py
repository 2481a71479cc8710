"""Qwen3.5/3.6's float32 norms and the MLP's gate on CUDA in fewer passes, bit for bit what
transformers computes (issue 36 item 2, after the fused causal conv of ``causal_conv``).

Why: after the fused conv, the 8B-shaped four-layer forward on an H100 spends 5.7 of its 11.2 ms
of kernels in GEMMs; most of the rest are elementwise passes over [tokens, width] tensors in
float32: each ``Qwen3_5RMSNorm`` casts to float32, squares, takes the mean, multiplies twice and
casts back (about 40 bytes of traffic per element), ``Qwen3_5RMSNormGated`` does that and a SiLU
of the gate in float32 (about 74), the MLP runs the SiLU and the product as two passes
(``bench/results/gpu/compile_probe_4l_fusedconv_h100_2026-12-07.json``).

Bits: the reductions stay ATen's own. A norm's mean is computed by the same ``mean`` call on a
float32 tensor of the same shape and values as transformers' ``x.float().pow(2)`` (written here by
one kernel: the square of a bf16 value in float32 is exact), so the reduction runs in the same
order; the ``+ eps`` and ``rsqrt`` run as the same ATen calls on the [rows, 1] result. Only the
elementwise steps move into one kernel each, in transformers' order with the same roundings
(float32 products, none followed by a sum it could fuse with, a bf16 rounding exactly where a bf16 tensor was;
SiLU as x / (1 + exp(-x)) with an accurate ``exp`` and IEEE division, which ``causal_conv``
matched to ATen on every finite bf16 value). That this holds is checked on the device, not
assumed: :func:`self_check` runs each fused forward against the class's own forward (the
installed transformers' code, on a module of that class) and the binding installs none that
differs in one bit. bf16 only; anything else goes to the original forward. On an H100
(2026-12-07) every class passed its check, the 8B-shaped four-layer forward's states stayed
bitwise equal, and it ran 1.09x faster (``compile_probe_4l_fusedlayers_h100_2026-12-07.json``).
"""

from __future__ import annotations

import types

_KERNELS: dict | None = None
# (device name, class) -> None when the fused forward gives the original's bits, else why not
_CHECKED: dict[tuple[str, str], str | None] = {}


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def square(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + off, x * x, mask=m)

    @triton.jit
    def norm_apply(x_ptr, r_ptr, w_ptr, y_ptr, n, H, BLOCK: tl.constexpr):
        # Qwen3_5RMSNorm: ((x * r) * (1 + w)).to(bf16), r = rsqrt(mean(x^2) + eps) per row,
        # w1 = 1 + w.float() per column (both computed by ATen)
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + off // H, mask=m, other=0.0)
        w1 = tl.load(w_ptr + off % H, mask=m, other=0.0)
        tl.store(y_ptr + off, ((x * r) * w1).to(tl.bfloat16), mask=m)

    @triton.jit
    def gated_apply(x_ptr, r_ptr, w_ptr, g_ptr, y_ptr, n, H, BLOCK: tl.constexpr):
        # Qwen3_5RMSNormGated: h = (x * r).to(bf16); h = (w * h) in bf16; out = (h * silu(g.float())).to(bf16)
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + off // H, mask=m, other=0.0)
        w = tl.load(w_ptr + off % H, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
        h = (x * r).to(tl.bfloat16).to(tl.float32)
        h = (w * h).to(tl.bfloat16).to(tl.float32)
        s = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
        tl.store(y_ptr + off, (h * s).to(tl.bfloat16), mask=m)

    @triton.jit
    def silu_mul(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
        # act_fn(gate) * up: the SiLU rounded to bf16 (a bf16 tensor), then the bf16 product
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        g = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + off, mask=m, other=0.0).to(tl.float32)
        s = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(tl.bfloat16).to(tl.float32)
        tl.store(y_ptr + off, (s * u).to(tl.bfloat16), mask=m)

    _KERNELS = {"square": square, "norm_apply": norm_apply, "gated_apply": gated_apply, "silu_mul": silu_mul}
    return _KERNELS


BLOCK = 1024
# Launched with Triton's defaults (fp fusion on), as ``causal_conv``'s kernel whose SiLU matched
# ATen on every bf16 value: no step here is a product followed by a sum, so nothing can contract
# into a fused multiply-add except inside ``exp``, which then compiles as it did there.


def _grid(n: int) -> tuple[int]:
    return ((n + BLOCK - 1) // BLOCK,)


def _bf16_contiguous(*ts) -> bool:
    import torch

    return all(t.is_cuda and t.dtype == torch.bfloat16 and t.is_contiguous() and t.numel() > 0 for t in ts)


def _rstd(x, eps: float):
    """ATen's rsqrt(mean(x.float()^2, -1) + eps) for bf16 ``x``, the square written by one kernel
    (same shape, values and layout as ``x.float().pow(2)``, so ``mean`` reduces in the same order)."""
    import torch

    sq = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _kernels()["square"][_grid(x.numel())](x, sq, x.numel(), BLOCK=BLOCK)
    return torch.rsqrt(sq.mean(-1, keepdim=True) + eps)


def rmsnorm_forward(self, x):
    """``Qwen3_5RMSNorm.forward`` (zero-centred weight: ``* (1 + w)``)."""
    import torch

    if not (_bf16_contiguous(x) and self.weight.is_cuda):
        return type(self).forward(self, x)
    r = _rstd(x, self.eps)
    w1 = 1.0 + self.weight.float()
    out = torch.empty_like(x)
    _kernels()["norm_apply"][_grid(x.numel())](x, r, w1, out, x.numel(), x.shape[-1], BLOCK=BLOCK)
    return out


def gated_forward(self, hidden_states, gate):
    """``Qwen3_5RMSNormGated.forward``: the norm, the bf16 weight, times SiLU of the float32 gate."""
    import torch

    if not (_bf16_contiguous(hidden_states, gate, self.weight) and gate.shape == hidden_states.shape):
        return type(self).forward(self, hidden_states, gate)
    r = _rstd(hidden_states, self.variance_epsilon)
    out = torch.empty_like(hidden_states)
    _kernels()["gated_apply"][_grid(out.numel())](hidden_states, r, self.weight, gate, out, out.numel(),
                                                   out.shape[-1], BLOCK=BLOCK)
    return out


def mlp_forward(self, x):
    """``Qwen3_5MLP.forward``: ``down(silu(gate(x)) * up(x))`` with the SiLU and product fused."""
    import torch

    g, u = self.gate_proj(x), self.up_proj(x)
    if not _bf16_contiguous(g, u):
        return self.down_proj(self.act_fn(g) * u)
    return self.down_proj(_silu_mul(g, u))


def _silu_mul(g, u):
    """``silu(g) * u`` for contiguous bf16 ``g`` and ``u`` of one shape, in one kernel."""
    import torch

    y = torch.empty_like(g)
    _kernels()["silu_mul"][_grid(g.numel())](g, u, y, g.numel(), BLOCK=BLOCK)
    return y


# (modeling module, class name) -> fused forward. Only classes whose forward the fused one
# reproduces; the self-check runs each against the installed class's own forward.
FUSED = {
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNorm"): rmsnorm_forward,
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNormGated"): gated_forward,
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5MLP"): mlp_forward,
}


def _probe_module(cls, like, device):
    """A module of ``cls`` like ``like`` (a module of the model) with random bf16 weights: a deep
    copy for the norms (a few KB); for the MLP, fresh projections of width 512 (the fused step is
    elementwise: the check needs the class's forward, not the model's 300 MB of weights)."""
    import copy

    import torch

    if hasattr(like, "gate_proj"):
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        width, inner = like.gate_proj.in_features, 512
        kw = {"bias": False, "device": device, "dtype": like.gate_proj.weight.dtype}
        m.gate_proj, m.up_proj = torch.nn.Linear(width, inner, **kw), torch.nn.Linear(width, inner, **kw)
        m.down_proj = torch.nn.Linear(inner, width, **kw)
        m.act_fn = like.act_fn
    else:
        m = copy.deepcopy(like).to(device)
    g = torch.Generator(device).manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device).mul_(0.5).to(p.dtype))
    return m


def self_check(cls, like, device) -> str | None:
    """None when ``FUSED``'s forward for ``cls`` gives the class's own forward's bits on ``device``
    (a copy of ``like`` with random weights; inputs of several row counts, and for the SiLUs every
    finite bf16 value), else what differed. Once per device and class."""
    import torch

    from .causal_conv import finite_bf16

    name = torch.cuda.get_device_name(device)
    memo = (name, f"{cls.__module__}.{cls.__qualname__}")
    if memo in _CHECKED:
        return _CHECKED[memo]
    fused = FUSED[(cls.__module__, cls.__name__)]
    why = None
    try:
        m = _probe_module(cls, like, device)
        g = torch.Generator(device).manual_seed(2)
        allv = finite_bf16(device)
        width = (m.weight.shape[0] if hasattr(m, "weight") else m.gate_proj.in_features)
        for rows in (1, 7, 333, 2048):
            x = torch.randn(rows, width, generator=g, device=device).mul_(3).to(torch.bfloat16)
            args = (x,)
            if cls.__name__.endswith("Gated"):
                gate = torch.randn(rows, width, generator=g, device=device).mul_(3).to(torch.bfloat16)
                if rows == 2048:  # every finite bf16 value through the gate's SiLU
                    flat = gate.view(-1)
                    k = min(flat.numel(), allv.numel())
                    flat[:k] = allv[:k]
                args = (x, gate)
            with torch.no_grad():
                want = type(m).forward(m, *args)
                got = fused(m, *args)
            if want.shape != got.shape or want.dtype != got.dtype or not torch.equal(
                    want.contiguous().view(torch.int16), got.contiguous().view(torch.int16)):
                n = (want.view(torch.int16) != got.view(torch.int16)).sum().item() if want.shape == got.shape else -1
                why = f"{cls.__name__}: {rows} rows: {n} values differ"
                break
        if why is None and cls.__name__.endswith("MLP"):  # the SiLU over every finite bf16 value
            gt = allv.view(-1, 1).expand(-1, 2).contiguous()
            up = torch.randn(gt.shape, generator=g, device=device).to(torch.bfloat16)
            want = m.act_fn(gt) * up
            got = _silu_mul(gt, up)
            if not torch.equal(want.view(torch.int16), got.view(torch.int16)):
                why = f"{cls.__name__}: SiLU x up over every bf16 value: {(want != got).sum().item()} differ"
    except Exception as e:  # a kernel that cannot run here is a reason to keep the original
        why = f"{cls.__name__}: did not run: {type(e).__name__}: {str(e)[:300]}"
    _CHECKED[memo] = why
    return why


def install(model, device) -> tuple[dict[str, int], list[str]]:
    """Give each module of ``model`` whose class ``FUSED`` covers and whose check passes the fused
    forward (an instance attribute: the class and other models are untouched). Returns class
    name -> modules fused, and why for each class left alone."""
    counts: dict[str, int] = {}
    why: list[str] = []
    verdict: dict[type, str | None] = {}
    for mod in model.modules():
        cls = type(mod)
        fused = FUSED.get((cls.__module__, cls.__name__))
        if fused is None:
            continue
        if cls not in verdict:
            verdict[cls] = self_check(cls, mod, device)
            if verdict[cls]:
                why.append(verdict[cls])
        if verdict[cls] is None:
            mod.forward = types.MethodType(fused, mod)
            counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
    return counts, why


def uninstall(model) -> None:
    """Back to the classes' own forwards (the A/B of a probe)."""
    for mod in model.modules():
        if "forward" in vars(mod) and isinstance(vars(mod)["forward"], types.MethodType) \
                and vars(mod)["forward"].__func__ in FUSED.values():
            del mod.forward

