"""The fused causal conv + SiLU (runner/models/causal_conv.py) gives transformers' PyTorch
fallback's bits, and the fla binding on CUDA uses it only then. The kernel needs a CUDA GPU and
triton: those tests are skipped elsewhere (CI has neither); the H100 figures are in
docs/benchmarks.md. On the CPU: the wrapper hands everything it cannot run to the fallback,
unchanged, and importing the module needs no triton."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("triton")
                               and importlib.util.find_spec("fla")),
                          reason="needs a CUDA GPU, triton and fla (the fused kernel and the fla binding)")


def _reference():
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    from runner.models.target import _TORCH_FUNCTIONS, kernel_wrappers

    kernel_wrappers(modeling)
    return _TORCH_FUNCTIONS[(modeling.__name__, "causal_conv1d_fn")]


def test_off_the_gpu_the_wrapper_is_the_fallback():
    from runner.models.causal_conv import exact_conv_fn

    ref = _reference()
    fn = exact_conv_fn(ref)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 24, 9, generator=g).to(dtype)
        w = torch.randn(24, 4, generator=g).to(dtype)
        for act in ("silu", None):
            got, want = fn(x, w, None, activation=act), ref(x, w, None, activation=act)
            assert got.dtype == want.dtype and torch.equal(got, want)


@cuda
def test_the_fused_kernel_gives_the_fallback_bits():
    from runner.models.causal_conv import _CHECKED, fused, self_check

    _CHECKED.clear()
    ref = _reference()
    variant, why = self_check(ref, torch.device("cuda"))
    assert variant is not None, why
    # a case self_check does not hold: the 8B-shaped layer's width, a batch, the model's layout
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(2, 515, 8192, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    w = torch.randn(8192, 4, generator=g, device="cuda").to(torch.bfloat16)
    want = ref(x, w, None, activation="silu")
    got = fused(x, w, "silu", variant)
    assert torch.equal(want.view(torch.int16), got.contiguous().view(torch.int16))
    assert got.transpose(1, 2).is_contiguous()  # the layer's transpose back costs no copy


@cuda
def test_the_fla_binding_uses_it_and_stores_the_same_rows(tiny_target):
    from runner.models.target import FINAL, apply_binding, load_target, resolve_kernel

    target = load_target(tiny_target, resolve_kernel("fla", "cuda", "bfloat16", "sdpa"))
    assert target.bound["causal_conv1d_fn"] == "runner.models.causal_conv.causal_conv1d_fn", target.bound
    assert "exact_overrides_skipped" not in target.provenance
    layers = [0, 2, 4, FINAL]
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(3, 500, (2, 77)).astype(np.int64)).cuda()
    got = target.forward_layers(x, layers)
    overrides, target.overrides = target.overrides, {}
    apply_binding(target.modeling_module, "fla")  # the binding without the fused conv
    want = target.forward_layers(x, layers)
    target.overrides = overrides
    for k in layers:
        assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), k
